"""One KV-store interface over both layouts: ``ContiguousKvStore`` and ``PagedKvStore``.

The runner runs every forward pass the same way; the layouts differ only here (how
a batch's new tokens are placed and what attention metadata that yields) and in the
attention backend the store was built with (:mod:`mlx_ferrum.layers.backends`, chosen
once by :func:`~mlx_ferrum.kv_cache.factory.build_kv_store`). A store:

- ``prepare(items, as_decode, blocks)``: places each item's new tokens and returns the
  forward passes that run them (:class:`KvPass`: which items, in what order, laid out
  how, with the pass's host-side inputs) plus an ``undo`` that restores the touched
  storage if the pass fails. The paged store allocates nothing: it reads the slots and
  block tables that the block manager's owner (the scheduler) appended
  (:class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`); the contiguous store grows
  its per-sequence buffers (that is storage, not block accounting);
- ``metadata(kv_pass)``: the pass's complete, typed attention metadata (device arrays,
  the backend, every per-pass array the layers share), built before the model runs;
- ``truncate``, ``fork``, ``release``: per-sequence storage operations (contiguous
  buffers; nothing to do for the paged pool);
- ``used_bytes`` / ``allocated_bytes``: KV memory in bytes;
- ``state(cache_ids)``: the arrays a pass writes, for the caller to evaluate.

The paged layout packs all items into ONE pass (one row, decode tokens first, no
padding; vLLM's varlen layout). The contiguous layout runs one pass per distinct
new-token count (rows of equal length; caches of different lengths are padded and
masked inside attention), so no pad token is ever stored.

Why this module is one file of over 500 lines: the one KV-store interface and both of
its implementations sit side by side on purpose, so that the layouts visibly differ only
in storage and metadata.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence

import numpy as np

import mlx.core as mx

from ..errors import KvCacheError, UnknownCacheError
from ..kernels.reference import SHARED_PREFIX_MIN_SEQS
from ..layers.attention import (
    AttentionBackend,
    ContiguousAttentionBackend,
    ContiguousMetadata,
    PagedAttentionBackend,
    PagedMetadata,
    contiguous_pad_mask,
    paged_metadata,
)
from .contiguous import ContiguousKvCache
from ..errors import ExecutorError
from .block_tables import BatchBlocks, KvGeometry, LayerGroupKvManager, layer_group_windows
from .pool import PagedKvPool


@dataclass
class PagedPassInputs:
    """A paged pass's host-side inputs (numpy), from :meth:`PagedKvStore.prepare`.

    Attributes:
        positions: ``[T]`` int32 position of each packed token.
        context_lens: ``[num_rows]`` int32, tokens stored after the pass's writes.
        query_start_loc: ``[num_rows + 1]`` int32 prefix sums of query tokens per row.
        num_decode_seqs: leading rows that bring exactly one token.
        host_context_lens, host_query_start_loc: the same as lists of ints.
        slot_mappings: per layer group, ``[T]`` int32.
        block_tables: per layer group, ``[num_rows, max_blocks]`` int32.
        shared_prefixes: per layer group, the decode rows'
            :class:`~mlx_ferrum.kernels.reference.SharedPrefix` (numpy) or None
            (the backend's ``shared_prefix``); an empty list when no group has one.
    """

    positions: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    num_decode_seqs: int
    host_context_lens: list
    host_query_start_loc: list
    slot_mappings: list
    block_tables: list
    shared_prefixes: list = field(default_factory=list)


@dataclass
class ContiguousPassInputs:
    """A contiguous pass's host-side inputs, from :meth:`ContiguousKvStore.prepare`.

    Attributes:
        offsets: ``[B]`` int32 cache length of each row before the pass.
        caches: per row, its per-layer caches.
        cache_lens_after: per row, tokens stored after the pass.
    """

    offsets: np.ndarray
    caches: list
    cache_lens_after: list


@dataclass
class KvPass:
    """One forward pass over some items of a batch.

    Attributes:
        items: indices into the ``prepare`` items, in the pass's order.
        rows, cols: the pass's token array is ``[rows, cols]``.
        starts: flat index (into the ``rows * cols`` tokens) of each item's first token.
        inputs: the store's host-side inputs of the pass (:class:`PagedPassInputs` or
            :class:`ContiguousPassInputs`), turned into metadata by ``store.metadata``.
        packed: True when the tokens are packed into one row of varlen sequences (the
            paged layout), so the model may take them as ``[T]``.
        decode_rows: attention rows that bring one token each (every row of a pure decode
            pass; 0 when the store has no decode rows).
    """

    items: list[int]
    rows: int
    cols: int
    starts: list[int]
    inputs: Any = None
    packed: bool = False
    decode_rows: int = 0


class KvStore(Protocol):
    """What the executor needs of a KV layout (see the module docstring).

    Per-sequence methods (``has``, ``num_tokens``, ``truncate``, ``fork``, ``release``,
    ``cache_ids``) concern per-sequence *storage*: the contiguous layout's buffers. The
    paged store stores nothing per sequence (the block manager's owner does the block
    accounting): they report nothing and change nothing there.
    """

    layout: str
    backend: AttentionBackend
    geometry: Optional[KvGeometry]
    pool: Optional[PagedKvPool]
    supports_compiled_decode: bool

    def has(self, cache_id: Hashable) -> bool: ...

    def num_tokens(self, cache_id: Hashable) -> int: ...

    def prepare(self, items: Sequence[tuple[Hashable, Sequence[int]]],
                as_decode: Sequence[bool] = (), blocks: Optional[BatchBlocks] = None,
                ) -> tuple[list[KvPass], Callable[[], None]]: ...

    def metadata(self, kv_pass: KvPass, dtype: mx.Dtype) -> Any: ...

    def set_ropes(self, ropes: Sequence) -> None: ...

    def truncate(self, cache_id: Hashable, new_len: int) -> None: ...

    def fork(self, cache_id: Hashable, new_cache_id: Hashable) -> None: ...

    def release(self, cache_id: Hashable) -> None: ...

    def cache_ids(self) -> list: ...

    def state(self, cache_ids: Sequence[Hashable]) -> list: ...

    def used_bytes(self, block_manager: Optional[LayerGroupKvManager] = None) -> int: ...

    def allocated_bytes(self) -> int: ...


def _unknown(cache_id: Hashable) -> UnknownCacheError:
    return UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released")


def _nothing() -> None:
    """The paged store's ``undo``: it allocated nothing."""


