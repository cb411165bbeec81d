"""LlmExecutor: the ferrum-compatible ``ModelExecutor`` surface, a thin adapter over a runner.

The engine drives a :class:`~mlx_ferrum.runner.LlmRunner` (the model, its KV store, the
forward pass) through the :class:`~mlx_ferrum.runner.ModelRunner` protocol. This
module offers the same runner to callers that speak ferrum's executor contract
(:class:`~mlx_ferrum.executor.types.ModelExecutor`): ``prefill`` / ``decode`` /
``batch_prefill`` / ``batch_decode`` / ``forward_verify`` take
:class:`~mlx_ferrum.executor.types.PrefillInput` / ``DecodeInput`` (``[1, L]`` int
``mx.array`` s) and return logits with a :class:`~mlx_ferrum.executor.types.KvCacheHandle`;
``truncate_kv`` / ``fork_cache`` / ``release_cache`` work on handles; ``capabilities``,
``status``, ``warmup`` and ``shutdown`` report on and manage the runner. Every call
validates its input, turns it into :class:`~mlx_ferrum.runner.SeqWork` and calls the
runner; nothing else happens here.

The ferrum-style calls evaluate their logits before returning, so timings in
:meth:`LlmExecutor.status` are real. :meth:`LlmExecutor.forward` and the other
runner methods are passed through unchanged, for code written against the executor.
"""

from __future__ import annotations

import itertools
import time
from typing import Hashable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..config import RuntimeConfig
from ..errors import ExecutorError, InvalidInputIdsError, UnknownCacheError
from ..kv_cache import LayerGroupKvManager
from ..runner import LlmRunner, SeqWork
# re-exported: code and tests import these from here
from ..runner.llm_runner import MAX_DECODE_TRACES, layer_windows, model_dtype, shape_bucket  # noqa: F401
from .types import (
    AttentionType,
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorMemoryUsage,
    ExecutorState,
    ExecutorStatus,
    KvCacheHandle,
    MemoryRequirements,
    PrefillInput,
    PrefillOutput,
)

_ids = itertools.count()


def _as_token_list(ids: mx.array, what: str) -> list[int]:
    """The token ids of one sequence's ``input_ids`` (an ``mx.array``, or anything
    ``mx.array`` takes) as Python ints.

    Raises:
        InvalidInputIdsError: not an integer dtype (float ids would be silently
            truncated), not shaped ``[1, L]`` (a 1-D array is refused rather than guessed
            at), or empty. The vocabulary range is checked by ``LlmExecutor.run``.
    """
    if not isinstance(ids, mx.array):
        try:
            ids = mx.array(ids)
        except (TypeError, ValueError) as e:
            raise InvalidInputIdsError(f"{what}.input_ids is not an array of token ids ({e}): pass "
                                       "mx.array([[id, ...]], dtype=mx.int32)") from None
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise InvalidInputIdsError(
            f"{what}.input_ids has dtype {ids.dtype}, not an integer dtype: token ids are integers; pass "
            "mx.array([[id, ...]], dtype=mx.int32) (a float id would be truncated to a different token)"
        )
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise InvalidInputIdsError(
            f"{what}.input_ids must have shape [1, L], got {tuple(ids.shape)}: wrap one sequence's ids as "
            "[[id, ...]], one sequence per input, and use batch_prefill/batch_decode for several"
        )
    if ids.shape[1] == 0:
        raise InvalidInputIdsError(f"{what}.input_ids is empty: give at least one token")
    return [int(t) for t in ids[0].tolist()]


