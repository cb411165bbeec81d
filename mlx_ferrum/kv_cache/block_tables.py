"""The paged layout's block manager and what a forward pass reads of it.

The manager. :class:`LayerGroupKvManager` keeps one block table per layer group. Every
paged store uses it; a model whose layers all share one window (or none) has one
group. Gemma 3 (5 sliding layers per global one) and gpt-oss (alternating) cannot free a
block while any full-attention layer still reads it, yet their sliding layers need
only the last ``window`` tokens. As in vLLM's hybrid KV cache manager, layers are
grouped by window (:func:`layer_group_windows`) and each group keeps its own block
tables over its own block ids (one :class:`~mlx_ferrum.kv_cache.PagedKvCacheManager`
per group): the full group holds every block of a sequence, a sliding group only the
blocks its window covers. KV bytes held are counted per group: blocks in use times the
bytes a block costs in that group's layers. The pool itself
(:class:`~mlx_ferrum.kv_cache.PagedKvPool`) keeps one array per layer; a layer's block
ids are those of its group, so the groups never share a slot. Every group's pool has
the same number of blocks. Sequence-level questions (tokens stored, whether ``n`` more
tokens fit, blocks free) are answered for all groups together.

What travels. Ownership follows vLLM's block manager (Kwon et al., SOSP 2023) and
nano-vllm: the *scheduler* owns the :class:`LayerGroupKvManager` (block tables,
reference counts, prefix hashes) and allocates a step's slots while it schedules (the
low-level executor adapter does, where there is no scheduler); the runner's
:class:`~mlx_ferrum.kv_cache.store.PagedKvStore` holds only the pool arrays (it makes the
copy-on-write copies it is handed) and its pass builder reads the slots and tables. Three things travel between them:

- :class:`KvGeometry`: what the store reports about its pool (blocks, block size, layer
  groups and their windows), from which the owner builds its block manager
  (:meth:`KvGeometry.new_block_manager`);
- :class:`RowBlocks`: one sequence's share of a step: where its new tokens go (``slots``,
  per layer group) and its block table (per group);
- :class:`BatchBlocks`: every row of a step by cache id, with the copy-on-write block
  copies the pool must make before the step writes.

:func:`append_row` is the one allocation path (the scheduler's and the low-level
executor adapter's): it appends slots in the manager and records them in a batch;
:func:`shrink_row` and :func:`undo_rows` give slots back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from .manager import AppendResult, PagedKvCacheManager, SequenceBlocks


# ---------------------------------------------------------------------------- the manager
def layer_group_windows(layer_windows: Sequence[Optional[int]]) -> tuple[list[Optional[int]], list[int]]:
    """Group layers by window: ``(window of each group, group of each layer)``.

    Full attention (None) comes first, then windows in increasing size.
    """
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    return windows, [windows.index(w) for w in layer_windows]


class LayerGroupKvManager:
    """Block tables of many sequences, one table per layer group.

    Args:
        num_blocks: blocks in each group's pool.
        block_size: tokens per block.
        max_blocks_per_seq: longest block table a sequence may have.
        layer_windows: the sliding window of each layer (None: full attention); the
            default, one full-attention layer, gives one group (every layer of a model
            without windows can share it).
        prefix_cache: share full blocks across sequences by hash chain, per group.
        window_slots: float-window slots of a quantized pool
            (:mod:`~mlx_ferrum.kernels.float_window`): each sequence takes one while it
            holds blocks (0: the pool keeps no float window).
        float_window, window_lookahead: the pool's float window and lookahead in tokens
            (a cut longer than ``window_lookahead + 1`` tokens moves the window start).

    Attributes:
        groups: one :class:`PagedKvCacheManager` per group (``sliding_window`` set for
            the sliding groups, so they free blocks outside their window).
        layer_groups: ``layer_groups[layer]`` is the layer's group index.
        group_windows: the window of each group.
        windows: cache id -> ``[window slot, window start]``: the sequence's float-window
            slot (-1 when all were taken: its attention then reads codes only) and its
            first position with a float entry (the positions before it came from the
            prefix cache or a fork, as codes).

    Raises (from its methods): as :class:`PagedKvCacheManager`; an append that does
    not fit in every group changes nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        layer_windows: Sequence[Optional[int]] = (None,),
        prefix_cache: bool = False,
        window_slots: int = 0,
        float_window: int = 0,
        window_lookahead: int = 0,
    ):
        self.group_windows, self.layer_groups = layer_group_windows(layer_windows)
        self.window_slots = window_slots
        self.float_window, self.window_lookahead = float_window, window_lookahead
        self._free_window_slots = list(range(window_slots - 1, -1, -1))
        self.windows: dict[Hashable, list[int]] = {}
        self.groups = [
            PagedKvCacheManager(num_blocks, block_size, max_blocks_per_seq, prefix_cache, sliding_window=w)
            for w in self.group_windows
        ]
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.prefix_cache = prefix_cache

    @property
    def num_blocks(self) -> int:
        """Blocks in each group's pool."""
        return self.groups[0].num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a new sequence can take: a sequence fits when it fits in every group,
        so this is the smallest group's free count."""
        if len(self.groups) == 1:  # the common case, asked per sequence and step
            return self.groups[0].allocator.num_free
        return min(g.allocator.num_free for g in self.groups)

    @property
    def num_in_use(self) -> int:
        """Blocks in use summed over the groups (each costs only its group's layers)."""
        return sum(g.allocator.num_in_use for g in self.groups)

    @property
    def peak_in_use(self) -> int:
        """The groups' peak blocks in use, summed."""
        return sum(g.allocator.peak_in_use for g in self.groups)

    @property
    def seqs(self) -> dict[Hashable, SequenceBlocks]:
        """Group 0's sequences (token counts are the same in every group)."""
        return self.groups[0].seqs

    def _seq(self, cache_id: Hashable) -> SequenceBlocks:
        return self.groups[0]._seq(cache_id)

    def has(self, cache_id: Hashable) -> bool:
        """True when ``cache_id`` holds block tables."""
        return self.groups[0].has(cache_id)

    def create(self, cache_id: Hashable) -> None:
        """Start an empty sequence in every group (KvCacheError: it exists); it takes a
        free float-window slot when the pool has them."""
        for g in self.groups:
            g.create(cache_id)
        if self.window_slots:
            self.windows[cache_id] = [self._free_window_slots.pop() if self._free_window_slots else -1, 0]

    def window_of(self, cache_id: Hashable) -> tuple[int, int]:
        """``(window slot, window start)`` of ``cache_id`` (``(-1, 0)`` without float windows)."""
        w = self.windows.get(cache_id)
        return (w[0], w[1]) if w is not None else (-1, 0)

    def num_tokens(self, cache_id: Hashable) -> int:
        """Tokens stored for ``cache_id`` (the same in every group)."""
        return self.groups[0].num_tokens(cache_id)

    def block_table(self, cache_id: Hashable, group: int = 0) -> list[int]:
        """Physical block ids of ``cache_id`` in ``group`` (a copy)."""
        return self.groups[group].block_table(cache_id)

    def blocks_needed(self, cache_id: Optional[Hashable], n: int) -> int:
        """The most new blocks any one group needs for ``n`` more tokens."""
        if len(self.groups) == 1:  # the common case, called per sequence and step
            return self.groups[0].blocks_needed(cache_id, n)
        return max(g.blocks_needed(cache_id, n) for g in self.groups)

    def can_append(self, cache_id: Optional[Hashable], n: int) -> bool:
        """True when ``n`` more tokens fit in every group."""
        return all(g.can_append(cache_id, n) for g in self.groups)

    def append_slots(self, cache_id: Hashable, n: int, token_ids: Optional[Sequence[int]] = None) -> list[AppendResult]:
        """Reserve slots for ``n`` new tokens in every group (all groups or none).

        Returns:
            One :class:`AppendResult` (slots, copy-on-write pairs) per group.

        Raises:
            KvCacheExhaustedError: some group cannot hold them; no group changed.
        """
        if len(self.groups) == 1:  # the common case, per sequence and step: nothing to roll back
            return [self.groups[0].append_slots(cache_id, n, token_ids)]
        before = self.num_tokens(cache_id)
        results: list[AppendResult] = []
        try:
            for g in self.groups:
                results.append(g.append_slots(cache_id, n, token_ids))
        except Exception:
            for g in self.groups[: len(results)]:
                g.truncate(cache_id, before)
            raise
        return results

    def set_token_ids(self, cache_id: Hashable, start: int, token_ids: Sequence[int]) -> None:
        """:meth:`PagedKvCacheManager.set_token_ids` in every group."""
        for g in self.groups:
            g.set_token_ids(cache_id, start, token_ids)

    def trim_to_window(self, cache_id: Hashable) -> None:
        """Free, in each sliding group, the blocks outside the next token's window."""
        for g in self.groups:
            g.trim_to_window(cache_id)

    def truncate(self, cache_id: Hashable, new_len: int, written: bool = True) -> None:
        """Keep the first ``new_len`` tokens in every group (checked in all groups first);
        ``written`` as in :meth:`PagedKvCacheManager.truncate`.

        Raises:
            KvCacheError: see :meth:`PagedKvCacheManager.check_truncate`; nothing changed.
        """
        for g in self.groups:
            g.check_truncate(cache_id, new_len)
        old_len = self.num_tokens(cache_id)
        for g in self.groups:
            g.truncate(cache_id, new_len, written)
        w = self.windows.get(cache_id)
        if w is not None:
            w[1] = window_start_after_cut(w[1], old_len, new_len, self.float_window, self.window_lookahead)

    def release(self, cache_id: Hashable, keep_cached: bool = True) -> None:
        """Free every block of ``cache_id`` in every group (UnknownCacheError: unknown id);
        ``keep_cached`` as in :meth:`PagedKvCacheManager.release`."""
        for g in self.groups:
            g.release(cache_id, keep_cached)
        w = self.windows.pop(cache_id, None)
        if w is not None and w[0] >= 0:
            self._free_window_slots.append(w[0])

    def fork(self, cache_id: Hashable, new_cache_id: Hashable) -> None:
        """Share all of ``cache_id``'s blocks with ``new_cache_id`` in every group (copy-on-write)."""
        for g in self.groups:
            g.fork(cache_id, new_cache_id)
        if self.window_slots:
            # the shared tokens come as codes: the copy's float entries start after them
            slot = self._free_window_slots.pop() if self._free_window_slots else -1
            self.windows[new_cache_id] = [slot, self.num_tokens(new_cache_id)]

    def longest_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens :meth:`match_prefix` would reuse: the shortest group's cached prefix
        (read-only; see :meth:`PagedKvCacheManager.longest_cached_prefix`)."""
        return min(g.longest_cached_prefix(token_ids) for g in self.groups)

    def match_prefix(self, cache_id: Hashable, token_ids: Sequence[int], max_tokens: Optional[int] = None) -> int:
        """Share cached prefix blocks in every group; the shortest group match wins (at
        most ``max_tokens``), and the longer groups give their extra blocks back.

        Raises:
            KvCacheError: ``cache_id`` is not empty.
        """
        hits = [g.match_prefix(cache_id, token_ids) for g in self.groups]
        common = min(hits)
        if max_tokens is not None:
            common = min(common, max(0, max_tokens) // self.block_size * self.block_size)
        for g, hit in zip(self.groups, hits):
            if hit > common:
                g.truncate(cache_id, common)
        w = self.windows.get(cache_id)
        if w is not None:
            w[1] = common  # the reused tokens come as codes
        return common

    def bytes_held(self, bytes_per_token_per_layer: int) -> int:
        """KV bytes held by all sequences: per group, blocks in use x block_size x
        that group's layer count x ``bytes_per_token_per_layer`` (K and V together)."""
        total = 0
        for gi, g in enumerate(self.groups):
            layers = self.layer_groups.count(gi)
            total += g.allocator.num_in_use * self.block_size * layers * bytes_per_token_per_layer
        return total

    def cache_metrics_snapshot(self) -> dict:
        """Group 0's metrics; with several groups also ``used_blocks`` per group under
        ``group_used_blocks`` and each group's window under ``group_windows``."""
        snap = self.groups[0].cache_metrics_snapshot()
        if len(self.groups) == 1:
            return snap
        snap["group_used_blocks"] = [g.allocator.num_in_use for g in self.groups]
        snap["group_windows"] = list(self.group_windows)
        return snap

    def check_invariants(self) -> None:
        """Assert every group's reference counts balance (for tests)."""
        for g in self.groups:
            g.check_invariants()


