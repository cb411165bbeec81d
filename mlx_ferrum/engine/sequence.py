"""One request in the engine, from its prompt to its output checks: the prompt's
encoding, token ids, status, sampling state, detokenizer, timings, stop strings and
prompt log-probabilities.

**The prompt**: :func:`encode_prompt` turns the prompt forms users pass (text, chat
messages, token ids) into token ids. Every form is checked before it reaches the
tokenizer or the engine, so a malformed prompt fails its own request with a
:class:`~mlx_ferrum.errors.RequestError` that names the problem, and never reaches a
batch shared with other requests.

**Request state.** :class:`Sequence` is one request inside the engine; its
:class:`RequestMetrics` are its timings.

**Stop strings** over streamed text. Text arrives in pieces (one per detokenized token)
and a stop string may span several pieces. :class:`StopStringMatcher` emits what is
certainly not part of a stop string and holds back the longest tail that is still the
beginning of one. When a stop string completes, the output ends just before it (the stop
string itself is excluded, as in the OpenAI API and vLLM's default). Why searching only
the held tail plus the new piece is enough: the held tail is the longest suffix of
everything seen that is a proper prefix of some stop string, so a stop string that began
inside already-emitted text would have made a longer tail be held back.
:func:`emit_token` applies a sampled token's checks in vLLM's order.

**Prompt log-probabilities** (vLLM's ``SamplingParams.prompt_logprobs``), computed in the
batched prefill. A prefill chunk of a request that asks for them returns the logits of
every one of its tokens (``SeqWork.all_logits``). The logits at position ``p`` score the
token at ``p + 1``, so a chunk covering positions ``[start, start + n)`` scores prompt
tokens ``start + 1 .. start + n`` (those inside the prompt). The scores are built lazily
on the device in the step that computes the chunk (:func:`chunk_scores`), evaluated with
it, and read back on the host only when the request's first output is built
(:func:`materialize`). The first prompt token has no score (``None``), as in vLLM and in
OpenAI's ``echo`` + ``logprobs``.
"""

from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq, Union

import mlx.core as mx

from ..errors import RequestError, SamplingParamsError
from .sampling import SamplerState, SamplingParams, top_logprobs

__all__ = ["Prompt", "encode_prompt", "SequenceStatus", "RequestMetrics", "Sequence",
           "StopCheck", "StopStringMatcher", "emit_token", "find_stop", "partial_stop_length",
           "PromptScoreChunk", "chunk_scores", "wants_prompt_rows", "materialize"]


# ------------------------------------------------------------------ the prompt
Prompt = Union[str, Seq[dict], Seq[int], mx.array]

_FORMS = "give a str, a list of {'role', 'content'} messages, or a list of int token ids"


def _check_ids(ids: list, vocab_size: Optional[int]) -> list[int]:
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestError(f"prompt item {i} is {type(t).__name__} {t!r}, not a token id: {_FORMS}")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise RequestError(
                f"token id {t} (prompt item {i}) is outside the vocabulary {bound}: "
                "check the ids come from this model's tokenizer"
            )
        out.append(t)
    return out