class LlmExecutor:
    """The ferrum ``ModelExecutor`` over a model, as an adapter over an :class:`~mlx_ferrum.runner.LlmRunner`.

    Args:
        model: the loaded model (``model.args`` a ``ModelArgs``); ignored when ``runner``
            is given (its model is used).
        config: runtime settings; ``None`` reads them from the environment.
        model_id: a name for :attr:`info`.
        manager: an existing paged manager to use (paged layout only); its block size
            and block count size the pool.
        runner: an existing runner to wrap instead of building one (``config``,
            ``model_id`` and ``manager`` are then the runner's).

    Attributes:
        runner: the :class:`~mlx_ferrum.runner.LlmRunner` every call goes to (the engine
            drives the same object when given this executor).
        model, config, args, info, dtype, layout, max_seq_len, manager, pool, store:
            the runner's (``model`` may be replaced, e.g. by a wrapper in tests).

    Raises (from its calls):
        PromptTooLongError: tokens beyond ``kv_capacity()``.
        KvCacheExhaustedError: the paged pool is full (the failed call's blocks are released).
        UnknownCacheError: a handle whose cache was released.
        InvalidInputIdsError (an ``ExecutorError``): ``input_ids`` not an integer array of
            shape ``[1, L]`` (one sequence; ``[1, 1]`` for ``decode``), or an id outside
            ``[0, vocab_size)``.
        ExecutorError: other malformed input, or a call after ``shutdown``.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        config: Optional[RuntimeConfig] = None,
        model_id: str = "model",
        manager: Optional[LayerGroupKvManager] = None,
        runner: Optional[LlmRunner] = None,
    ):
        if runner is None:
            if model is None:
                raise ExecutorError("LlmExecutor needs a model (or an existing runner=)")
            runner = LlmRunner(model, config, model_id=model_id, manager=manager)
        self.runner = runner
        self._counts = {"prefill": 0, "decode": 0}
        self._times = {"prefill": 0.0, "decode": 0.0}
        self._last_batch = 0
        self._last_op: Optional[float] = None
        self._peak_kv_bytes = 0

    # ------------------------------------------------------------- the runner's facts
    @property
    def model(self) -> nn.Module:
        """The runner's model."""
        return self.runner.model

    @model.setter
    def model(self, model: nn.Module) -> None:
        self.runner.model = model

    config = property(lambda self: self.runner.config, doc="The runner's :class:`RuntimeConfig`.")
    args = property(lambda self: self.runner.args, doc="The model's ``ModelArgs``.")
    info = property(lambda self: self.runner.info, doc="Static facts (:class:`ModelInfo`).")
    dtype = property(lambda self: self.runner.dtype, doc="The model's activation dtype (also the KV dtype).")
    layout = property(lambda self: self.runner.layout, doc='``"paged"`` or ``"contiguous"``.')
    max_seq_len = property(lambda self: self.runner.max_seq_len, doc="Most tokens per sequence.")
    manager = property(lambda self: self.runner.manager, doc="The paged block manager (None: contiguous).")
    pool = property(lambda self: self.runner.pool, doc="The paged K/V pool arrays (None: contiguous).")
    store = property(lambda self: self.runner.store, doc="The runner's KV store.")
    _contiguous = property(lambda self: self.runner._contiguous, doc="Contiguous caches by id (empty: paged).")

    @property
    def compiled_decode(self) -> bool:
        """True while paged decode passes run as one ``mx.compile``'d step (see :class:`LlmRunner`)."""
        return self.runner.compiled_decode

    # ------------------------------------------------------------- handles
    def _handle(self, cache_id: Hashable) -> KvCacheHandle:
        if self.runner.manager is not None:
            seq = self.runner.manager._seq(cache_id)
            return KvCacheHandle(
                cache_id, seq.num_tokens, "paged", self.runner.manager.block_size, tuple(seq.block_ids)
            )
        return KvCacheHandle(cache_id, self.runner.num_tokens(cache_id), "contiguous")

    def _check_open(self) -> None:
        self.runner._check_open()

    @property
    def _state(self) -> ExecutorState:
        """The runner's lifecycle, in ferrum's terms."""
        if self.runner.closed:
            return ExecutorState.SHUTDOWN
        return ExecutorState.BUSY if self.runner.busy else ExecutorState.READY

    # ------------------------------------------------------------- the runner's calls, unchanged
    def has_cache(self, cache_id: Hashable) -> bool:
        """True when ``cache_id`` holds a cache."""
        return self.runner.has_cache(cache_id)

    def num_tokens(self, cache_id: Hashable) -> int:
        """Tokens stored for ``cache_id``. Raises UnknownCacheError for an unknown id."""
        return self.runner.num_tokens(cache_id)

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold (``FERRUM_KV_CAPACITY`` or ``max_position_embeddings``)."""
        return self.runner.kv_capacity()

    def run(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None) -> list[mx.array]:
        """:meth:`LlmRunner.run`: one evaluated forward pass; ``[n_i or 1, vocab]`` per item."""
        return self.runner.run(work, prev_tokens)

    def forward(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None):
        """:meth:`LlmRunner.forward`: one forward pass, unevaluated: ``(logits [R, vocab], state)``."""
        return self.runner.forward(work, prev_tokens)

    def schedule_kv_state(self) -> None:
        """:meth:`LlmRunner.schedule_kv_state`."""
        self.runner.schedule_kv_state()

    def trim_cache(self, cache_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of a cache (see :meth:`truncate_kv` for handles).

        Raises:
            UnknownCacheError: released cache. KvCacheError: ``num_tokens`` out of range.
        """
        self.runner.trim_cache(cache_id, num_tokens)

    def set_token_ids(self, cache_id: Hashable, start: int, token_ids: Sequence[int]) -> None:
        """:meth:`LlmRunner.set_token_ids` (prefix caching of tokens stored before they were known)."""
        self.runner.set_token_ids(cache_id, start, token_ids)

    # ---------------------------------------------------------- ferrum API
    def _timed(self, kind: str, batch: int, fn):
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        self._counts[kind] += 1
        self._times[kind] += dt
        self._last_batch = batch
        self._last_op = time.time()
        self._peak_kv_bytes = max(self._peak_kv_bytes, self.runner.kv_used_bytes())
        return res

    def prefill(self, input: PrefillInput) -> PrefillOutput:
        """Run a prompt (or extend ``input.kv_cache`` by a chunk) in one forward pass.

        Returns:
            ``PrefillOutput`` with logits ``[1, L, vocab]`` when ``return_all_logits``
            else ``[1, 1, vocab]``.

        Raises:
            InvalidInputIdsError: ``input.input_ids`` is not an integer ``[1, L]`` array of
                ids in ``[0, vocab_size)``.
        """
        return self.batch_prefill([input])[0]

    def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        """Several prompts in one forward pass (paged: packed; contiguous: grouped by length)."""
        work = []
        for inp in inputs:
            toks = _as_token_list(inp.input_ids, "PrefillInput")
            if inp.attention_mask is not None and not bool(mx.all(inp.attention_mask != 0)):
                raise ExecutorError("attention_mask with zeros is not supported: send unpadded sequences")
            if inp.kv_cache is not None:
                cid = inp.kv_cache.cache_id
                if not self.has_cache(cid):
                    raise UnknownCacheError(f"unknown KV cache {cid!r}: it was never created or was released")
            else:
                cid = inp.cache_id or f"seq-{next(_ids)}"
                if self.has_cache(cid):
                    raise ExecutorError(f"cache_id {cid!r} is in use: release it or pass its handle as kv_cache")
            work.append(SeqWork(cid, toks, inp.return_all_logits))
        logits = self._timed("prefill", len(work), lambda: self.run(work))
        return [PrefillOutput(l[None], self._handle(w.cache_id)) for l, w in zip(logits, work)]

    def decode(self, input: DecodeInput) -> DecodeOutput:
        """One token of one sequence; logits ``[1, vocab]``.

        Raises:
            InvalidInputIdsError: ``input.input_ids`` is not an integer ``[1, 1]`` array of
                an id in ``[0, vocab_size)``.
        """
        return self.batch_decode([input])[0]

    def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """One token for each of several sequences, in ONE forward pass.

        Paged: ragged context lengths, no padding. Contiguous: K/V rows padded to the
        longest cache and masked.
        """
        work = []
        for inp in inputs:
            toks = _as_token_list(inp.input_ids, "DecodeInput")
            if len(toks) != 1:
                raise ExecutorError("DecodeInput.input_ids must hold one token ([1, 1]); use forward_verify for more")
            if not self.has_cache(inp.kv_cache.cache_id):
                raise UnknownCacheError(
                    f"unknown KV cache {inp.kv_cache.cache_id!r}: it was never created or was released"
                )
            work.append(SeqWork(inp.kv_cache.cache_id, toks))
        logits = self._timed("decode", len(work), lambda: self.run(work))
        return [DecodeOutput(l, self._handle(w.cache_id)) for l, w in zip(logits, work)]

    def forward_verify(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """N+1 tokens of ONE sequence in one forward pass, one logits row per token.

        For speculative decoding: pass the last accepted token followed by N draft
        tokens, all with the same ``kv_cache``; row ``i`` gives the logits after token
        ``i``. Every output carries the final handle; roll rejected tokens back with
        :meth:`truncate_kv`.
        """
        if not inputs:
            return []
        cid = inputs[0].kv_cache.cache_id
        if any(i.kv_cache.cache_id != cid for i in inputs):
            raise ExecutorError("forward_verify takes tokens of one sequence: all inputs must share kv_cache")
        if not self.has_cache(cid):
            raise UnknownCacheError(f"unknown KV cache {cid!r}: it was never created or was released")
        toks = [t for i in inputs for t in _as_token_list(i.input_ids, "DecodeInput")]
        logits = self._timed("decode", 1, lambda: self.run([SeqWork(cid, toks, True)]))[0]
        h = self._handle(cid)
        return [DecodeOutput(logits[i : i + 1], h) for i in range(len(toks))]

    def truncate_kv(self, kv_cache: KvCacheHandle, new_len: int) -> KvCacheHandle:
        """Keep the first ``new_len`` tokens of a cache; paged blocks past them are freed.

        Raises:
            UnknownCacheError: released cache. KvCacheError: ``new_len`` out of range.
        """
        cid = kv_cache.cache_id
        with self._lock:
            self.store.truncate(cid, new_len)
        return self._handle(cid)

    def truncate_kv(self, kv_cache: KvCacheHandle, new_len: int) -> KvCacheHandle:
        """Keep the first ``new_len`` tokens of a cache; paged blocks past them are freed.

        Raises:
            UnknownCacheError: released cache. KvCacheError: ``new_len`` out of range.
        """
        self.runner.trim_cache(kv_cache.cache_id, new_len)
        return self._handle(kv_cache.cache_id)

    def fork_cache(self, kv_cache: KvCacheHandle, new_cache_id: Optional[str] = None) -> KvCacheHandle:
        """A new sequence starting with ``kv_cache``'s tokens (paged: shared blocks, copy-on-write).

        Raises:
            UnknownCacheError: released cache.
        """
        new_id = new_cache_id or f"seq-{next(_ids)}"
        self.runner.fork_cache(kv_cache.cache_id, new_id)
        return self._handle(new_id)

    def claim_prefix(self, cache_id: str, token_ids: Sequence[int], num_tokens: int) -> KvCacheHandle:
        """Create the paged cache ``cache_id`` sharing the first ``num_tokens`` prefix-cached
        tokens of ``token_ids`` (see :meth:`LlmRunner.claim_prefix`).

        Returns:
            The new cache's handle (``num_tokens`` tokens).

        Raises:
            ExecutorError: the contiguous layout, or prefix caching is off.
            KvCacheError: ``cache_id`` exists, or fewer than ``num_tokens`` tokens are
                cached (nothing changes then).
        """
        self.runner.claim_prefix(cache_id, token_ids, num_tokens)
        return self._handle(cache_id)

    def release_cache(self, cache_id: str) -> None:
        """Free a sequence's cache; unknown ids are ignored (release is idempotent)."""
        self.runner.release_cache(cache_id)

    # ------------------------------------------------------------- LoRA
    lora = property(lambda self: self.runner.lora, doc="The runner's LoRA registry (None: LoRA off).")

    def add_lora(self, name: str, path: str):
        """Register an adapter: :meth:`LlmRunner.add_lora <mlx_ferrum.runner.LlmRunner.add_lora>`.

        Raises:
            ExecutorError: LoRA is off. LoraError: the adapter is refused.
        """
        return self.runner.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown. LoraError: in use.
        """
        self.runner.remove_lora(name)

    def list_loras(self) -> list[str]:
        """Registered adapter names (empty when LoRA is off)."""
        return self.runner.list_loras()

    def lora_path(self, name: str) -> str:
        """Where ``name`` was registered from. Raises ExecutorError (off) or UnknownLoraError."""
        return self.runner.lora_path(name)

    def acquire_lora(self, name: str, owner: object) -> Optional[int]:
        """Pin ``name``'s slot for ``owner`` (None: every slot pinned by others); see
        :meth:`LlmRunner.acquire_lora <mlx_ferrum.runner.LlmRunner.acquire_lora>`.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``.
        """
        return self.runner.acquire_lora(name, owner)

    def release_lora(self, owner: object) -> None:
        """Unpin ``owner``'s adapter slot (a no-op when it holds none or LoRA is off)."""
        self.runner.release_lora(owner)

    def lora_metrics_snapshot(self) -> dict:
        """The runner's adapter metrics; ``{}`` when LoRA is off."""
        return self.runner.lora_metrics_snapshot()

    # ------------------------------------------------------------ reports
    def kv_allocated_bytes(self) -> int:
        """Bytes of KV memory held: the whole pool (paged) or every buffer's capacity (contiguous)."""
        return self.runner.kv_allocated_bytes()

    def cache_metrics_snapshot(self) -> dict:
        """Paged: the manager's block metrics; contiguous: sequences and bytes held."""
        return self.runner.cache_metrics_snapshot()

    def capabilities(self) -> ExecutorCapabilities:
        """What this executor does (every flag is true of the implementation)."""
        a = self.args
        mechs = [AttentionType.MULTI_HEAD]
        if a.num_key_value_heads < a.num_attention_heads:
            mechs.append(AttentionType.MULTI_QUERY if a.num_key_value_heads == 1 else AttentionType.GROUPED_QUERY)
        if self.layout == "paged":
            mechs.append(AttentionType.PAGED)
        # K+V bytes one token takes in one layer as stored: the model dtype, or a quantized
        # cache's codes with their scales and biases
        per_tok_layer = self.runner.store.bytes_per_token // a.num_hidden_layers
        return ExecutorCapabilities(
            max_batch_size=self.config.max_num_seqs if self.layout == "paged" else 256,
            max_sequence_length=self.max_seq_len,
            attention_mechanisms=mechs,
            supports_dynamic_batching=True,
            supports_continuous_batching=self.layout == "paged",
            supports_speculative_decoding=True,
            supports_tensor_parallelism=False,
            supports_pipeline_parallelism=False,
            supported_dtypes=["float32", "float16", "bfloat16"],
            supported_devices=["gpu" if mx.metal.is_available() else "cpu"],
            memory_requirements=MemoryRequirements(
                parameter_memory=self.runner.weight_bytes,
                activation_memory_per_token=4 * a.hidden_size * self.dtype.size,
                kv_cache_memory_per_token=per_tok_layer,
            ),
            kv_layout=self.layout,
        )

    def status(self) -> ExecutorStatus:
        """Counts of prefill/decode calls and their average time in milliseconds."""
        avg = lambda k: 1000.0 * self._times[k] / self._counts[k] if self._counts[k] else 0.0  # noqa: E731
        alloc = self.kv_allocated_bytes()
        used = self.runner.kv_used_bytes()
        state = self._state
        return ExecutorStatus(
            state=state,
            is_ready=state == ExecutorState.READY,
            current_batch_size=self._last_batch,
            prefill_operations=self._counts["prefill"],
            decode_operations=self._counts["decode"],
            avg_prefill_time_ms=avg("prefill"),
            avg_decode_time_ms=avg("decode"),
            memory_usage=ExecutorMemoryUsage(
                allocated_bytes=alloc,
                used_bytes=used,
                peak_bytes=self._peak_kv_bytes,
                utilization_percent=100.0 * used / alloc if alloc else 0.0,
            ),
            last_operation=self._last_op,
        )

    def warmup(self) -> None:
        """Run a 2-token prefill and a decode on a scratch cache, then release it."""
        self._check_open()
        cid = f"warmup-{next(_ids)}"
        try:
            self.run([SeqWork(cid, [0, 0])])
            self.run([SeqWork(cid, [0])])
        finally:
            self.release_cache(cid)

    def shutdown(self) -> None:
        """Release every cache; later calls raise ``ExecutorError``."""
        self.runner.close()
