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
runner.

The runner never allocates KV blocks. In the engine the scheduler owns the block
manager; this low-level API has no scheduler, so the adapter owns one itself
(:attr:`LlmExecutor.manager`, built from the runner's ``kv_geometry``) and plays the
scheduler's part for it: before each pass it appends the rows' slots
(:func:`~mlx_ferrum.kv_cache.block_tables.append_row`), hands them to the runner, gives
them back when the pass fails, and frees blocks outside a sliding window after it (the
block manager of vLLM, Kwon et al., SOSP 2023). An engine built over this executor
shares the same manager (its scheduler drives it), so both see one set of caches.

The ferrum-style calls evaluate their logits before returning, so timings in
:meth:`LlmExecutor.status` are real. :meth:`LlmExecutor.forward` and the other
runner methods are passed through unchanged, for code written against the executor.

Why this module is one file of over 500 lines: it is ferrum's whole public executor API
(prefill, decode, batch calls, fork, trim, release, handles) over one runner and the
block manager it owns; callers read it as one surface.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Hashable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..config import RuntimeConfig
from ..errors import ExecutorError, InvalidInputIdsError, KvCacheError, UnknownCacheError
from ..kv_cache import LayerGroupKvManager
from ..kv_cache.block_tables import BatchBlocks, append_row, undo_rows
from ..kv_cache.manager import UNKNOWN_TOKEN
from ..lora import prefix_salt, salt_token_ids
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
        manager: an existing paged block manager to own (paged layout only); its block
            size and block count size the pool. None: one is built from the runner's
            ``kv_geometry``.
        runner: an existing runner to wrap instead of building one (``config`` and
            ``model_id`` are then the runner's).

    Attributes:
        runner: the :class:`~mlx_ferrum.runner.LlmRunner` every call goes to (the engine
            drives the same object when given this executor).
        manager: the paged block manager this adapter owns (None: contiguous layout);
            an engine built over this executor schedules with it.
        model, config, args, info, dtype, layout, max_seq_len, pool, store:
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
        geometry = runner.kv_geometry
        if manager is not None and geometry is None:
            raise ExecutorError("a block manager needs the paged layout: pass RuntimeConfig(kv_layout='paged')")
        self.manager: Optional[LayerGroupKvManager] = (
            manager if manager is not None else geometry.new_block_manager() if geometry is not None else None)
        self._lock = threading.RLock()
        self._salts: dict = {}  # cache id -> its adapter's prefix-cache salt (set_token_ids)
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
    pool = property(lambda self: self.runner.pool, doc="The paged K/V pool arrays (None: contiguous).")
    store = property(lambda self: self.runner.store, doc="The runner's KV store.")
    _contiguous = property(lambda self: self.runner._contiguous, doc="Contiguous caches by id (empty: paged).")

    @property
    def compiled_decode(self) -> bool:
        """True while paged decode passes run as one ``mx.compile``'d step (see :class:`LlmRunner`)."""
        return self.runner.compiled_decode

    # ------------------------------------------------------------- handles
    def _handle(self, cache_id: Hashable) -> KvCacheHandle:
        if self.manager is not None:
            seq = self.manager._seq(cache_id)
            return KvCacheHandle(cache_id, seq.num_tokens, "paged", self.manager.block_size, tuple(seq.block_ids))
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
        """True when ``cache_id`` holds a cache (a block table, or contiguous buffers)."""
        if self.manager is not None:
            return self.manager.has(cache_id)
        return self.runner.has_cache(cache_id)

    def num_tokens(self, cache_id: Hashable) -> int:
        """Tokens stored for ``cache_id``. Raises UnknownCacheError for an unknown id."""
        if self.manager is not None:
            return self.manager.num_tokens(cache_id)
        return self.runner.num_tokens(cache_id)

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold (``FERRUM_KV_CAPACITY`` or ``max_position_embeddings``)."""
        return self.runner.kv_capacity()

    def _allocate(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array]):
        """Append every item's slots in :attr:`manager` (caches that do not exist are
        created) after the runner's checks; returns ``(blocks, undo)``, ``(None, no-op)``
        for the contiguous layout. ``undo`` cuts each row back and releases the caches
        this call created. Call with the lock held.

        Raises:
            PromptTooLongError, InvalidInputIdsError, ExecutorError (the runner's checks);
            KvCacheExhaustedError: the pool is full (nothing changes then).
        """
        mgr = self.manager
        if mgr is None:
            return None, lambda: None
        self.runner.validate(work, prev_tokens, stored=lambda cid: mgr.num_tokens(cid) if mgr.has(cid) else 0)
        batch = BatchBlocks()
        created: list = []

        def undo() -> None:
            undo_rows(mgr, batch)
            for cid in created:
                if mgr.has(cid):
                    mgr.release(cid)
                self._salts.pop(cid, None)

        try:
            for w in work:
                key_ids = None
                if mgr.prefix_cache:
                    # a token still being sampled (prev_row) is stored as UNKNOWN_TOKEN: prefix
                    # caching hashes its block once set_token_ids() brings the id
                    ids = w.tokens[:-1] + [UNKNOWN_TOKEN] if w.prev_row >= 0 else list(w.tokens)
                    key_ids = self.runner.cache_key_ids(w, ids)
                    if w.lora_slot >= 0 and self.runner.lora is not None:
                        self._salts[w.cache_id] = prefix_salt(self.runner.lora.slot_name(w.lora_slot))
                if not mgr.has(w.cache_id):
                    created.append(w.cache_id)
                append_row(mgr, batch, w.cache_id, len(w.tokens), key_ids)
        except BaseException:  # Ctrl-C too: never leave slots appended
            undo()
            raise
        return batch, undo

    def run(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None) -> list[mx.array]:
        """One evaluated forward pass (:meth:`LlmRunner.run`) at slots this adapter
        allocates; ``[n_i or 1, vocab]`` per item. On any error the touched caches go
        back to their previous lengths (new ones are released). After the pass, blocks
        outside a sliding window are freed, except for rows returning all logits (a
        verify pass keeps them until its rejected tokens are truncated).

        Raises:
            PromptTooLongError, KvCacheExhaustedError, InvalidInputIdsError, ExecutorError.
        """
        self._check_open()
        if not work:
            return []
        with self._lock:
            blocks, undo = self._allocate(work, prev_tokens)
            try:
                out = self.runner.run(work, prev_tokens, blocks)
            except BaseException:
                undo()
                raise
            if self.manager is not None:
                for w in work:
                    if not w.all_logits and self.manager.has(w.cache_id):
                        self.manager.trim_to_window(w.cache_id)
            return out

    def forward(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None):
        """One forward pass (:meth:`LlmRunner.forward`) at slots this adapter allocates,
        unevaluated: ``(logits [R, vocab], state)``. Nothing changes when it raises."""
        self._check_open()
        if not work:
            return self.runner.forward(work, prev_tokens)
        with self._lock:
            blocks, undo = self._allocate(work, prev_tokens)
            try:
                return self.runner.forward(work, prev_tokens, blocks)
            except BaseException:
                undo()
                raise

    def schedule_kv_state(self) -> None:
        """:meth:`LlmRunner.schedule_kv_state`."""
        self.runner.schedule_kv_state()

    def trim_cache(self, cache_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of a cache (see :meth:`truncate_kv` for
        handles); whole paged blocks past them are freed.

        Raises:
            UnknownCacheError: released cache. KvCacheError: ``num_tokens`` out of range.
        """
        with self._lock:
            if self.manager is not None:
                self.manager.truncate(cache_id, num_tokens)
            else:
                self.runner.trim_cache(cache_id, num_tokens)

    def set_token_ids(self, cache_id: Hashable, start: int, token_ids: Sequence[int]) -> None:
        """Tell the block manager the ids of tokens it stored before they were known on
        the host (a pipelined step's ``prev_row`` token), so prefix caching can hash their
        blocks. A no-op without prefix caching, for an unknown cache, and for positions
        not stored yet.

        Args:
            cache_id: the sequence. start: position of ``token_ids[0]`` (tokens).
            token_ids: the ids (ints), unsalted (the cache's adapter salt is added).

        Raises:
            KvCacheError: a position already holds a different known id.
        """
        mgr = self.manager
        if mgr is None or not mgr.prefix_cache:
            return
        with self._lock:
            if mgr.has(cache_id):
                mgr.set_token_ids(cache_id, start, salt_token_ids(token_ids, self._salts.get(cache_id, 0)))

    # ---------------------------------------------------------- ferrum API
    def _timed(self, kind: str, batch: int, fn):
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        self._counts[kind] += 1
        self._times[kind] += dt
        self._last_batch = batch
        self._last_op = time.time()
        self._peak_kv_bytes = max(self._peak_kv_bytes, self.kv_used_bytes())
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
        self.trim_cache(kv_cache.cache_id, new_len)
        return self._handle(kv_cache.cache_id)

    def fork_cache(self, kv_cache: KvCacheHandle, new_cache_id: Optional[str] = None) -> KvCacheHandle:
        """A new sequence starting with ``kv_cache``'s tokens (paged: shared blocks, copy-on-write).

        Raises:
            UnknownCacheError: released cache.
        """
        new_id = new_cache_id or f"seq-{next(_ids)}"
        with self._lock:
            if self.manager is not None:
                self.manager.fork(kv_cache.cache_id, new_id)
                if kv_cache.cache_id in self._salts:
                    self._salts[new_id] = self._salts[kv_cache.cache_id]
            else:
                self.runner.fork_cache(kv_cache.cache_id, new_id)
        return self._handle(new_id)

    def claim_prefix(self, cache_id: str, token_ids: Sequence[int], num_tokens: int) -> KvCacheHandle:
        """Create the paged cache ``cache_id`` sharing the first ``num_tokens`` prefix-cached
        tokens of ``token_ids`` (reference counts; no K/V is computed or copied). The match
        is the manager's ``match_prefix`` (chained SHA-256 block keys, as in vLLM's
        automatic prefix caching); ``longest_cached_prefix`` says how many tokens it finds.

        Args:
            cache_id: a new cache id.
            token_ids: the prompt's token ids (ints; salted with
                :func:`~mlx_ferrum.lora.salt_token_ids` for a LoRA sequence).
            num_tokens: cached tokens to share: a multiple of ``block_size``, at most
                ``len(token_ids) - 1``; 0 creates an empty cache.

        Returns:
            The new cache's handle (``num_tokens`` tokens).

        Raises:
            ExecutorError: the contiguous layout, or prefix caching is off.
            KvCacheError: ``cache_id`` exists, or fewer than ``num_tokens`` tokens are
                cached (nothing changes then).
        """
        mgr = self.manager
        if mgr is None or not mgr.prefix_cache:
            raise ExecutorError("claim_prefix needs the paged layout with prefix caching: pass "
                                "RuntimeConfig(kv_layout='paged', prefix_cache=True)")
        with self._lock:
            if mgr.has(cache_id):
                raise KvCacheError(f"KV cache {cache_id!r} already exists")
            if mgr.longest_cached_prefix(token_ids) < num_tokens:
                raise KvCacheError(f"{num_tokens} prefix tokens of {cache_id!r} are not all cached")
            mgr.create(cache_id)
            try:
                mgr.match_prefix(cache_id, token_ids, max_tokens=num_tokens)
            except BaseException:
                mgr.release(cache_id)
                raise
        return self._handle(cache_id)

    def release_cache(self, cache_id: str) -> None:
        """Free a sequence's cache (its blocks, or its contiguous buffers); unknown ids are
        ignored (release is idempotent)."""
        with self._lock:
            if self.manager is not None:
                if self.manager.has(cache_id):
                    self.manager.release(cache_id)
                self._salts.pop(cache_id, None)
            else:
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

    def kv_used_bytes(self) -> int:
        """Bytes of KV memory holding tokens: the blocks this adapter's manager holds
        (paged) or every buffer's capacity (contiguous)."""
        return self.runner.kv_used_bytes(self.manager)

    def cache_metrics_snapshot(self) -> dict:
        """Paged: the manager's block metrics and the pool's bytes; contiguous: sequences and bytes held."""
        return self.runner.cache_metrics_snapshot(self.manager)

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
        model = self.runner.model
        tensor = int(getattr(model, "tensor_parallel_size", 1))
        stage = getattr(model, "pipeline_stage", None)
        pipeline = int(stage.size) if stage is not None else 1
        return ExecutorCapabilities(
            max_batch_size=self.config.max_num_seqs if self.layout == "paged" else 256,
            max_sequence_length=self.max_seq_len,
            attention_mechanisms=mechs,
            supports_dynamic_batching=True,
            supports_continuous_batching=self.layout == "paged",
            supports_speculative_decoding=True,
            supports_tensor_parallelism=tensor > 1,
            supports_pipeline_parallelism=pipeline > 1,
            tensor_parallel_size=tensor,
            pipeline_parallel_size=pipeline,
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
        used = self.kv_used_bytes()
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
        with self._lock:
            if self.manager is not None:
                for cid in list(self.manager.seqs):
                    self.manager.release(cid)
            self.runner.close()