class PagedKvStore:
    """The paged layout's storage: a :class:`PagedKvPool` (or a
    :class:`~mlx_ferrum.kv_cache.quantized.QuantizedPagedKvPool`) read and written by one
    attention backend at the slots and block tables it is handed.

    It allocates nothing and holds no block table: the block manager
    (:class:`LayerGroupKvManager`) belongs to the scheduler (or to the low-level
    :class:`~mlx_ferrum.executor.LlmExecutor`), built from :attr:`geometry`; each pass
    reads that step's :class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`.

    Args:
        geometry: the pool's :class:`~mlx_ferrum.kv_cache.block_tables.KvGeometry` (or a
            :class:`LayerGroupKvManager`, whose geometry is taken).
        pool: the per-layer K/V block pools (this store is their only holder).
        bytes_per_token: K+V bytes of one token over all layers.
        backend: the attention backend (default :class:`PagedAttentionBackend`), chosen
            once by the factory.
        metal_kernels: the runner's ``RuntimeConfig.metal_kernels``.

    Attributes:
        block_size, group_windows: from the geometry (the window of each layer group).
        layer_groups: each layer's group (all 0 with one group).
        ropes: the model's distinct table ropes, whose ``(cos, sin)`` tables the
            metadata carries (set by the runner with :meth:`set_ropes`).

    Raises:
        KvCacheError: a geometry of several groups whose layers are not the pool's.
    """

    layout = "paged"
    supports_compiled_decode = True

    def __init__(self, geometry, pool: PagedKvPool, bytes_per_token: int,
                 backend: Optional[AttentionBackend] = None, metal_kernels: Optional[bool] = None):
        num_layers = pool.num_layers if pool is not None else None
        if isinstance(geometry, LayerGroupKvManager):
            geometry = KvGeometry.of(geometry, num_layers)
        self.geometry: KvGeometry = geometry
        self.pool = pool
        self.bytes_per_token = bytes_per_token
        self.backend = backend if backend is not None else PagedAttentionBackend()
        self.metal_kernels = metal_kernels
        self.ropes: list = []
        self.block_size = geometry.block_size
        self.group_windows, layer_groups = layer_group_windows(geometry.layer_windows)
        num_layers = num_layers if num_layers is not None else len(layer_groups)
        if len(self.group_windows) == 1:
            self.layer_groups = [0] * num_layers
        elif len(layer_groups) == num_layers:
            self.layer_groups = list(layer_groups)
        else:
            raise KvCacheError(f"the block geometry groups {len(layer_groups)} layers and the pool has "
                               f"{num_layers}: build it from the model's layer windows")

    def set_ropes(self, ropes: Sequence) -> None:
        """The model's ropes with tables (one per distinct ``table_key`` is kept)."""
        seen: dict = {}
        for rope in ropes:
            seen.setdefault(rope.table_key, rope)
        self.ropes = list(seen.values())

    def has(self, cache_id: Hashable) -> bool:
        """False: the paged store keeps nothing per sequence (the block manager knows)."""
        return False

    def num_tokens(self, cache_id: Hashable) -> int:
        """Raises UnknownCacheError: the block manager, not the store, counts a sequence's tokens."""
        raise UnknownCacheError(f"the paged store keeps no per-sequence state ({cache_id!r}): "
                                "ask the block manager's owner (the scheduler, or LlmExecutor)")

    def prepare(self, items: Sequence[tuple[Hashable, Sequence[int]]],
                as_decode: Sequence[bool] = (), blocks: Optional[BatchBlocks] = None,
                ) -> tuple[list[KvPass], Callable[[], None]]:
        """Pack every item into one pass, decode tokens first, at the slots ``blocks`` gives.

        The store allocates nothing: the owner of the block manager (the scheduler, or the
        low-level executor adapter) appended the slots and hands over each row's slots and
        block tables (:class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`); the store
        makes the batch's copy-on-write copies in the pool and lays the pass out.

        Args:
            items: ``(cache_id, token ids)`` per sequence (only the counts are read).
            as_decode: per item, True to lay its ``n`` tokens out as ``n`` decode rows of
                one query each (the same block table, context lengths ``start + 1`` ..
                ``start + n``) instead of one prefill segment. Each token then attends to
                the cache up to itself, exactly as causal prefill attention would (every
                row's K/V is written before any row attends), so a speculative draft
                runs through the decode attention, and through the compiled decode step
                when the whole pass is decode rows, as vLLM runs drafts as multi-query decode.
            blocks: the step's rows, one per item's cache id, each with as many slots as
                the item has tokens.

        Returns:
            ``([KvPass], undo)``; ``undo`` does nothing (the block owner gives slots back).

        Raises:
            ExecutorError: ``blocks`` missing, or a row absent or of another token count.
        """
        if blocks is None:
            raise ExecutorError("the paged store allocates no blocks: pass the step's BatchBlocks "
                                "(the scheduler's SchedulerOutput.kv, or use LlmExecutor)")
        expand = [bool(as_decode[i]) if i < len(as_decode) else False for i in range(len(items))]
        # decode rows (one token, or expanded drafts) first, stable
        order = sorted(range(len(items)), key=lambda i: not (len(items[i][1]) == 1 or expand[i]))
        starts: list[int] = []
        group_slots: list[list[int]] = [[] for _ in self.group_windows]
        rows = []
        for i in order:
            cid, tokens = items[i]
            row = blocks.rows.get(cid)
            if row is None or row.num_tokens != len(tokens):
                raise ExecutorError(
                    f"cache {cid!r} brings {len(tokens)} tokens but the step's blocks hold "
                    f"{'no row' if row is None else f'{row.num_tokens} slots'} for it: allocate its slots first")
            for g, slots in enumerate(row.slots):
                group_slots[g].extend(slots)
            starts.append(row.start)
            rows.append(row)
        for g, pairs in enumerate(blocks.copies):
            if pairs:
                self.pool.copy_blocks(pairs, layers=[n for n, x in enumerate(self.layer_groups) if x == g])
                pairs.clear()  # made once, by the first pass that reads them
        lens = np.fromiter((len(items[i][1]) for i in order), dtype=np.int64, count=len(order))
        item_qsl = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=item_qsl[1:])
        starts_np = np.asarray(starts, dtype=np.int64)
        # position of packed token j: its sequence's start + (j - that sequence's first row)
        positions = np.arange(int(item_qsl[-1]), dtype=np.int64) - np.repeat(item_qsl[:-1] - starts_np, lens)
        # attention rows: one per item, or one per token of an expanded item
        if any(expand):
            expanded = np.fromiter((expand[i] for i in order), dtype=bool, count=len(order))
            row_item = np.repeat(np.arange(len(order), dtype=np.int64), np.where(expanded, lens, 1))
            row_lens = np.where(expanded[row_item], 1, lens[row_item])
        else:
            row_item, row_lens = np.arange(len(order), dtype=np.int64), lens
        qsl = np.zeros(len(row_lens) + 1, dtype=np.int64)
        np.cumsum(row_lens, out=qsl[1:])
        ctx_np = positions[qsl[1:] - 1] + 1  # each row attends up to its last token
        ctx = ctx_np.tolist()
        tables = [self._block_tables([row.block_tables[g] for row in rows]) for g in range(len(self.group_windows))]
        if len(row_item) != len(order):
            tables = [t[row_item] for t in tables]
        num_decode = int(np.sum(row_lens == 1))
        shared = [None] * len(tables)
        # decode rows come first, in item order: the last one's item counts the sequences
        if num_decode and int(row_item[num_decode - 1]) + 1 >= SHARED_PREFIX_MIN_SEQS:
            row_seqs = row_item[:num_decode] if len(row_item) != len(order) else None
            shared = [self.backend.shared_prefix(t[:num_decode], ctx_np[:num_decode], self.block_size,
                                                 self.metal_kernels, row_seqs=row_seqs)
                      if window is None else None for t, window in zip(tables, self.group_windows)]
        inputs = PagedPassInputs(
            positions=positions.astype(np.int32),
            context_lens=np.asarray(ctx, dtype=np.int32),
            query_start_loc=qsl.astype(np.int32),
            num_decode_seqs=num_decode,
            host_context_lens=ctx,
            host_query_start_loc=qsl.tolist(),
            slot_mappings=[np.asarray(gs, dtype=np.int32) for gs in group_slots],
            block_tables=tables,
            shared_prefixes=shared if any(x is not None for x in shared) else [],
        )
        decode_rows = num_decode if num_decode == int(item_qsl[-1]) else 0
        return [KvPass(order, 1, int(item_qsl[-1]), item_qsl[:-1].tolist(), inputs, packed=True,
                       decode_rows=decode_rows)], _nothing

    def metadata(self, kv_pass: KvPass, dtype: mx.Dtype) -> PagedMetadata:
        """The pass's complete :class:`~mlx_ferrum.layers.backends.PagedMetadata` (numpy
        inputs moved to the device; ``dtype``, the activation dtype, is unused here)."""
        f: PagedPassInputs = kv_pass.inputs
        return paged_metadata(
            self.backend, self.pool, mx.array(f.positions), mx.array(f.context_lens), f.num_decode_seqs,
            self.layer_groups, [mx.array(x) for x in f.slot_mappings], [mx.array(x) for x in f.block_tables],
            ropes=self.ropes, query_start_loc=mx.array(f.query_start_loc), host_context_lens=f.host_context_lens,
            host_query_start_loc=f.host_query_start_loc, metal_kernels=self.metal_kernels,
            shared_prefixes=[None if x is None else x.to_device() for x in f.shared_prefixes],
        )

    @staticmethod
    def _block_tables(tables: list) -> np.ndarray:
        """``[num_seqs, max_blocks]`` int32 from per-row block id lists, zero-padded; blocks
        freed outside a sliding window (-1) point at block 0, which attention never reads for them."""
        widths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        table_arr = np.zeros((len(tables), int(widths.max())), dtype=np.int32)
        if len(tables) <= 8:
            for r, t in enumerate(tables):
                table_arr[r, : len(t)] = t
        else:
            # one flat copy (row r's blocks fill its first widths[r] columns): a row at
            # a time costs about 2 us per row
            table_arr[np.arange(table_arr.shape[1])[None, :] < widths[:, None]] = np.fromiter(
                itertools.chain.from_iterable(tables), dtype=np.int32, count=int(widths.sum()))
        return np.maximum(table_arr, 0, out=table_arr)

    def truncate(self, cache_id: Hashable, new_len: int) -> None:
        """Nothing to do: a paged sequence's blocks are its block manager's to free."""

    def fork(self, cache_id: Hashable, new_cache_id: Hashable) -> None:
        """Raises ExecutorError: a paged fork shares blocks, which is the block manager's
        (``LayerGroupKvManager.fork``; ``LlmExecutor.fork_cache``)."""
        raise ExecutorError("a paged fork shares blocks: fork in the block manager (LlmExecutor.fork_cache)")

    def release(self, cache_id: Hashable) -> None:
        """Nothing to do: a paged sequence's blocks are its block manager's to free."""

    def cache_ids(self) -> list:
        """Empty: the paged store keeps nothing per sequence."""
        return []

    def state(self, cache_ids: Sequence[Hashable]) -> list:
        """The pool arrays (every pass writes them)."""
        return self.pool.arrays()

    def used_bytes(self, block_manager: Optional[LayerGroupKvManager] = None) -> int:
        """Bytes of the blocks ``block_manager`` holds in use, per layer group (each group's
        blocks cost only its layers); 0 without a manager."""
        if block_manager is None:
            return 0
        per_layer = self.bytes_per_token // len(self.layer_groups)
        return sum(g.allocator.num_in_use * self.block_size * self.layer_groups.count(gi) * per_layer
                   for gi, g in enumerate(block_manager.groups))

    def allocated_bytes(self) -> int:
        """Bytes of the whole pool (free blocks included)."""
        return self.pool.nbytes

    def metrics(self, block_manager: Optional[LayerGroupKvManager] = None) -> dict:
        """``block_manager``'s block metrics (when given), and the bytes as stored:
        ``kv_cache_dtype``, ``bytes_per_token`` (K+V of one token over all layers,
        quantized scales and biases included), ``allocated_bytes`` (the whole pool) and
        ``used_bytes`` (the blocks in use)."""
        blocks = block_manager.cache_metrics_snapshot() if block_manager is not None else {}
        return {**blocks, "kv_cache_dtype": self.backend.kv_cache_dtype,
                "bytes_per_token": self.bytes_per_token, "allocated_bytes": self.allocated_bytes(),
                "used_bytes": self.used_bytes(block_manager)}