def encode_prompt(tokenizer, prompt: Prompt, vocab_size: Optional[int] = None) -> list[int]:
    """Token ids of a prompt, validated.

    Args:
        tokenizer: a :class:`~mlx_ferrum.tokenizer.Tokenizer` (unused for token ids).
        prompt: text (encoded; BOS as ``tokenizer_config.json`` says), OpenAI-style
            messages ``[{"role", "content"}]`` (rendered with the chat template, with the
            generation prompt), or token ids (a list of ints or an integer ``mx.array``),
            kept as they are.
        vocab_size: when given, every token id must lie in ``[0, vocab_size)``.

    Returns:
        The prompt's token ids, a non-empty ``list[int]``.

    Raises:
        ChatTemplateError: messages given and the checkpoint has no chat template.
        TokenizerError: the text is not valid Unicode (lone surrogates), too long, or the
            template cannot be rendered within its limits.
        RequestError: an empty prompt, a prompt of another type (``None``, ``bytes``, an
            int, nested lists ...), text without a tokenizer, or a token id out of range.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a text prompt needs a tokenizer: pass one to the engine, or give token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (bytes, bytearray)):
        raise RequestError(f"the prompt is {type(prompt).__name__}: decode it to str first ({_FORMS})")
    elif isinstance(prompt, mx.array):
        if not mx.issubdtype(prompt.dtype, mx.integer):
            raise RequestError(f"a token-id array must have an integer dtype, not {prompt.dtype}: {_FORMS}")
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, (list, tuple)):
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if tokenizer is None:
                raise RequestError("chat messages need a tokenizer: pass one to the engine, or give token ids")
            for i, m in enumerate(items):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), (str, list)):
                    raise RequestError(f"message {i} needs a str 'role' and a str 'content': {_FORMS}")
            ids = list(tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True))
        else:
            ids = items
    else:
        raise RequestError(f"the prompt is {type(prompt).__name__} {prompt!r:.40}: {_FORMS}")
    ids = _check_ids(ids, vocab_size)
    if not ids:
        raise RequestError("the prompt is empty: give at least one token (or a tokenizer that adds BOS)")
    return ids


# ------------------------------------------------------------------ request state
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
    #: prompt logprobs: chunks scored on the device, then the host table (see materialize)
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


# ------------------------------------------------------------------ stop strings
def find_stop(text: str, stops: Seq[str]) -> Optional[tuple[int, str]]:
    """The earliest stop string in ``text``: ``(start index, stop)``, or ``None``.

    Ties at one start index go to the stop listed first.
    """
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_length(text: str, stops: Seq[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


@dataclass
class StopCheck:
    """Result of :meth:`StopStringMatcher.feed`.

    - ``text``: text safe to emit now (``str``, possibly empty).
    - ``stopped``: a stop string was completed; ``text`` ends right before it.
    - ``stop``: the stop string matched, or ``None``.
    """

    text: str
    stopped: bool = False
    stop: Optional[str] = None


class StopStringMatcher:
    """Incremental stop-string detection for one stream of text.

    Usage: call :meth:`feed` with each new piece of text; emit ``check.text``; once
    ``check.stopped``, end the request. When the request ends for another reason
    (EOS, length), call :meth:`flush` and emit what it returns. When two stop strings
    start at the same place, the one completed first in the stream is reported (the
    emitted text is the same either way).
    """

    def __init__(self, stop: Seq[str] = ()):
        """Watch for the strings in ``stop`` (a single ``str`` is accepted).

        Raises:
            SamplingParamsError: a stop string is empty or not a string.
        """
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise SamplingParamsError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = stops
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    @property
    def held(self) -> str:
        """Text received but not yet emitted (it may start a stop string)."""
        return self._held

    def feed(self, new_text: str) -> StopCheck:
        """Add the next piece of text; return what may be emitted and whether a stop hit.

        After a stop, further calls return an empty, stopped :class:`StopCheck`.
        """
        if self.stopped:
            return StopCheck("", True, self.matched)
        if not self.stops:
            return StopCheck(new_text)
        buffer = self._held + new_text
        hit = find_stop(buffer, self.stops)
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit[1], ""
            return StopCheck(buffer[: hit[0]], True, hit[1])
        keep = partial_stop_length(buffer, self.stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text (``""`` after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def emit_token(
    detok, matcher: StopStringMatcher, token: int, stop_ids, out_of_room: bool
) -> tuple[str, Optional[str]]:
    """Turn one sampled token into the text to emit and a finish reason.

    Order of checks (vLLM's): a stop token id (or EOS) ends the request and its text is
    not emitted; otherwise the token is detokenized and stop strings are matched (a hit
    trims the text at the stop string); otherwise ``out_of_room`` (``max_tokens`` reached
    or the context full) ends it with ``"length"``, flushing held-back text.

    Args:
        detok: a :class:`~mlx_ferrum.tokenizer.StreamingDetokenizer`, or None (ids only).
        matcher: the request's stop-string matcher.
        token: the sampled token id.
        stop_ids: ids that end the request.
        out_of_room: no further token may follow this one.

    Returns:
        ``(text, reason)`` with ``reason`` in ``None``, ``"stop"``, ``"length"``.
    """
    if token in stop_ids:
        if detok is None:
            return "", "stop"
        return matcher.feed(detok.finalize()).text + matcher.flush(), "stop"
    text = ""
    if detok is not None:
        check = matcher.feed(detok.add_token(token))
        text = check.text
        if check.stopped:
            return text, "stop"
    if not out_of_room:
        return text, None
    if detok is not None:
        tail = matcher.feed(detok.finalize())
        text += tail.text
        if tail.stopped:
            return text, "stop"
        text += matcher.flush()
    return text, "length"


# ------------------------------------------------------------------ prompt log-probabilities
@dataclass
class PromptScoreChunk:
    """The lazily computed scores of one prefill chunk.

    Attributes:
        start: the prompt position of the first token scored (``>= 1``).
        token_ids: the scored prompt ids (host ints), ``m`` of them.
        logprobs: ``[m]`` float32, ``log_softmax(logits)`` at each scored id.
        top_ids / top_logprobs: ``[m, k]`` int32 / float32, the ``k`` most likely ids per
            position, best first; None when ``k == 0``.
    """

    start: int
    token_ids: list[int]
    logprobs: mx.array
    top_ids: Optional[mx.array] = None
    top_logprobs: Optional[mx.array] = None

    def arrays(self) -> list[mx.array]:
        """The device arrays to evaluate with the step."""
        return [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


def wants_prompt_rows(seq, num_tokens: int) -> bool:
    """True when the chunk of ``num_tokens`` tokens of ``seq`` from ``seq.num_computed``
    must return every row's logits: the request asks for prompt logprobs and the chunk
    scores at least one prompt token it has not scored yet."""
    k = seq.params.prompt_logprobs
    if k is None or seq.prompt_logprobs is not None:
        return False
    return seq.num_computed + 1 < len(seq.prompt_ids) and num_tokens > 0


def chunk_scores(rows: mx.array, prompt_ids: Seq[int], start_pos: int, k: int) -> Optional[PromptScoreChunk]:
    """Scores of the prompt tokens a chunk's logits predict (lazy).

    Args:
        rows: ``[n, V]`` logits of the chunk's ``n`` tokens (any float dtype), row ``i``
            at sequence position ``start_pos + i``.
        prompt_ids: the whole prompt.
        start_pos: the chunk's first position.
        k: top alternatives to keep per position (``0``: none).

    Returns:
        A :class:`PromptScoreChunk` for positions ``start_pos + 1 ..`` inside the prompt,
        or None when the chunk scores no prompt token (it starts at the prompt's last
        token or later).
    """
    m = min(rows.shape[0], len(prompt_ids) - 1 - start_pos)
    if m <= 0:
        return None
    x = rows[:m].astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    targets = [int(t) for t in prompt_ids[start_pos + 1 : start_pos + 1 + m]]
    chosen = mx.take_along_axis(logp, mx.array(targets, dtype=mx.int32).reshape(m, 1), axis=-1).reshape(m)
    chunk = PromptScoreChunk(start=start_pos + 1, token_ids=targets, logprobs=chosen)
    k = min(k, logp.shape[-1])
    if k > 0:
        chunk.top_ids, chunk.top_logprobs = top_logprobs(logp, k)
    return chunk


def materialize(seq) -> Optional[list[Optional[dict[int, float]]]]:
    """``seq.prompt_logprobs``, built from its pending chunks once every prompt token is
    scored (reads the chunks back: call after their step was evaluated).

    Returns:
        None while the request does not ask for them or they are incomplete; else one
        entry per prompt token: ``None`` for the first, then ``{token id: logprob}``
        holding the prompt's own token and the top ``prompt_logprobs`` alternatives
        (vLLM's shape; natural log).
    """
    if seq.params.prompt_logprobs is None:
        return None
    if seq.prompt_logprobs is not None:
        return seq.prompt_logprobs
    n = len(seq.prompt_ids)
    table: list = [None] * n
    for chunk in seq.prompt_score_chunks:  # a recomputed chunk (preemption) overwrites the same values
        lps = chunk.logprobs.tolist()
        tops = (chunk.top_ids.tolist(), chunk.top_logprobs.tolist()) if chunk.top_ids is not None else None
        for j, (tid, lp) in enumerate(zip(chunk.token_ids, lps)):
            entry = {}
            if tops is not None:
                entry.update(zip(tops[0][j], tops[1][j]))
            entry[tid] = lp
            table[chunk.start + j] = entry
    if any(e is None for e in table[1:]):
        return None
    seq.prompt_logprobs = table
    seq.prompt_score_chunks = []
    return table
