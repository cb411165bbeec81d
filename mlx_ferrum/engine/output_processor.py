"""The output stage: sampled token ids -> :class:`RequestOutput` s, and their delivery.

:class:`OutputProcessor` records a request's sampled tokens (per-request metrics,
logprobs, streaming detokenization, the stop ids / stop strings / ``max_tokens`` /
grammar checks of :func:`~mlx_ferrum.engine.sequence.emit_token`), builds each
:class:`RequestOutput`, keeps the engine-wide token and latency counters, and holds the
per-request output boxes that :meth:`Engine.generate <mlx_ferrum.engine.engine.Engine.generate>`
and :meth:`~mlx_ferrum.engine.engine.Engine.stream` callers wait on (whichever thread steps
routes every output to its request's box). It never touches the scheduler or the KV
caches: ending a request is the engine's (the stop reason is returned to it).

The latency counters are bounded: a long-running server finishes millions of requests,
so the engine keeps no list that grows with them. :class:`LatencyReservoir` keeps the
exact count and mean plus a uniform random sample of at most ``capacity`` values
(reservoir sampling, Vitter's Algorithm R, ACM TOMS 1985), from which percentiles are read.
"""

from __future__ import annotations

import collections
import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ..errors import RequestError
from .sequence import RequestMetrics, Sequence, emit_token, materialize

#: Placeholder in ``Sequence.output_ids`` for a token sampled but not yet read back.
IN_FLIGHT = -1


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the request.
        text: all text generated so far (stop strings trimmed).
        delta: text added by this step.
        token_ids: all generated token ids that were read back and emitted (never a
            placeholder of a token still being computed): ``text`` is their text and
            ``logprobs`` has one entry per id.
        new_token_ids: ids added by this step.
        finished: True once it ended; then ``finish_reason`` is ``"stop"``,
            ``"length"``, ``"abort"`` or ``"error"`` (with ``error`` set).
        error: with ``"error"``: ``"ExceptionType: message"``.
        exception: with ``"error"``: the exception that failed the request, when there
            was one (callers re-raise it; None for a refusal that has only ``error``).
        logprobs: log-probability of each generated token, when asked.
        top_logprobs: per token, ``{token_id: logprob}`` of the top alternatives, when asked.
        metrics: timings (:class:`~mlx_ferrum.engine.sequence.RequestMetrics`).
        prompt_token_ids: the prompt.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token
            ``None`` (the first) or ``{token id: logprob}`` (its own id and the top
            alternatives); None until every prompt token is scored.
    """

    request_id: str
    text: str
    delta: str
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    metrics: RequestMetrics
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict]] = None
    error: Optional[str] = None
    prompt_logprobs: Optional[list] = None
    exception: Optional[BaseException] = None


def make_output(seq: Sequence, delta: str, new_ids: list[int]) -> RequestOutput:
    """The :class:`RequestOutput` of ``seq`` now, with this step's ``delta`` text and ``new_ids``.

    The pipelined step queues the next token before this one is emitted: its placeholder
    (:data:`IN_FLIGHT`) sits at the end of ``output_ids`` (two of them between a launch and
    the read-back of the step before) and is no part of the output (token_ids, logprobs
    and text then all cover the same tokens).
    """
    want_lp = seq.params.logprobs is not None
    ids = seq.output_ids
    end = len(ids)
    while end and ids[end - 1] == IN_FLIGHT:
        end -= 1
    return RequestOutput(
        request_id=seq.request_id,
        text=seq.text,
        delta=delta,
        token_ids=ids[:end],
        new_token_ids=new_ids,
        finished=seq.finished,
        finish_reason=seq.finish_reason,
        metrics=seq.metrics,
        prompt_token_ids=seq.prompt_ids,
        logprobs=list(seq.logprobs) if want_lp else None,
        top_logprobs=list(seq.top_logprobs) if want_lp and seq.params.logprobs else None,
        error=seq.error,
        exception=seq.exception,
        prompt_logprobs=materialize(seq) if seq.params.prompt_logprobs is not None else None,
    )


def host_logprobs(result: tuple, host: dict) -> tuple:
    """Row ``r`` of a :class:`~mlx_ferrum.engine.sampling.SampleResult`'s logprobs and top
    alternatives as Python values: ``(logprob, (top ids, top logprobs))``, ``(lp, None)``
    without alternatives, ``(None, None)`` without logprobs. ``result`` is
    ``(SampleResult or None, r)``; ``host`` caches each result's read-back (once per step)."""
    res, r = result
    if res is None or res.logprobs is None:
        return None, None
    got = host.get(id(res))
    if got is None:
        got = (res.logprobs.tolist(),
               (res.top_ids.tolist(), res.top_logprobs.tolist()) if res.top_ids is not None else None)
        host[id(res)] = got
    lps, tops = got
    return lps[r], ((tops[0][r], tops[1][r]) if tops is not None else None)


