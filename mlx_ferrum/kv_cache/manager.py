"""PagedKvCacheManager: per-sequence block tables over one shared block pool, and the
BlockAllocator (free list and reference counts) under them.

One layer group's tables: the paged store's manager is a
:class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`, which keeps one of these per group.

Host-side bookkeeping only (vLLM's block manager; Kwon et al., SOSP 2023). Its owner
changes it: in the engine the scheduler (it allocates a step's slots, frees preempted
and finished sequences, shares cached prefixes), in the low-level API the
:class:`~mlx_ferrum.executor.LlmExecutor` adapter. The runner's pass builder
(:mod:`mlx_ferrum.runner.inputs`) only reads the slots and block tables its owner hands
over (:mod:`~mlx_ferrum.kv_cache.block_tables`). The pool arrays belong to the store: when an
append must copy a shared block first (copy-on-write), the manager returns the
``(src, dst)`` block pairs and the store copies them before the step writes.

Prefix caching (``FERRUM_PREFIX_CACHE``): each full block is keyed by a chained
SHA-256 digest, ``sha256(parent_digest || its token ids as little-endian int64)``, so a
key names the whole prefix up to that block (vLLM moved from Python's ``hash()`` to
SHA-256 after GHSA-rm76-4mrf-v9r8 / CVE-2025-25183: ``hash()`` collisions can be forced,
and would let one request read another's KV). A hit also compares the block's stored
token ids with the prompt's before reuse (as nano-vllm does), so even a digest collision
cannot hand out wrong KV. A new sequence whose prompt starts with cached blocks shares
them by reference count (``match_prefix``) and prefills only the rest. Freed hashed
blocks stay reusable until evicted, least recently freed first.

Sliding windows (``sliding_window``, for models whose every layer has the same
window, e.g. Mistral and Phi-3): before each append, the blocks that lie wholly
before the window of the first new token are freed, so a sequence holds about
``window / block_size + 1`` blocks however long it grows. Their entries in
``block_ids`` become :data:`FREED_BLOCK` (the executor points them at any valid
block; attention never reads them). This is vLLM's sliding-window block freeing.

The allocator (:class:`BlockAllocator`): reference-counted block ids, host-side only (it
never touches arrays). Blocks are shared by reference count (``fork``, prefix caching),
and a block returns to the free list when its count reaches zero. With prefix caching, a
freed block that still holds a hashed, full block of tokens is kept in an LRU list of
*evictable* blocks: it can be revived by ``acquire`` on a later prefix hit, and is
reused (evicted, least recently freed first) only once the plain free list is empty.

Why this module is one file of over 500 lines: allocation, copy-on-write, prefix hashing
and trimming all edit the same per-sequence block tables and reference counts (the
allocator's counts are what the tables' sharing and freeing change); split, each part
would reach into the others' state.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

from ..errors import DoubleFreeError, KvCacheError, KvCacheExhaustedError, UnknownBlockError, UnknownCacheError

FREED_BLOCK = -1
"""``block_ids`` entry of a block freed because it left the sliding window."""


#: digest of the empty prefix, the parent of a sequence's first block
ROOT_DIGEST = b"\x00" * 32

#: ``token_ids`` entry of a token whose id the host does not know yet (the pipelined
#: step appends a token that is still being sampled on the device). A block holding one
#: is hashed only once :meth:`PagedKvCacheManager.set_token_ids` has filled it in.
UNKNOWN_TOKEN = -1


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Prefix-cache key of a full block: SHA-256 over the parent block's digest followed by
    the block's token ids as little-endian signed 64-bit integers (32 bytes)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


# ---------------------------------------------------------------------------- allocator
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


# ---------------------------------------------------------------------------- block tables
@dataclass
class SequenceBlocks:
    """One sequence's share of the pool.

    Attributes:
        block_ids: physical block ids, logical order (the host mirror of ``block_table``).
        num_tokens: tokens stored (the sequence's ``context_len``).
        token_ids: the stored tokens' ids, kept only with prefix caching.
        block_hashes: SHA-256 chain digests of the leading full blocks registered so far.
        num_shared_blocks: leading blocks it took from the prefix cache or a fork rather
            than wrote itself (what ``release(cache_id, keep_cached=False)`` leaves cached).
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_shared_blocks: int = 0


@dataclass
class AppendResult:
    """Where ``n`` new tokens go.

    Attributes:
        slots: ``n`` slot indices, ``block_id * block_size + offset``.
        copies: ``(src_block, dst_block)`` pairs the executor must copy in the pool
            before writing (copy-on-write of a shared partial block).
    """

    slots: list[int]
    copies: list[tuple[int, int]]


class PagedKvCacheManager:
    """Block tables of many sequences over a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_blocks: blocks in the pool (each layer's pool has this many).
        block_size: tokens per block.
        max_blocks_per_seq: longest block table a sequence may have (capacity / block_size).
        prefix_cache: share full blocks across sequences by hash chain.
        sliding_window: every layer attends only to its last ``sliding_window``
            tokens, so blocks wholly outside that window are freed (None: keep all).

    Raises (from its methods):
        KvCacheExhaustedError: the pool cannot hold the new tokens (nothing changes).
        UnknownCacheError: an unknown ``cache_id``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        prefix_cache: bool = False,
        sliding_window: Optional[int] = None,
    ):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.max_blocks_per_seq = max_blocks_per_seq
        self.prefix_cache = prefix_cache
        self.allocator = BlockAllocator(num_blocks, on_evict=self._on_evict)
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self._block_tokens: dict[int, tuple[int, ...]] = {}  # token ids a cached block holds
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ----------------------------------------------------------------- lookup
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks free to allocate (cached-but-free ones included)."""
        return self.allocator.num_free

    @property
    def num_in_use(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.allocator.num_in_use

    def _seq(self, cache_id: Hashable) -> SequenceBlocks:
        try:
            return self.seqs[cache_id]
        except KeyError:
            raise UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released") from None

    def has(self, cache_id: Hashable) -> bool:
        """True when ``cache_id`` holds a block table."""
        return cache_id in self.seqs

    def create(self, cache_id: Hashable) -> None:
        """Start an empty sequence.

        Raises:
            KvCacheError: ``cache_id`` already exists.
        """
        if cache_id in self.seqs:
            raise KvCacheError(f"KV cache {cache_id!r} already exists")
        self.seqs[cache_id] = SequenceBlocks()

    def num_tokens(self, cache_id: Hashable) -> int:
        """Tokens stored for ``cache_id`` (its ``context_len``)."""
        return self._seq(cache_id).num_tokens

    def block_table(self, cache_id: Hashable) -> list[int]:
        """Physical block ids of ``cache_id`` in logical order (a copy)."""
        return list(self._seq(cache_id).block_ids)

    # ----------------------------------------------------------------- growth
    def blocks_needed(self, cache_id: Optional[Hashable], n: int) -> int:
        """New blocks an append of ``n`` tokens would take (copy-on-write included)."""
        seq = self.seqs.get(cache_id) if cache_id is not None else None
        if seq is None:
            return -(-n // self.block_size)
        have = len(seq.block_ids) * self.block_size
        need = max(0, -(-(seq.num_tokens + n - have) // self.block_size))
        if n and self._last_block_is_shared_partial(seq):
            need += 1
        return need

    def can_append(self, cache_id: Optional[Hashable], n: int) -> bool:
        """True when ``n`` more tokens fit in the free blocks."""
        return self.blocks_needed(cache_id, n) <= self.allocator.num_free

    def _last_block_is_shared_partial(self, seq: SequenceBlocks) -> bool:
        # block_ids always spans exactly ceil(num_tokens / block_size) blocks, so a
        # partial block is the last one
        if seq.num_tokens % self.block_size == 0:
            return False
        return self.allocator.ref_counts[seq.block_ids[-1]] > 1

    def append_slots(self, cache_id: Hashable, n: int, token_ids: Optional[Sequence[int]] = None) -> AppendResult:
        """Reserve slots for ``n`` new tokens of ``cache_id``, allocating blocks on demand.

        Args:
            token_ids: the new tokens' ids (needed with prefix caching to hash full blocks);
                :data:`UNKNOWN_TOKEN` for one still being sampled, filled in later by
                :meth:`set_token_ids` (its block is hashed then).

        Raises:
            KvCacheExhaustedError: the pool (or ``max_blocks_per_seq``) cannot hold them;
                nothing was allocated.
        """
        seq = self._seq(cache_id)
        if self.prefix_cache and (token_ids is None or len(token_ids) != n):
            raise KvCacheError("prefix caching needs the token ids of every appended token")
        bs = self.block_size
        start = seq.num_tokens
        offset = start % bs
        if n == 1 and offset and self.sliding_window is None and self.allocator.ref_counts[seq.block_ids[-1]] == 1:
            # A decode token into the room left in its own last block: no allocation, no
            # copy-on-write, no window; the steady state of every sequence, every step.
            seq.num_tokens = start + 1
            if self.prefix_cache:
                seq.token_ids.append(int(token_ids[0]))
                if offset == bs - 1:  # the block is full now
                    self._register_full_blocks(seq)
            return AppendResult([seq.block_ids[-1] * bs + offset], [])
        end = start + n
        if -(-end // bs) > self.max_blocks_per_seq:
            raise KvCacheExhaustedError(
                f"sequence {cache_id!r} would hold {end} tokens, more than its capacity of "
                f"{self.max_blocks_per_seq * bs}: raise FERRUM_KV_CAPACITY or shorten the request"
            )
        copies: list[tuple[int, int]] = []
        if self.sliding_window is not None and n > 0:
            self._free_outside_window(seq)
        cow = n > 0 and self._last_block_is_shared_partial(seq)
        new_needed = max(0, -(-end // bs) - len(seq.block_ids))
        fresh = self.allocator.allocate_n(new_needed + (1 if cow else 0))
        if cow:
            idx = seq.num_tokens // bs
            src, dst = seq.block_ids[idx], fresh.pop()
            self.allocator.free(src)
            seq.block_ids[idx] = dst
            copies.append((src, dst))
        seq.block_ids.extend(fresh)
        start = seq.num_tokens
        slots = [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        seq.num_tokens = end
        if self.prefix_cache:
            seq.token_ids.extend(int(t) for t in token_ids)
            self._register_full_blocks(seq)
        return AppendResult(slots, copies)

    def _free_outside_window(self, seq: SequenceBlocks) -> None:
        # The first new token, at position num_tokens, reads keys from
        # num_tokens - window + 1 on; later tokens read even later ones.
        first_needed = max(0, seq.num_tokens - self.sliding_window + 1)
        for i in range(first_needed // self.block_size):
            b = seq.block_ids[i]
            if b != FREED_BLOCK:
                self.allocator.free(b)
                seq.block_ids[i] = FREED_BLOCK

    def trim_to_window(self, cache_id: Hashable) -> None:
        """Free the blocks the next token's window no longer covers (no-op without a window).

        Called by the executor after a forward pass, so a sequence holds only its
        window between steps. Not called after a speculative verify step, whose
        rejected tokens may be truncated away.
        """
        if self.sliding_window is not None:
            self._free_outside_window(self._seq(cache_id))

    def first_live_token(self, cache_id: Hashable) -> int:
        """Position of the first token whose block is still held (0 without a window)."""
        seq = self._seq(cache_id)
        freed = next((i for i, b in enumerate(seq.block_ids) if b != FREED_BLOCK), len(seq.block_ids))
        return freed * self.block_size

    # ---------------------------------------------------------------- release
    def truncate(self, cache_id: Hashable, new_len: int, written: bool = True) -> None:
        """Keep the first ``new_len`` tokens and free the blocks past them.

        A kept block that becomes partial loses its prefix-cache key (its tail will be
        overwritten); if it is shared, the next append copies it first.

        Args:
            written: whether the KV of the tokens cut off was written. True after a pass
                (rejected draft tokens: their blocks hold the KV of the ids they are keyed
                by, so freed full blocks stay cached). False for slots whose pass never
                ran (a failed or interrupted step): every block holding such a position
                loses its key, since its key was registered when the slots were appended
                and a later prompt matching it would read KV that was never written.

        Raises:
            KvCacheError: ``new_len`` is negative or above ``num_tokens``.
        """
        seq = self._seq(cache_id)
        self.check_truncate(cache_id, new_len)
        if self.prefix_cache and not written:
            for b in seq.block_ids[new_len // self.block_size:]:
                self._uncache(b)
        keep = -(-new_len // self.block_size)
        for b in seq.block_ids[keep:]:
            if b != FREED_BLOCK:
                self.allocator.free(b)
        del seq.block_ids[keep:]
        seq.num_tokens = new_len
        seq.num_shared_blocks = min(seq.num_shared_blocks, keep)
        full = new_len // self.block_size
        if self.prefix_cache:
            del seq.token_ids[new_len:]
            del seq.block_hashes[full:]
            if full < keep:
                partial = seq.block_ids[full]
                if self.allocator.ref_counts[partial] == 1:
                    # its tail will be overwritten, so its key no longer describes it
                    self._uncache(partial)

    def check_truncate(self, cache_id: Hashable, new_len: int) -> None:
        """Raise what :meth:`truncate` would raise, changing nothing.

        Raises:
            KvCacheError: ``new_len`` is out of range, or the sliding window of the
                token at ``new_len`` would start in a block already freed.
        """
        seq = self._seq(cache_id)
        if not 0 <= new_len <= seq.num_tokens:
            raise KvCacheError(f"cannot truncate {cache_id!r} of {seq.num_tokens} tokens to {new_len}")
        if self.sliding_window is not None and new_len and max(0, new_len - self.sliding_window + 1) < self.first_live_token(
            cache_id
        ):
            raise KvCacheError(
                f"cannot truncate {cache_id!r} to {new_len} tokens: the blocks its sliding window would need were "
                "freed; release the sequence and recompute it instead"
            )

    def release(self, cache_id: Hashable, keep_cached: bool = True) -> None:
        """Free every block of ``cache_id`` and forget it.

        Args:
            keep_cached: False when the KV this sequence wrote may not be what its blocks'
                keys say (it ended with an error: a failed evaluation leaves unwritten
                values behind it): the blocks it wrote leave the prefix cache; the
                blocks it took from the cache (``num_shared_blocks``) stay.

        Raises:
            UnknownCacheError: unknown ``cache_id``.
        """
        seq = self.seqs.pop(cache_id, None)
        if seq is None:
            raise UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released")
        if self.prefix_cache and not keep_cached:
            for b in seq.block_ids[seq.num_shared_blocks:]:
                self._uncache(b)
        for b in seq.block_ids:
            if b != FREED_BLOCK:
                self.allocator.free(b)

    def fork(self, cache_id: Hashable, new_cache_id: Hashable) -> None:
        """Make ``new_cache_id`` share all of ``cache_id``'s blocks (copy-on-write on append).

        Raises:
            UnknownCacheError: unknown ``cache_id``.
            KvCacheError: ``new_cache_id`` exists.
        """
        src = self._seq(cache_id)
        self.create(new_cache_id)
        dst = self.seqs[new_cache_id]
        for b in src.block_ids:
            if b != FREED_BLOCK:
                self.allocator.acquire(b)
        dst.block_ids = list(src.block_ids)
        dst.num_tokens = src.num_tokens
        dst.token_ids = list(src.token_ids)
        dst.block_hashes = list(src.block_hashes)
        dst.num_shared_blocks = len(src.block_ids)

    # ---------------------------------------------------------- prefix cache
    def _on_evict(self, block: int) -> None:
        self._block_tokens.pop(block, None)
        h = self._block_to_hash.pop(block, None)
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]

    def _uncache(self, block: int) -> None:
        """Take ``block``'s key out of the prefix cache (no later prompt matches it); its
        holders keep it. A no-op for a freed slot or a block without a key."""
        if block != FREED_BLOCK and block in self._block_to_hash:
            self._on_evict(block)
            self.allocator.mark_cached(block, False)

    def set_token_ids(self, cache_id: Hashable, start: int, token_ids: Sequence[int]) -> None:
        """Fill in the ids of stored tokens appended as :data:`UNKNOWN_TOKEN`, and hash the
        blocks that are now full and known (a no-op without prefix caching).

        The pipelined engine appends a token before it is read back from the device; a
        block is registered in the prefix cache only when every id in it is known, so no
        other sequence can ever match a block by a guessed id. Positions at or past
        ``num_tokens`` (not stored yet) are ignored: they arrive with their ids.

        Args:
            cache_id: the sequence.
            start: position of ``token_ids[0]``.
            token_ids: the ids, in order.

        Raises:
            UnknownCacheError: unknown ``cache_id``.
            KvCacheError: a position already holds a different known id.
        """
        if not self.prefix_cache:
            return
        seq = self._seq(cache_id)
        for offset, token in enumerate(token_ids):
            position = start + offset
            if not 0 <= position < len(seq.token_ids):
                continue
            known = seq.token_ids[position]
            if known == UNKNOWN_TOKEN:
                seq.token_ids[position] = int(token)
            elif known != int(token):
                raise KvCacheError(
                    f"token {position} of {cache_id!r} is stored as id {known}, not {int(token)}"
                )
        self._register_full_blocks(seq)

    def _register_full_blocks(self, seq: SequenceBlocks) -> None:
        bs = self.block_size
        full = seq.num_tokens // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_DIGEST
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if UNKNOWN_TOKEN in chunk:
                break  # hashed when set_token_ids fills it in
            h = block_digest(parent, chunk)
            seq.block_hashes.append(h)
            b = seq.block_ids[i]
            if h not in self._hash_to_block and b not in self._block_to_hash:
                self._hash_to_block[h] = b
                self._block_to_hash[b] = h
                self._block_tokens[b] = chunk
                self.allocator.mark_cached(b)

    def _prefix_hits(self, token_ids: Sequence[int]) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """``(block, digest, token ids)`` of each cached full block that begins ``token_ids``,
        stopping at the first miss and before the last token (read-only)."""
        bs = self.block_size
        hits: list[tuple[int, bytes, tuple[int, ...]]] = []
        parent = ROOT_DIGEST
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(int(t) for t in token_ids[i * bs : (i + 1) * bs])
            h = block_digest(parent, chunk)
            b = self._hash_to_block.get(h)
            if b is None or self._block_tokens.get(b) != chunk:
                break  # a miss, or a digest collision: never reuse a block whose tokens differ
            hits.append((b, h, chunk))
            parent = h
        return hits

    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Ids of the cached blocks :meth:`match_prefix` would share for ``token_ids``; changes nothing.

        The blocks may be in use by other sequences or free but cached (evictable); a
        match revives the latter. Empty without prefix caching. The scheduler uses this to
        plan admission while the engine, not the scheduler, performs the match.

        Args:
            token_ids: the prompt (int token ids).

        Returns:
            Block ids in logical order; ``len(result) * block_size <= len(token_ids) - 1``.
        """
        if not self.prefix_cache:
            return []
        return [b for b, _, _ in self._prefix_hits(token_ids)]

    def longest_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens :meth:`match_prefix` would reuse for ``token_ids`` (a multiple of
        ``block_size``, at most ``len(token_ids) - 1``); changes nothing, counts no query."""
        return len(self.cached_prefix_blocks(token_ids)) * self.block_size

    def match_prefix(self, cache_id: Hashable, token_ids: Sequence[int], max_tokens: Optional[int] = None) -> int:
        """Share the cached full blocks that begin ``token_ids`` with the new, empty ``cache_id``.

        At most ``len(token_ids) - 1`` tokens are reused, so the last prompt token is
        always recomputed and yields logits. The blocks are those
        :meth:`cached_prefix_blocks` names (the same lookup), so
        :meth:`longest_cached_prefix` predicts the result exactly.

        Args:
            cache_id: an existing, empty sequence.
            token_ids: the prompt.
            max_tokens: reuse at most this many tokens (rounded down to whole blocks);
                None: as many as are cached.

        Returns:
            Tokens reused (a multiple of ``block_size``); the caller prefills the rest.

        Raises:
            KvCacheError: ``cache_id`` is not empty.
        """
        seq = self._seq(cache_id)
        if seq.num_tokens:
            raise KvCacheError(f"match_prefix needs an empty sequence; {cache_id!r} holds {seq.num_tokens} tokens")
        if not self.prefix_cache:
            return 0
        bs = self.block_size
        self.prefix_queries += 1
        self.prefix_query_tokens += len(token_ids)
        hits = self._prefix_hits(token_ids)
        if max_tokens is not None:
            hits = hits[: max(0, max_tokens) // bs]
        for b, h, chunk in hits:
            self.allocator.acquire(b)
            seq.block_ids.append(b)
            seq.block_hashes.append(h)
            seq.token_ids.extend(chunk)
            seq.num_tokens += bs
        seq.num_shared_blocks = len(hits)
        self.prefix_hit_tokens += seq.num_tokens
        return seq.num_tokens

    # ---------------------------------------------------------------- metrics
    def cache_metrics_snapshot(self) -> dict:
        """Pool occupancy: total/used/free blocks, utilization (0-1), peak, prefix-cache hit rate."""
        a = self.allocator
        used = a.num_in_use
        return {
            "block_size": self.block_size,
            "total_blocks": a.num_blocks,
            "used_blocks": used,
            "free_blocks": a.num_free,
            "cached_free_blocks": len(a._evictable),
            "utilization": used / a.num_blocks,
            "peak_blocks": a.peak_in_use,
            "num_sequences": len(self.seqs),
            "prefix_cache": self.prefix_cache,
            "prefix_hit_rate": (self.prefix_hit_tokens / self.prefix_query_tokens) if self.prefix_query_tokens else 0.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "evictions": a.num_evictions,
        }

    def check_invariants(self) -> None:
        """Assert reference counts equal the block-table references (for tests)."""
        self.allocator.check_invariants()
        counts = [0] * self.num_blocks
        for seq in self.seqs.values():
            assert len(seq.block_ids) == -(-seq.num_tokens // self.block_size), "block table length mismatch"
            for b in seq.block_ids:
                if b != FREED_BLOCK:
                    counts[b] += 1
        assert counts == self.allocator.ref_counts, "reference counts do not balance"
