"""Per-request state: token ids, status, sampling state, detokenizer, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from .sampling import SamplerState, SamplingParams
from .stop import StopStringMatcher


class SequenceStatus(str, enum.Enum):
    """Where a request is: queued, scheduled, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds since the epoch (``time.time()``) or seconds.

    Attributes:
        arrival_time: when it was added.
        first_scheduled_time: when it first ran.
        first_token_time: when its first token was sampled.
        finished_time: when it finished.
        token_times: time of every sampled token.
        num_prompt_tokens: prompt length.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_prefilled_tokens: prompt (and recomputed) tokens run through the model.
        num_preemptions: times it was preempted and recomputed.
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_prefilled_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token (seconds)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Sequence:
    """One request inside the engine.

    Attributes:
        request_id: the caller's id; also the KV ``cache_id``.
        prompt_ids: prompt token ids.
        output_ids: generated token ids.
        num_computed: tokens (prompt then outputs) whose K/V are in the cache.
        status, finish_reason: progress; ``finish_reason`` in ``stop``/``length``/``abort``/``error``.
        text: the generated text emitted so far (stop strings trimmed).
        logprobs: log-probability of each generated token (when asked).
        error, exception: a failed request's ``"Type: message"`` and the exception behind
            it (see :class:`~mlx_ferrum.engine.engine.RequestOutput`).
        order: admission counter; larger = admitted later (preempted first).
        lora: the LoRA adapter name the request runs with, or None (the base model).
        prefix_salt: its adapter's prefix-cache salt (0 without an adapter), see
            :meth:`prefix_key_ids`.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SamplerState
    detok: object
    matcher: StopStringMatcher
    stop_ids: frozenset
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict] = field(default_factory=list)
    error: Optional[str] = None
    exception: Optional[BaseException] = None
    order: int = 0
    #: prompt logprobs: chunks scored on the device, then the host table (see prompt_logprobs.py)
    prompt_score_chunks: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    #: the request's grammar matcher (structured output), or None
    grammar: Optional[object] = None
    lora: Optional[str] = None
    prefix_salt: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, stop: int) -> list[int]:
        """Token ids ``[start, stop)`` of prompt + output."""
        p = len(self.prompt_ids)
        out = self.prompt_ids[start:stop] if start < p else []
        if stop > p:
            out = out + self.output_ids[max(0, start - p) : stop - p]
        return out

    def prefix_key_ids(self) -> list[int]:
        """All token ids as the prefix cache keys them: salted by the request's LoRA
        adapter (``prefix_salt``; see :func:`mlx_ferrum.lora.salt_token_ids`)."""
        ids = self.token_at(0, self.num_tokens)
        if not self.prefix_salt:
            return ids
        from ..lora.registry import salt_token_ids

        return salt_token_ids(ids, self.prefix_salt)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        """True once the request has ended."""
        return self.status is SequenceStatus.FINISHED  # members are singletons: no string compare

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer, eos_ids) -> "Sequence":
        """A new waiting request (its sampler seeded from ``params.seed``)."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(eos_ids)
        return cls(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            sampler=SamplerState.create(params, prompt_ids),
            detok=tokenizer.detokenizer(prompt_ids=prompt_ids) if tokenizer is not None else None,
            matcher=StopStringMatcher(params.stop),
            stop_ids=frozenset(stop_ids),
            metrics=RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_ids)),
        )
