"""BlockPlan: one scheduling step's block accounting over a manager it never changes.

The scheduler decides, while it plans a step, to preempt sequences (their blocks will
be freed) and to let admitted sequences share cached prefix blocks; the engine
applies both through the executor after the plan is made. Later decisions of the same
step must see the earlier ones, so this view records them as *pending* and answers
what the manager would answer once they are applied:

- ``num_free``: the allocator's free blocks, plus the blocks whose last reference a
  pending release drops, minus the free-but-cached (evictable) blocks a pending prefix
  claim revives;
- ``has`` / ``blocks_needed``: as the manager, with released sequences gone and
  claimed ones holding their shared full blocks;
- ``longest_cached_prefix``: the manager's read-only lookup (pending releases keep
  their blocks' hashes, as :meth:`PagedKvCacheManager.release` does).

The rules are the :class:`~mlx_ferrum.kv_cache.BlockAllocator`'s (vLLM's block
manager, Kwon et al., SOSP 2023): a block is free when its reference count is zero,
whether it still holds cached tokens or not. The
:class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` is planned per group (a sequence
fits when it fits in every group: ``num_free`` is the smallest group's).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from ..errors import KvCacheError, UnknownCacheError
from .manager import FREED_BLOCK


class BlockPlan:
    """Pending releases and prefix claims of one step, over a read-only manager.

    Args:
        manager: the :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`; only read, never written.

    Attributes:
        released: cache ids whose release is pending, in the order planned.
        claims: cache id -> tokens of cached prefix to claim (a multiple of ``block_size``).
    """

    def __init__(self, manager):
        self.manager = manager
        self._groups = list(manager.groups)
        self._free = [g.allocator.num_free for g in self._groups]
        self._delta: list[dict[int, int]] = [{} for _ in self._groups]  # block -> planned change of its count
        self.released: list[Hashable] = []
        self.claims: dict[Hashable, int] = {}
        self._claimed_blocks: dict[Hashable, list[list[int]]] = {}

    def _change(self, group: int, block: int, d: int) -> None:
        count = self._groups[group].allocator.ref_counts[block] + self._delta[group].get(block, 0)
        if count + d < 0:
            raise KvCacheError(f"planned to free block {block} more often than it is referenced")
        self._delta[group][block] = self._delta[group].get(block, 0) + d
        if count == 0 and count + d > 0:
            self._free[group] -= 1  # revived (it was free but cached) or taken
        elif count > 0 and count + d == 0:
            self._free[group] += 1

    @property
    def num_free(self) -> int:
        """Blocks ``allocate_n`` could hand out once the pending changes are applied."""
        return min(self._free)

    def has(self, cache_id: Hashable) -> bool:
        """True when ``cache_id`` will hold a block table (claimed now, or existing and not released)."""
        if cache_id in self.claims:
            return True
        return cache_id not in self.released and self.manager.has(cache_id)

    def blocks_needed(self, cache_id: Optional[Hashable], n: int) -> int:
        """New blocks an append of ``n`` tokens to ``cache_id`` would take (None or a
        sequence that will not exist: a new one). A claimed prefix is whole blocks, so
        the append starts in a fresh block. Copy-on-write of a shared partial last block
        is judged on the current reference counts: a pending release of a ``fork``
        partner is not seen (the engine never forks; the count is then one too high)."""
        if cache_id is None or cache_id in self.claims or not self.has(cache_id):
            return self.manager.blocks_needed(None, n)
        return self.manager.blocks_needed(cache_id, n)

    def longest_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens a prefix claim for ``token_ids`` would share (the manager's lookup)."""
        return self.manager.longest_cached_prefix(token_ids)

    def release(self, cache_id: Hashable) -> None:
        """Plan freeing every block of ``cache_id`` (as ``manager.release``).

        Raises:
            UnknownCacheError: ``cache_id`` will not hold a block table.
        """
        if cache_id in self.claims:
            self.cancel_claim(cache_id)
            return
        if not self.has(cache_id):
            raise UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released")
        for gi, g in enumerate(self._groups):
            for b in g.seqs[cache_id].block_ids:
                if b != FREED_BLOCK:
                    self._change(gi, b, -1)
        self.released.append(cache_id)

    def claim(self, cache_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Plan a new sequence ``cache_id`` sharing the first ``num_tokens`` cached tokens
        of ``token_ids`` (as ``manager.create`` + ``match_prefix(max_tokens=num_tokens)``).

        Raises:
            KvCacheError: ``cache_id`` will already exist, or fewer than ``num_tokens``
                tokens are cached.
        """
        if self.has(cache_id):
            raise KvCacheError(f"KV cache {cache_id!r} already exists")
        per_group = []
        for g in self._groups:
            blocks = g.cached_prefix_blocks(token_ids)[: num_tokens // g.block_size]
            if len(blocks) * g.block_size != num_tokens:
                raise KvCacheError(f"{num_tokens} prefix tokens of {cache_id!r} are not all cached")
            per_group.append(blocks)
        for gi, blocks in enumerate(per_group):
            for b in blocks:
                self._change(gi, b, +1)
        self.claims[cache_id] = num_tokens
        self._claimed_blocks[cache_id] = per_group

    def cancel_claim(self, cache_id: Hashable) -> None:
        """Drop a planned claim (its revived blocks count as free again)."""
        for gi, blocks in enumerate(self._claimed_blocks.pop(cache_id)):
            for b in blocks:
                self._change(gi, b, -1)
        del self.claims[cache_id]
