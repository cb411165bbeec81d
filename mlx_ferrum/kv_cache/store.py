"""The KV storage behind one interface: ``PagedKvStore`` (over the pool arrays,
``PagedKvPool``) and ``ContiguousKvStore`` (per-sequence buffers).

A store holds the K/V arrays and the operations on them; how a pass lays out its rows
and the attention metadata it gets are the runner's
(:mod:`mlx_ferrum.runner.inputs`), and the block accounting is the block
manager's owner's (the scheduler). A store:

- ``prepare(cache_ids, blocks)``: readies the storage a pass writes and returns an ``undo``
  that restores it if the pass fails: the paged store makes the step's copy-on-write
  block copies in the pool (it allocates nothing); the contiguous store creates the
  buffers of new sequences (that is storage, not block accounting);
- ``truncate``, ``fork``, ``release``: per-sequence storage operations (contiguous
  buffers; nothing to do for the paged pool);
- ``used_bytes`` / ``allocated_bytes``: KV memory in bytes;
- ``state(cache_ids)``: the arrays a pass writes, for the caller to evaluate.

The pool keeps the only reference to each of its arrays: writes go through an MLX
indexed update (``pool[idx] = new``), which MLX performs in the pool's own buffer only
while the array has no other live reference (``mx.fast.metal_kernel`` cannot write in
place at all: its outputs are always fresh arrays).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Protocol, Sequence

import mlx.core as mx

from .. import config as config_module
from ..config import DEFAULT_KV_POOL_BYTES, available_memory_bytes, check_memory, device_info
from ..errors import ExecutorError, KvCacheError, UnknownCacheError
from ..kernels.reference import slot_indices, write_kv_slots
from ..layers.attention import AttentionBackend, ContiguousAttentionBackend, PagedAttentionBackend
from .block_tables import BatchBlocks, KvGeometry, LayerGroupKvManager, layer_group_windows
from .contiguous import ContiguousKvCache


class PagedKvPool:
    """K/V block pools of all layers.

    Args:
        num_layers, num_blocks, num_kv_heads, block_size, head_dim: the pool shape.
        dtype: the model's dtype.

    Attributes:
        k, v: lists (one entry per layer) of ``[num_blocks, num_kv_heads, block_size, head_dim]``.
    """

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype):
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        check_pool_fits(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype)
        self.shape = shape
        self.dtype = dtype
        self.k = [mx.zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    def arrays(self) -> list[mx.array]:
        """Every pool array, flat: the K pools of all layers, then the V pools."""
        return self.k + self.v

    def with_arrays(self, arrays: list) -> "PagedKvPool":
        """A pool object of the same shape over other arrays (:meth:`arrays`' order).

        A compiled decode step (``mx.compile``) gets the pools as inputs and returns the
        written pools as outputs; attention writes through this view, so the real pool
        is rebound to the outputs (:meth:`set_arrays`) only once the step has been built.
        """
        view = object.__new__(PagedKvPool)
        view.shape, view.dtype = self.shape, self.dtype
        view.set_arrays(arrays)
        return view

    def set_arrays(self, arrays: list) -> None:
        """Rebind this pool to ``arrays`` (:meth:`arrays`' order), e.g. a compiled step's outputs."""
        arrays = list(arrays)
        half = len(arrays) // 2
        self.k, self.v = arrays[:half], arrays[half:]

    @property
    def num_layers(self) -> int:
        """Layers (one K and one V pool each)."""
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer pool."""
        return self.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V pools."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def write(self, layer: int, slot_mapping: mx.array, k: mx.array, v: mx.array, indices=None) -> None:
        """Store ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``.

        ``indices``: :meth:`slot_indices` of ``slot_mapping``, to reuse across layers.
        """
        if indices is None:
            indices = self.slot_indices(slot_mapping)
        write_kv_slots(self.k[layer], slot_mapping, k, indices=indices)
        write_kv_slots(self.v[layer], slot_mapping, v, indices=indices)

    def slot_indices(self, slot_mapping: mx.array):
        """Index arrays addressing ``slot_mapping`` in this pool (see ``kernels.reference.slot_indices``)."""
        return slot_indices(slot_mapping, self.shape[1], self.shape[2])

    def copy_blocks(self, copies: list[tuple[int, int]], layers=None) -> None:
        """Copy whole blocks ``src -> dst`` in every layer, or in ``layers`` (a list of
        layer indices: one layer group's), for copy-on-write of shared blocks."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        if layers is None:
            pools = self.k + self.v
        else:
            pools = [self.k[i] for i in layers] + [self.v[i] for i in layers]
        # Evaluate the gathers first: a pending read of a pool would make the scatter
        # below copy the whole pool instead of updating it in place (docs/benchmarks.md, "Pool writes stay in place").
        blocks = [p[src] for p in pools]
        mx.eval(blocks)
        for p, b in zip(pools, blocks):
            p[dst] = b


#: Host bytes the block bookkeeping costs per block (``BlockAllocator``'s reference
#: count list slot, free-list slot and int object), counted with the pool so that a
#: huge block count is refused before those Python lists are built.
HOST_BYTES_PER_BLOCK = 64


def check_pool_fits(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype, extra_blocks: int = 0) -> None:
    """Refuse a paged pool of ``num_blocks`` (+ ``extra_blocks`` the owner adds, such as
    the executor's scratch block) blocks that free memory cannot hold, before anything
    (device pool or host bookkeeping) is allocated.

    Raises:
        InsufficientMemoryError: names ``FERRUM_KV_MAX_BLOCKS`` / ``--max-num-blocks``,
            the bytes asked for and free, and the most blocks that fit.
    """
    per = bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, dtype) + HOST_BYTES_PER_BLOCK
    fits = max(0, config_module.available_memory_bytes() // per - extra_blocks)
    check_memory(
        (num_blocks + extra_blocks) * per,
        f"a paged KV pool of {num_blocks} blocks (FERRUM_KV_MAX_BLOCKS / --max-num-blocks / "
        f"RuntimeConfig.max_num_blocks; {per} bytes per block)",
        f"set it to at most {fits} blocks, or leave it unset to size the pool from FERRUM_PAGED_MAX_SEQS",
    )


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype) -> int:
    """Bytes one block id costs across all layers, K and V together."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.size


def default_num_blocks(
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype,
    weight_bytes: int,
    memory_fraction: float,
    max_num_seqs: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    block_bytes: Optional[int] = None,
) -> int:
    """Blocks to give the pool when ``FERRUM_KV_MAX_BLOCKS`` is unset.

    What the engine can use: ``max_num_seqs`` sequences of ``max_seq_len`` tokens each
    (when both are given), capped by a memory budget: on a Mac
    ``memory_fraction * (max_recommended_working_set_size - weight_bytes)``; elsewhere
    ``memory_fraction * (available memory - weight_bytes)``, at most
    ``DEFAULT_KV_POOL_BYTES`` (1 GiB). At least 16 blocks. ``block_bytes``: what one
    block costs over all layers when it is not the model dtype's K+V (a quantized pool's
    codes, scales and biases); None: :func:`bytes_per_block`.
    """
    per = block_bytes if block_bytes is not None else bytes_per_block(num_layers, num_kv_heads, block_size,
                                                                      head_dim, dtype)
    budget = DEFAULT_KV_POOL_BYTES
    try:
        if mx.metal.is_available():
            ws = int(device_info()["max_recommended_working_set_size"])
            budget = int(memory_fraction * max(0, ws - weight_bytes))
        else:
            budget = min(budget, int(memory_fraction * max(0, available_memory_bytes() - weight_bytes)))
    except Exception:  # noqa: BLE001 - device_info is best effort; fall back to the default
        pass
    blocks = budget // per
    if max_num_seqs is not None and max_seq_len is not None:
        blocks = min(blocks, max_num_seqs * -(-max_seq_len // block_size))
    return max(16, blocks)


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

    def prepare(self, cache_ids: Sequence[Hashable], blocks: Optional[BatchBlocks] = None) -> Callable[[], None]: ...

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
    attention backend at the slots and block tables the runner's pass builder
    (:mod:`mlx_ferrum.runner.inputs`) reads from the block manager's owner; the store
    makes the copy-on-write copies it is handed.

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

    Attributes:
        block_size, group_windows: from the geometry (the window of each layer group).
        layer_groups: each layer's group (all 0 with one group).

    Raises:
        KvCacheError: a geometry of several groups whose layers are not the pool's.
    """

    layout = "paged"
    supports_compiled_decode = True

    def __init__(self, geometry, pool: PagedKvPool, bytes_per_token: int,
                 backend: Optional[AttentionBackend] = None):
        num_layers = pool.num_layers if pool is not None else None
        if isinstance(geometry, LayerGroupKvManager):
            geometry = KvGeometry.of(geometry, num_layers)
        self.geometry: KvGeometry = geometry
        self.pool = pool
        self.bytes_per_token = bytes_per_token
        self.backend = backend if backend is not None else PagedAttentionBackend()
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

    def has(self, cache_id: Hashable) -> bool:
        """False: the paged store keeps nothing per sequence (the block manager knows)."""
        return False

    def num_tokens(self, cache_id: Hashable) -> int:
        """Raises UnknownCacheError: the block manager, not the store, counts a sequence's tokens."""
        raise UnknownCacheError(f"the paged store keeps no per-sequence state ({cache_id!r}): "
                                "ask the block manager's owner (the scheduler, or LlmExecutor)")

    def prepare(self, cache_ids: Sequence[Hashable], blocks: Optional[BatchBlocks] = None) -> Callable[[], None]:
        """Make the step's copy-on-write block copies (``blocks.copies``: per layer group,
        ``(src, dst)`` block pairs the block manager's owner planned) in the pool, in that
        group's layers; each list is emptied, so the copies are made once. The store
        allocates nothing: ``cache_ids`` are unused (the rows' slots are in ``blocks``).

        Returns:
            ``undo``, which does nothing (the block owner gives the slots back).

        Raises:
            ExecutorError: ``blocks`` missing.
        """
        if blocks is None:
            raise ExecutorError("the paged store allocates no blocks: pass the step's BatchBlocks "
                                "(the scheduler's SchedulerOutput.kv, or use LlmExecutor)")
        for g, pairs in enumerate(blocks.copies):
            if pairs:
                self.pool.copy_blocks(pairs, layers=[n for n, x in enumerate(self.layer_groups) if x == g])
                pairs.clear()  # made once, by the first pass that reads them
        return _nothing

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
        quantized scales and biases included), ``allocated_bytes`` (the whole pool, float
        windows included), ``used_bytes`` (the blocks in use) and ``float_window_bytes``
        (an int4 pool's float windows, one slot per running sequence; 0 without)."""
        blocks = block_manager.cache_metrics_snapshot() if block_manager is not None else {}
        return {**blocks, "kv_cache_dtype": self.backend.kv_cache_dtype,
                "bytes_per_token": self.bytes_per_token, "allocated_bytes": self.allocated_bytes(),
                "used_bytes": self.used_bytes(block_manager),
                "float_window_bytes": getattr(self.pool, "float_window_bytes", 0)}


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

    def prepare(self, cache_ids: Sequence[Hashable], blocks: Optional[BatchBlocks] = None) -> Callable[[], None]:
        """Create the caches of ``cache_ids`` that do not exist (``blocks`` is unused). The
        K/V writes happen inside attention, so the returned ``undo`` truncates every cache
        back to its length now and drops the caches created here."""
        touched: list[tuple[list[ContiguousKvCache], int]] = []
        created: list[Hashable] = []

        def undo() -> None:
            for caches, prev in touched:
                for layer in caches:
                    if layer.len > prev:
                        layer.truncate(prev)
            for cid in created:
                self.caches.pop(cid, None)

        try:
            for cid in cache_ids:
                if cid not in self.caches:
                    self.caches[cid] = self.make_caches()
                    created.append(cid)
                caches = self.caches[cid]
                touched.append((caches, caches[0].len))
        except BaseException:  # Ctrl-C too: no half-created caches stay behind
            undo()
            raise
        return undo

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
