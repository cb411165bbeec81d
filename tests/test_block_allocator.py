"""BlockAllocator: all-or-nothing allocation, reference counts, named errors."""

import pytest

from mlx_ferrum.errors import DoubleFreeError, KvCacheExhaustedError, UnknownBlockError
from mlx_ferrum.kv_cache import BlockAllocator


def test_allocate_n_is_all_or_nothing():
    a = BlockAllocator(8)
    got = a.allocate_n(5)
    assert len(set(got)) == 5 and a.num_free == 3
    with pytest.raises(KvCacheExhaustedError, match="FERRUM_KV_MAX_BLOCKS"):
        a.allocate_n(4)
    assert a.num_free == 3  # nothing was taken by the failed call
    assert a.allocate_n(3) and a.num_free == 0
    a.check_invariants()


def test_reference_counts_and_sharing():
    a = BlockAllocator(4)
    b = a.allocate()
    a.acquire(b)
    assert a.ref_counts[b] == 2
    a.free(b)
    assert a.num_free == 3  # still held once
    a.free(b)
    assert a.num_free == 4
    a.check_invariants()


def test_double_free_and_unknown_block():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        a.free(b)
    with pytest.raises(UnknownBlockError):
        a.free(4)
    with pytest.raises(UnknownBlockError):
        a.free(-1)
    with pytest.raises(UnknownBlockError):
        a.acquire(2)  # free and not cached: nothing to share


def test_peak_in_use():
    a = BlockAllocator(10)
    x = a.allocate_n(6)
    for b in x[:4]:
        a.free(b)
    a.allocate_n(2)
    assert a.peak_in_use == 6
    assert a.num_in_use == 4


def test_cached_blocks_are_evicted_lru_and_revivable():
    evicted = []
    a = BlockAllocator(3, on_evict=evicted.append)
    b0, b1, b2 = a.allocate_n(3)
    a.mark_cached(b0)
    a.mark_cached(b1)
    a.free(b1)
    a.free(b0)  # b1 freed first: it is the least recently freed
    a.free(b2)
    assert a.num_free == 3
    a.acquire(b0)  # revive a cached block
    assert a.ref_counts[b0] == 1 and a.num_free == 2
    got = a.allocate_n(2)  # plain free block first, then evict b1
    assert got[0] == b2 and got[1] == b1 and evicted == [b1]
    a.check_invariants()
