"""Engine: requests -> Scheduler -> runner -> sampler -> detokenizer.

Continuous batching in the manner of Orca (Yu et al., OSDI 2022) and vLLM: every
``step()`` asks the scheduler which sequences run (the scheduler owns the KV block
manager and appends the step's slots: ``SchedulerOutput.kv``), packs their new tokens
(prefill chunks and decode tokens together) into ONE runner call that reads those
slots, samples the sequences whose chunk reached their last token in one batched
``sample()``, detokenizes, checks stops, and frees the caches of finished requests at
once (through the scheduler: the engine never touches the KV pool's arrays). The engine
keeps admission, the step loop and failure handling; the launch and read-back stage,
with the step in flight, is :class:`~mlx_ferrum.engine.launch.StepLauncher`, the output
stage :mod:`~mlx_ferrum.engine.output_processor` and LoRA admission
:mod:`~mlx_ferrum.engine.lora_admission`.

``add_request``, ``abort``, ``step``, ``generate`` and ``stream`` are thread-safe: any
thread may submit while another drives ``step()``, and several threads may call
``generate`` / ``stream`` on one engine at once (one steps while the others wait; each
gets its own requests' outputs). :meth:`Engine.stream` drives the loop itself; :class:`AsyncEngine`
(``mlx_ferrum.engine.async_engine``) drives it from a background thread for asyncio.

Why this file is over 500 lines: ``Engine`` is the public class of the API contract
(``add_request``, ``abort``, ``step``, ``generate``, ``stream``, the LoRA calls,
``stats``), and each of those edits the same request state (the sequences, the pending
outputs, the deferred releases) under one lock; the step itself is short, its stages
living in ``launch.py``, ``output_processor.py`` and ``lora_admission.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Iterator, Optional, Sequence as Seq, Union

import mlx.core as mx

from ..config import RuntimeConfig
from ..errors import LoraError, PromptTooLongError, RequestError
from ..runner import LlmRunner, ModelRunner, SeqWork
from ..models.loader import tokenizer_id_limit
from ..lora import prefix_salt
from .lora_admission import LoraAdmission
from .output_processor import IN_FLIGHT as _IN_FLIGHT, OutputProcessor, RequestOutput, make_output
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Prompt, Sequence, SequenceStatus, encode_prompt
from .rejection_sampler import Proposal
from .speculative import SpeculationPolicy, SpeculativeRequest, make_proposer
from .structured import GrammarBackend
from .launch import InFlight, StepLauncher, build_work, grammar_allowed, live_items

_req_ids = itertools.count()


def _pool_token_limit(manager) -> Optional[int]:
    """Tokens one sequence can hold in a paged pool (``num_blocks * block_size``), or None
    when no pool bounds it: the contiguous layout, or only sliding-window layers (they free
    the blocks their window left behind)."""
    if manager is None:
        return None
    if manager.group_windows[0] is not None:  # full-attention layers come first when there are any
        return None
    return manager.num_blocks * manager.block_size


def context_full_message(num_tokens: int, capacity: int, max_position_embeddings: int) -> str:
    """Why a prompt of ``num_tokens`` does not fit a context of ``capacity``, and the fix that
    exists: FERRUM_KV_CAPACITY can only be raised up to ``max_position_embeddings``."""
    msg = f"the prompt has {num_tokens} tokens and the context holds {capacity}: shorten it"
    if capacity < max_position_embeddings:
        return msg + f", or raise FERRUM_KV_CAPACITY (up to the model's max_position_embeddings={max_position_embeddings})"
    return msg + f" ({capacity} is the model's own limit, max_position_embeddings)"


class Engine:
    """A continuous-batching engine over one model.

    Args:
        model, tokenizer: from :func:`mlx_ferrum.load` (tokenizer may be None when every
            prompt is token ids; then outputs carry no text).
        config: runtime settings (``kv_layout``, budgets, prefix caching ...); None
            reads the environment. The paged layout is what makes continuous batching
            efficient; the contiguous layout works with padded batches and no preemption.
        executor: the model runner to use instead of building one: a
            :class:`~mlx_ferrum.runner.ModelRunner` (e.g. :class:`~mlx_ferrum.runner.LlmRunner`),
            or an :class:`~mlx_ferrum.executor.LlmExecutor`, whose runner is used and
            whose block manager the scheduler takes over (the engine then shares its KV
            caches with the executor's ferrum-style calls).
        proposer: a speculative-decoding proposer (``NgramProposer`` /
            ``DraftModelProposer`` from :mod:`mlx_ferrum.engine.speculative`) to use
            instead of the one ``config.speculative`` names.

    Attributes:
        overlap_constrained_rows: in the pipelined step, a constrained row's next forward
            pass is built before its previous token is read back (the token is read just
            before the masks are computed). True on GPU backends; False on the CPU
            backend, where it measured slower (the step then waits for the token first).

    Threads: one engine may be shared. :meth:`add_request` and :meth:`abort` may be
    called from any thread; :meth:`step` runs one step at a time (a second caller waits);
    :meth:`generate` and :meth:`stream` may run on several threads at once: whichever
    thread steps routes every output to the caller waiting for that request, so each
    caller gets exactly its own outputs, the same as when it runs alone (with greedy or
    seeded sampling). Outputs of requests added with :meth:`add_request` go only to
    whoever calls :meth:`step`.

    Raises (from its calls):
        RequestError: unknown request id, or a request that alone cannot fit the pool.
        PromptTooLongError: a prompt that fills the context.
        SamplingParamsError: invalid sampling parameters.
    """

    def __init__(self, model, tokenizer=None, config: Optional[RuntimeConfig] = None,
                 executor: Optional[ModelRunner] = None, proposer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config if config is not None else RuntimeConfig()
        # an LlmExecutor (the ferrum-style adapter) is driven through its runner; the block
        # manager it owns becomes the scheduler's, so both see the same caches
        shared_blocks = getattr(executor, "manager", None)
        executor = getattr(executor, "runner", executor)
        # everything below calls only ModelRunner methods (tests/test_runner_protocol.py checks it)
        self.runner: ModelRunner = executor if executor is not None else LlmRunner(model, self.config)
        geometry = self.runner.kv_geometry
        #: the paged block manager, owned and driven by the scheduler (None: contiguous)
        self.block_manager = (shared_blocks if shared_blocks is not None
                              else geometry.new_block_manager() if geometry is not None else None)
        self._pool_tokens = _pool_token_limit(self.block_manager)
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_sequence_tokens())
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        # a checkpoint whose embedding is padded past its tokenizer (Qwen): the padding
        # ids have no text, so they are never sampled (mlx_ferrum.load refuses a pair
        # whose gap is more than padding: check_tokenizer_vocabulary)
        limit = tokenizer_id_limit(tokenizer)
        vocab = model.args.vocab_size
        self._decodable = (mx.arange(vocab) < limit)[None] if limit is not None and limit < vocab else None
        self._lock = threading.RLock()  # guards scheduler and sequences
        # one step at a time; reentrant so that a caller of generate/stream may hold it
        # around step() (which takes it too) while it routes the step's outputs
        self._step_lock = threading.RLock()
        #: the output stage: tokens -> RequestOutputs, counters, and the boxes of waiting callers
        self.outputs = OutputProcessor()
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts, rejections)
        # request ids of the step now in the runner; an abort of one of them frees its
        # cache only after the runner call, so forward() never re-creates a released cache
        self._in_flight: set[str] = set()
        self._deferred_release: list[tuple[str, bool]] = []  # (request id, keep_cached)
        # every mode runs on the pipelined step: prefix caching hashes a block once its
        # ids are read back (scheduler.set_token_ids), penalties count the token still in
        # flight on the device, and only a row about to speculate waits for its token
        self._pipelined = bool(self.config.async_scheduling)
        self._start = time.time()
        self._proposer = proposer if proposer is not None else make_proposer(self.config, model.args.vocab_size)
        self._policy = SpeculationPolicy(self.config) if self._proposer is not None else None
        #: constrained requests (structured output) that ended at max_tokens or the context
        #: before their grammar was complete: the output does not parse
        self.num_structured_length = 0
        # On MLX's CPU backend mx.async_eval runs the queued work before it returns, so
        # there is no device work for the host to overlap: reading a constrained row's
        # token back mid-step only splits the step's evaluation in two (measured on
        # stories260K, 8/8 rows constrained: 1.31x the unconstrained step with the
        # overlap, 1.04x without). GPU backends queue and return, and overlap.
        self.overlap_constrained_rows = mx.default_device().type != mx.DeviceType.cpu
        self._grammar_backend: Optional[GrammarBackend] = None  # built with the first constrained request
        self._grammar_init_lock = threading.Lock()
        #: LoRA: the adapter slots requests pin, and the requests waiting for one
        self.lora_admission = LoraAdmission(self.runner, self.scheduler)
        #: the launch and read-back stage, with the step in flight (``launcher.inflight``);
        #: the lambdas look the engine's methods up at each call
        self.launcher = StepLauncher(
            self.runner, self.scheduler, self.outputs, self._lock,
            finish=lambda *a, **k: self._finish(*a, **k), fail=lambda seqs, exc: self._fail_seqs(seqs, exc),
            pend=lambda outs: self._pending.extend(outs),
            max_sequence_tokens=self.max_sequence_tokens(), decodable=self._decodable,
            prefix_cache=bool(getattr(self.block_manager, "prefix_cache", False)),
            proposer=self._proposer, policy=self._policy, grammar_backend=self.grammar_backend)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens emitted over the engine's life."""
        return self.outputs.num_generated_tokens

    @property
    def num_steps(self) -> int:
        """Steps launched over the engine's life (steps that ran a forward pass)."""
        return self.launcher.num_steps

    # ------------------------------------------------------ structured output
    def grammar_backend(self) -> GrammarBackend:
        """The engine's :class:`~mlx_ferrum.engine.structured.GrammarBackend` (built once).

        Raises:
            StructuredOutputError: no tokenizer, llguidance missing, or a tokenizer it cannot read.
        """
        with self._grammar_init_lock:
            if self._grammar_backend is None:
                if self.tokenizer is None:
                    from ..errors import StructuredOutputError

                    raise StructuredOutputError("structured output needs a tokenizer: load the model with mlx_ferrum.load")
                self._grammar_backend = GrammarBackend(self.tokenizer, self.model.args.vocab_size)
            return self._grammar_backend

    def compile_constraint(self, params: SamplingParams):
        """The request's grammar state (None without a constraint). Thread-safe; the server
        calls it in a worker thread first, so that a bad schema is a 400 before admission
        and the compile is cached when :meth:`add_request` asks again.

        Raises:
            StructuredOutputError: the constraint does not compile.
        """
        if params.structured_outputs is None:
            return None
        return self.grammar_backend().matcher(params.structured_outputs)

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
            PromptTooLongError: the prompt fills the context, or the paged pool (it could
                never produce a token: see :meth:`max_sequence_tokens`).
            RequestError: the id is in use, the prompt is empty or not a prompt type, or a
                token id is outside ``[0, vocab_size)``.
            TokenizerError: the text cannot be tokenized (lone surrogates, too long ...).
            SamplingParamsError: a ``logit_bias`` id is outside the vocabulary.
        """
        params = params if params is not None else SamplingParams()
        ids = encode_prompt(self.tokenizer, prompt, vocab_size=self.runner.info.vocab_size)
        cap = self.runner.kv_capacity()
        if len(ids) >= cap:
            raise PromptTooLongError(context_full_message(len(ids), cap, self.model.args.max_position_embeddings))
        if self._pool_tokens is not None and len(ids) >= self._pool_tokens:
            raise PromptTooLongError(self._pool_full_message(len(ids)))
        params.check_vocab(self.model.args.vocab_size)
        self.lora_admission.check_name(lora)
        rid = request_id if request_id is not None else f"req-{next(_req_ids)}"
        grammar = self.compile_constraint(params)
        seq = Sequence.create(rid, ids, params, self.tokenizer, self._eos)
        seq.grammar = grammar
        if lora is not None:
            seq.lora, seq.prefix_salt = lora, prefix_salt(lora)
        with self._lock:
            if rid in self._seqs:
                raise RequestError(f"request id {rid!r} is in use: pick another")
            self._seqs[rid] = seq
            self.lora_admission.admit(seq)
        return rid

    def max_sequence_tokens(self) -> int:
        """Most tokens (prompt + output) one request may reach: the context
        (``runner.kv_capacity()``), or fewer when a paged pool holds fewer tokens
        (``max_num_blocks * block_size``, FERRUM_KV_MAX_BLOCKS).

        A request is refused at :meth:`add_request` when its prompt alone reaches this
        (it could never produce a token), and ends with ``finish_reason="length"`` and
        its output so far when it reaches it while generating, as when the context is
        full. ``max_tokens`` beyond it is not refused here, since clients of the Python
        API commonly ask for the rest of the context (the OpenAI server refuses it with a
        400, as vLLM does: leaving the field out there asks for the rest). Requests that fit alone but not together are preempted
        and recomputed instead, so a neighbour never ends early for lack of blocks.
        """
        cap = self.runner.kv_capacity()
        return cap if self._pool_tokens is None else min(cap, self._pool_tokens)

    def _pool_full_message(self, num_tokens: int) -> str:
        mgr = self.block_manager
        return (f"the prompt has {num_tokens} tokens and the KV pool holds {self._pool_tokens} "
                f"({mgr.num_blocks} KV blocks of {mgr.block_size} tokens): shorten it, or raise FERRUM_KV_MAX_BLOCKS "
                "(RuntimeConfig.max_num_blocks) or FERRUM_KV_MEMORY_FRACTION")

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
            return (self.scheduler.has_unfinished() or bool(self._pending) or self.launcher.inflight is not None
                    or bool(self.lora_admission.waiting))

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """End every request the engine holds with ``"error"`` (``exc``), and return their
        final outputs together with any output not yet returned by :meth:`step`.

        For a driver whose :meth:`step` raised past the engine's own isolation (the
        :class:`~mlx_ferrum.engine.async_engine.AsyncEngine` loop): every client then gets a
        final output and the engine stays usable. Thread-safe.
        """
        outs = []
        with self._lock:
            for seq in list(self._seqs.values()):
                if not seq.finished:
                    self._finish(seq, "error", exception=exc)
                    outs.append(self._output(seq, "", []))
            outs.extend(self._pending)
            self._pending = []
        return outs

    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None,
                exception: Optional[BaseException] = None) -> None:
        while seq.output_ids and seq.output_ids[-1] == _IN_FLIGHT:
            seq.output_ids.pop()  # never read back: not part of the output
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if error is None and exception is not None:
            error = f"{type(exception).__name__}: {exception}"
        seq.error, seq.exception = error, exception
        if reason == "length" and seq.grammar is not None and not seq.grammar.done:
            self.num_structured_length += 1
        seq.metrics.finished_time = time.time()
        self.scheduler.remove(seq)
        self.lora_admission.release(seq)
        # a request that failed may leave blocks whose KV its keys do not describe (a
        # failed evaluation writes what it computed from unwritten buffers): they leave
        # the prefix cache with it
        keep_cached = reason != "error"
        if seq.request_id in self._in_flight:
            # the step being built still reads its cache and its draft state
            self._deferred_release.append((seq.request_id, keep_cached))
        else:
            self._release_request(seq.request_id, keep_cached)
        self._seqs.pop(seq.request_id, None)
        self.outputs.record_finished(seq.metrics)

    def _release_request(self, request_id: str, keep_cached: bool = True) -> None:
        """Free a finished request's KV blocks (the scheduler's; ``keep_cached`` as in
        :meth:`Scheduler.free <mlx_ferrum.engine.scheduler.Scheduler.free>`), contiguous
        buffers (the runner's storage), draft cache and speculation record."""
        self.scheduler.free(request_id, keep_cached)
        self.runner.release_cache(request_id)
        if self._proposer is not None:
            self._proposer.release(request_id)
            self._policy.release(request_id)

    def _end_flight(self) -> None:
        """The step left the runner: free what requests aborted meanwhile held."""
        with self._lock:
            self._in_flight = set()
            for rid, keep_cached in self._deferred_release:
                self._release_request(rid, keep_cached)
            self._deferred_release = []

    def _fail_step(self, items, exc: BaseException) -> list[RequestOutput]:
        """End every request of a failed step with ``"error"`` (the runner already
        restored their caches; finishing releases them). Other requests are untouched."""
        return self._fail_seqs([it.seq for it in items], exc)

    def _fail_seqs(self, seqs, exc: BaseException) -> list[RequestOutput]:
        """:meth:`_fail_step` for a list of sequences (finished ones are skipped)."""
        outs = []
        with self._lock:
            for s in seqs:
                if not s.finished:
                    self._finish(s, "error", exception=exc)
                    outs.append(self._output(s, "", []))
        return outs

    @staticmethod
    def _output(seq: Sequence, delta: str, new_ids: list[int]) -> RequestOutput:
        return make_output(seq, delta, new_ids)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for each request that changed.

        Pipelined (``RuntimeConfig.async_scheduling``, the default): this step's forward
        pass and sampling are queued with ``mx.async_eval`` BEFORE the previous step's
        tokens are read back, detokenized and checked for stops, so the host work of one
        step overlaps the device work of the next (vLLM's async scheduling; mlx-lm's
        ``generate_step`` overlaps the same way). Outputs therefore trail by one step;
        token ids are the same as in the synchronous mode (see
        :meth:`StepLauncher.resolve <mlx_ferrum.engine.launch.StepLauncher.resolve>` for
        the one-step lag).

        Every mode runs through this one step, in four stages: schedule
        (:meth:`_begin_step`: the scheduler plans the rows, their slots, adapter slots and
        speculative lookahead), run (:meth:`_run_step`: the proposer fills the lookahead,
        the runner's forward pass is built, and the plain rows' sampling is queued with it
        lazily), sample (:meth:`StepLauncher.read_back
        <mlx_ferrum.engine.launch.StepLauncher.read_back>`: the tokens of the step in
        flight are read back; rows carrying a draft get 1 to k+1 tokens) and process
        output (the :class:`~mlx_ferrum.engine.output_processor.OutputProcessor` records
        the tokens, checks stops and builds the outputs, which are routed to waiting callers).
        """
        # MLX gives every thread its own streams, and an array still unscheduled on one
        # thread's stream cannot be evaluated from another ("There is no Stream(cpu, n) in
        # current thread"); once scheduled (mx.async_eval) any thread may use it. So every
        # lazy array a step leaves for the next one (KV state, sampled tokens, the split
        # sampler keys) is scheduled or evaluated before step() returns: the next step may
        # run on another thread (generate / stream from several threads, AsyncEngine).
        with self._step_lock:
            outputs: list[RequestOutput] = []
            try:
                items, plan, drafts, num_requests = self._begin_step(outputs)  # schedule
                launched, verified = self._run_step(items, plan, drafts, num_requests, outputs)  # run, queue sampling
                with self._lock:
                    self.launcher.read_back(launched, verified, self._pipelined, outputs)  # sample + output
            except BaseException:
                # Ctrl-C (or a failure past the stages' own isolation): what this step already
                # produced is returned by the next call instead of being lost
                with self._lock:
                    self._pending[:0] = outputs
                raise
            self.outputs.route(outputs)
            return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> tuple[list, SchedulerOutput]:
        """The scheduler's items for this step and its :class:`SchedulerOutput` (the rows'
        slots are appended already); requests the pool can never hold, and rows whose
        slots could not be appended, end here with ``"error"`` (their outputs are
        appended to ``outputs``). Call with the lock held."""
        self.lora_admission.admit_waiting(self._fail_waiting_lora)
        lookahead = None
        if self._policy is not None and self._policy.enabled_for_batch(self._num_requests()):
            lookahead = self._lookahead
        plan = self.scheduler.schedule(lookahead)
        for seq, exc in plan.failed:
            self._finish(seq, "error", exception=exc)
            outputs.append(self._output(seq, "", []))
        for seq in plan.rejected:
            self._finish(seq, "error", "the request alone needs more KV blocks than the pool has: "
                         "raise FERRUM_KV_MAX_BLOCKS or shorten it")
            outputs.append(self._output(seq, "", []))
        return [it for it in plan.items if not it.seq.finished], plan

    def _begin_step(self, outputs: list[RequestOutput]) -> tuple[list, Optional[SchedulerOutput], list, int]:
        """The schedule stage: the outputs produced between steps, the read-back of the
        step in flight when this one cannot be queued behind it (:meth:`_can_overlap`),
        then the scheduler's rows (:meth:`_schedule`). Returns ``(items, plan, drafts,
        num_requests)``: ``drafts`` are ``(item index, SpeculativeRequest)`` of the rows
        given a lookahead; ``num_requests`` the batch size the speculation policy saw."""
        with self._lock:
            outputs.extend(self._pending)
            self._pending = []
            if self.launcher.inflight is not None and not self._can_overlap():
                self.launcher.read_back_inflight(outputs)
            items, plan = self._schedule(outputs)
            num_requests = self._num_requests()
            drafts = [(i, SpeculativeRequest(it.seq.request_id, it.seq.token_at(0, it.seq.num_tokens),
                                             it.num_lookahead, it.seq.sampler))
                      for i, it in enumerate(items) if it.num_lookahead > 0]
            # aborts from here until the runner call returns are released after it
            self._in_flight = {it.seq.request_id for it in items}
        if not items:
            self._end_flight()
        return items, plan, drafts, num_requests

    def _propose(self, items: list, drafts: list, num_requests: int) -> dict[int, Proposal]:
        """The proposer's drafts for the rows in ``drafts``, keyed by item index, each cut to
        what its grammar allows; a row left without a draft is recorded as rejected."""
        proposals: dict[int, Proposal] = {}
        found = self._proposer.propose([r for _, r in drafts])
        for (i, request), proposal in zip(drafts, found):
            try:
                proposal, rejected = grammar_allowed(items[i].seq, proposal)
            except Exception:  # noqa: BLE001 - this row only: it decodes without a draft
                proposal, rejected = Proposal([]), len(proposal.token_ids)
            if proposal.token_ids:
                proposals[i] = proposal
            else:
                self._policy.record(request.request_id, rejected, 0, self.num_steps, num_requests)
        return proposals

    def _forward(self, work: list[SeqWork], plan: Optional[SchedulerOutput]) -> tuple[mx.array, list]:
        """The runner's forward pass over ``work`` (lazy, nothing evaluated), each in-flight
        token taken from the step in flight on the device.

        Returns ``(logits [R, V], state)`` as :meth:`ModelRunner.forward
        <mlx_ferrum.runner.ModelRunner.forward>` does. Called without the lock: the runner
        has its own, and requests aborted while it builds the pass are released after it
        (:meth:`_end_flight`, called here whatever happens).

        Raises:
            whatever the runner raises; the runner restored every cache it touched, and a
            ``BaseException`` (Ctrl-C) first gives the step's slots back to the scheduler
            (the next step schedules the same tokens again). An ``Exception`` fails this
            step's requests: the caller does that.
        """
        flight = self.launcher.inflight
        try:
            # the runner reads the slots the scheduler appended (plan.kv)
            return self.runner.forward(work, flight.tokens if flight is not None else None,
                                       plan.kv if plan is not None else None)
        except BaseException:
            if plan is not None:
                with self._lock:
                    self.scheduler.rollback(plan)
            raise
        finally:
            self._end_flight()

    def _run_step(self, items: list, plan: Optional[SchedulerOutput], drafts: list, num_requests: int,
                  outputs: list[RequestOutput]) -> tuple[Optional[InFlight], list]:
        """The run stage: drafts, the runner's work, then the forward pass (:meth:`_forward`)
        and the lazy sampling of the plain rows, queued with it (:meth:`StepLauncher.sample
        <mlx_ferrum.engine.launch.StepLauncher.sample>`). Returns ``(flight, verified)`` as
        ``sample`` does (``(None, [])`` when nothing ran).

        Isolation: an ``Exception`` fails this step's requests only (appended to
        ``outputs``); a ``BaseException`` before the launch gives the step's slots back
        (the next step schedules the same tokens again), then propagates.
        """
        if not items:
            return None, []
        launching = False
        try:
            proposals = self._propose(items, drafts, num_requests) if drafts else {}
            with self._lock:
                # the lookahead slots a draft does not fill go back to the pool
                for i, _ in drafts:
                    used = len(proposals[i].token_ids) if i in proposals else 0
                    if not items[i].seq.finished:
                        self.scheduler.release_lookahead(plan, items[i], used)
                # an abort since scheduling took the request's in-flight token back
                # (see _finish): its row no longer has the tokens it was planned with,
                # and leaves the pass; the slots it was given are never written, so they
                # go back before its (deferred) release could leave their blocks cached
                live, proposals = live_items(items, proposals)
                if len(live) < len(items):
                    self.scheduler.rollback(plan, [it.seq.request_id for it in items if it.seq.finished])
                items = live
                work = self._build_work(items, proposals)
            if work:
                launching = True
                logits, state = self._forward(work, plan)  # run: the lazy forward pass
                return self.launcher.sample(items, work, proposals, logits, state, outputs)  # queue sampling
            self._end_flight()
        except Exception as e:  # noqa: BLE001 - any failure of the pass fails this step only
            # the pass's KV writes may be left lazy, bound to this thread: see step()
            self.runner.schedule_kv_state()
            self._end_flight()
            outputs.extend(self._fail_step(items, e))
        except BaseException:
            if not launching:
                # Ctrl-C while the draft or the batch was built: the step never ran, so
                # its slots go back and the next step schedules the same tokens again
                # (_forward does the same when the runner is interrupted)
                with self._lock:
                    self.scheduler.rollback(plan)
                self._end_flight()
            raise
        return None, []

    def _num_requests(self) -> int:
        """Requests in the engine, running or waiting: the batch size the speculation
        policy decides by."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def _lookahead(self, seq: Sequence) -> int:
        """Speculative tokens ``seq`` would like this step (the scheduler bounds them by
        budget and blocks): none while its last token is still in flight (a proposal
        extends it), while it backs off or opted out, or past ``max_tokens`` / the context."""
        if not seq.params.speculative or (seq.grammar is not None and seq.grammar.done):
            return 0
        if not seq.output_ids or seq.output_ids[-1] == _IN_FLIGHT:
            return 0
        if not self._policy.wants(seq.request_id, self.num_steps):
            return 0
        room = min(seq.params.max_tokens - len(seq.output_ids), self.max_sequence_tokens() - seq.num_tokens) - 1
        return max(0, min(self._policy.k, room))

    def _can_overlap(self) -> bool:
        """True when the next step may be queued before the in-flight tokens are known.

        Prefix caching and penalties never need to wait (see ``__init__``), nor does a
        constrained row with :attr:`overlap_constrained_rows`: the forward pass takes its
        token on the device, and only its mask needs it on the host, which
        :meth:`StepLauncher.sample <mlx_ferrum.engine.launch.StepLauncher.sample>` reads
        back once the pass is built. A row that will propose a draft next step does
        wait, since its draft continues that token.
        """
        if not self._pipelined:
            return False
        if not self.overlap_constrained_rows and any(s.grammar is not None for s, _, _ in self.launcher.inflight.rows):
            return False
        if self._policy is None:
            return True
        if not self._policy.enabled_for_batch(self._num_requests()):
            return True
        return not any(
            s.params.speculative and self._policy.wants(s.request_id, self.num_steps + 1)
            for s, _, _ in self.launcher.inflight.rows
        )

    def _build_work(self, items: list, proposals: Optional[dict] = None) -> list[SeqWork]:
        """The runner's work for ``items`` (:func:`~mlx_ferrum.engine.launch.build_work`)."""
        rows = self.launcher.inflight.row_of if self.launcher.inflight is not None else {}
        return build_work(items, proposals or {}, rows)

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
        Thread-safe: several threads may call it (and :meth:`stream`) at once; each gets
        its own outputs.

        Raises:
            RequestError, PromptTooLongError, SamplingParamsError, UnknownLoraError: see :meth:`add_request`
                (a bad prompt aborts the call's other requests).
                Also RequestError: ``params`` or ``lora`` lists of the wrong length.
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
                ids.append(self._add_boxed(p, sp, lora=name))
            while len(final) < len(ids):
                for out in self.outputs.wait_outputs([rid for rid in ids if rid not in final], self._step_lock, self.step):
                    if out.finished:
                        final[out.request_id] = out
        finally:
            # a bad prompt or Ctrl-C: this call's other requests do not stay behind
            for rid in ids:
                if rid not in final:
                    try:
                        self.abort(rid)
                    except RequestError:
                        pass
                self.outputs.close_box(rid)
        return [final[i] for i in ids]

    def _add_boxed(self, prompt: Prompt, params: Optional[SamplingParams], request_id: Optional[str] = None,
                   lora: Optional[str] = None) -> str:
        """:meth:`add_request`, with a box that collects the request's outputs from any
        thread's step (opened before the request can run, so none is missed)."""
        rid = request_id if request_id is not None else f"req-{next(_req_ids)}"
        self.outputs.open_box(rid)
        try:
            return self.add_request(prompt, params, rid, lora=lora)
        except BaseException:
            self.outputs.close_box(rid)
            raise

    def stream(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> Iterator[RequestOutput]:
        """Add one request (with adapter ``lora``, or the base) and yield its outputs as
        they come, stepping the engine.

        Other requests in the engine advance too. Closing the iterator early aborts
        the request. Thread-safe: several threads may stream (and :meth:`generate`) at
        once; each gets its own request's outputs.
        """
        rid = self._add_boxed(prompt, params, request_id, lora=lora)
        done = False
        try:
            while not done:
                for out in self.outputs.wait_outputs([rid], self._step_lock, self.step):
                    yield out
                    done = out.finished
        finally:
            if not done:
                try:
                    self.abort(rid)
                except RequestError:
                    pass
            self.outputs.close_box(rid)

    # ----------------------------------------------------------------- LoRA
    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT or mlx-lm LoRA adapter at ``path`` (folder or hub id) as
        ``name``; it is read and checked against the model now. Thread-safe.

        Raises:
            LoraError: LoRA is off (``RuntimeConfig(enable_lora=True)``), or the adapter is
            refused (format, DoRA, module, shape, rank; the message says which).
        """
        self.lora_admission.executor().add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            UnknownLoraError: unknown ``name``. LoraError: requests still use it, or LoRA is off.
        """
        with self._lock:
            if self.lora_admission.has_waiting_for(name):
                raise LoraError(f"adapter {name!r} has waiting requests: remove it once they finish")
            self.lora_admission.executor().remove_lora(name)

    def list_loras(self) -> list[str]:
        """Registered adapter names (empty when LoRA is off)."""
        return self.runner.list_loras()

    def lora_metrics_snapshot(self) -> dict:
        """The executor's adapter metrics (registered, loaded, resident, requests per
        adapter, loads, evictions) plus ``waiting_for_slot`` (requests waiting for a
        slot); ``{}`` when LoRA is off."""
        snapshot = self.runner.lora_metrics_snapshot()
        if snapshot:
            snapshot["waiting_for_slot"] = len(self.lora_admission.waiting)
        return snapshot

    def _fail_waiting_lora(self, seq: Sequence, exc: LoraError) -> None:
        """A request waiting for an adapter slot whose adapter cannot be loaded ends alone."""
        self._finish(seq, "error", exception=exc)
        self._pending.append(self._output(seq, "", []))

    # -------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Engine metrics: queue and running counts, token counters, TTFT and inter-token
        latency (seconds: mean, p50, p90, p99 over finished requests), KV blocks, prefix hits."""
        with self._lock:
            kv = self.runner.cache_metrics_snapshot(self.block_manager)
            launcher = self.launcher
            ttft, itl = self.outputs.ttft, self.outputs.itl
            return {
                "num_waiting": len(self.scheduler.waiting),
                "num_running": len(self.scheduler.running),
                "num_steps": self.num_steps,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefilled_tokens": self.launcher.num_prefilled_tokens,
                "generated_tokens": self.outputs.num_generated_tokens,
                "structured_length_finishes": self.num_structured_length,
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
                "spec_num_drafts": launcher.spec_num_drafts,
                "spec_proposed_tokens": launcher.spec_proposed_tokens,
                "spec_accepted_tokens": launcher.spec_accepted_tokens,
                "spec_acceptance_rate": (launcher.spec_accepted_tokens / launcher.spec_proposed_tokens
                                         if launcher.spec_proposed_tokens else 0.0),
                "spec_mean_accepted_length": (1.0 + launcher.spec_accepted_tokens / launcher.spec_num_drafts
                                              if launcher.spec_num_drafts else 0.0),
                "kv": kv,
            }