class ContiguousKvStore:
    """The contiguous layout: per sequence, one :class:`ContiguousKvCache` per layer.

    Args:
        make_caches: builds a fresh per-layer cache list for a new sequence.
        bytes_per_token: K+V bytes of one token over all layers.
        backend: the attention backend (default :class:`ContiguousAttentionBackend`),
            chosen once by the factory.
    """

    layout = "contiguous"
    supports_compiled_decode = False
    geometry = None
    pool = None

    def __init__(self, make_caches: Callable[[], list[ContiguousKvCache]], bytes_per_token: int,
                 backend: Optional[AttentionBackend] = None):
        self.make_caches = make_caches
        self.bytes_per_token = bytes_per_token
        self.backend = backend if backend is not None else ContiguousAttentionBackend()
        self.caches: dict[Hashable, list[ContiguousKvCache]] = {}

    def set_ropes(self, ropes: Sequence) -> None:
        """Unused: contiguous passes rotate by each row's offset (``mx.fast.rope``), no tables."""

    def has(self, cache_id: Hashable) -> bool:
        """True when ``cache_id`` holds a cache."""
        return cache_id in self.caches

    def _get(self, cache_id: Hashable) -> list[ContiguousKvCache]:
        c = self.caches.get(cache_id)
        if c is None:
            raise _unknown(cache_id)
        return c

    def num_tokens(self, cache_id: Hashable) -> int:
        """Tokens stored (raises UnknownCacheError for an unknown id)."""
        return self._get(cache_id)[0].len

    def prepare(self, items: Sequence[tuple[Hashable, Sequence[int]]],
                as_decode: Sequence[bool] = (), blocks: Optional[BatchBlocks] = None,
                ) -> tuple[list[KvPass], Callable[[], None]]:
        """One pass per distinct new-token count; caches are created as needed. The K/V
        writes happen inside attention, so ``undo`` truncates back to these lengths."""
        groups: dict[int, list[int]] = {}
        for i, (_, tokens) in enumerate(items):
            groups.setdefault(len(tokens), []).append(i)
        touched: list[tuple[list[ContiguousKvCache], int]] = []
        created: list[Hashable] = []

        def undo() -> None:
            for caches, prev in touched:
                for layer in caches:
                    if layer.len > prev:
                        layer.truncate(prev)
            for cid in created:
                self.caches.pop(cid, None)

        passes = []
        try:
            for n, idxs in groups.items():
                caches = []
                for i in idxs:
                    cid = items[i][0]
                    if cid not in self.caches:
                        self.caches[cid] = self.make_caches()
                        created.append(cid)
                    caches.append(self.caches[cid])
                prev = [c[0].len for c in caches]
                touched.extend(zip(caches, prev))
                inputs = ContiguousPassInputs(np.asarray(prev, dtype=np.int32), caches, [p + n for p in prev])
                passes.append(KvPass(idxs, len(idxs), n, [j * n for j in range(len(idxs))], inputs))
        except BaseException:  # Ctrl-C too: no half-created caches stay behind
            undo()
            raise
        return passes, undo

    def metadata(self, kv_pass: KvPass, dtype: mx.Dtype) -> ContiguousMetadata:
        """The pass's :class:`~mlx_ferrum.layers.backends.ContiguousMetadata`: offsets on the
        device, the rows' caches, and the pad mask (in ``dtype``) for rows of different lengths."""
        f: ContiguousPassInputs = kv_pass.inputs
        return ContiguousMetadata(self.backend, mx.array(f.offsets), f.caches,
                                  contiguous_pad_mask(f.cache_lens_after, kv_pass.cols, dtype))

    def truncate(self, cache_id: Hashable, new_len: int) -> None:
        """Keep the first ``new_len`` tokens (their buffers stay allocated)."""
        for c in self._get(cache_id):
            c.truncate(new_len)

    def fork(self, cache_id: Hashable, new_cache_id: Hashable) -> None:
        """Copy ``cache_id``'s tokens into a new sequence (a quantized cache copies its codes)."""
        src = self._get(cache_id)
        dst = self.make_caches()
        for s, d in zip(src, dst):
            d.copy_from(s)
        self.caches[new_cache_id] = dst

    def release(self, cache_id: Hashable) -> None:
        """Drop the sequence's buffers; unknown ids are ignored."""
        self.caches.pop(cache_id, None)

    def cache_ids(self) -> list:
        """Every live cache id."""
        return list(self.caches)

    def state(self, cache_ids: Sequence[Hashable]) -> list:
        """The K/V buffers of the given sequences (every layer)."""
        out: list[Any] = []
        for cid in cache_ids:
            for layer in self.caches.get(cid, ()):
                out.extend(layer.arrays())
        return out

    def used_bytes(self, block_manager=None) -> int:
        """Bytes of every buffer's capacity (the contiguous layout holds what it allocates)."""
        return sum(c[0].capacity for c in self.caches.values()) * self.bytes_per_token

    def allocated_bytes(self) -> int:
        """Same as :meth:`used_bytes`."""
        return self.used_bytes()

    def metrics(self, block_manager=None) -> dict:
        """Sequences and bytes held (as stored: ``bytes_per_token`` over all layers, quantized
        scales and biases included)."""
        held = self.used_bytes()
        return {"num_sequences": len(self.caches), "kv_cache_dtype": self.backend.kv_cache_dtype,
                "bytes_per_token": self.bytes_per_token, "allocated_bytes": held, "used_bytes": held}
