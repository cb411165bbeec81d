"""Engine: requests -> Scheduler -> runner -> sampler -> detokenizer.

Why this file is over 500 lines: the engine's step is one state machine over the
requests' sequences, the step in flight (``Engine._inflight``), the outputs pending
between steps, and the deferred releases of requests aborted while the runner runs;
the launch and read-back methods (``_launch``, ``_resolve_before_masks``,
``_evaluation_failed``, ``_resolve``, ``_verify``) each edit that state under the
engine's lock and carry its failure isolation (which requests a failure ends, and when
slots go back to the scheduler). Their stateless pieces live in ``launch.py`` (work,
prompt scores, batched sampling), the output stage in ``output_processor.py`` and LoRA
admission in ``lora_admission.py``; splitting the stateful remainder further would
hand the engine's private state to another object, which is what those moves avoid.

Continuous batching in the manner of Orca (Yu et al., OSDI 2022) and vLLM: every
``step()`` asks the scheduler which sequences run (the scheduler owns the KV block
manager and appends the step's slots: ``SchedulerOutput.kv``), packs their new tokens
(prefill chunks and decode tokens together) into ONE runner call that reads those
slots, samples the sequences whose chunk reached their last token in one batched
``sample()``, detokenizes, checks stops, and frees the caches of finished requests at
once (through the scheduler: the engine never touches the KV pool's arrays).

``add_request``, ``abort``, ``step``, ``generate`` and ``stream`` are thread-safe: any
thread may submit while another drives ``step()``, and several threads may call
``generate`` / ``stream`` on one engine at once (one steps while the others wait; each
gets its own requests' outputs). :meth:`Engine.stream` drives the loop itself; :class:`AsyncEngine`
(``mlx_ferrum.engine.async_engine``) drives it from a background thread for asyncio.
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
from .output_processor import IN_FLIGHT as _IN_FLIGHT, OutputProcessor, RequestOutput, host_logprobs, make_output
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Prompt, Sequence, SequenceStatus, encode_prompt
from .rejection_sampler import Proposal, token_logprobs, verify
from .speculative import SpeculationPolicy, SpeculativeRequest, make_proposer
from .structured import GrammarBackend
from .launch import (InFlight, build_work, first_logit_rows, grammar_allowed, live_items, mask_undecodable,
                     non_finite_error, sample_rows, score_prompts)

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
        self._deferred_release: list[str] = []
        # every mode runs on the pipelined step: prefix caching hashes a block once its
        # ids are read back (scheduler.set_token_ids), penalties count the token still in
        # flight on the device, and only a row about to speculate waits for its token
        self._pipelined = bool(self.config.async_scheduling)
        self._prefix_cache = bool(getattr(self.block_manager, "prefix_cache", False))
        self._inflight: Optional[InFlight] = None  # the launched step not read back yet
        self.num_steps = 0
        self.num_prefilled_tokens = 0
        self._start = time.time()
        self._proposer = proposer if proposer is not None else make_proposer(self.config, model.args.vocab_size)
        self._policy = SpeculationPolicy(self.config) if self._proposer is not None else None
        #: constrained requests (structured output) that ended at max_tokens or the context
        #: before their grammar was complete: the output does not parse
        self.num_structured_length = 0
        self.spec_num_drafts = 0  # verified rows that carried at least one proposed token
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
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

    @property
    def num_generated_tokens(self) -> int:
        """Tokens emitted over the engine's life."""
        return self.outputs.num_generated_tokens

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

    def _grammar_mask(self, seqs: list, queued: Optional[mx.array] = None) -> Optional[mx.array]:
        """The packed ``[B, ceil(V / 32)]`` token bitmask of ``seqs`` (None when none is
        constrained). ``queued``: the logits being sampled, started on the device first so
        that the host computes the masks while the forward pass runs."""
        if not any(s.grammar is not None for s in seqs):
            return None
        if queued is not None:
            mx.async_eval(queued)
        return mx.array(self._grammar_backend.fill_bitmask([s.grammar for s in seqs]))

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
            return (self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None
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
        if seq.request_id in self._in_flight:
            # the step being built still reads its cache and its draft state
            self._deferred_release.append(seq.request_id)
        else:
            self._release_request(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        self.outputs.record_finished(seq.metrics)

    def _release_request(self, request_id: str) -> None:
        """Free a finished request's KV blocks (the scheduler's), contiguous buffers (the
        runner's storage), draft cache and speculation record."""
        self.scheduler.free(request_id)
        self.runner.release_cache(request_id)
        if self._proposer is not None:
            self._proposer.release(request_id)
            self._policy.release(request_id)

    def _end_flight(self) -> None:
        """The step left the runner: free what requests aborted meanwhile held."""
        with self._lock:
            self._in_flight = set()
            for rid in self._deferred_release:
                self._release_request(rid)
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
        token ids are the same as in the synchronous mode (see :meth:`_resolve` for the
        one-step lag).

        Every mode runs through this one step, in four stages: schedule
        (:meth:`_begin_step`: the scheduler plans the rows and their speculative
        lookahead), run (:meth:`_run_step`: the proposer fills the lookahead, the runner
        runs one forward pass, and the plain rows' sampling is queued lazily,
        :meth:`_sample_flight`), sample (:meth:`_process_step`: the tokens of the step in
        flight are read back, :meth:`_resolve`; rows carrying a draft get 1 to k+1 tokens,
        :meth:`_verify`) and process output (the
        :class:`~mlx_ferrum.engine.output_processor.OutputProcessor` records the tokens,
        checks stops and builds the outputs, which are routed to waiting callers).
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
                    self._process_step(launched, verified, outputs)  # sample (read back, verify) + output
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
            if self._inflight is not None and not self._can_overlap():
                flight, self._inflight = self._inflight, None
                outputs.extend(self._resolve(flight))
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

    def _run_step(self, items: list, plan: Optional[SchedulerOutput], drafts: list, num_requests: int,
                  outputs: list[RequestOutput]) -> tuple[Optional[InFlight], list]:
        """The run stage: drafts, the runner's work, then the forward pass and the (lazy)
        sampling of the plain rows queued by :meth:`_launch`. Returns ``(flight, verified)``
        as :meth:`_launch` does (``(None, [])`` when nothing ran).

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
                # (see _finish): its row no longer has the tokens it was planned with
                items, proposals = live_items(items, proposals)
                work = self._build_work(items, proposals)
            if work:
                launching = True
                return self._launch(items, work, proposals, outputs, plan)
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
                # (_launch does the same when the runner is interrupted)
                with self._lock:
                    self.scheduler.rollback(plan)
                self._end_flight()
            raise
        return None, []

    def _process_step(self, launched: Optional[InFlight], verified: list, outputs: list[RequestOutput]) -> None:
        """The sample and output stages: read back the step launched before (pipelined) or
        this one (synchronous) and emit its tokens (:meth:`_resolve`), and verify this
        step's drafts (:meth:`_verify`); outputs are appended to ``outputs``. Lock held."""
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            outputs.extend(self._resolve(previous))
        if verified:
            outputs.extend(self._verify(verified))
        if launched is not None and not self._pipelined:
            self._inflight = None
            outputs.extend(self._resolve(launched))

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
        token on the device, and only its mask needs it on the host, which :meth:`_launch`
        reads back once the pass is built. A row that will propose a draft next step does
        wait, since its draft continues that token.
        """
        if not self._pipelined:
            return False
        if not self.overlap_constrained_rows and any(s.grammar is not None for s, _, _ in self._inflight.rows):
            return False
        if self._policy is None:
            return True
        if not self._policy.enabled_for_batch(self._num_requests()):
            return True
        return not any(
            s.params.speculative and self._policy.wants(s.request_id, self.num_steps + 1)
            for s, _, _ in self._inflight.rows
        )

    def _build_work(self, items: list, proposals: Optional[dict] = None) -> list[SeqWork]:
        """The runner's work for ``items`` (:func:`~mlx_ferrum.engine.launch.build_work`), with
        each request's pinned LoRA slot."""
        rows = self._inflight.row_of if self._inflight is not None else {}
        return self.lora_admission.with_slots(build_work(items, proposals or {}, rows))

    def _launch(self, items: list, work: list[SeqWork], proposals: Optional[dict] = None,
                outputs: Optional[list] = None, plan: Optional[SchedulerOutput] = None):
        """Queue the forward pass and the sampling of ``items``; nothing of this step is read back.

        Returns ``(flight, verified)``: the :class:`InFlight` of the plain sampled rows
        (or None), and ``(sequence, logits [1 + m, V], proposal)`` for each row that carried
        a draft of ``m`` tokens, which :meth:`_verify` settles after this step's launch.

        A constrained row whose previous token is still in flight needs that token on the
        host for its mask (its grammar takes it in :meth:`_emit`): once the forward pass
        is queued, the step in flight is read back here (:meth:`_resolve`, its outputs
        appended to ``outputs``, and ``self._inflight`` cleared so that the caller does
        not resolve it again), so the pass still overlaps the read-back; a row whose
        request ended in that read-back is not sampled.

        Isolation as in a synchronous step: an ``Exception`` from the runner
        fails this step's requests (the caller does that; the runner restored every
        cache first), a ``BaseException`` propagates after the runner's rollback; a
        sampler failure ends only its row's request (:meth:`_sample_flight`), and a
        ``BaseException`` while sampling ends this step's sampled requests, then propagates.
        When ``mx.async_eval`` raises, see :meth:`_evaluation_failed`.
        """
        proposals = proposals or {}
        prev = self._inflight.tokens if self._inflight is not None else None
        try:
            # the runner reads the slots the scheduler appended (plan.kv); when the pass
            # cannot be built, the scheduler takes them back, so a BaseException (Ctrl-C)
            # propagates with every cache as it was before this step
            logits, state = self.runner.forward(work, prev, plan.kv if plan is not None else None)
        except BaseException:
            if plan is not None:
                with self._lock:
                    self.scheduler.rollback(plan)
            raise
        finally:
            self._end_flight()
        with self._lock:
            self.num_steps += 1
            sampled, verified = [], []
            samples = [it.samples for it in items]  # read before num_computed moves
            scores = score_prompts(items, work, logits, skip=proposals)
            row_of_item = first_logit_rows(work)
            pending_rows = []
            for i, it in enumerate(items):
                s = it.seq
                if s.finished:  # aborted while the step was built: released by _end_flight
                    continue
                if i in proposals:
                    # the draft's K/V are kept or trimmed by _verify
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
                    in_flight = bool(s.output_ids) and s.output_ids[-1] == _IN_FLIGHT
                    pending_rows.append(self._inflight.row_of[s.request_id] if in_flight else -1)
            started = False
            if self._inflight is not None and any(s.grammar is not None and p >= 0
                                                  for s, p in zip(sampled, pending_rows)):
                self._resolve_before_masks(logits, sampled, outputs if outputs is not None else self._pending)
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
                self._pending.extend(self._fail_seqs(sampled, e))
                raise
            sampled_ids = {id(s) for s in sampled}
            flight.unsampled = [it.seq for i, it in enumerate(items)
                                if not it.seq.finished and id(it.seq) not in sampled_ids and i not in proposals]
            extra = [a for res in {id(x[0]): x[0] for x in flight.results if x[0] is not None}.values()
                     for a in (res.logprobs, res.top_ids, res.top_logprobs) if a is not None]
            keys = [s.sampler.key for s in sampled]  # split by this step: see step()
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
        queuing the pass before the wait would serialize the two.) ``self._inflight`` is
        cleared: the caller must not resolve that step again.

        Isolation: a failed read-back ends the flight's requests (:meth:`_resolve`); a
        failure queuing the pass is this step's own (the flight was read back), raised
        after the flight's tokens are emitted so that none is lost; a ``BaseException``
        also ends this step's sampled requests, whose rows would never be sampled.
        """
        flight, self._inflight = self._inflight, None
        try:
            try:
                read = flight.tokens.tolist(), flight.finite.tolist()
            except Exception as e:  # noqa: BLE001 - the step's evaluation failed: _resolve ends its requests
                read = e
            queue_error = None
            if not isinstance(read, Exception):
                try:
                    mx.async_eval(logits)
                except BaseException as e:  # noqa: BLE001 - raised below, after the flight is emitted
                    queue_error = e
            outputs.extend(self._resolve(flight, read))
        except BaseException as e:
            self._pending.extend(self._fail_seqs([s for s, _, _ in flight.rows] + sampled, e))
            raise
        if queue_error is not None:
            if not isinstance(queue_error, Exception):
                self._pending.extend(self._fail_seqs(sampled, queue_error))
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
        previous = self._inflight
        if isinstance(exc, Exception):
            if previous is not None:
                self._pending.extend(self._fail_seqs([s for s, _, _ in previous.rows] + previous.unsampled, exc))
        else:
            self._pending.extend(self._fail_seqs(sampled, exc))

    def _sample_flight(self, take: mx.array, seqs: list[Sequence], pending: Optional[mx.array] = None,
                       allowed: Optional[mx.array] = None) -> InFlight:
        """Sample every row of ``take`` at once, lazily (:func:`~mlx_ferrum.engine.launch.sample_rows`);
        a row whose sampling fails ends only its own request (finished here with
        ``"error"``; its output is pending). Lock held."""
        flight, errors = sample_rows(take, seqs, pending, allowed, self._decodable)
        for b, e in errors.items():
            s = seqs[b]
            self._finish(s, "error", f"{type(e).__name__}: sampling failed: {e}", exception=e)
            self._pending.append(self._output(s, "", []))
        return flight

    def _resolve(self, flight: InFlight, read=None) -> list[RequestOutput]:
        """Read a launched step's tokens, then detokenize, check stops and emit.

        ``read``: ``(tokens, finite)`` as lists, or the ``Exception`` reading them raised,
        when the caller read the step back already; None reads it here.

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
            if read is None:
                try:
                    read = flight.tokens.tolist(), flight.finite.tolist()
                except Exception as e:  # noqa: BLE001
                    read = e
            if isinstance(read, Exception):  # the step's evaluation failed: its requests only
                return self._fail_seqs([s for s, _, _ in flight.rows] + flight.unsampled, read)
            tokens, finite = read
            host: dict[int, tuple] = {}
            now = time.time()
            cap = self.max_sequence_tokens()
            for s, b, index in flight.rows:
                if s.finished:
                    continue
                error = None if finite[b] else non_finite_error()
                if error is None:
                    try:
                        tok = tokens[b]
                        lp, top = host_logprobs(flight.results[b], host)
                        s.sampler.append(tok)
                        if self._prefix_cache:
                            # stored as UNKNOWN_TOKEN when the next step was queued: its
                            # block can be hashed now
                            self.scheduler.set_token_ids(s, len(s.prompt_ids) + index, [tok])
                        outs.append(self._emit(s, [tok], [lp], [top], now, cap, index=index))
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. the detokenizer: this request only
                        error = e
                if not s.finished:
                    self._finish(s, "error", exception=error)
                outs.append(self._output(s, "", []))
        except BaseException as e:
            self._pending.extend(outs + self._fail_seqs([s for s, _, _ in flight.rows], e))
            raise
        return outs

    def _emit(self, s: Sequence, tokens: list[int], lps: list, tops: list, now: float, cap: int,
              index: Optional[int] = None) -> RequestOutput:
        """The output stage (:meth:`OutputProcessor.emit
        <mlx_ferrum.engine.output_processor.OutputProcessor.emit>`) for 1 or more sampled
        tokens of ``s``; ends the request when one of them does. Call with the lock held."""
        delta, new_ids, reason = self.outputs.emit(s, tokens, lps, tops, now, cap, index=index)
        if reason is not None:
            self._finish(s, reason)
        return self._output(s, delta, new_ids)

    def _draft_mask(self, seq: Sequence, proposal: Proposal) -> Optional[mx.array]:
        """The ``[1 + m, ceil(V / 32)]`` grammar bitmask a constrained row's draft is verified
        under (each position: its grammar state after the draft's earlier tokens), or None
        for an unconstrained row."""
        if seq.grammar is None:
            return None
        return mx.array(seq.grammar.draft_bitmask(proposal.token_ids, self._grammar_backend.words))

    def _verify(self, verified: list) -> list[RequestOutput]:
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
                outs.extend(self._fail_seqs([s], e))
        live = kept
        if not live:
            return outs
        seqs = [s for s, _, _ in live]
        try:
            finite_rows = mx.all(mx.isfinite(mx.concatenate([row for _, row, _ in live], axis=0)), axis=-1)
            results = verify([mask_undecodable(row, self._decodable) for _, row, _ in live], [p for _, _, p in live],
                             [s.sampler for s in seqs], also=[finite_rows], allowed=masks)
            finite = finite_rows.tolist()
        except Exception as e:  # noqa: BLE001 - this step's drafts only
            return outs + self._fail_seqs(seqs, e)
        cap = self.max_sequence_tokens()
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
                self._policy.record(s.request_id, len(prop.token_ids), res.num_accepted, self.num_steps)
                kept = s.num_computed + res.num_accepted  # prompt + output + accepted draft tokens
                # the scheduler frees the rejected tokens' blocks (and learns the accepted
                # ids); the runner cuts a contiguous cache's buffers (nothing for paged)
                self.scheduler.commit_draft(s, s.num_computed, res.token_ids[: res.num_accepted])
                self.runner.trim_cache(s.request_id, kept)
                self._proposer.committed(s.request_id, kept)
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
                    self._finish(s, "error", exception=e)
                outs.append(self._output(s, "", []))
        return outs

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
            ttft, itl = self.outputs.ttft, self.outputs.itl
            return {
                "num_waiting": len(self.scheduler.waiting),
                "num_running": len(self.scheduler.running),
                "num_steps": self.num_steps,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefilled_tokens": self.num_prefilled_tokens,
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
                "spec_num_drafts": self.spec_num_drafts,
                "spec_proposed_tokens": self.spec_proposed_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens,
                "spec_acceptance_rate": (self.spec_accepted_tokens / self.spec_proposed_tokens
                                         if self.spec_proposed_tokens else 0.0),
                "spec_mean_accepted_length": (1.0 + self.spec_accepted_tokens / self.spec_num_drafts
                                              if self.spec_num_drafts else 0.0),
                "kv": kv,
            }
