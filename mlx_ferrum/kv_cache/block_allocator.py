"""BlockAllocator: free list and reference counts of a paged KV pool's blocks.

Host-side only; it never touches arrays. Follows vLLM's block manager (Kwon et al.,
SOSP 2023): blocks are shared by reference count (``fork``, prefix caching), and
a block returns to the free list when its count reaches zero. With prefix caching, a
freed block that still holds a hashed, full block of tokens is kept in an LRU list
of *evictable* blocks: it can be revived by ``acquire`` on a later prefix hit, and is
reused (evicted, least recently freed first) only once the plain free list is empty.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Optional

from ..errors import DoubleFreeError, KvCacheExhaustedError, UnknownBlockError


class BlockAllocator:
    """Reference-counted allocator of ``num_blocks`` block ids ``0..num_blocks-1``.

    Attributes:
        num_blocks: blocks in the pool.
        peak_in_use: most blocks ever held at once (count > 0).

    ``on_evict(block_id)`` (optional) is called when a cached block is reused, so the
    owner can drop its hash.
    """

    def __init__(self, num_blocks: int, on_evict: Optional[Callable[[int], None]] = None):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: set[int] = set()
        self.on_evict = on_evict
        self.peak_in_use = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate_n`` can hand out (plain free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - self.num_free

    def _check(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise UnknownBlockError(f"block {block!r} is not in this pool of {self.num_blocks} blocks")

    def allocate_n(self, n: int) -> list[int]:
        """Take ``n`` blocks, each with reference count 1; all or nothing.

        Raises:
            KvCacheExhaustedError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > self.num_free:
            raise KvCacheExhaustedError(
                f"KV block pool exhausted: {n} blocks needed, {self.num_free} of {self.num_blocks} free; "
                "raise FERRUM_KV_MAX_BLOCKS, lower FERRUM_PAGED_MAX_SEQS, or release finished sequences"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._cached.discard(b)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(b)
            self.ref_counts[b] = 1
            out.append(b)
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return out

    def allocate(self) -> int:
        """Take one block (see :meth:`allocate_n`)."""
        return self.allocate_n(1)[0]

    def acquire(self, block: int) -> None:
        """Add a reference to ``block`` (sharing); revives an evictable cached block.

        Raises:
            UnknownBlockError: ``block`` is outside the pool, or free and not cached.
        """
        self._check(block)
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise UnknownBlockError(f"block {block} is free and holds no cached tokens: allocate it instead")
            del self._evictable[block]
            self.peak_in_use = max(self.peak_in_use, self.num_in_use + 1)
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block becomes free (or evictable, if cached).

        Raises:
            UnknownBlockError: ``block`` is outside the pool.
            DoubleFreeError: its count is already zero.
        """
        self._check(block)
        if self.ref_counts[block] == 0:
            raise DoubleFreeError(f"block {block} freed twice: its reference count is already 0")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._cached:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def mark_cached(self, block: int, cached: bool = True) -> None:
        """Say whether ``block`` holds a hashed full block worth keeping after it is freed."""
        self._check(block)
        if cached:
            self._cached.add(block)
        else:
            self._cached.discard(block)
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def is_evictable(self, block: int) -> bool:
        """True when ``block`` is free but still holds cached tokens."""
        return block in self._evictable

    def check_invariants(self) -> None:
        """Assert that free, evictable and referenced blocks partition the pool (for tests)."""
        free = set(self._free)
        ev = set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not (free & ev), "block both free and evictable"
        for b in range(self.num_blocks):
            in_use = self.ref_counts[b] > 0
            assert in_use + (b in free) + (b in ev) == 1, f"block {b} is in {in_use=}, free={b in free}, evictable={b in ev}"
