"""What a paged forward pass reads of the block manager: geometry, per-row slots and tables.

Ownership follows vLLM's block manager (Kwon et al., SOSP 2023) and nano-vllm: the
*scheduler* owns the :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` (block tables,
reference counts, prefix hashes) and allocates a step's slots while it schedules; the
runner's :class:`~mlx_ferrum.kv_cache.store.PagedKvStore` holds only the pool arrays and
reads the tables it is handed. Three things travel between them:

- :class:`KvGeometry`: what the store reports about its pool (blocks, block size, layer
  groups and their windows), from which the owner builds its block manager
  (:meth:`KvGeometry.new_block_manager`);
- :class:`RowBlocks`: one sequence's share of a step: where its new tokens go (``slots``,
  per layer group) and its block table (per group);
- :class:`BatchBlocks`: every row of a step by cache id, with the copy-on-write block
  copies the pool must make before the step writes.

:func:`append_row` is the one allocation path (the scheduler's and the low-level
executor adapter's): it appends slots in the manager and records them in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from .layer_groups import LayerGroupKvManager


@dataclass(frozen=True)
class KvGeometry:
    """A paged pool's shape, as its store reports it to the owner of the block manager.

    Attributes:
        num_blocks: blocks the manager may hand out (the pool has one more: the scratch
            block, id ``num_blocks``, that pad rows of a compiled decode step write).
        block_size: tokens per block.
        max_blocks_per_seq: longest block table (``ceil(kv_capacity / block_size)``).
        layer_windows: each layer's sliding window (None: full attention); layers are
            grouped by window (:func:`~mlx_ferrum.kv_cache.layer_groups.layer_group_windows`).
        prefix_cache: whether full blocks are shared by hash chain.
    """

    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    layer_windows: tuple = (None,)
    prefix_cache: bool = False

    @classmethod
    def of(cls, manager: LayerGroupKvManager, num_layers: Optional[int] = None) -> "KvGeometry":
        """The geometry of an existing manager (``num_layers`` layers when it has one group)."""
        if len(manager.groups) == 1 and num_layers is not None:
            windows = (manager.group_windows[0],) * num_layers
        else:
            windows = tuple(manager.group_windows[g] for g in manager.layer_groups)
        return cls(manager.num_blocks, manager.block_size, manager.max_blocks_per_seq, windows,
                   manager.prefix_cache)

    def new_block_manager(self) -> LayerGroupKvManager:
        """A fresh, empty :class:`LayerGroupKvManager` over this geometry (host lists only)."""
        return LayerGroupKvManager(self.num_blocks, self.block_size, self.max_blocks_per_seq,
                                   list(self.layer_windows) or [None], prefix_cache=self.prefix_cache)


@dataclass
class RowBlocks:
    """One sequence's blocks for one step.

    Attributes:
        start: tokens stored before this step's tokens (the position of the first new token).
        slots: per layer group, one slot index (``block_id * block_size + offset``, int)
            per new token, in order.
        block_tables: per layer group, the sequence's physical block ids in logical order
            (:data:`~mlx_ferrum.kv_cache.manager.FREED_BLOCK` for blocks freed outside a
            sliding window). These are the manager's own lists: read them, never change
            them; they stay valid until the owner's next allocation.
    """

    start: int
    slots: list
    block_tables: list

    @property
    def num_tokens(self) -> int:
        """New tokens this row writes (``len(slots[0])``)."""
        return len(self.slots[0])

    @property
    def context_len(self) -> int:
        """Tokens stored once this step's are written (``start + num_tokens``)."""
        return self.start + len(self.slots[0])


@dataclass
class BatchBlocks:
    """Every row's blocks for one step, and the copies to make first.

    Attributes:
        rows: cache id -> :class:`RowBlocks`.
        copies: per layer group, ``(src_block, dst_block)`` pairs the pool copies before
            the step writes (copy-on-write of a shared partial block).
    """

    rows: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)


def append_row(manager: LayerGroupKvManager, batch: BatchBlocks, cache_id: Hashable,
               num_tokens: int, key_ids: Optional[Sequence[int]] = None) -> RowBlocks:
    """Allocate ``num_tokens`` new slots of ``cache_id`` (created when absent) and record
    them in ``batch`` (a second call for the same id in one batch extends its row).

    Args:
        manager: the block manager (its owner calls this; nothing else changes it).
        batch: the step's :class:`BatchBlocks`.
        num_tokens: tokens to append (> 0).
        key_ids: with prefix caching, the new tokens' ids as the prefix cache keys them
            (``UNKNOWN_TOKEN`` for ids not known yet); None without prefix caching.

    Returns:
        The row (``batch.rows[cache_id]``).

    Raises:
        KvCacheExhaustedError: the pool or the sequence's capacity cannot hold them
            (nothing changes then).
    """
    groups = manager.groups
    seq = groups[0].seqs.get(cache_id)  # token counts are the same in every group
    created = seq is None
    if created:
        manager.create(cache_id)
        seq = groups[0].seqs[cache_id]
    start = seq.num_tokens
    try:
        results = manager.append_slots(cache_id, num_tokens, key_ids if manager.prefix_cache else None)
    except BaseException:
        if created:
            manager.release(cache_id)
        raise
    row = batch.rows.get(cache_id)
    if row is None:
        if len(groups) == 1:  # the common case, per row and step
            row = RowBlocks(start, [results[0].slots], [seq.block_ids])
        else:
            row = RowBlocks(start, [r.slots for r in results], [g.seqs[cache_id].block_ids for g in groups])
        batch.rows[cache_id] = row
    else:
        for slots, r in zip(row.slots, results):
            slots.extend(r.slots)
    for g, r in enumerate(results):
        if r.copies:
            if not batch.copies:
                batch.copies = [[] for _ in groups]
            batch.copies[g].extend(r.copies)
    return row


def shrink_row(manager: LayerGroupKvManager, batch: BatchBlocks, cache_id: Hashable, num_tokens: int) -> None:
    """Keep only the first ``num_tokens`` of a row's new slots (the rest are given back:
    lookahead slots a draft did not use). A no-op for an id without a row.

    Raises:
        KvCacheError: ``num_tokens`` above the row's.
    """
    row = batch.rows.get(cache_id)
    if row is None or num_tokens == row.num_tokens:
        return
    manager.truncate(cache_id, row.start + num_tokens)
    for slots in row.slots:
        del slots[num_tokens:]


def undo_rows(manager: LayerGroupKvManager, batch: BatchBlocks) -> None:
    """Give back every slot ``batch`` appended (a step that did not run): each row's cache
    is cut back to its ``start`` tokens. Rows whose cache was released meanwhile are skipped."""
    for cache_id, row in batch.rows.items():
        if manager.has(cache_id) and manager.num_tokens(cache_id) >= row.start:
            manager.truncate(cache_id, row.start)
