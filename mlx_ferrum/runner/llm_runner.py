"""LlmRunner: the :class:`~mlx_ferrum.runner.ModelRunner` over a decoder-only MLX model.

One runner holds one model and one KV store (built once by
:func:`mlx_ferrum.kv_cache.factory.build_kv_store` from ``RuntimeConfig.kv_layout``,
with its attention backend) and serves many sequences, each known by a ``cache_id``.
It has ONE forward path: the store readies the storage a pass writes, and the runner's
:mod:`.inputs` part lays the pass out and builds its typed metadata (which
carries the backend) before the model runs; the layouts differ only in their store,
backend and pass builder:

- contiguous: each sequence has per-layer :class:`~mlx_ferrum.kv_cache.ContiguousKvCache`.
  Batched calls put sequences on separate rows; rows whose caches differ in length are
  right-padded and masked inside attention, and prompts of different lengths are run
  in groups of equal length (so no pad token is ever stored).
- paged: all sequences share one :class:`~mlx_ferrum.kv_cache.PagedKvPool`; a batched
  call packs every sequence's new tokens into ONE row (varlen, no padding), with
  per-token positions and a ``slot_mapping`` into the pool (ferrum's ``unified_decode``).
  The runner allocates no block: the slots and block tables of each pass come from the
  block manager's owner (the scheduler's ``SchedulerOutput``, as in vLLM and nano-vllm;
  or :class:`~mlx_ferrum.executor.LlmExecutor` for the low-level API) and are only read.
  Pure decode passes run through a compiled step (:meth:`LlmRunner._decode_pass`).

:meth:`LlmRunner.forward` returns the pass unevaluated, for the engine's pipelined step;
:meth:`LlmRunner.run` evaluates it. The ferrum-style calls (prefill/decode/handles) are
the adapter :class:`~mlx_ferrum.executor.LlmExecutor`.

Why this module is one file of over 500 lines: the forward pass and its storage calls,
validation and LoRA binding share the runner's locks and store; input building, the
compiled decode step and model facts are already separate modules.
"""

from __future__ import annotations

import contextlib

import logging
import threading
from typing import Hashable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import RuntimeConfig, resolve_kv_capacity
from ..errors import ExecutorError, InvalidInputIdsError, PromptTooLongError
from ..kv_cache import LayerGroupKvManager
from ..kv_cache.factory import KvSpec, build_kv_store
from ..kv_cache.block_tables import BatchBlocks, KvGeometry
from ..kv_cache.store import KvStore
from ..layers.attention import AttentionMetadata
from ..layers.dense import cache_transposed_weights
from ..lora import LoraAdapter, LoraRegistry, prefix_salt, salt_token_ids
from .compiled_decode import MAX_DECODE_TRACES, CompiledDecodeStep
from .inputs import KvPass, device_input_ids, lora_token_slots, pass_builder, shape_bucket
from .model_facts import layer_windows, model_dtype, table_ropes
from .protocol import ModelInfo, SeqWork

# re-exported here: code and tests import them from this module
__all__ = ["LlmRunner", "MAX_DECODE_EXPANSION", "MAX_DECODE_TRACES", "layer_windows", "model_dtype", "shape_bucket",
           "table_ropes"]

logger = logging.getLogger(__name__)

#: Longest row laid out as one decode row per token (a speculative draft plus its token):
#: past it the decode attention's per-row reads of the whole context cost more than a
#: prefill segment's.
MAX_DECODE_EXPANSION = 16


