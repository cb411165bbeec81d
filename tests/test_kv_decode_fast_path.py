"""The one-token append and fill-in of the paged KV manager (every decode step of every
sequence) must leave the manager exactly as the general path does.

References: the same tokens appended in one multi-token call (the general path, which
allocates, copies on write and hashes in one place), and the slot arithmetic
``block_ids[p // block_size] * block_size + p % block_size`` computed here.
"""

import random

import pytest

from mlx_ferrum.errors import KvCacheError
from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvCacheManager
from mlx_ferrum.kv_cache.manager import UNKNOWN_TOKEN


def _state(mgr: PagedKvCacheManager, cid):
    seq = mgr.seqs[cid]
    return (list(seq.block_ids), seq.num_tokens, list(seq.token_ids), list(seq.block_hashes),
            dict(mgr._hash_to_block), list(mgr.allocator.ref_counts))


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_one_token_appends_equal_one_append_of_all(prefix_cache, block_size):
    rng = random.Random(block_size)
    tokens = [rng.randrange(50) for _ in range(5 * block_size + 3)]
    one_by_one = PagedKvCacheManager(64, block_size, 32, prefix_cache=prefix_cache)
    at_once = PagedKvCacheManager(64, block_size, 32, prefix_cache=prefix_cache)
    for mgr in (one_by_one, at_once):
        mgr.create("s")
    prompt = 3
    slots = one_by_one.append_slots("s", prompt, tokens[:prompt]).slots
    for i in range(prompt, len(tokens)):
        result = one_by_one.append_slots("s", 1, [tokens[i]])
        assert result.copies == []
        slots += result.slots
        # after every token, not only at the end: a block is registered for prefix
        # caching the moment it is full
        reference = PagedKvCacheManager(64, block_size, 32, prefix_cache=prefix_cache)
        reference.create("s")
        reference.append_slots("s", i + 1, tokens[: i + 1])
        assert _state(one_by_one, "s") == _state(reference, "s"), f"after token {i}"
    expected = at_once.append_slots("s", len(tokens), tokens).slots
    assert slots == expected
    table = one_by_one.block_table("s")
    assert slots == [table[p // block_size] * block_size + p % block_size for p in range(len(tokens))]
    assert _state(one_by_one, "s") == _state(at_once, "s")


def test_pipelined_fill_in_registers_the_same_blocks():
    """Tokens appended as UNKNOWN_TOKEN (still being sampled) and filled in one step later,
    as the pipelined engine does, end with the blocks hashed as if known from the start;
    no block is registered while one of its ids is unknown."""
    bs = 4
    rng = random.Random(3)
    tokens = [rng.randrange(20) for _ in range(6 * bs + 1)]
    known = PagedKvCacheManager(32, bs, 16, prefix_cache=True)
    lagged = PagedKvCacheManager(32, bs, 16, prefix_cache=True)
    for mgr in (known, lagged):
        mgr.create("s")
        mgr.append_slots("s", 2, tokens[:2])
    for i in range(2, len(tokens)):
        known.append_slots("s", 1, [tokens[i]])
        lagged.append_slots("s", 1, [UNKNOWN_TOKEN])
        full = lagged.seqs["s"].num_tokens // bs
        assert len(lagged.seqs["s"].block_hashes) <= i // bs  # the block holding position i waits
        assert len(lagged.seqs["s"].block_hashes) <= full
        lagged.set_token_ids("s", i, [tokens[i]])
        assert _state(lagged, "s") == _state(known, "s"), f"after token {i}"
    assert _state(lagged, "s") == _state(known, "s")
    assert len(known.seqs["s"].block_hashes) == len(tokens) // bs


def test_a_shared_partial_last_block_is_copied_on_a_one_token_append():
    bs = 4
    mgr = PagedKvCacheManager(16, bs, 8)
    mgr.create("a")
    mgr.append_slots("a", 6)  # blocks: one full, one holding 2 of 4
    mgr.fork("a", "b")
    shared = mgr.block_table("a")[-1]
    result = mgr.append_slots("b", 1)
    assert len(result.copies) == 1 and result.copies[0][0] == shared
    new_block = result.copies[0][1]
    assert mgr.block_table("b")[-1] == new_block != shared
    assert result.slots == [new_block * bs + 2]
    assert mgr.block_table("a")[-1] == shared
    # "a" holds its block alone again: its next token takes the fast path into it
    assert mgr.append_slots("a", 1).slots == [shared * bs + 2]


def test_layer_groups_with_a_window_keep_the_general_path():
    """A sliding-window group frees blocks outside the window on append; the one-token path
    is only for full-attention groups."""
    bs = 4
    mgr = LayerGroupKvManager(32, bs, 16, layer_windows=[None, 6])
    mgr.create("s")
    mgr.append_slots("s", 3)
    for _ in range(13):
        mgr.trim_to_window("s")
        mgr.append_slots("s", 1)
    full, windowed = mgr.groups
    assert full.num_tokens("s") == windowed.num_tokens("s") == 16
    assert full.allocator.num_in_use == 4
    # the window (6 tokens) covers positions 10..15 for the next token: blocks 0 and 1 are freed
    assert windowed.allocator.num_in_use == 2


@pytest.mark.parametrize("n", [1, 5])
def test_an_append_without_its_ids_changes_nothing(n):
    """With prefix caching an append must bring its token ids; refusing one must leave
    the sequence and the pool as they were (no slots taken, no blocks held)."""
    mgr = PagedKvCacheManager(16, 4, 8, prefix_cache=True)
    mgr.create("s")
    mgr.append_slots("s", 3, [1, 2, 3])
    before = _state(mgr, "s"), mgr.num_free
    with pytest.raises(KvCacheError, match="token ids"):
        mgr.append_slots("s", n, None)
    with pytest.raises(KvCacheError, match="token ids"):
        mgr.append_slots("s", n, [7] * (n + 1))
    assert (_state(mgr, "s"), mgr.num_free) == before
