"""The launch and read-back stage: a step's runner work, prompt scores, lazy sampling and read-back.

Plain functions over the scheduler's items (:class:`~mlx_ferrum.engine.scheduler.ScheduledItem`)
and :class:`~mlx_ferrum.engine.sequence.Sequence` s (the runner's work, prompt scores,
batched sampling with its row-by-row fallback), and :class:`StepLauncher`, which runs
them for :class:`~mlx_ferrum.engine.engine.Engine`: it holds the step in flight, queues
the sampling of the forward pass the engine built, and reads the step back (ending requests
through the engine's ``finish`` / ``fail``, which own the release of their slots). The pipelined
step follows vLLM's async scheduling: a token still being computed is taken on the
device (``SeqWork.prev_row``) and stands as :data:`~mlx_ferrum.engine.output_processor.IN_FLIGHT`
in ``output_ids`` until it is read back.

Why this file is over 500 lines: :class:`StepLauncher`'s methods share the step in
flight and one failure-isolation rule (which requests a failure ends, and when), and the
functions above it are their stateless parts; splitting them apart would spread one
stage over two files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from ..errors import NonFiniteLogitsError
from ..runner import SeqWork
from .output_processor import IN_FLIGHT, RequestOutput, host_logprobs, make_output
from .rejection_sampler import Proposal, token_logprobs, verify as verify_drafts
from .sampling import sample
from .sequence import Sequence, chunk_scores, wants_prompt_rows


@dataclass
class InFlight:
    """A launched step, not read back yet.

    Attributes:
        tokens: ``[B]`` int32 sampled ids, on the device (the next step's ``prev_tokens``).
        finite: ``[B]`` bool, whether row ``b``'s logits were all finite.
        results: per row ``b``, ``(SampleResult, row in it)`` (one shared result when the
            batched sample succeeded; one per row after the row-by-row fallback; ``None``
            for a row whose sampling failed).
        rows: ``(sequence, row, output index)`` per sampled request still running.
        row_of: request id -> row.
        unsampled: the step's other sequences (a prompt chunk short of the last token):
            their KV came from the same evaluation, so they end too when it failed.
    """

    tokens: mx.array
    finite: mx.array
    results: list
    rows: list = field(default_factory=list)
    row_of: dict = field(default_factory=dict)
    unsampled: list = field(default_factory=list)


def grammar_allowed(seq: Sequence, proposal: Proposal) -> tuple[Proposal, int]:
    """``proposal`` cut to the prefix ``seq``'s grammar allows (unchanged without one), and
    the number of draft tokens it proposed: a draft token the grammar forbids would be
    rejected by the masked verification anyway, so it is not sent to the model.

    Raises:
        whatever the grammar raises (the caller drops that row's draft).
    """
    proposed = len(proposal.token_ids)
    if seq.grammar is None or not proposed:
        return proposal, proposed
    allowed = seq.grammar.allowed_prefix(proposal.token_ids, seq.stop_ids)
    if allowed == proposed:
        return proposal, proposed
    probs = proposal.draft_probs[:allowed] if proposal.draft_probs is not None else None
    return Proposal(proposal.token_ids[:allowed], probs), proposed


def live_items(items: list, proposals: dict) -> tuple[list, dict]:
    """``items`` without the rows whose request finished since it was scheduled, and
    ``proposals`` (keyed by item index) re-keyed to the kept rows."""
    live = [i for i, it in enumerate(items) if not it.seq.finished]
    if len(live) == len(items):
        return items, proposals
    return [items[i] for i in live], {j: proposals[i] for j, i in enumerate(live) if i in proposals}


def non_finite_error() -> NonFiniteLogitsError:
    """The exception of a request whose logits held NaN or Inf."""
    return NonFiniteLogitsError(
        "the model produced NaN or Inf logits for this request: check the checkpoint's weights "
        "and rope_theta, or load it in float32")


def mask_undecodable(logits: mx.array, decodable: Optional[mx.array]) -> mx.array:
    """``logits`` (``[..., vocab]``) with the ids outside ``decodable`` (``[1, vocab]`` bool;
    None: every id decodes) at ``-inf``."""
    if decodable is None:
        return logits
    return mx.where(decodable, logits, mx.array(-mx.inf, dtype=logits.dtype))


def build_work(items: list, proposals: dict, flight_rows: dict) -> list[SeqWork]:
    """The runner's work for ``items``, each row with the adapter slot its scheduled item
    carries (``ScheduledItem.lora_slot``, -1: the base model).

    A token still in flight is taken on the device from the previous step's sampled
    tokens (``prev_row``: its row in ``flight_rows``, request id -> row); a row with a
    proposal (``proposals``: item index -> :class:`Proposal`) carries it after its token
    and returns the logits of every position. Sets each sequence's
    ``metrics.first_scheduled_time`` (seconds since the epoch) when unset.
    """
    now = time.time()
    work = []
    for i, it in enumerate(items):
        s = it.seq
        if s.metrics.first_scheduled_time is None:
            s.metrics.first_scheduled_time = now
        end = s.num_computed + it.num_tokens
        tokens = s.token_at(s.num_computed, end)
        if i in proposals:
            work.append(SeqWork(s.request_id, tokens + proposals[i].token_ids, all_logits=True, as_decode=True,
                                lora_slot=it.lora_slot))
            continue
        prev_row = -1
        if end == s.num_tokens and s.output_ids and s.output_ids[-1] == IN_FLIGHT:
            prev_row = flight_rows[s.request_id]
            tokens[-1] = 0
        work.append(SeqWork(s.request_id, tokens, return_logits=it.samples, prev_row=prev_row,
                            all_logits=wants_prompt_rows(s, it.num_tokens), lora_slot=it.lora_slot))
    return work


def first_logit_rows(work: list[SeqWork]) -> list[int]:
    """Per item of ``work``, the index of its first row in the step's logits (items return
    ``num_logit_rows`` rows each, in order)."""
    rows, r = [], 0
    for w in work:
        rows.append(r)
        r += w.num_logit_rows
    return rows


def score_prompts(items: list, work: list[SeqWork], logits: mx.array, skip=()) -> list[mx.array]:
    """Queue the prompt scores of every chunk that returned all its rows (prompt logprobs);
    returns the arrays to evaluate with the step. Call before ``num_computed`` moves.
    ``logits`` holds every item's rows in ``work`` order; items whose index is in ``skip``
    (drafted decode rows) hold no prompt."""
    arrays = []
    r = 0
    for i, (it, w) in enumerate(zip(items, work)):
        n = w.num_logit_rows
        if w.all_logits and i not in skip and it.seq.params.prompt_logprobs is not None:
            chunk = chunk_scores(logits[r : r + n], it.seq.prompt_ids, it.seq.num_computed,
                                 it.seq.params.prompt_logprobs)
            if chunk is not None:
                it.seq.prompt_score_chunks.append(chunk)
                arrays.extend(chunk.arrays())
        r += n
    return arrays


def sample_rows(take: mx.array, seqs: list[Sequence], pending: Optional[mx.array] = None,
                allowed: Optional[mx.array] = None,
                decodable: Optional[mx.array] = None) -> tuple[InFlight, dict[int, Exception]]:
    """Sample every row of ``take`` (``[B, V]`` logits) at once, lazily; when that raises,
    row by row with the random keys restored, so a failure (a bad parameter, a fault)
    belongs only to the request it comes from.

    Each sequence sampled gets an :data:`IN_FLIGHT` placeholder in ``output_ids`` and a
    row in the returned :class:`InFlight`; the failed ones are returned as
    ``{row: exception}`` for the caller to end (nothing else of theirs is touched).

    Args:
        pending: ``[B]`` int32 on the device, each row's generated token still in flight
            (``-1``: none), which the penalties count (see :func:`sample`).
        allowed: the grammar bitmask of the rows (structured output), or None.
        decodable: see :func:`mask_undecodable`.
    """
    states = [s.sampler for s in seqs]
    saved = [st.key for st in states]
    finite = mx.all(mx.isfinite(take), axis=-1)
    take = mask_undecodable(take, decodable)
    errors: dict[int, Exception] = {}
    try:
        res = sample(take, states, record=False, pending=pending, allowed=allowed)
        results = [(res, b) for b in range(len(seqs))]
        tokens = res.tokens
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        results, pieces = [], []
        for b, st in enumerate(states):
            st.key = saved[b]  # the failed batched call may have split it
            try:
                r = sample(take[b : b + 1], [st], record=False,
                           pending=pending[b : b + 1] if pending is not None else None,
                           allowed=allowed[b : b + 1] if allowed is not None else None)
                results.append((r, 0))
                pieces.append(r.tokens.astype(mx.int32))
            except Exception as e:  # noqa: BLE001
                errors[b] = e
                results.append((None, 0))
                pieces.append(mx.zeros((1,), dtype=mx.int32))
        tokens = mx.concatenate(pieces)
    flight = InFlight(tokens, finite, results)
    for b, s in enumerate(seqs):
        if b in errors:
            continue
        s.output_ids.append(IN_FLIGHT)
        flight.rows.append((s, b, len(s.output_ids) - 1))
        flight.row_of[s.request_id] = b
    return flight, errors


class StepLauncher:
    """The launch and read-back stage of :meth:`Engine.step <mlx_ferrum.engine.engine.Engine.step>`:
    queue the sampling of the forward pass the engine built, hold the step in flight, and
    read it back (tokens, drafts verified, outputs emitted).

    It owns the step in flight (:attr:`inflight`) and the counters of what it ran; the
    requests it ends go through the engine's ``finish`` / ``fail`` (which free their slots
    and caches at the right time), the outputs produced outside a caller's list through
    ``pend``. :attr:`inflight` is written only by the thread holding the engine's step
    lock; everything that edits a sequence runs under ``lock`` (the engine's), because
    other threads add and abort requests meanwhile.

    Args:
        runner: the engine's :class:`~mlx_ferrum.runner.ModelRunner`.
        scheduler: the engine's :class:`~mlx_ferrum.engine.scheduler.Scheduler`
            (prefix-cache ids, drafts committed and their rejected slots freed).
        outputs: the engine's :class:`~mlx_ferrum.engine.output_processor.OutputProcessor`.
        lock: the engine's lock (a ``threading.RLock``).
        finish: ``finish(seq, reason, error=None, exception=None)`` ends one request.
        fail: ``fail(seqs, exc) -> [RequestOutput]`` ends requests with ``"error"``
            (finished ones skipped) and returns their final outputs.
        pend: ``pend(outputs)`` keeps outputs for the engine's next :meth:`step` to return.
        max_sequence_tokens: most tokens one request may reach (``Engine.max_sequence_tokens``,
            read once as the scheduler reads it: the runner's capacity does not change).
        decodable: ``[1, vocab]`` bool, the ids the tokenizer can decode (None: all).
        prefix_cache: True when the scheduler's block manager hashes blocks (each token
            read back is then reported through ``scheduler.set_token_ids``).
        proposer, policy: the speculative proposer and
            :class:`~mlx_ferrum.engine.speculative.SpeculationPolicy` (None without speculation).
        grammar_backend: returns the engine's :class:`~mlx_ferrum.engine.structured.GrammarBackend`
            (asked only for constrained rows).

    Attributes:
        inflight: the launched step not read back yet (:class:`InFlight`), or None.
        num_steps: steps launched. num_prefilled_tokens: prompt (and recomputed) tokens run.
        spec_num_drafts, spec_proposed_tokens, spec_accepted_tokens: verified rows that
            carried a draft, their proposed and their accepted tokens.
    """

    def __init__(self, runner, scheduler, outputs, lock, finish: Callable, fail: Callable, pend: Callable,
                 max_sequence_tokens: int, decodable: Optional[mx.array],
                 prefix_cache: bool, proposer=None, policy=None, grammar_backend: Optional[Callable] = None):
        self.runner = runner
        self.scheduler = scheduler
        self.outputs = outputs
        self.lock = lock
        self.finish = finish
        self.fail = fail
        self.pend = pend
        self.max_sequence_tokens = max_sequence_tokens
        self.decodable = decodable
        self.prefix_cache = prefix_cache
        self.proposer = proposer
        self.policy = policy
        self.grammar_backend = grammar_backend
        self.inflight: Optional[InFlight] = None
        self.num_steps = 0
        self.num_prefilled_tokens = 0
        self.spec_num_drafts = 0
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0

    def read_back(self, launched: Optional[InFlight], verified: list, pipelined: bool, outputs: list) -> None:
        """The read-back stage: read the step launched before (``pipelined``) or ``launched``
        itself (synchronous) and emit its tokens (:meth:`resolve`), and verify this step's
        drafts (:meth:`verify`); ``launched`` becomes :attr:`inflight` when pipelined.
        Outputs are appended to ``outputs`` as they come (so a ``BaseException`` part way
        loses none). Lock held."""
        previous, self.inflight = self.inflight, launched
        if previous is not None:
            outputs.extend(self.resolve(previous))
        if verified:
            outputs.extend(self.verify(verified))
        if launched is not None and not pipelined:
            self.inflight = None
            outputs.extend(self.resolve(launched))

    def read_back_inflight(self, outputs: list) -> None:
        """Read back the step in flight now (:meth:`resolve`; its outputs appended to
        ``outputs``), for a step that cannot be queued behind it. Lock held."""
        flight, self.inflight = self.inflight, None
        outputs.extend(self.resolve(flight))

    def _grammar_mask(self, seqs: list, queued: Optional[mx.array] = None) -> Optional[mx.array]:
        """The packed ``[B, ceil(V / 32)]`` token bitmask of ``seqs`` (None when none is
        constrained). ``queued``: the logits being sampled, started on the device first so
        that the host computes the masks while the forward pass runs."""
        if not any(s.grammar is not None for s in seqs):
            return None
        if queued is not None:
            mx.async_eval(queued)
        return mx.array(self.grammar_backend().fill_bitmask([s.grammar for s in seqs]))

    def sample(self, items: list, work: list[SeqWork], proposals: dict, logits: mx.array, state: list,
               outputs: list) -> tuple[Optional[InFlight], list]:
        """The sample stage's launch: advance each row by the tokens the pass computed,
        queue the prompt scores and the batched sampling of the plain rows, then
        ``mx.async_eval`` all of it with ``state``; nothing of this step is read back.

        Kept apart from the run stage (the engine's call of the runner) at no cost to the
        pipelined step: both only build lazy graphs, and the one ``mx.async_eval`` at the
        end still queues the pass and its sampling together (evaluating the pass first would split the step's device work
        in two and, on MLX's CPU backend, block the host for the pass).

        Args:
            items: the step's :class:`~mlx_ferrum.engine.scheduler.ScheduledItem` s, in
                ``work`` order; ``proposals``: item index -> its draft
                (:class:`~mlx_ferrum.engine.rejection_sampler.Proposal`).
            logits, state: the runner's ``forward`` result for ``work``.
            outputs: where the outputs of a step read back early go (see below).

        Returns ``(flight, verified)``: the :class:`InFlight` of the plain sampled rows
        (or None), and ``(sequence, logits [1 + m, V], proposal)`` for each row that carried
        a draft of ``m`` tokens, which :meth:`verify` settles after this step's launch.

        A constrained row whose previous token is still in flight needs that token on the
        host for its mask (its grammar takes it in :meth:`_emit`): once the forward pass
        is built, the step in flight is read back here (:meth:`_resolve_before_masks`, its
        outputs appended to ``outputs``, and :attr:`inflight` cleared so that the caller
        does not resolve it again), so the pass still overlaps the read-back; a row whose
        request ended in that read-back is not sampled.

        Isolation: a sampler failure ends only its row's request (:meth:`_sample_flight`);
        a ``BaseException`` while sampling ends this step's sampled requests, then
        propagates; an ``Exception`` otherwise fails this step's requests (the caller does
        that). When ``mx.async_eval`` raises, see :meth:`_evaluation_failed`.
        """
        prev = self.inflight.tokens if self.inflight is not None else None
        with self.lock:
            self.num_steps += 1
            sampled, verified = [], []
            samples = [it.samples for it in items]  # read before num_computed moves
            scores = score_prompts(items, work, logits, skip=proposals)
            row_of_item = first_logit_rows(work)
            pending_rows = []
            for i, it in enumerate(items):
                s = it.seq
                if s.finished:  # aborted while the step was built: released by the engine's end of flight
                    continue
                if i in proposals:
                    # the draft's K/V are kept or trimmed by verify
                    s.num_computed += 1
                    start = row_of_item[i]
                    verified.append((s, logits[start : start + work[i].num_logit_rows], proposals[i]))
                    continue
                if s.num_computed < len(s.prompt_ids):
                    self.num_prefilled_tokens += it.num_tokens
                    s.metrics.num_prefilled_tokens += it.num_tokens
                s.num_computed += it.num_tokens
                if s.num_computed == s.num_tokens:
                    sampled.append(s)
                    in_flight = bool(s.output_ids) and s.output_ids[-1] == IN_FLIGHT
                    pending_rows.append(self.inflight.row_of[s.request_id] if in_flight else -1)
            started = False
            if self.inflight is not None and any(s.grammar is not None and p >= 0
                                                 for s, p in zip(sampled, pending_rows)):
                self._resolve_before_masks(logits, sampled, outputs)
                started = True
                # every token of that step is on the host now: the penalties count it from
                # the history, and a request it ended is not sampled
                sampled = [s for s in sampled if not s.finished]
                pending_rows = [-1] * len(sampled)
                prev = None
            # an item's sampled row is its last one (a prompt-logprobs chunk returns them all)
            rows = [row_of_item[i] + work[i].num_logit_rows - 1 for i, it in enumerate(items)
                    if samples[i] and not it.seq.finished and i not in proposals]
            if not sampled:
                try:
                    mx.async_eval(state, *scores)
                except BaseException as e:
                    self._evaluation_failed([], e)
                    raise
                return None, verified
            take = logits if len(rows) == logits.shape[0] else logits[mx.array(rows, dtype=mx.int32)]
            pending = None
            if prev is not None and any(p >= 0 for p in pending_rows):
                # the penalties count each row's token still in flight, on the device
                index = mx.array(pending_rows, dtype=mx.int32)
                pending = mx.where(index >= 0, prev.astype(mx.int32)[mx.maximum(index, 0)], -1)
            try:
                flight = self._sample_flight(take, sampled, pending,
                                             self._grammar_mask(sampled, None if started else take))
            except BaseException as e:
                # the KV already holds this step, so its sampled requests end now rather
                # than stall; then it propagates
                self.pend(self.fail(sampled, e))
                raise
            sampled_ids = {id(s) for s in sampled}
            flight.unsampled = [it.seq for i, it in enumerate(items)
                                if not it.seq.finished and id(it.seq) not in sampled_ids and i not in proposals]
            extra = [a for res in {id(x[0]): x[0] for x in flight.results if x[0] is not None}.values()
                     for a in (res.logprobs, res.top_ids, res.top_logprobs) if a is not None]
            keys = [s.sampler.key for s in sampled]  # split by this step: see Engine.step()
            try:
                mx.async_eval(flight.tokens, flight.finite, *extra, *state, *keys, *scores)
            except BaseException as e:
                self._evaluation_failed(sampled, e)
                raise
            return (flight if flight.rows else None), verified

    def _resolve_before_masks(self, logits: mx.array, sampled: list, outputs: list) -> None:
        """Read back the step in flight for the masks of this step's constrained rows, with
        this step's pass queued in between; the flight's outputs are appended to
        ``outputs``. Call with the lock held, after the pass is built and before sampling.

        Order: wait for the step in flight (``tolist``), then queue the pass
        (``mx.async_eval(logits)``), then emit the read tokens (each grammar accepts its
        own), so that the pass runs on the device while the host emits and computes the
        masks. (On MLX's CPU backend ``async_eval`` waits for the work queued before it, so
        queuing the pass before the wait would serialize the two.) ``self.inflight`` is
        cleared: the caller must not resolve that step again.

        Isolation: a failed read-back ends the flight's requests (:meth:`resolve`); a
        failure queuing the pass is this step's own (the flight was read back), raised
        after the flight's tokens are emitted so that none is lost; a ``BaseException``
        also ends this step's sampled requests, whose rows would never be sampled.
        """
        flight, self.inflight = self.inflight, None
        try:
            try:
                read = flight.tokens.tolist(), flight.finite.tolist()
            except Exception as e:  # noqa: BLE001 - the step's evaluation failed: resolve ends its requests
                read = e
            queue_error = None
            if not isinstance(read, Exception):
                try:
                    mx.async_eval(logits)
                except BaseException as e:  # noqa: BLE001 - raised below, after the flight is emitted
                    queue_error = e
            outputs.extend(self.resolve(flight, read))
        except BaseException as e:
            self.pend(self.fail([s for s, _, _ in flight.rows] + sampled, e))
            raise
        if queue_error is not None:
            if not isinstance(queue_error, Exception):
                self.pend(self.fail(sampled, queue_error))
            raise queue_error

    def _evaluation_failed(self, sampled: list, exc: BaseException) -> None:
        """``mx.async_eval`` of the step being launched raised. Call with the lock held.

        MLX reports a failed evaluation once, at the first host wait after it (on the CPU
        ``async_eval`` waits for most of the queued work), and computes what depends on
        the failed op from an unwritten buffer without a word. So an ``Exception`` here
        may be the failure of the step still in flight, whose tokens and KV this step
        reads: that step's requests end too (their next read-back would return garbage
        as if it were tokens); the caller ends this step's. A ``BaseException`` (Ctrl-C
        while it waited) ends this step's sampled requests, whose tokens no flight
        would ever read back; then it propagates.
        """
        previous = self.inflight
        if isinstance(exc, Exception):
            if previous is not None:
                self.pend(self.fail([s for s, _, _ in previous.rows] + previous.unsampled, exc))
        else:
            self.pend(self.fail(sampled, exc))

    def _sample_flight(self, take: mx.array, seqs: list[Sequence], pending: Optional[mx.array] = None,
                       allowed: Optional[mx.array] = None) -> InFlight:
        """Sample every row of ``take`` at once, lazily (:func:`~mlx_ferrum.engine.launch.sample_rows`);
        a row whose sampling fails ends only its own request (finished here with
        ``"error"``; its output is pending). Lock held."""
        flight, errors = sample_rows(take, seqs, pending, allowed, self.decodable)
        for b, e in errors.items():
            s = seqs[b]
            self.finish(s, "error", f"{type(e).__name__}: sampling failed: {e}", exception=e)
            self.pend([make_output(s, "", [])])
        return flight

    def resolve(self, flight: InFlight, read=None) -> list[RequestOutput]:
        """Read a launched step's tokens, then detokenize, check stops and emit.

        ``read``: ``(tokens, finite)`` as lists, or the ``Exception`` reading them raised,
        when the caller read the step back already; None reads it here.

        The one-step lag: a request that finishes here may already have its next token
        queued (a placeholder at the end of ``output_ids``); it is dropped with the rest
        of the request when the engine's ``finish`` frees its blocks, and a later resolve skips
        finished requests. Aborted or finished requests are skipped the same way.

        Isolation: NaN/Inf logits end their request with :class:`NonFiniteLogitsError`;
        a failure emitting one token (e.g. the detokenizer) ends only that request; a
        failure reading the step back (its evaluation failed) ends only this step's
        requests, prompt-chunk ones included (``flight.unsampled``); a ``BaseException``
        ends this step's sampled requests, then propagates.
        """
        outs: list[RequestOutput] = []
        try:
            if read is None:
                try:
                    read = flight.tokens.tolist(), flight.finite.tolist()
                except Exception as e:  # noqa: BLE001
                    read = e
            if isinstance(read, Exception):  # the step's evaluation failed: its requests only
                return self.fail([s for s, _, _ in flight.rows] + flight.unsampled, read)
            tokens, finite = read
            host: dict[int, tuple] = {}
            now = time.time()
            cap = self.max_sequence_tokens
            for s, b, index in flight.rows:
                if s.finished:
                    continue
                error = None if finite[b] else non_finite_error()
                if error is None:
                    try:
                        tok = tokens[b]
                        lp, top = host_logprobs(flight.results[b], host)
                        s.sampler.append(tok)
                        if self.prefix_cache:
                            # stored as UNKNOWN_TOKEN when the next step was queued: its
                            # block can be hashed now
                            self.scheduler.set_token_ids(s, len(s.prompt_ids) + index, [tok])
                        outs.append(self._emit(s, [tok], [lp], [top], now, cap, index=index))
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. the detokenizer: this request only
                        error = e
                if not s.finished:
                    self.finish(s, "error", exception=error)
                outs.append(make_output(s, "", []))
        except BaseException as e:
            self.pend(outs + self.fail([s for s, _, _ in flight.rows], e))
            raise
        return outs

    def _emit(self, s: Sequence, tokens: list[int], lps: list, tops: list, now: float, cap: int,
              index: Optional[int] = None) -> RequestOutput:
        """The output stage (:meth:`OutputProcessor.emit
        <mlx_ferrum.engine.output_processor.OutputProcessor.emit>`) for 1 or more sampled
        tokens of ``s``; ends the request when one of them does. Call with the lock held."""
        delta, new_ids, reason = self.outputs.emit(s, tokens, lps, tops, now, cap, index=index)
        if reason is not None:
            self.finish(s, reason)
        return make_output(s, delta, new_ids)

    def _draft_mask(self, seq: Sequence, proposal: Proposal) -> Optional[mx.array]:
        """The ``[1 + m, ceil(V / 32)]`` grammar bitmask a constrained row's draft is verified
        under (each position: its grammar state after the draft's earlier tokens), or None
        for an unconstrained row."""
        if seq.grammar is None:
            return None
        return mx.array(seq.grammar.draft_bitmask(proposal.token_ids, self.grammar_backend().words))

    def verify(self, verified: list) -> list[RequestOutput]:
        """The sampling stage of rows that carried a draft: accept a prefix of each draft
        and add one token of the target's (:func:`~mlx_ferrum.engine.rejection_sampler.verify`:
        the target's own choice for greedy rows, rejection sampling for sampled ones), trim
        each cache to the accepted length (whole blocks past it are freed, with the draft
        model's cache), and emit the tokens. Call with the lock held.

        Isolation: a failure verifying or emitting ends only the rows of this step's drafts;
        NaN/Inf logits end their request with :class:`NonFiniteLogitsError`.
        """
        live = [(s, row, prop) for s, row, prop in verified if not s.finished]
        if not live:
            return []
        outs, kept, masks = [], [], []
        for s, row, prop in live:
            try:
                masks.append(self._draft_mask(s, prop))
                kept.append((s, row, prop))
            except Exception as e:  # noqa: BLE001 - a grammar failure ends its own request only
                outs.extend(self.fail([s], e))
        live = kept
        if not live:
            return outs
        seqs = [s for s, _, _ in live]
        try:
            finite_rows = mx.all(mx.isfinite(mx.concatenate([row for _, row, _ in live], axis=0)), axis=-1)
            results = verify_drafts([mask_undecodable(row, self.decodable) for _, row, _ in live],
                                    [p for _, _, p in live], [s.sampler for s in seqs],
                                    also=[finite_rows], allowed=masks)
            finite = finite_rows.tolist()
        except Exception as e:  # noqa: BLE001 - this step's drafts only
            return outs + self.fail(seqs, e)
        cap = self.max_sequence_tokens
        now = time.time()
        offset = 0
        for (s, row, prop), res in zip(live, results):
            rows = 1 + len(prop.token_ids)
            ok = all(finite[offset : offset + rows])
            offset += rows
            try:
                if not ok:
                    raise non_finite_error()
                self.spec_num_drafts += 1
                self.spec_proposed_tokens += len(prop.token_ids)
                self.spec_accepted_tokens += res.num_accepted
                self.policy.record(s.request_id, len(prop.token_ids), res.num_accepted, self.num_steps)
                kept = s.num_computed + res.num_accepted  # prompt + output + accepted draft tokens
                # the scheduler frees the rejected tokens' blocks (and learns the accepted
                # ids); the runner cuts a contiguous cache's buffers (nothing for paged)
                self.scheduler.commit_draft(s, s.num_computed, res.token_ids[: res.num_accepted])
                self.runner.trim_cache(s.request_id, kept)
                self.proposer.committed(s.request_id, kept)
                s.num_computed = kept
                lps = tops = [None] * len(res.token_ids)
                if s.params.logprobs is not None:
                    chosen, top_ids, top_lps = token_logprobs(row[: len(res.token_ids)], res.token_ids,
                                                              s.params.logprobs or 0)
                    lps = chosen
                    tops = list(zip(top_ids, top_lps)) if top_ids is not None else [None] * len(chosen)
                for tok in res.token_ids:
                    s.sampler.append(tok)
                outs.append(self._emit(s, res.token_ids, lps, tops, now, cap))
            except Exception as e:  # noqa: BLE001 - this request only
                if not s.finished:
                    self.finish(s, "error", exception=e)
                outs.append(make_output(s, "", []))
        return outs