class LlmRunner(CompiledDecodeStep):
    """The :class:`~mlx_ferrum.runner.ModelRunner` over a Llama-family (or any registered)
    ``Model`` (``model.args`` a ``ModelArgs``).

    Args:
        model: the loaded model.
        config: runtime settings; ``None`` reads them from the environment.
        model_id: a name for :attr:`info`.
        manager: an existing paged block manager whose geometry sizes the pool (paged
            layout only); the runner does not keep it: its owner drives it.

    Attributes:
        model, config, args, info, dtype: the model and its facts.
        store: the KV store (:class:`PagedKvStore` or :class:`ContiguousKvStore`) with
            its attention backend (``store.backend``).
        passes: the pass builder of the store's layout
            (:class:`~mlx_ferrum.runner.inputs.PagedPassBuilder` or
            ``ContiguousPassBuilder``): each pass's layout and attention metadata.
        layout: ``store.layout``, for reports.
        kv_geometry: the paged pool's :class:`~mlx_ferrum.kv_cache.block_tables.KvGeometry`,
            from which the scheduler (or :class:`~mlx_ferrum.executor.LlmExecutor`) builds
            the block manager it owns (None for contiguous). The runner never allocates
            blocks: each paged pass reads the slots and tables it is handed.
        pool: the paged pool arrays (None for contiguous).
        max_seq_len: :meth:`kv_capacity`.
        weight_bytes: bytes of the model's parameters.
        busy: True while a pass is being built. closed: True after :meth:`close`.

    Raises:
        ExecutorError: ``manager`` given with the contiguous layout.
        InsufficientMemoryError: the paged pool does not fit (see ``build_kv_store``).
        ConfigurationError: ``kv_capacity`` beyond the model's ``max_position_embeddings``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[RuntimeConfig] = None,
        model_id: str = "model",
        manager: Optional[LayerGroupKvManager] = None,
    ):
        self.model = model
        self.config = config if config is not None else RuntimeConfig()
        args = model.args
        self.args = args
        self.dtype = model_dtype(model)
        self.max_seq_len = resolve_kv_capacity(self.config, args.max_position_embeddings)
        self._lock = threading.RLock()
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
        self.info = ModelInfo(
            model_id=model_id,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_hidden_layers,
            num_heads=args.num_attention_heads,
            num_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            max_sequence_length=self.max_seq_len,
            dtype=str(self.dtype).replace("mlx.core.", ""),
            num_parameters=n_params,
        )
        spec = KvSpec(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, self.dtype, self.max_seq_len,
                      tuple(layer_windows(model)), self.config.kv_cache_dtype)
        self.store: KvStore = build_kv_store(spec, self.config, self.weight_bytes, manager)
        self.passes = pass_builder(self.store, table_ropes(model))
        # before any step is traced: the projections' transposed weights become constants
        # of the compiled step rather than a Transpose node each
        cache_transposed_weights(model)
        self.layout = self.store.layout
        # what the block manager's owner (the scheduler, or LlmExecutor) builds its manager
        # from; the runner itself keeps no block tables and never allocates
        self.kv_geometry: Optional[KvGeometry] = self.store.geometry
        self.pool = self.store.pool  # PagedKvPool or QuantizedPagedKvPool (None: contiguous)
        if self.kv_geometry is not None:
            # the pool's block past the manager's (see build_kv_store)
            self._scratch_block = self.kv_geometry.num_blocks
        # paged decode passes run as one compiled graph (see _decode_pass); None: op by op
        # (MLX streams belong to the thread that made them, and a trace keeps its streams:
        # each thread that runs steps gets its own compiled function)
        self._compiled_decode: Optional[dict] = None
        self._wait_for_pools = mx.default_device().type == mx.DeviceType.cpu
        if self.store.supports_compiled_decode and not self.config.enforce_eager:
            self._compiled_decode = {}
        # paged passes give the model its packed tokens as [T] when it takes them
        # (Model.packed_tokens): 2-D activations, so no flatten/unflatten pair of graph
        # ops around each projection (the matmul of a 3-D input adds them)
        self._packed_tokens = bool(getattr(model, "packed_tokens", False))
        # LoRA: the registry switches the decoder projections to their LoRA variants
        # (exactly the base until a pass binds slots); None without enable_lora
        self.lora: Optional[LoraRegistry] = None
        if self.config.enable_lora:
            self.lora = LoraRegistry(model, self.config.max_loras, self.config.max_lora_rank,
                                     self.config.max_cpu_loras, self.dtype)
        self.busy = False
        self.closed = False

    # ------------------------------------------------------------- caches
    @property
    def _contiguous(self) -> dict:
        """Contiguous layout: cache id -> per-layer caches (empty for paged)."""
        return getattr(self.store, "caches", {})

    def has_cache(self, cache_id: str) -> bool:
        """True when ``cache_id`` holds per-sequence storage (contiguous buffers; always
        False for the paged layout, whose block tables belong to the block manager's owner)."""
        return self.store.has(cache_id)

    def num_tokens(self, cache_id: str) -> int:
        """Tokens stored in ``cache_id``'s contiguous buffers.

        Raises:
            UnknownCacheError: unknown ``cache_id``, or the paged layout (ask the block manager).
        """
        return self.store.num_tokens(cache_id)

    @property
    def compiled_decode(self) -> bool:
        """True while paged decode passes run as one ``mx.compile``'d step (see
        ``RuntimeConfig.enforce_eager``); False for the contiguous layout, with
        ``enforce_eager``, or once a model was found that cannot be traced."""
        return self._compiled_decode is not None

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold (``FERRUM_KV_CAPACITY`` or ``max_position_embeddings``)."""
        return self.max_seq_len

    def _check_open(self) -> None:
        if self.closed:
            raise ExecutorError("this executor was shut down: create a new one")

    def close(self) -> None:
        """Release every cache; later passes raise ``ExecutorError``."""
        with self._lock:
            for cid in self.store.cache_ids():
                self.store.release(cid)
            self.closed = True

    # ------------------------------------------------------------- core
    def run(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None,
            blocks: Optional[BatchBlocks] = None) -> list[mx.array]:
        """One forward pass over new tokens of several sequences (ferrum's ``unified_decode``),
        evaluated before returning.

        Contiguous caches that do not exist are created. On any error the contiguous
        caches touched by this call are restored to their previous length (and new ones
        dropped); the paged slots in ``blocks`` are given back by their owner.

        Args:
            work: one :class:`SeqWork` per sequence.
            prev_tokens: see :meth:`forward`.
            blocks: see :meth:`forward`.

        Returns:
            One array per item: ``[n_i, vocab]`` if ``all_logits`` else ``[1, vocab]``
            (``[0, vocab]`` when ``return_logits`` is False), in the model dtype, evaluated.

        Raises:
            PromptTooLongError, KvCacheExhaustedError, ExecutorError.
        """
        self._check_open()
        if not work:
            return []
        logits, state, undo = self._build(work, prev_tokens, blocks)
        try:
            mx.eval(logits, state)
        except BaseException:  # Ctrl-C too: the caches go back to their previous lengths
            with self._lock:
                undo()
            raise
        out = []
        r = 0
        for w in work:
            n = w.num_logit_rows
            out.append(logits[r : r + n])
            r += n
        return out

    def forward(
        self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None, blocks: Optional[BatchBlocks] = None,
    ) -> tuple[mx.array, list[mx.array]]:
        """Build one forward pass over ``work`` and return it UNEVALUATED.

        This is the pipelined engine's entry: the caller samples from the lazy logits
        and ``mx.async_eval``-s the result together with ``state`` (the KV arrays this
        pass writes), so the host can build the next step while this one runs (the
        overlap mlx-lm's ``generate_step`` gets from ``mx.async_eval``).

        Args:
            work: one :class:`SeqWork` per sequence (each ``cache_id`` once).
            prev_tokens: ``[R]`` int32 device array (a previous step's sampled tokens);
                an item with ``prev_row >= 0`` takes its LAST token from
                ``prev_tokens[prev_row]`` instead of ``tokens[-1]`` (a placeholder).
            blocks: paged layout: the step's slots and block tables
                (:class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`), one row per
                item with as many slots as it has tokens, allocated by the block
                manager's owner (the scheduler's ``SchedulerOutput.kv``, or
                :class:`~mlx_ferrum.executor.LlmExecutor`); only read here. Unused by
                the contiguous layout.

        Returns:
            ``(logits, state)``: logits ``[R, vocab]`` (model dtype), the rows of every
            item in ``work`` order (``num_logit_rows`` each); ``state`` the cache arrays
            to evaluate with them.

        Raises:
            PromptTooLongError, InvalidInputIdsError, ExecutorError (``blocks`` missing or
            not matching ``work``); nothing changes then.
        """
        self._check_open()
        if not work:
            return mx.zeros((0, self.args.vocab_size), self.dtype), []
        logits, state, _ = self._build(work, prev_tokens, blocks)
        return logits, state

    def _build(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array], blocks: Optional[BatchBlocks]):
        """:meth:`forward` plus the store's ``undo`` (for :meth:`run` to call when the
        evaluation fails)."""
        self.validate(work, prev_tokens, blocks)
        with self._lock:
            self.busy = True
            try:
                return self._forward(work, prev_tokens, blocks)
            finally:
                self.busy = False

    def stored_tokens(self, cache_id: Hashable, blocks: Optional[BatchBlocks] = None) -> int:
        """Tokens ``cache_id`` holds before this pass: its row's ``start`` in ``blocks``
        (paged), or its contiguous buffers' length (0 for a new sequence)."""
        if blocks is not None:
            row = blocks.rows.get(cache_id)
            return row.start if row is not None else 0
        return self.store.num_tokens(cache_id) if self.store.has(cache_id) else 0

    def validate(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array],
                 blocks: Optional[BatchBlocks] = None, stored=None) -> None:
        """Check a batch before anything is placed: each cache once, tokens given and in
        the vocabulary, ``prev_tokens`` present when a row takes one, LoRA slots resident,
        and every sequence within :meth:`kv_capacity`.

        Args:
            stored: ``cache_id -> tokens held before the pass`` (default
                :meth:`stored_tokens` over ``blocks``); the executor adapter passes its
                block manager's counts to check before it allocates.

        Raises:
            ExecutorError, InvalidInputIdsError, PromptTooLongError.
        """
        if stored is None:
            stored = lambda cid: self.stored_tokens(cid, blocks)  # noqa: E731
        ids = [w.cache_id for w in work]
        if len(set(ids)) != len(ids):
            raise ExecutorError("a cache_id appears twice in one batch: send one item per sequence")
        vocab = self.args.vocab_size
        for w in work:
            if not w.tokens:
                raise ExecutorError(f"no tokens given for cache {w.cache_id!r}")
            if w.prev_row >= 0 and prev_tokens is None:
                raise ExecutorError(f"cache {w.cache_id!r} takes a previous step's token but prev_tokens is None")
            host = w.tokens[:-1] if w.prev_row >= 0 else w.tokens
            if host and not (0 <= min(host) and max(host) < vocab):
                bad = next(t for t in host if not 0 <= t < vocab)
                raise InvalidInputIdsError(f"token id {bad} is outside the vocabulary [0, {vocab}): pass ids the "
                                           "model's tokenizer produced")
            if w.lora_slot >= 0 and (self.lora is None or self.lora.slot_name(w.lora_slot) is None):
                raise ExecutorError(
                    f"cache {w.cache_id!r} asks for LoRA slot {w.lora_slot}, which holds no adapter"
                    + ("" if self.lora is not None else ": LoRA is off (RuntimeConfig(enable_lora=True))")
                    + "; take slots from acquire_lora(name, owner)"
                )
            have = stored(w.cache_id)
            if have + len(w.tokens) > self.max_seq_len:
                raise PromptTooLongError(
                    f"sequence {w.cache_id!r} would hold {have + len(w.tokens)} tokens, more than the context of "
                    f"{self.max_seq_len}: shorten the prompt or max_tokens, or raise FERRUM_KV_CAPACITY "
                    "(at most the model's max_position_embeddings for sound results)"
                )

    #: the step's token ids on the device (:func:`.inputs.device_input_ids`)
    _input_ids = staticmethod(device_input_ids)

    def _forward(self, work: Sequence[SeqWork], prev: Optional[mx.array], blocks: Optional[BatchBlocks]):
        """One code path for both layouts: the store readies the storage the tokens go
        to, and the pass builder lays them out in passes (paged: one packed pass at the
        scheduler's slots; contiguous: one per token count).

        A pipeline stage (``model.pipeline_stage``, :mod:`mlx_ferrum.distributed.pipeline`)
        that can overlap splits the step into micro-batches, each readied by the store and
        laid out by the pass builder on its own, and sums the passes' logits across ranks only once all are built, so
        the stages work on different micro-batches at the same time."""
        stage = getattr(self.model, "pipeline_stage", None)
        overlap = stage is not None and stage.overlaps
        groups = stage.split([len(w.tokens) for w in work]) if overlap else [list(range(len(work)))]
        pieces: list[mx.array] = []
        owner: list[int] = []  # work index of each returned logits row, in piece order
        undos: list = []

        def undo() -> None:
            for one in reversed(undos):
                one()

        try:
            with stage.deferring() if overlap else contextlib.nullcontext():
                for indices in groups:
                    part = [work[i] for i in indices]
                    items = [(w.cache_id, w.tokens) for w in part]
                    # the storage first (a contiguous pass reads its caches' lengths)
                    undos.append(self.store.prepare([cid for cid, _ in items], blocks))
                    passes = self.passes.passes(items, [self._as_decode(w, blocks) for w in part], blocks)
                    for kv_pass in passes:
                        part_owner: list[int] = []
                        pieces.append(self._run_pass(part, kv_pass, prev, part_owner))
                        owner.extend(indices[j] for j in part_owner)
                if overlap:
                    pieces = stage.sum_logits(pieces)
        except BaseException:  # Ctrl-C too: never leave slots appended twice
            undo()
            self.schedule_kv_state()
            raise
        logits = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
        order = sorted(range(len(owner)), key=lambda r: owner[r])  # stable: rows of one item stay in order
        if order != list(range(len(order))):
            logits = logits[mx.array(np.asarray(order, dtype=np.int32))]
        return logits, self.store.state([w.cache_id for w in work]), undo

    def _as_decode(self, w: SeqWork, blocks: Optional[BatchBlocks]) -> bool:
        """True for a short row marked ``as_decode`` that returns every position's logits on
        a cache that exists (a speculative draft): it runs as one decode row per token (see
        ``PagedPassBuilder.passes``), so a batch of drafts stays a decode pass and goes
        through the compiled step instead of the op-by-op prefill path."""
        if not (w.as_decode and w.all_logits and 1 < len(w.tokens) <= MAX_DECODE_EXPANSION and w.prev_row < 0
                and blocks is not None):
            return False
        row = blocks.rows.get(w.cache_id)
        return row is not None and row.start > 0

    def schedule_kv_state(self) -> None:
        """Queue (``mx.async_eval``) the evaluation of every KV array, without waiting.

        A pass that failed part-way may leave the KV arrays as lazy writes nobody
        evaluates. MLX binds an unscheduled array to the thread that built it (another
        thread's evaluation raises "There is no Stream(cpu, n) in current thread"), and
        the next pass may be built on another thread, so the failure paths queue them.
        The writes went to slots the failed call released (they are written again before
        anything reads them). An error of that evaluation is the failed call's, already
        being reported, so it is not raised again here.
        """
        try:
            with self._lock:
                arrays = self.store.state(self.store.cache_ids())
            if arrays:
                mx.async_eval(*arrays)
        except Exception:  # noqa: BLE001 - the failure being handled already reports it
            pass

    def _run_pass(self, work: Sequence[SeqWork], kv_pass: KvPass, prev: Optional[mx.array], owner: list[int]) -> mx.array:
        """Build one pass's metadata and input ids and call the model (lazily); returns the
        logits rows of its items ``[R, vocab]`` and appends their owners to ``owner``."""
        if self._compiled_decode is not None and self._is_decode_pass(work, kv_pass):
            logits = self._decode_pass(work, kv_pass, prev)
            if logits is not None:
                for i in kv_pass.items:
                    owner.extend([i] * work[i].num_logit_rows)
                return logits
        flat = np.empty(kv_pass.rows * kv_pass.cols, dtype=np.int32)
        patch_at: list[int] = []
        patch_rows: list[int] = []
        rows: list[int] = []
        for i, start in zip(kv_pass.items, kv_pass.starts):
            w = work[i]
            n = len(w.tokens)
            flat[start : start + n] = w.tokens
            if w.prev_row >= 0:
                patch_at.append(start + n - 1)
                patch_rows.append(w.prev_row)
            k = w.num_logit_rows
            rows.extend(range(start + n - k, start + n))
            owner.extend([i] * k)
        meta = self.passes.metadata(kv_pass, self.dtype)
        meta.lora_slots = self._lora_token_slots(work, kv_pass, flat.size)
        # the LM head runs only on the rows whose logits are returned
        if not (len(rows) == flat.size and rows == list(range(flat.size))):
            meta.logits_indices = mx.array(np.asarray(rows or [0], dtype=np.int32))
        tokens = self._input_ids(flat, patch_at, patch_rows, prev)
        if not (self._packed_tokens and kv_pass.packed):
            tokens = tokens.reshape(kv_pass.rows, kv_pass.cols)
        logits = self._call_model(tokens, meta, None)
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if rows else logits[:0]

    def cache_key_ids(self, w: SeqWork, token_ids: list[int]) -> list[int]:
        """The ids the prefix cache keys ``w``'s tokens by: salted by its adapter
        (:func:`~mlx_ferrum.lora.salt_token_ids`) so prefix caching never shares blocks
        across adapters; ``token_ids`` unchanged for the base model. For the block
        manager's owner (the executor adapter), which appends the slots."""
        if w.lora_slot < 0 or self.lora is None:
            return token_ids
        return salt_token_ids(token_ids, prefix_salt(self.lora.slot_name(w.lora_slot)))

    def _lora_token_slots(self, work: Sequence[SeqWork], kv_pass, size: int) -> Optional[mx.array]:
        """``[size]`` int32 LoRA slot of each flattened token of the pass (the zero slot for
        tokens without an adapter and for padding), or None when no item of the pass has one."""
        if self.lora is None:
            return None
        return lora_token_slots(self.lora.none_slot, work, kv_pass.items, kv_pass.starts, size)

    def _call_model(self, tokens: mx.array, meta: AttentionMetadata, lora_weights: Optional[dict]) -> mx.array:
        """``self.model(tokens, meta)`` with the pass's LoRA slots bound to the model's LoRA
        projections (``lora_weights``: the stacks, None = the registry's current ones)."""
        if meta.lora_slots is None:
            return self.model(tokens, meta)
        weights = self.lora.weights() if lora_weights is None else lora_weights
        with self.lora.context.bound(meta.lora_slots, weights):
            return self.model(tokens, meta)

    # ------------------------------------------------------------ storage operations
    def trim_cache(self, cache_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of a contiguous cache's buffers (the engine's
        rollback of a rejected draft). Paged: nothing to do here; the block manager's owner
        frees the blocks.

        Raises:
            UnknownCacheError: released contiguous cache. KvCacheError: ``num_tokens`` out of range.
        """
        with self._lock:
            self.store.truncate(cache_id, num_tokens)

    def fork_cache(self, cache_id: Hashable, new_cache_id: Hashable) -> None:
        """Start the contiguous cache ``new_cache_id`` with a copy of ``cache_id``'s buffers.

        Raises:
            UnknownCacheError: unknown ``cache_id``. ExecutorError: the paged layout (a
            paged fork shares blocks in the block manager: ``LlmExecutor.fork_cache``).
        """
        with self._lock:
            self.store.fork(cache_id, new_cache_id)

    def release_cache(self, cache_id: Hashable) -> None:
        """Free a sequence's contiguous buffers; unknown ids are ignored (release is
        idempotent). Paged: nothing to do here (the block manager's owner frees blocks)."""
        with self._lock:
            self.store.release(cache_id)

    # ------------------------------------------------------------- LoRA
    def _lora_registry(self) -> LoraRegistry:
        if self.lora is None:
            raise ExecutorError("LoRA is off for this runner: pass RuntimeConfig(enable_lora=True) "
                                "(FERRUM_ENABLE_LORA=1, --enable-lora)")
        return self.lora

    def add_lora(self, name: str, path: str) -> LoraAdapter:
        """Register the PEFT or mlx-lm adapter at ``path`` (folder or hub id) as ``name``;
        it is read and checked against the model now.

        Returns:
            The loaded :class:`~mlx_ferrum.lora.LoraAdapter`.

        Raises:
            ExecutorError: LoRA is off. LoraError: the adapter is refused (the message
            names the reason: format, DoRA, module, shape, rank).
        """
        return self._lora_registry().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``.
            LoraError: running requests still use it.
        """
        self._lora_registry().remove(name)

    def list_loras(self) -> list[str]:
        """Registered adapter names (empty when LoRA is off)."""
        return [] if self.lora is None else self.lora.names()

    def lora_path(self, name: str) -> str:
        """The folder or hub id adapter ``name`` was registered from.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name`` (the message
            lists the registered names).
        """
        return self._lora_registry().path_of(name)

    def acquire_lora(self, name: str, owner: object) -> Optional[int]:
        """The resident slot of adapter ``name`` for ``owner`` (a request id), pinned until
        :meth:`release_lora`; None when every slot is pinned by other adapters' requests.
        Pass it as ``SeqWork.lora_slot``.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``.
            LoraError: the adapter's folder cannot be read any more.
        """
        return self._lora_registry().acquire(name, owner)

    def release_lora(self, owner: object) -> None:
        """Unpin ``owner``'s adapter slot (a no-op when it holds none or LoRA is off)."""
        if self.lora is not None:
            self.lora.release(owner)

    def lora_metrics_snapshot(self) -> dict:
        """Adapters registered, loaded and resident (``{name: slot}``), requests per adapter,
        loads and evictions (see :meth:`~mlx_ferrum.lora.LoraRegistry.metrics`); ``{}``
        when LoRA is off."""
        return {} if self.lora is None else self.lora.metrics()

    # ------------------------------------------------------------ reports
    def kv_used_bytes(self, block_manager: Optional[LayerGroupKvManager] = None) -> int:
        """Bytes of KV memory holding tokens: the blocks ``block_manager`` holds (paged; 0
        without it) or buffer capacities (contiguous)."""
        return self.store.used_bytes(block_manager)

    def kv_allocated_bytes(self) -> int:
        """Bytes of KV memory held: the whole pool (paged) or every buffer's capacity (contiguous)."""
        return self.store.allocated_bytes()

    def cache_metrics_snapshot(self, block_manager: Optional[LayerGroupKvManager] = None) -> dict:
        """Paged: ``block_manager``'s block metrics (when given) and the pool's bytes;
        contiguous: sequences and bytes held."""
        return self.store.metrics(block_manager)
