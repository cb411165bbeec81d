"""KV cache layouts: contiguous per-sequence buffers, or one paged block pool.

- :class:`ContiguousKvCache`: ``[1, num_kv_heads, capacity, head_dim]`` per layer and sequence.
- :class:`PagedKvPool`: ``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer, shared.
- :class:`LayerGroupKvManager` (:mod:`.block_tables`): the paged block manager: one block
  table per layer group (full / sliding-window layers; one group when the layers do not
  differ), each group's tables a :class:`PagedKvCacheManager` over a
  :class:`BlockAllocator` (:mod:`.manager`: host-side bookkeeping of the pool).
- :func:`build_kv_store` (:mod:`.factory`): the one place a store's layout, attention
  backend, block manager and pool size are chosen, from a :class:`KvSpec`.
- :mod:`.block_tables` also holds what a paged pass reads of the block manager
  (:class:`KvGeometry`, :class:`RowBlocks`, :class:`BatchBlocks`) and the one allocation
  path (:func:`append_row`), used by the manager's owner: the scheduler, or the
  low-level executor adapter. The store never allocates.
"""

from .block_tables import BatchBlocks, KvGeometry, LayerGroupKvManager, RowBlocks, append_row
from .contiguous import ContiguousKvCache
from .factory import KvSpec, build_kv_store
from .manager import AppendResult, BlockAllocator, PagedKvCacheManager, SequenceBlocks
from .store import PagedKvPool, bytes_per_block, default_num_blocks

__all__ = [
    "AppendResult",
    "BlockAllocator",
    "BatchBlocks",
    "ContiguousKvCache",
    "KvGeometry",
    "KvSpec",
    "LayerGroupKvManager",
    "PagedKvCacheManager",
    "PagedKvPool",
    "RowBlocks",
    "SequenceBlocks",
    "append_row",
    "build_kv_store",
    "bytes_per_block",
    "default_num_blocks",
]
