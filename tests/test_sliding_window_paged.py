"""Sliding-window block freeing in the paged layout.

A model whose every layer has the same window (Mistral) lets the paged manager free
blocks wholly before the window; a model mixing full and sliding layers (Gemma 3)
gets one block table per layer group, and only the sliding group frees. The manager
tests check the accounting; the engine test checks that generation with freeing,
prefix caching and preemption produces exactly what the contiguous layout (a masked
cache that frees nothing) produces, request by request.
"""

from __future__ import annotations

import random

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import KvCacheError
from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvCacheManager
from mlx_ferrum.kv_cache.manager import FREED_BLOCK


def _append(mgr, cid, n, start=0):
    return mgr.append_slots(cid, n, list(range(start, start + n)))


def test_blocks_outside_the_window_are_freed_and_the_count_stays_bounded():
    mgr = PagedKvCacheManager(64, 8, 64, sliding_window=20)
    mgr.create("a")
    _append(mgr, "a", 30)
    for i in range(200):
        _append(mgr, "a", 1, 30 + i)
        mgr.check_invariants()
        n = mgr.num_tokens("a")
        # the next token (position n) needs n-19 .. n: at most ceil(20/8)+1 blocks, plus the one being filled
        assert mgr.num_in_use <= -(-20 // 8) + 2
        assert mgr.first_live_token("a") <= max(0, n - 1 - 20 + 1)
    table = mgr.block_table("a")
    assert table[0] == FREED_BLOCK and table[-1] != FREED_BLOCK
    mgr.release("a")
    assert mgr.num_in_use == 0


def test_without_a_window_nothing_is_freed():
    mgr = PagedKvCacheManager(64, 8, 64)
    mgr.create("a")
    _append(mgr, "a", 100)
    assert FREED_BLOCK not in mgr.block_table("a") and mgr.num_in_use == 13


def test_fork_truncate_and_prefix_cache_with_freed_blocks():
    mgr = PagedKvCacheManager(64, 8, 64, prefix_cache=True, sliding_window=12)
    mgr.create("a")
    _append(mgr, "a", 40)
    _append(mgr, "a", 1, 40)  # frees the blocks before position 40 - 12 + 1 = 29
    assert mgr.block_table("a")[:3] == [FREED_BLOCK] * 3
    mgr.fork("a", "b")
    mgr.check_invariants()
    with pytest.raises(KvCacheError, match="sliding window"):
        mgr.truncate("b", 20)
    mgr.truncate("b", 38)  # still inside the live blocks
    mgr.check_invariants()
    # the freed blocks stay cached: a new prompt with the same prefix reuses them
    mgr.create("c")
    assert mgr.match_prefix("c", list(range(41))) == 40
    mgr.check_invariants()
    for cid in ("a", "b", "c"):
        mgr.release(cid)
    mgr.check_invariants()
    assert mgr.num_in_use == 0


def test_layer_groups_hold_full_blocks_for_global_layers_and_a_window_for_sliding_ones():
    windows = [16, 16, None, 16, 16, None]
    mgr = LayerGroupKvManager(64, 8, 64, windows, prefix_cache=True)
    assert mgr.group_windows == [None, 16] and mgr.layer_groups == [1, 1, 0, 1, 1, 0]
    mgr.create("a")
    mgr.append_slots("a", 100, list(range(100)))
    for i in range(60):
        res = mgr.append_slots("a", 1, [100 + i])
        assert len(res) == 2  # one AppendResult per group
        mgr.check_invariants()
    full, sliding = (g.allocator.num_in_use for g in mgr.groups)
    assert full == -(-160 // 8) and sliding <= -(-16 // 8) + 2
    per_token_layer = 10
    assert mgr.bytes_held(per_token_layer) == (full * 2 + sliding * 4) * 8 * per_token_layer
    mgr.fork("a", "b")
    with pytest.raises(KvCacheError):
        mgr.truncate("b", 155)  # its window would start in a freed sliding block
    mgr.truncate("b", 159)
    mgr.create("c")
    # freed sliding blocks stay cached until evicted, so all 20 full blocks match in both groups
    assert mgr.match_prefix("c", list(range(200))) == 160
    for cid in ("a", "b", "c"):
        mgr.release(cid)
    mgr.check_invariants()
    assert mgr.num_in_use == 0


@pytest.fixture(scope="module", params=["mistral", "gemma3_text", "gpt_oss"])
def windowed_model(request, tmp_path_factory):
    from support.hf_reference import make_checkpoint

    from mlx_ferrum.models import load_model

    folder = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, folder, window=12)
    return load_model(folder)[0]


def test_engine_with_freeing_prefix_cache_and_preemption_matches_contiguous(windowed_model):
    mistral = windowed_model
    r = random.Random(5)
    shared = [r.randrange(3, 128) for _ in range(24)]
    prompts = [
        (shared if i % 2 else []) + [r.randrange(3, 128) for _ in range(r.randint(4, 30))] for i in range(24)
    ]
    params = [SamplingParams(max_tokens=r.randint(8, 24), temperature=0.0, ignore_eos=True) for _ in prompts]
    cfg = RuntimeConfig(
        kv_layout="paged", block_size=8, max_num_blocks=12, max_num_seqs=12, prefix_cache=True, kv_capacity=256,
    )
    eng = Engine(mistral, None, cfg)
    outs = eng.generate(prompts, params)
    assert eng.stats()["num_preemptions"] > 0, "the pool was never under pressure: the test is too easy"
    contiguous = Engine(mistral, None, RuntimeConfig(kv_layout="contiguous", kv_capacity=256))
    expected = contiguous.generate(prompts, params)
    for o, e in zip(outs, expected):
        assert o.token_ids == e.token_ids