class LatencyReservoir:
    """Count, mean and percentiles of a stream of latencies in seconds, in O(capacity) memory.

    Args:
        capacity: most values kept for percentiles (>= 1).
        seed: seed of the replacement choices, so runs are reproducible.

    Percentiles are exact while fewer than ``capacity`` values were added, and estimates
    from a uniform sample afterwards.
    """

    def __init__(self, capacity: int = 4096, seed: int = 0):
        if capacity < 1:
            raise ValueError("a reservoir needs capacity >= 1")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.samples: list[float] = []
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        """Record one latency (seconds)."""
        self.count += 1
        self.total += value
        if len(self.samples) < self.capacity:
            self.samples.append(value)
            return
        j = self._random.randrange(self.count)
        if j < self.capacity:
            self.samples[j] = value

    def extend(self, values: Iterable[float]) -> None:
        """Record several latencies."""
        for v in values:
            self.add(v)

    @property
    def mean(self) -> float:
        """Mean of every value added (0.0 when none)."""
        return self.total / self.count if self.count else 0.0

    def percentile(self, q: float) -> float:
        """The ``q``-quantile (``q`` in [0, 1], nearest rank) of the kept sample; 0.0 when empty."""
        if not self.samples:
            return 0.0
        ys = sorted(self.samples)
        return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]


