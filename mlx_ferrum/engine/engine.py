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
from ..errors import FerrumError, PromptTooLongError, RequestError
from ..executor import LlmExecutor, SeqWork
from .prompt import Prompt, encode_prompt
from .sampling import SampleResult, SamplingParams, sample
from .scheduler import Scheduler
from .sequence import RequestMetrics, Sequence, SequenceStatus
from .stop import emit_token

_req_ids = itertools.count()

#: Placeholder in ``Sequence.output_ids`` for a token sampled but not yet read back.
_IN_FLIGHT = -1


@dataclass
class _InFlight:
    """A launched step: its lazy :class:`SampleResult` and, per sampled request, its row
    and the index in ``output_ids`` the token goes to."""

    result: SampleResult
    rows: list = field(default_factory=list)  # (sequence, row, output index)
    row_of: dict = field(default_factory=dict)  # request id -> row

    @property
    def tokens(self) -> mx.array:
        """``[B]`` int32 sampled ids, on the device."""
        return self.result.tokens


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

    Raises (from its calls):
        RequestError: unknown request id, or a request that alone cannot fit the pool.
        PromptTooLongError: a prompt that fills the context.
        SamplingParamsError: invalid sampling parameters.
    """

    def __init__(self, model, tokenizer=None, config: Optional[RuntimeConfig] = None, executor: Optional[LlmExecutor] = None):
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
        self._finished_ttft: list[float] = []
        self._finished_itl: list[float] = []
        self._pipelined = bool(self.config.async_scheduling) and not (
            self.executor.manager is not None and self.executor.manager.prefix_cache
        )
        self._inflight: Optional[_InFlight] = None  # the launched step not read back yet
        self.num_steps = 0
        self.num_prefilled_tokens = 0
        self.num_generated_tokens = 0
        self._start = time.time()

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
    ) -> str:
        """Queue a request (text, chat messages or token ids); returns its id. Thread-safe.

        Raises:
            PromptTooLongError: the prompt fills the context.
            RequestError: the id is in use, or the prompt is empty.
        """
        params = params if params is not None else SamplingParams()
        ids = encode_prompt(self.tokenizer, prompt)
        cap = self.executor.kv_capacity()
        if len(ids) >= cap:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and the context holds {cap}: shorten it or raise FERRUM_KV_CAPACITY"
            )
        rid = request_id if request_id is not None else f"req-{next(_req_ids)}"
        seq = Sequence.create(rid, ids, params, self.tokenizer, self._eos)
        with self._lock:
            if rid in self._seqs:
                raise RequestError(f"request id {rid!r} is in use: pick another")
            self._seqs[rid] = seq
            self.scheduler.add(seq)
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
            return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        while seq.output_ids and seq.output_ids[-1] == _IN_FLIGHT:
            seq.output_ids.pop()  # never read back: not part of the output
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = time.time()
        self.scheduler.remove(seq)
        self.executor.release_cache(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        m = seq.metrics
        if m.ttft is not None:
            self._finished_ttft.append(m.ttft)
        self._finished_itl.extend(m.inter_token_latencies)

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
        with self._step_lock:
            with self._lock:
                outputs, self._pending = self._pending, []
                if self._inflight is not None and not self._can_overlap():
                    outputs.extend(self._resolve(self._inflight))
                    self._inflight = None
                plan = self.scheduler.schedule()
                for seq in plan.rejected:
                    self._finish(seq, "error", "the request alone needs more KV blocks than the pool has: "
                                 "raise FERRUM_KV_MAX_BLOCKS or shorten it")
                    outputs.append(self._output(seq, "", []))
                items = plan.items
                work = self._build_work(items)
            launched = None
            if items:
                try:
                    launched = self._launch(items, work)
                except FerrumError as e:
                    with self._lock:
                        for it in items:
                            if not it.seq.finished:
                                self._finish(it.seq, "error", str(e))
                                outputs.append(self._output(it.seq, "", []))
            with self._lock:
                if self._inflight is not None:
                    outputs.extend(self._resolve(self._inflight))
                self._inflight = launched
                if launched is not None and not self._pipelined:
                    outputs.extend(self._resolve(launched))
                    self._inflight = None
            return outputs

    def _can_overlap(self) -> bool:
        """True when the next step may be queued before the in-flight tokens are known.

        Not with prefix caching (the manager hashes token ids on the host) and not while
        an in-flight row uses a repetition penalty (its history needs the token).
        """
        if not self._pipelined:
            return False
        return not any(s.params.repetition_penalty != 1.0 for s, _, _ in self._inflight.rows)

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
        return work

    def _launch(self, items: list, work: list[SeqWork]) -> Optional["_InFlight"]:
        """Queue the forward pass and the sampling of ``items``; nothing is read back."""
        prev = self._inflight.tokens if self._inflight is not None else None
        logits, state = self.executor.forward(work, prev)
        with self._lock:
            self.num_steps += 1
            sampled = []
            samples = [it.samples for it in items]  # read before num_computed moves
            for it in items:
                s = it.seq
                if s.finished:  # aborted while the step was built: its blocks may have been re-created
                    self.executor.release_cache(s.request_id)
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
                mx.async_eval(state)
                return None
            take = logits if len(rows) == logits.shape[0] else logits[mx.array(rows, dtype=mx.int32)]
            res = sample(take, [s.sampler for s in sampled], record=False)
            flight = _InFlight(res, [])
            for b, s in enumerate(sampled):
                s.output_ids.append(_IN_FLIGHT)
                flight.rows.append((s, b, len(s.output_ids) - 1))
                flight.row_of[s.request_id] = b
            extra = [a for a in (res.logprobs, res.top_ids, res.top_logprobs) if a is not None]
            mx.async_eval(res.tokens, *extra, *state)
            return flight

    def _resolve(self, flight: "_InFlight") -> list[RequestOutput]:
        """Read a launched step's tokens, then detokenize, check stops and emit.

        The one-step lag: a request that finishes here may already have its next token
        queued (a placeholder at the end of ``output_ids``); it is dropped with the rest
        of the request when :meth:`_finish` frees its blocks, and a later resolve skips
        finished requests. Aborted or finished requests are skipped the same way.
        """
        res = flight.result
        tokens = res.tokens.tolist()
        lps = res.logprobs.tolist() if res.logprobs is not None else None
        tops = (res.top_ids.tolist(), res.top_logprobs.tolist()) if res.top_ids is not None else None
        now = time.time()
        outs = []
        cap = self.executor.kv_capacity()
        for s, b, index in flight.rows:
            if s.finished:
                continue
            tok = tokens[b]
            s.output_ids[index] = tok
            s.sampler.append(tok)
            m = s.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            self.num_generated_tokens += 1
            if lps is not None and s.params.logprobs is not None:
                s.logprobs.append(lps[b])
                if tops is not None and s.params.logprobs:
                    k = s.params.logprobs
                    s.top_logprobs.append(dict(zip(tops[0][b][:k], tops[1][b][:k])))
            out_of_room = index + 1 >= s.params.max_tokens or len(s.prompt_ids) + index + 1 >= cap
            delta, reason = emit_token(s.detok, s.matcher, tok, s.stop_ids, out_of_room)
            s.text += delta
            if reason is not None:
                del s.output_ids[index + 1 :]  # a token queued in the lag is dropped
                self._finish(s, reason)
            outs.append(self._output(s, delta, [tok]))
        return outs

    # -------------------------------------------------------- conveniences
    def generate(
        self,
        prompts: Seq[Prompt],
        params: Union[SamplingParams, Seq[SamplingParams], None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per prompt.
        """
        if params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams: give one or one each")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs as they come, stepping the engine.

        Other requests in the engine advance too. Closing the iterator early aborts
        the request.
        """
        rid = self.add_request(prompt, params, request_id)
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

    # -------------------------------------------------------------- metrics
    def stats(self) -> dict:
        """Engine metrics: queue and running counts, token counters, TTFT and inter-token
        latency (seconds: mean, p50, p90, p99 over finished requests), KV blocks, prefix hits."""
        def pct(xs, q):
            if not xs:
                return 0.0
            ys = sorted(xs)
            return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]

        with self._lock:
            kv = self.executor.cache_metrics_snapshot()
            ttft, itl = self._finished_ttft, self._finished_itl
            return {
                "num_waiting": len(self.scheduler.waiting),
                "num_running": len(self.scheduler.running),
                "num_steps": self.num_steps,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefilled_tokens": self.num_prefilled_tokens,
                "generated_tokens": self.num_generated_tokens,
                "ttft_mean": sum(ttft) / len(ttft) if ttft else 0.0,
                "ttft_p50": pct(ttft, 0.5),
                "ttft_p90": pct(ttft, 0.9),
                "itl_mean": sum(itl) / len(itl) if itl else 0.0,
                "itl_p50": pct(itl, 0.5),
                "itl_p90": pct(itl, 0.9),
                "itl_p99": pct(itl, 0.99),
                "kv_blocks_used": kv.get("used_blocks"),
                "kv_blocks_free": kv.get("free_blocks"),
                "kv_blocks_total": kv.get("total_blocks"),
                "prefix_cache_hit_rate": kv.get("prefix_hit_rate", 0.0),
                "kv": kv,
            }
