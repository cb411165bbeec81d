"""PagedKvPool: the per-layer K and V block pools of the paged layout.

Each layer owns one ``k`` and one ``v`` array of shape
``[num_blocks, num_kv_heads, block_size, head_dim]`` in the model dtype, shared by
every sequence. Writes go through an MLX indexed update (``pool[idx] = new``), which
MLX performs in the pool's own buffer as long as the pool array has no other live
reference; so this object is the only holder of each pool and never hands out
pool arrays to be kept (``mx.fast.metal_kernel`` cannot write in place at all: its
outputs are always fresh arrays).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .. import config as config_module
from ..config import DEFAULT_KV_POOL_BYTES, available_memory_bytes, check_memory, device_info
from ..kernels.reference import slot_indices, write_kv_slots


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