class OutputProcessor:
    """Turns sampled tokens into outputs, counts them, and routes outputs to waiting callers.

    Attributes:
        num_generated_tokens: tokens emitted over the engine's life.
        ttft, itl: :class:`LatencyReservoir` of finished
            requests' time to first token and inter-token latencies (seconds; bounded).
        boxes: request id -> deque of outputs not yet taken by its waiting caller.

    Threads: :meth:`emit` runs under the engine's lock; the box methods take their own
    condition, so any thread may wait while another steps.
    """

    def __init__(self):
        self.num_generated_tokens = 0
        # bounded: count, sum and a fixed-size sample each (a server finishes millions of requests)
        self.ttft = LatencyReservoir()
        self.itl = LatencyReservoir(seed=1)
        # outputs of requests whose caller (generate / stream, on any thread) waits for
        # them: whichever thread steps puts each output in its request's box
        self.boxes: dict[str, collections.deque] = {}
        self._boxes_changed = threading.Condition(threading.Lock())
        self._steps_routed = 0

    # ------------------------------------------------------------ recording
    def emit(self, s: Sequence, tokens: list[int], lps: list, tops: list, now: float, cap: int,
             index: Optional[int] = None) -> tuple[str, list[int], Optional[str]]:
        """Record 1 or more sampled tokens of ``s`` in order (metrics, logprobs, text, stop
        checks), stopping at the first that ends the request, so EOS, a stop string or
        ``max_tokens`` ends it where it would end one token at a time.

        Args:
            tokens: the ids; ``lps`` / ``tops``: per id its logprob (float) and top
                alternatives (``(ids, logprobs)``) or None.
            now: the time the tokens were read back (seconds since the epoch).
            cap: the most tokens (prompt + output) the request may reach.
            index: the placeholder in ``output_ids`` the first token replaces (pipelined
                step); None appends.

        Returns:
            ``(delta text, ids recorded, finish reason or None)``: with a reason, the
            caller ends the request.

        Raises:
            StructuredOutputError: the grammar refuses a token (this request only), or
            whatever the detokenizer raises.
        """
        m = s.metrics
        delta, new_ids = "", []
        for j, tok in enumerate(tokens):
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            self.num_generated_tokens += 1
            lp, top = lps[j], tops[j]
            if lp is not None and s.params.logprobs is not None:
                s.logprobs.append(lp)
                if top is not None and s.params.logprobs:
                    k = s.params.logprobs
                    s.top_logprobs.append(dict(zip(top[0][:k], top[1][:k])))
            if index is not None and j == 0:
                s.output_ids[index] = tok
                at = index
            else:
                s.output_ids.append(tok)
                at = len(s.output_ids) - 1
            new_ids.append(tok)
            out_of_room = at + 1 >= s.params.max_tokens or len(s.prompt_ids) + at + 1 >= cap
            grammar_done = False
            if s.grammar is not None and tok not in s.stop_ids:
                s.grammar.accept(tok)  # a StructuredOutputError ends this request only (the caller's isolation)
                grammar_done = s.grammar.done
            if s.grammar is not None:
                # in its error state the grammar's mask allows only EOS: that is a failure,
                # never a finished reply
                s.grammar.check()
            text, reason = emit_token(s.detok, s.matcher, tok, s.stop_ids, out_of_room or grammar_done)
            if grammar_done and reason == "length" and not out_of_room:
                reason = "stop"  # the constraint is complete: nothing may follow
            s.text += text
            delta += text
            if reason is not None:
                del s.output_ids[at + 1 :]  # a token queued in the pipeline's lag is dropped
                return delta, new_ids, reason
        return delta, new_ids, None

    def record_finished(self, metrics: RequestMetrics) -> None:
        """Add a finished request's TTFT and inter-token latencies to the engine's."""
        if metrics.ttft is not None:
            self.ttft.add(metrics.ttft)
        self.itl.extend(metrics.inter_token_latencies)

    # ------------------------------------------------- outputs for waiting callers
    def open_box(self, request_id: str) -> None:
        """Open the box that collects ``request_id``'s outputs from any thread's step.

        Raises:
            RequestError: a box for that id is open (the id is in use).
        """
        with self._boxes_changed:
            if request_id in self.boxes:
                raise RequestError(f"request id {request_id!r} is in use: pick another")
            self.boxes[request_id] = collections.deque()

    def close_box(self, request_id: str) -> None:
        """Stop collecting ``request_id``'s outputs (unknown ids are ignored)."""
        with self._boxes_changed:
            self.boxes.pop(request_id, None)

    def route(self, outputs: list[RequestOutput]) -> None:
        """Put each output whose request a caller waits for in that request's box, and wake
        the waiting callers. Call under the engine's step lock, so a box receives its
        outputs in step order."""
        with self._boxes_changed:
            for out in outputs:
                box = self.boxes.get(out.request_id)
                if box is not None:
                    box.append(out)
            self._steps_routed += 1
            self._boxes_changed.notify_all()

    def _drain(self, request_id: str) -> list[RequestOutput]:
        box = self.boxes.get(request_id)
        if not box:
            return []
        got = list(box)
        box.clear()
        return got

    def wait_outputs(self, request_ids, step_lock, step: Callable[[], list]) -> list[RequestOutput]:
        """The next outputs of ``request_ids`` (at least one), in step order.

        Calls ``step`` (holding ``step_lock``) while no other thread steps; while one does,
        waits for it to route this caller's outputs, so any number of threads may drive
        one engine and each gets exactly its own requests' outputs.
        """
        while True:
            with self._boxes_changed:
                got = [out for rid in request_ids for out in self._drain(rid)]
                if got:
                    return got
                seen = self._steps_routed
            if step_lock.acquire(blocking=False):
                try:
                    step()
                finally:
                    step_lock.release()
                continue
            with self._boxes_changed:
                # another thread is stepping: sleep until it routed a step (the timeout
                # only bounds the wait should that thread stop stepping, e.g. on Ctrl-C)
                if self._steps_routed == seen:
                    self._boxes_changed.wait(timeout=0.05)