def window_start_after_cut(window_start: int, old_len: int, new_len: int, float_window: int, lookahead: int) -> int:
    """A sequence's first position with a trusted float entry once it is cut from
    ``old_len`` to ``new_len`` tokens.

    The positions from ``new_len`` on are written anew before any query reads them. But
    the dropped positions overwrote the ring entries of the positions ``ring`` before
    them (``ring = float_window + lookahead``): a cut of at most ``lookahead + 1`` tokens
    (a rejected draft) only overwrote positions no later query's window reaches; a longer
    one may have, so the window then starts past them and those positions are read from
    the codes.
    """
    start = min(window_start, new_len)
    if old_len - new_len > lookahead + 1:
        start = max(start, min(old_len - (float_window + lookahead), new_len))
    return start


# ---------------------------------------------------------------------------- what a pass reads
@dataclass(frozen=True)
class KvGeometry:
    """A paged pool's shape, as its store reports it to the owner of the block manager.

    Attributes:
        num_blocks: blocks the manager may hand out (the pool has one more: the scratch
            block, id ``num_blocks``, that pad rows of a compiled decode step write).
        block_size: tokens per block.
        max_blocks_per_seq: longest block table (``ceil(kv_capacity / block_size)``).
        layer_windows: each layer's sliding window (None: full attention); layers are
            grouped by window (:func:`layer_group_windows`).
        prefix_cache: whether full blocks are shared by hash chain.
        window_slots: float-window slots of a quantized pool (0: none).
        float_window, window_lookahead: that pool's float window and lookahead in tokens.
    """

    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    layer_windows: tuple = (None,)
    prefix_cache: bool = False
    window_slots: int = 0
    float_window: int = 0
    window_lookahead: int = 0

    @classmethod
    def of(cls, manager: LayerGroupKvManager, num_layers: Optional[int] = None) -> "KvGeometry":
        """The geometry of an existing manager (``num_layers`` layers when it has one group)."""
        if len(manager.groups) == 1 and num_layers is not None:
            windows = (manager.group_windows[0],) * num_layers
        else:
            windows = tuple(manager.group_windows[g] for g in manager.layer_groups)
        return cls(manager.num_blocks, manager.block_size, manager.max_blocks_per_seq, windows,
                   manager.prefix_cache, manager.window_slots, manager.float_window, manager.window_lookahead)

    def new_block_manager(self) -> LayerGroupKvManager:
        """A fresh, empty :class:`LayerGroupKvManager` over this geometry (host lists only)."""
        return LayerGroupKvManager(self.num_blocks, self.block_size, self.max_blocks_per_seq,
                                   list(self.layer_windows) or [None], prefix_cache=self.prefix_cache,
                                   window_slots=self.window_slots, float_window=self.float_window,
                                   window_lookahead=self.window_lookahead)


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
        window_slot, window_start: the sequence's float-window slot and first position
            with a float entry (:attr:`LayerGroupKvManager.windows`; -1 and 0 without).
    """

    start: int
    slots: list
    block_tables: list
    window_slot: int = -1
    window_start: int = 0

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
        if manager.window_slots:
            row.window_slot, row.window_start = manager.window_of(cache_id)
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
    manager.truncate(cache_id, row.start + num_tokens, written=False)
    for slots in row.slots:
        del slots[num_tokens:]


def undo_rows(manager: LayerGroupKvManager, batch: BatchBlocks, cache_ids: Optional[Sequence[Hashable]] = None) -> None:
    """Give back every slot ``batch`` appended (a step that did not run), or only the rows
    of ``cache_ids``: each row's cache is cut back to its ``start`` tokens, and the blocks
    that held the given-back slots leave the prefix cache (their keys were registered at
    append; their KV was never written). Rows whose cache was released meanwhile are skipped."""
    for cache_id, row in batch.rows.items():
        if cache_ids is not None and cache_id not in cache_ids:
            continue
        if manager.has(cache_id) and manager.num_tokens(cache_id) >= row.start:
            manager.truncate(cache_id, row.start, written=False)
