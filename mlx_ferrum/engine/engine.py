"""Engine: requests -> Scheduler -> executor -> sampler -> detokenizer.

Continuous batching in the manner of Orca (Yu et al., OSDI 2022) and vLLM: every
``step()`` asks the scheduler which sequences run, packs their new tokens (prefill
chunks and decode tokens together) into ONE executor call, samples the sequences
whose chunk reached their last token in one batched ``sample()``, detokenizes, checks
stops, and frees the caches of finished requests at once.

``add_request`` and ``abort`` are thread-safe: any thread may submit while another
drives ``step()``. :meth:`Engine.stream` drives the loop itself; :class:`AsyncEngine`
(``mlx_ferrum.engine.async_engine``) drives it from a background thread for asyncio.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence as Seq, Union

import mlx.core as mx

from ..config import RuntimeConfig
from collections import deque

from ..errors import LoraError, NonFiniteLogitsError, PromptTooLongError, RequestError
from ..lora import prefix_salt
from ..executor import LlmExecutor, SeqWork
from .metrics import LatencyReservoir
from .prompt import Prompt, encode_prompt
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestMetrics, Sequence, SequenceStatus
from .speculative import SpeculativeRequest, make_proposer, token_logprobs, verify
from ..executor import KvCacheHandle
from .stop import emit_token

_req_ids = itertools.count()

#: Placeholder in ``Sequence.output_ids`` for a token sampled but not yet read back.
_IN_FLIGHT = -1


@dataclass
class _InFlight:
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


def _non_finite_error() -> str:
    """The ``error`` text of a request whose logits held NaN or Inf."""
    return f"{NonFiniteLogitsError.__name__}: " + str(NonFiniteLogitsError(
        "the model produced NaN or Inf logits for this request: check the checkpoint's weights "
        "and rope_theta, or load it in float32"))


def context_full_message(num_tokens: int, capacity: int, max_position_embeddings: int) -> str:
    """Why a prompt of ``num_tokens`` does not fit a context of ``capacity``, and the fix that
    exists: FERRUM_KV_CAPACITY can only be raised up to ``max_position_embeddings``."""
    msg = f"the prompt has {num_tokens} tokens and the context holds {capacity}: shorten it"
    if capacity < max_position_embeddings:
        return msg + f", or raise FERRUM_KV_CAPACITY (up to the model's max_position_embeddings={max_position_embeddings})"
    return msg + f" ({capacity} is the model's own limit, max_position_embeddings)"


def apply_kv_plan(executor, plan: SchedulerOutput) -> list[tuple[Sequence, Exception]]:
    """Apply the KV-cache changes the scheduler planned (it only reads the manager):
    free the caches of the preempted sequences, in order, then perform the prefix-cache
    lookups in order (``executor.claim_prefix``; a lookup whose sequence was not admitted
    is released at once, see :class:`~mlx_ferrum.engine.scheduler.PrefixLookup`).

    Called right after :meth:`Scheduler.schedule`, before the step is built, so the
    manager then holds what the scheduler counted on, changed exactly as when the
    scheduler wrote it itself: releases first (a claim may revive blocks a preempted
    sequence held), then the lookups in the scheduler's order.

    Returns:
        ``(sequence, error)`` for each admitted claim that failed (the engine fails that
        request); empty when the manager agreed with the plan, which it always should.
    """
    for seq in plan.preempted:
        if executor.has_cache(seq.request_id):
            executor.release_cache(seq.request_id)
    failed = []
    for lookup in plan.prefix_lookups:
        seq = lookup.seq
        try:
            executor.claim_prefix(seq.request_id, seq.prefix_key_ids(), lookup.num_tokens)
        except Exception as e:  # noqa: BLE001 - this request only
            if lookup.admitted:
                failed.append((seq, e))
            continue
        if not lookup.admitted:
            executor.release_cache(seq.request_id)
    return failed


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the request.
        text: all text generated so far (stop strings trimmed).
        delta: text added by this step.
        token_ids: all generated token ids.
        new_token_ids: ids added by this step.
        finished: True once it ended; then ``finish_reason`` is ``"stop"``,
            ``"length"``, ``"abort"`` or ``"error"`` (with ``error`` set).
        logprobs: log-probability of each generated token, when asked.
        top_logprobs: per token, ``{token_id: logprob}`` of the top alternatives, when asked.
        metrics: timings (:class:`~mlx_ferrum.engine.sequence.RequestMetrics`).
        prompt_token_ids: the prompt.
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


class Engine:
    """A continuous-batching engine over one model.

    Args:
        model, tokenizer: from :func:`mlx_ferrum.load` (tokenizer may be None when every
            prompt is token ids; then outputs carry no text).
        config: runtime settings (``kv_layout``, budgets, prefix caching ...); None
            reads the environment. The paged layout is what makes continuous batching
            efficient; the contiguous layout works with padded batches and no preemption.
        executor: an existing executor to use instead of building one.
        proposer: a speculative-decoding proposer (``NgramProposer`` /
            ``DraftModelProposer`` from :mod:`mlx_ferrum.engine.speculative`) to use
            instead of the one ``config.speculative`` names.

    Raises (from its calls):
        RequestError: unknown request id, or a request that alone cannot fit the pool.
        PromptTooLongError: a prompt that fills the context.
        SamplingParamsError: invalid sampling parameters.
    """

    def __init__(self, model, tokenizer=None, config: Optional[RuntimeConfig] = None, executor: Optional[LlmExecutor] = None,
                 proposer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config if config is not None else RuntimeConfig()
        self.executor = executor if executor is not None else LlmExecutor(model, self.config)
        self.scheduler = Scheduler(self.config, self.executor.manager, self.executor.kv_capacity())
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._lock = threading.RLock()  # guards scheduler and sequences
        self._step_lock = threading.Lock()  # one step at a time
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts, rejections)
        # bounded: count, sum and a fixed-size sample each (a server finishes millions of requests)
        self._ttft = LatencyReservoir()
        self._itl = LatencyReservoir(seed=1)
        # request ids of the step now in the executor; an abort of one of them frees its
        # cache only after the executor call, so forward() never re-creates a released cache
        self._in_flight: set[str] = set()
        self._deferred_release: list[str] = []
        self._pipelined = bool(self.config.async_scheduling) and not (
            self.executor.manager is not None and self.executor.manager.prefix_cache
        )
        self._inflight: Optional[_InFlight] = None  # the launched step not read back yet
        self.num_steps = 0
        self.num_prefilled_tokens = 0
        self.num_generated_tokens = 0
        self._start = time.time()
        self._proposer = proposer if proposer is not None else make_proposer(self.config, model.args.vocab_size)
        self.spec_num_drafts = 0  # verified rows that carried at least one proposed token
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        # LoRA: requests with an adapter hold a pinned slot from admission to their end;
        # those that find every slot pinned by other adapters wait here, outside the scheduler
        self._lora_slot_of: dict[str, int] = {}
        self._lora_waiting: deque = deque()

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> str:
        """Queue a request (text, chat messages or token ids); returns its id. Thread-safe.

        ``lora`` names a registered adapter (:meth:`add_lora`) to run the request with;
        None runs the base model.

        Raises:
            UnknownLoraError: ``lora`` is not registered. LoraError: LoRA is off.
            PromptTooLongError: the prompt fills the context.
            RequestError: the id is in use, the prompt is empty or not a prompt type, or a
                token id is outside ``[0, vocab_size)``.
            TokenizerError: the text cannot be tokenized (lone surrogates, too long ...).
            SamplingParamsError: a ``logit_bias`` id is outside the vocabulary.
        """
        params = params if params is not None else SamplingParams()
        ids = encode_prompt(self.tokenizer, prompt, vocab_size=getattr(getattr(self.executor, "info", None), "vocab_size", None))
        cap = self.executor.kv_capacity()
        if len(ids) >= cap:
            raise PromptTooLongError(context_full_message(len(ids), cap, self.model.args.max_position_embeddings))
        params.check_vocab(self.model.args.vocab_size)
        self._check_lora_name(lora)
        rid = request_id if request_id is not None else f"req-{next(_req_ids)}"
        seq = Sequence.create(rid, ids, params, self.tokenizer, self._eos)
        if lora is not None:
            seq.lora, seq.prefix_salt = lora, prefix_salt(lora)
        with self._lock:
            if rid in self._seqs:
                raise RequestError(f"request id {rid!r} is in use: pick another")
            self._seqs[rid] = seq
            self._admit_with_lora(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """End a request now and free its KV blocks; its output ends with ``"abort"``.

        Raises:
            RequestError: unknown (or already finished and collected) request id.
        """
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                raise RequestError(f"unknown request {request_id!r}: it finished or was never added")
            if seq.finished:
                return
            self._finish(seq, "abort")
            self._pending.append(self._output(seq, "", []))

    def has_unfinished_requests(self) -> bool:
        """True while a request waits or runs (or has an output not yet returned)."""
        with self._lock:
            return (self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None
                    or bool(self._lora_waiting))

    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        while seq.output_ids and seq.output_ids[-1] == _IN_FLIGHT:
            seq.output_ids.pop()  # never read back: not part of the output
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = time.time()
        self.scheduler.remove(seq)
        self._release_lora_of(seq)
        if seq.request_id in self._in_flight:
            self._deferred_release.append(seq.request_id)
        else:
            self.executor.release_cache(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        if self._proposer is not None:
            self._proposer.release(seq.request_id)
        m = seq.metrics
        if m.ttft is not None:
            self._ttft.add(m.ttft)
        self._itl.extend(m.inter_token_latencies)

    def _end_flight(self) -> None:
        """The step left the executor: free the caches of requests aborted meanwhile."""
        with self._lock:
            self._in_flight = set()
            for rid in self._deferred_release:
                self.executor.release_cache(rid)
            self._deferred_release = []

    def _fail_step(self, items, exc: BaseException) -> list[RequestOutput]:
        """End every request of a failed step with ``"error"`` (the executor already
        restored their caches; finishing releases them). Other requests are untouched."""
        return self._fail_seqs([it.seq for it in items], exc)

    def _fail_seqs(self, seqs, exc: BaseException) -> list[RequestOutput]:
        """:meth:`_fail_step` for a list of sequences (finished ones are skipped)."""
        outs = []
        with self._lock:
            for s in seqs:
                if not s.finished:
                    self._finish(s, "error", f"{type(exc).__name__}: {exc}")
                    outs.append(self._output(s, "", []))
        return outs

    def _output(self, seq: Sequence, delta: str, new_ids: list[int]) -> RequestOutput:
        want_lp = seq.params.logprobs is not None
        return RequestOutput(
            request_id=seq.request_id,
            text=seq.text,
            delta=delta,
            token_ids=list(seq.output_ids),
            new_token_ids=new_ids,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            prompt_token_ids=seq.prompt_ids,
            logprobs=list(seq.logprobs) if want_lp else None,
            top_logprobs=list(seq.top_logprobs) if want_lp and seq.params.logprobs else None,
            error=seq.error,
        )

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for each request that changed.

        Pipelined (``RuntimeConfig.async_scheduling``, the default): this step's forward
        pass and sampling are queued with ``mx.async_eval`` BEFORE the previous step's
        tokens are read back, detokenized and checked for stops, so the host work of one
        step overlaps the device work of the next (vLLM's async scheduling; mlx-lm's
        ``generate_step`` overlaps the same way). Outputs therefore trail by one step;
        token ids are the same as in the synchronous mode (see :meth:`_resolve` for the
        one-step lag).
        """
        if self._proposer is not None:
            return self._speculative_step()
        with self._step_lock:
            outputs: list[RequestOutput] = []
            try:
                self._step_body(outputs)
            except BaseException:
                # Ctrl-C (or a failure past the isolation below): what this step already
                # produced is returned by the next call instead of being lost
                with self._lock:
                    self._pending[:0] = outputs
                raise
            return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> list:
        """The scheduler's items for this step; requests the pool can never hold end here
        with ``"error"`` (their outputs are appended to ``outputs``). Call with the lock held."""
        self._admit_lora_waiting()
        plan = self.scheduler.schedule()
        # the scheduler only reads the manager: its releases and prefix claims land here
        for seq, exc in apply_kv_plan(self.executor, plan):
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            outputs.append(self._output(seq, "", []))
        for seq in plan.rejected:
            self._finish(seq, "error", "the request alone needs more KV blocks than the pool has: "
                         "raise FERRUM_KV_MAX_BLOCKS or shorten it")
            outputs.append(self._output(seq, "", []))
        return [it for it in plan.items if not it.seq.finished]

    def _step_body(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            outputs.extend(self._pending)
            self._pending = []
            if self._inflight is not None and not self._can_overlap():
                flight, self._inflight = self._inflight, None
                outputs.extend(self._resolve(flight))
            items = self._schedule(outputs)
            work = self._build_work(items)
            # aborts from here until the executor call returns are released after it
            self._in_flight = {it.seq.request_id for it in items}
        launched = None
        if items:
            try:
                launched = self._launch(items, work)
            except Exception as e:  # noqa: BLE001 - any failure of the pass fails this step only
                outputs.extend(self._fail_step(items, e))
        with self._lock:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                outputs.extend(self._resolve(previous))
            if launched is not None and not self._pipelined:
                self._inflight = None
                outputs.extend(self._resolve(launched))

    def _can_overlap(self) -> bool:
        """True when the next step may be queued before the in-flight tokens are known.

        Not with prefix caching (the manager hashes token ids on the host) and not while
        an in-flight row uses a repetition, presence or frequency penalty (its history
        needs the token).
        """
        if not self._pipelined:
            return False
        return not any(
            s.params.repetition_penalty != 1.0 or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
            for s, _, _ in self._inflight.rows
        )

    def _build_work(self, items: list) -> list[SeqWork]:
        """The executor's work for ``items``; a token still in flight is taken on the device
        from the previous step's sampled tokens (``prev_row``)."""
        now = time.time()
        rows = self._inflight.row_of if self._inflight is not None else {}
        work = []
        for it in items:
            s = it.seq
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
            end = s.num_computed + it.num_tokens
            tokens = s.token_at(s.num_computed, end)
            prev_row = -1
            if end == s.num_tokens and s.output_ids and s.output_ids[-1] == _IN_FLIGHT:
                prev_row = rows[s.request_id]
                tokens[-1] = 0
            work.append(SeqWork(s.request_id, tokens, return_logits=it.samples, prev_row=prev_row))
        return self._with_lora_slots(work)

    def _launch(self, items: list, work: list[SeqWork]) -> Optional["_InFlight"]:
        """Queue the forward pass and the sampling of ``items``; nothing is read back.

        Isolation (issue 13) as in a synchronous step: an ``Exception`` from the executor
        fails this step's requests (the caller does that; the executor restored every
        cache first), a ``BaseException`` propagates after the executor's rollback; a
        sampler failure ends only its row's request (:meth:`_sample_flight`), and a
        ``BaseException`` while sampling ends this step's sampled requests, then propagates.
        When ``mx.async_eval`` raises, see :meth:`_evaluation_failed`.
        """
        prev = self._inflight.tokens if self._inflight is not None else None
        try:
            # a BaseException (Ctrl-C) propagates after the executor restored every cache
            logits, state = self.executor.forward(work, prev)
        finally:
            self._end_flight()
        with self._lock:
            self.num_steps += 1
            sampled = []
            samples = [it.samples for it in items]  # read before num_computed moves
            for it in items:
                s = it.seq
                if s.finished:  # aborted while the step was built: released by _end_flight
                    continue
                if s.num_computed < len(s.prompt_ids):
                    self.num_prefilled_tokens += it.num_tokens
                    s.metrics.num_prefilled_tokens += it.num_tokens
                s.num_computed += it.num_tokens
                if s.num_computed == s.num_tokens:
                    sampled.append(s)
            row_of_item = []
            r = 0
            for w in work:
                row_of_item.append(r)
                r += w.num_logit_rows
            rows = [row_of_item[i] for i, it in enumerate(items) if samples[i] and not it.seq.finished]
            if not sampled:
                try:
                    mx.async_eval(state)
                except BaseException as e:
                    self._evaluation_failed([], e)
                    raise
                return None
            take = logits if len(rows) == logits.shape[0] else logits[mx.array(rows, dtype=mx.int32)]
            try:
                flight = self._sample_flight(take, sampled)
            except BaseException as e:
                # the KV already holds this step, so its sampled requests end now rather
                # than stall; then it propagates
                self._pending.extend(self._fail_seqs(sampled, e))
                raise
            sampled_ids = {id(s) for s in sampled}
            flight.unsampled = [it.seq for it in items if not it.seq.finished and id(it.seq) not in sampled_ids]
            extra = [a for res in {id(x[0]): x[0] for x in flight.results if x[0] is not None}.values()
                     for a in (res.logprobs, res.top_ids, res.top_logprobs) if a is not None]
            try:
                mx.async_eval(flight.tokens, flight.finite, *extra, *state)
            except BaseException as e:
                self._evaluation_failed(sampled, e)
                raise
            return flight if flight.rows else None

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
        previous = self._inflight
        if isinstance(exc, Exception):
            if previous is not None:
                self._pending.extend(self._fail_seqs([s for s, _, _ in previous.rows] + previous.unsampled, exc))
        else:
            self._pending.extend(self._fail_seqs(sampled, exc))

    def _sample_flight(self, take: mx.array, seqs: list[Sequence]) -> "_InFlight":
        """Sample every row of ``take`` at once (lazily); when that raises, row by row with
        the random keys restored, so a failure (a bad parameter, a fault) ends only the
        request it belongs to (finished here with ``"error"``; its output is pending)."""
        states = [s.sampler for s in seqs]
        saved = [st.key for st in states]
        finite = mx.all(mx.isfinite(take), axis=-1)
        errors: dict[int, str] = {}
        try:
            res = sample(take, states, record=False)
            results = [(res, b) for b in range(len(seqs))]
            tokens = res.tokens
        except Exception:  # noqa: BLE001 - find the row(s) at fault
            results, pieces = [], []
            for b, st in enumerate(states):
                st.key = saved[b]  # the failed batched call may have split it
                try:
                    r = sample(take[b : b + 1], [st], record=False)
                    results.append((r, 0))
                    pieces.append(r.tokens.astype(mx.int32))
                except Exception as e:  # noqa: BLE001
                    errors[b] = f"{type(e).__name__}: sampling failed: {e}"
                    results.append((None, 0))
                    pieces.append(mx.zeros((1,), dtype=mx.int32))
            tokens = mx.concatenate(pieces)
        flight = _InFlight(tokens, finite, results)
        for b, s in enumerate(seqs):
            if b in errors:
                self._finish(s, "error", errors[b])
                self._pending.append(self._output(s, "", []))
                continue
            s.output_ids.append(_IN_FLIGHT)
            flight.rows.append((s, b, len(s.output_ids) - 1))
            flight.row_of[s.request_id] = b
        return flight

    def _resolve(self, flight: "_InFlight") -> list[RequestOutput]:
        """Read a launched step's tokens, then detokenize, check stops and emit.

        The one-step lag: a request that finishes here may already have its next token
        queued (a placeholder at the end of ``output_ids``); it is dropped with the rest
        of the request when :meth:`_finish` frees its blocks, and a later resolve skips
        finished requests. Aborted or finished requests are skipped the same way.

        Isolation: NaN/Inf logits end their request with :class:`NonFiniteLogitsError`;
        a failure emitting one token (e.g. the detokenizer) ends only that request; a
        failure reading the step back (its evaluation failed) ends only this step's
        requests, prompt-chunk ones included (``flight.unsampled``); a ``BaseException``
        ends this step's sampled requests, then propagates.
        """
        outs: list[RequestOutput] = []
        try:
            try:
                tokens = flight.tokens.tolist()
                finite = flight.finite.tolist()
            except Exception as e:  # noqa: BLE001 - the step's evaluation failed: its requests only
                return self._fail_seqs([s for s, _, _ in flight.rows] + flight.unsampled, e)
            host: dict[int, tuple] = {}
            now = time.time()
            cap = self.executor.kv_capacity()
            for s, b, index in flight.rows:
                if s.finished:
                    continue
                error = None if finite[b] else _non_finite_error()
                if error is None:
                    try:
                        tok = tokens[b]
                        lp, top = self._host_logprobs(flight.results[b], host)
                        s.sampler.append(tok)
                        outs.append(self._emit(s, tok, lp, top, now, cap, index=index))
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. the detokenizer: this request only
                        error = f"{type(e).__name__}: {e}"
                if not s.finished:
                    self._finish(s, "error", error)
                outs.append(self._output(s, "", []))
        except BaseException as e:
            self._pending.extend(outs + self._fail_seqs([s for s, _, _ in flight.rows], e))
            raise
        return outs

    @staticmethod
    def _host_logprobs(result: tuple, host: dict) -> tuple:
        """Row ``r`` of a :class:`~mlx_ferrum.engine.sampling.SampleResult`'s logprobs and top alternatives as Python
        values (each result read back once per step)."""
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

    def _sample_rows(self, rows: mx.array, seqs: list[Sequence]):
        """Sample every row at once; when that raises, sample row by row so a failure
        (a bad parameter, a fault) ends only the request it belongs to.

        Returns ``(tokens, logprobs, tops, errors)``: per row a token (None on error),
        logprobs and top alternatives as :func:`sample` gives them (or None), and an
        error message or None. A row of NaN/Inf logits gets a :class:`NonFiniteLogitsError`.
        """
        n = len(seqs)
        saved = [(s.sampler.key, len(s.sampler.history)) for s in seqs]
        finite = mx.all(mx.isfinite(rows), axis=-1)
        errors: list = [None] * n
        try:
            res = sample(rows, [s.sampler for s in seqs], record=False)
            mx.eval(res.tokens, finite)
            tokens = res.tokens.tolist()
            for s, tok in zip(seqs, tokens):
                s.sampler.append(tok)
            lps = res.logprobs.tolist() if res.logprobs is not None else [None] * n
            tops = list(zip(res.top_ids.tolist(), res.top_logprobs.tolist())) if res.top_ids is not None else [None] * n
        except Exception:  # noqa: BLE001 - find the row(s) at fault
            tokens, lps, tops = [None] * n, [None] * n, [None] * n
            for b, (s, (key, hist)) in enumerate(zip(seqs, saved)):
                s.sampler.key = key  # the failed batched call may have split it
                del s.sampler.history[hist:]
                try:
                    r = sample(rows[b : b + 1], [s.sampler])
                    tokens[b] = r.tokens.tolist()[0]
                    lps[b] = r.logprobs.tolist()[0] if r.logprobs is not None else None
                    tops[b] = (r.top_ids.tolist()[0], r.top_logprobs.tolist()[0]) if r.top_ids is not None else None
                except Exception as e:  # noqa: BLE001
                    errors[b] = f"{type(e).__name__}: sampling failed: {e}"
        for b, ok in enumerate(finite.tolist()):
            if not ok:
                errors[b] = _non_finite_error()
        return tokens, lps, tops, errors

    def _sample_and_emit(self, sampled: list) -> list[RequestOutput]:
        seqs = [s for s, _ in sampled]
        rows = mx.concatenate([r for _, r in sampled], axis=0)
        tokens, lps, tops, errors = self._sample_rows(rows, seqs)
        now = time.time()
        outs = []
        cap = self.executor.kv_capacity()
        for b, (s, tok) in enumerate(zip(seqs, tokens)):
            if errors[b] is None:
                try:
                    outs.append(self._emit(s, tok, lps[b], tops[b], now, cap))
                    continue
                except Exception as e:  # noqa: BLE001 - e.g. the detokenizer: this request only
                    errors[b] = f"{type(e).__name__}: {e}"
            if not s.finished:
                self._finish(s, "error", errors[b])
            outs.append(self._output(s, "", []))
        return outs

    def _emit(self, s: Sequence, tok: int, lp, top, now: float, cap: int, index: Optional[int] = None) -> RequestOutput:
        """Record one sampled token of ``s``: metrics, logprobs, text, stop checks.

        ``index``: the placeholder in ``output_ids`` the token replaces (pipelined step);
        None appends it."""
        m = s.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        self.num_generated_tokens += 1
        if lp is not None and s.params.logprobs is not None:
            s.logprobs.append(lp)
            if top is not None and s.params.logprobs:
                k = s.params.logprobs
                s.top_logprobs.append(dict(zip(top[0][:k], top[1][:k])))
        if index is None:
            s.output_ids.append(tok)
            index = len(s.output_ids) - 1
        else:
            s.output_ids[index] = tok
        out_of_room = index + 1 >= s.params.max_tokens or len(s.prompt_ids) + index + 1 >= cap
        delta, reason = emit_token(s.detok, s.matcher, tok, s.stop_ids, out_of_room)
        s.text += delta
        if reason is not None:
            del s.output_ids[index + 1 :]  # a token queued in the pipeline's lag is dropped
            self._finish(s, reason)
        return self._output(s, delta, [tok])

    # -------------------------------------------------------- conveniences
    def generate(
        self,
        prompts: Seq[Prompt],
        params: Union[SamplingParams, Seq[SamplingParams], None] = None,
        lora: Union[str, None, Seq[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per prompt;
        ``lora`` one adapter name (or None) for all prompts or one per prompt.

        Raises:
            RequestError: ``params`` or ``lora`` lists of the wrong length.
            UnknownLoraError: an adapter name is not registered.
        """
        if lora is None or isinstance(lora, str):
            loras = [lora] * len(prompts)
        else:
            loras = list(lora)
            if len(loras) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(loras)} lora names: give one or one each")
        if params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams: give one or one each")
        ids = []
        final: dict[str, RequestOutput] = {}
        try:
            for p, sp, name in zip(prompts, plist, loras):
                ids.append(self.add_request(p, sp, lora=name))
            wanted = set(ids)
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
        finally:
            # a bad prompt or Ctrl-C: this call's other requests do not stay behind
            for rid in ids:
                if rid not in final:
                    try:
                        self.abort(rid)
                    except RequestError:
                        pass
        return [final[i] for i in ids]

    def stream(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> Iterator[RequestOutput]:
        """Add one request (with adapter ``lora``, or the base) and yield its outputs as
        they come, stepping the engine.

        Other requests in the engine advance too. Closing the iterator early aborts
        the request.
        """
        rid = self.add_request(prompt, params, request_id, lora=lora)
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        done = out.finished
        finally:
            if not done:
                try:
                    self.abort(rid)
                except RequestError:
                    pass

    # ----------------------------------------------------------------- LoRA
    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT or mlx-lm LoRA adapter at ``path`` (folder or hub id) as
        ``name``; it is read and checked against the model now. Thread-safe.

        Raises:
            LoraError: LoRA is off (``RuntimeConfig(enable_lora=True)``), or the adapter is
            refused (format, DoRA, module, shape, rank; the message says which).
        """
        self._lora_executor().add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            UnknownLoraError: unknown ``name``. LoraError: requests still use it, or LoRA is off.
        """
        with self._lock:
            if any(s.lora == name for s in self._lora_waiting):
                raise LoraError(f"adapter {name!r} has waiting requests: remove it once they finish")
            self._lora_executor().remove_lora(name)

    def list_loras(self) -> list[str]:
        """Registered adapter names (empty when LoRA is off)."""
        return self.executor.list_loras()

    def lora_metrics_snapshot(self) -> dict:
        """The executor's adapter metrics (registered, loaded, resident, requests per
        adapter, loads, evictions) plus ``waiting_for_slot`` (requests waiting for a
        slot); ``{}`` when LoRA is off."""
        snapshot = self.executor.lora_metrics_snapshot()
        if snapshot:
            snapshot["waiting_for_slot"] = len(self._lora_waiting)
        return snapshot

    def _lora_executor(self) -> LlmExecutor:
        if self.executor.lora is None:
            raise LoraError("LoRA is off for this engine: pass RuntimeConfig(enable_lora=True) "
                            "(FERRUM_ENABLE_LORA=1, --enable-lora)")
        return self.executor

    def _check_lora_name(self, name: Optional[str]) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise RequestError(f"lora must be an adapter name (str) or None, got {type(name).__name__}")
        self._lora_executor().lora.path_of(name)  # UnknownLoraError names the known adapters

    def _admit_with_lora(self, seq: Sequence) -> None:
        """Hand ``seq`` to the scheduler, pinning its adapter's slot first; when every slot
        is pinned by other adapters' requests it waits (FIFO) for one. Lock held."""
        if seq.lora is None:
            self.scheduler.add(seq)
            return
        slot = None if self._lora_waiting else self.executor.acquire_lora(seq.lora, seq.request_id)
        if slot is None:
            self._lora_waiting.append(seq)
            return
        self._lora_slot_of[seq.request_id] = slot
        self.scheduler.add(seq)

    def _admit_lora_waiting(self) -> None:
        """Move waiting adapter requests to the scheduler while slots can be had, in order. Lock held."""
        while self._lora_waiting:
            seq = self._lora_waiting[0]
            if seq.finished:
                self._lora_waiting.popleft()
                continue
            try:
                slot = self.executor.acquire_lora(seq.lora, seq.request_id)
            except LoraError as e:  # removed, or its folder cannot be read any more: this request only
                self._lora_waiting.popleft()
                self._finish(seq, "error", f"{type(e).__name__}: {e}")
                self._pending.append(self._output(seq, "", []))
                continue
            if slot is None:
                return
            self._lora_waiting.popleft()
            self._lora_slot_of[seq.request_id] = slot
            self.scheduler.add(seq)

    def _release_lora_of(self, seq: Sequence) -> None:
        if seq.lora is None:
            return
        if self._lora_slot_of.pop(seq.request_id, None) is not None:
            self.executor.release_lora(seq.request_id)
        elif seq in self._lora_waiting:
            self._lora_waiting.remove(seq)

    def _with_lora_slots(self, work: list[SeqWork]) -> list[SeqWork]:
        """``work`` with each item's ``lora_slot`` set from its request's pinned slot."""
        if self._lora_slot_of:
            for w in work:
                w.lora_slot = self._lora_slot_of.get(w.cache_id, -1)
        return work

    # -------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Engine metrics: queue and running counts, token counters, TTFT and inter-token
        latency (seconds: mean, p50, p90, p99 over finished requests), KV blocks, prefix hits."""
        with self._lock:
            kv = self.executor.cache_metrics_snapshot()
            ttft, itl = self._ttft, self._itl
            return {
                "num_waiting": len(self.scheduler.waiting),
                "num_running": len(self.scheduler.running),
                "num_steps": self.num_steps,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefilled_tokens": self.num_prefilled_tokens,
                "generated_tokens": self.num_generated_tokens,
                "ttft_mean": ttft.mean,
                "ttft_p50": ttft.percentile(0.5),
                "ttft_p90": ttft.percentile(0.9),
                "itl_mean": itl.mean,
                "itl_p50": itl.percentile(0.5),
                "itl_p90": itl.percentile(0.9),
                "itl_p99": itl.percentile(0.99),
                "kv_blocks_used": kv.get("used_blocks"),
                "kv_blocks_free": kv.get("free_blocks"),
                "kv_blocks_total": kv.get("total_blocks"),
                "prefix_cache_hit_rate": kv.get("prefix_hit_rate", 0.0),
                # speculative decoding (vLLM's spec_decode counters; all 0 when it is off):
                # spec_num_drafts = verified rows that carried proposals; acceptance rate =
                # accepted / proposed; mean accepted length = tokens emitted per verified row,
                # the bonus token included (1 + accepted / drafts, vLLM's mean acceptance length)
                "spec_num_drafts": self.spec_num_drafts,
                "spec_proposed_tokens": self.spec_proposed_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens,
                "spec_acceptance_rate": (self.spec_accepted_tokens / self.spec_proposed_tokens
                                         if self.spec_proposed_tokens else 0.0),
                "spec_mean_accepted_length": (1.0 + self.spec_accepted_tokens / self.spec_num_drafts
                                              if self.spec_num_drafts else 0.0),
                "kv": kv,
            }

    # --------------------------------------------------- speculative decoding
    # Speculation runs on this synchronous step: proposals must be known before the
    # verification pass is built, and the accepted length decides the next step's input.
    def _speculative_step(self) -> list[RequestOutput]:
        """:meth:`step` with speculative decoding (``config.speculative`` set).

        The same schedule and the same single forward pass, except that a decoding
        request with ``k`` proposals brings ``k + 1`` tokens (a multi-token row in either
        KV layout) and is finished by :meth:`_verify_and_emit`. Requests without a
        proposal (prefill chunks, opted out, nothing found) run exactly as in ``step``.
        """
        with self._step_lock:
            with self._lock:
                outputs, self._pending = self._pending, []
                items = self._schedule(outputs)
                now = time.time()
                for it in items:
                    if it.seq.metrics.first_scheduled_time is None:
                        it.seq.metrics.first_scheduled_time = now
                candidates = self._speculation_requests(items)
                # aborts from here until the pass ends are released after it (as in step)
                self._in_flight = {it.seq.request_id for it in items}
            if not items:
                return outputs
            try:
                proposals = {}
                if candidates:
                    found = self._proposer.propose([r for _, r in candidates])
                    proposals = {i: p for (i, _), p in zip(candidates, found) if p.token_ids}
                with self._lock:
                    work = []
                    for i, it in enumerate(items):
                        s = it.seq
                        tokens = s.token_at(s.num_computed, s.num_computed + it.num_tokens)
                        if i in proposals:
                            work.append(SeqWork(s.request_id, tokens + proposals[i].token_ids, all_logits=True))
                        else:
                            work.append(SeqWork(s.request_id, tokens))
                logits = self.executor.run(self._with_lora_slots(work))
            except Exception as e:  # noqa: BLE001 - a failed proposal or pass fails this step only
                return outputs + self._fail_step(items, e)
            finally:
                self._end_flight()
            with self._lock:
                self.num_steps += 1
                sampled, verified = [], []
                for i, (it, row) in enumerate(zip(items, logits)):
                    s = it.seq
                    if s.finished:  # aborted while the step ran
                        continue
                    if i in proposals:
                        s.num_computed += 1  # the proposals' K/V are settled by _verify_and_emit
                        verified.append((s, row, proposals[i]))
                        continue
                    samples = it.samples
                    if s.num_computed < len(s.prompt_ids):
                        self.num_prefilled_tokens += it.num_tokens
                        s.metrics.num_prefilled_tokens += it.num_tokens
                    s.num_computed += it.num_tokens
                    if samples:
                        sampled.append((s, row))
                for i, r in candidates:
                    if items[i].seq.finished:  # aborted while it proposed: drop a draft cache made meanwhile
                        self._proposer.release(r.request_id)
                    elif i not in proposals:
                        self._proposer.committed(r.request_id, items[i].seq.num_computed)
                try:
                    if sampled:
                        outputs.extend(self._sample_and_emit(sampled))
                    if verified:
                        outputs.extend(self._verify_and_emit(verified))
                except BaseException as e:
                    # as in step: the KV holds this step, so its requests end now, then it propagates
                    self._pending.extend(outputs + self._fail_step(
                        [it for i, it in enumerate(items) if it.samples or i in proposals], e))
                    raise
            return outputs

    def _speculation_requests(self, items) -> list[tuple[int, SpeculativeRequest]]:
        """Scheduled decode rows that may speculate, each with its ``k``: bounded by
        ``num_speculative_tokens``, the tokens left before ``max_tokens``, the context,
        the step's token budget and (paged) the free blocks beside this step's own."""
        k_max = self.config.num_speculative_tokens
        cap = self.executor.kv_capacity()
        budget = self.config.max_num_batched_tokens - sum(it.num_tokens for it in items)
        mgr = self.executor.manager
        free = None
        if mgr is not None:
            needed = sum(
                mgr.blocks_needed(it.seq.request_id if mgr.has(it.seq.request_id) else None, it.num_tokens)
                for it in items
            )
            free = mgr.allocator.num_free - needed
        out = []
        for i, it in enumerate(items):
            s = it.seq
            if it.num_tokens != 1 or not it.samples or not s.output_ids or not s.params.speculative:
                continue
            k = min(k_max, s.params.max_tokens - len(s.output_ids) - 1, cap - s.num_tokens, budget)
            if mgr is not None and k > 0:
                cid = s.request_id if mgr.has(s.request_id) else None
                while k > 0 and mgr.blocks_needed(cid, 1 + k) - mgr.blocks_needed(cid, 1) > free:
                    k -= 1
                free -= mgr.blocks_needed(cid, 1 + k) - mgr.blocks_needed(cid, 1)
            if k < 1:
                continue
            budget -= k
            out.append((i, SpeculativeRequest(s.request_id, s.token_at(0, s.num_tokens), k, s.sampler)))
        return out

    def _verify_and_emit(self, verified: list) -> list[RequestOutput]:
        """Accept proposals (:func:`~mlx_ferrum.engine.speculative.verify`), roll the
        target and draft caches back to the accepted length (``truncate_kv`` frees the
        whole blocks past it), and emit the tokens one by one so that EOS, a stop string
        or ``max_tokens`` ends the run where it would end without speculation."""
        seqs = [s for s, _, _ in verified]
        results = verify([r for _, r, _ in verified], [p for _, _, p in verified], [s.sampler for s in seqs])
        cap = self.executor.kv_capacity()
        outs = []
        for (s, row, prop), res in zip(verified, results):
            self.spec_num_drafts += 1
            self.spec_proposed_tokens += len(prop.token_ids)
            self.spec_accepted_tokens += res.num_accepted
            kept = s.num_computed + res.num_accepted  # prompt + output + accepted proposals
            self.executor.truncate_kv(KvCacheHandle(s.request_id, kept + len(prop.token_ids) - res.num_accepted,
                                                    self.executor.layout), kept)
            self._proposer.committed(s.request_id, kept)
            s.num_computed = kept
            want_lp = s.params.logprobs is not None
            if want_lp:
                n = len(res.token_ids)
                lps, top_ids, top_lps = token_logprobs(row[:n], res.token_ids, s.params.logprobs or 0)
            now = time.time()
            delta, new_ids = "", []
            for j, tok in enumerate(res.token_ids):
                m = s.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
                self.num_generated_tokens += 1
                if want_lp:
                    s.logprobs.append(lps[j])
                    if top_ids is not None:
                        s.top_logprobs.append(dict(zip(top_ids[j], top_lps[j])))
                s.output_ids.append(tok)
                s.sampler.append(tok)
                new_ids.append(tok)
                out_of_room = len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= cap
                text, reason = emit_token(s.detok, s.matcher, tok, s.stop_ids, out_of_room)
                s.text += text
                delta += text
                if reason is not None:
                    self._finish(s, reason)
                    break
            outs.append(self._output(s, delta, new_ids))
        return outs
