"""PagedKvCacheManager lifecycle: random allocate/append/fork/truncate/release over one pool.

Each sequence writes K/V values that encode (its own tag, position); reading every
sequence back through its block table proves that no sequence sees another's data,
and the reference counts must balance with nothing leaked at the end.
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.errors import KvCacheError, KvCacheExhaustedError, UnknownCacheError
from mlx_ferrum.kv_cache import PagedKvCacheManager, PagedKvPool


def _read_back(pool: PagedKvPool, mgr: PagedKvCacheManager, cid) -> np.ndarray:
    table = mgr.block_table(cid)
    n = mgr.num_tokens(cid)
    if n == 0:
        return np.zeros((0,), np.float32)
    k = np.array(pool.k[0][mx.array(table)])  # [nb, 1, bs, 1]
    return k.reshape(-1)[:n]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_random_lifecycle_no_leak_no_corruption(prefix_cache):
    rng = random.Random(1234 + prefix_cache)
    bs = 4
    mgr = PagedKvCacheManager(num_blocks=48, block_size=bs, max_blocks_per_seq=16, prefix_cache=prefix_cache)
    pool = PagedKvPool(1, 48, 1, bs, 1, mx.float32)
    expect: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    next_id = 0
    ops = {"create": 0, "append": 0, "fork": 0, "truncate": 0, "release": 0, "exhausted": 0}

    def append(cid, n):
        # token ids drawn from a tiny alphabet so prefix-cache hashes collide often
        toks = [rng.randrange(3) for _ in range(n)]
        res = mgr.append_slots(cid, n, toks)
        pool.copy_blocks(res.copies)
        start = len(expect[cid])
        vals = [float(cid * 1000 + start + i) for i in range(n)]
        pool.write(0, mx.array(res.slots, dtype=mx.int32), mx.array(vals).reshape(n, 1, 1), mx.array(vals).reshape(n, 1, 1))
        expect[cid].extend(vals)
        tokens[cid].extend(toks)

    for step in range(2500):
        live = list(expect)
        r = rng.random()
        try:
            if r < 0.15 or not live:
                cid = next_id
                next_id += 1
                mgr.create(cid)
                expect[cid], tokens[cid] = [], []
                ops["create"] += 1
                append(cid, rng.randint(1, 3 * bs))
            elif r < 0.55:
                cid = rng.choice(live)
                append(cid, rng.randint(1, bs + 2))
                ops["append"] += 1
            elif r < 0.65:
                src = rng.choice(live)
                cid = next_id
                next_id += 1
                mgr.fork(src, cid)
                # a fork reads its source's values; new writes get the new tag
                expect[cid] = list(expect[src])
                tokens[cid] = list(tokens[src])
                ops["fork"] += 1
            elif r < 0.8:
                cid = rng.choice(live)
                new_len = rng.randint(0, len(expect[cid]))
                mgr.truncate(cid, new_len)
                del expect[cid][new_len:]
                del tokens[cid][new_len:]
                ops["truncate"] += 1
            else:
                cid = rng.choice(live)
                mgr.release(cid)
                del expect[cid], tokens[cid]
                ops["release"] += 1
        except KvCacheExhaustedError:
            ops["exhausted"] += 1
            # all-or-nothing: the failed append changed nothing; free room
            victim = rng.choice(list(expect))
            mgr.release(victim)
            del expect[victim], tokens[victim]
        mgr.check_invariants()
        if step % 25 == 0:
            for cid in expect:
                got = _read_back(pool, mgr, cid)
                np.testing.assert_array_equal(got, np.array(expect[cid], np.float32), err_msg=f"seq {cid} at step {step}")
                assert mgr.num_tokens(cid) == len(expect[cid])
    for cid in expect:
        np.testing.assert_array_equal(_read_back(pool, mgr, cid), np.array(expect[cid], np.float32))
    assert all(v > 20 for k, v in ops.items() if k != "exhausted"), ops
    assert ops["exhausted"] > 0, "the pool was never exhausted: the test did not reach that path"
    for cid in list(expect):
        mgr.release(cid)
    mgr.check_invariants()
    assert mgr.allocator.num_free == mgr.num_blocks and all(c == 0 for c in mgr.allocator.ref_counts)


def test_fork_copy_on_write_of_shared_partial_block():
    bs = 4
    mgr = PagedKvCacheManager(num_blocks=8, block_size=bs, max_blocks_per_seq=8)
    mgr.create("a")
    mgr.append_slots("a", 6)
    mgr.fork("a", "b")
    assert mgr.block_table("a") == mgr.block_table("b")
    res = mgr.append_slots("b", 1)
    assert len(res.copies) == 1
    src, dst = res.copies[0]
    assert src == mgr.block_table("a")[1] and dst == mgr.block_table("b")[1]
    assert mgr.block_table("a")[0] == mgr.block_table("b")[0]  # full block stays shared
    assert res.slots == [dst * bs + 2]
    mgr.check_invariants()


def test_truncate_frees_blocks_and_errors():
    mgr = PagedKvCacheManager(num_blocks=8, block_size=4, max_blocks_per_seq=8)
    mgr.create("a")
    mgr.append_slots("a", 13)
    assert mgr.allocator.num_free == 4
    mgr.truncate("a", 5)
    assert len(mgr.block_table("a")) == 2 and mgr.allocator.num_free == 6
    with pytest.raises(KvCacheError):
        mgr.truncate("a", 6)
    with pytest.raises(UnknownCacheError):
        mgr.release("nope")
    with pytest.raises(KvCacheExhaustedError, match="capacity"):
        mgr.append_slots("a", 100)
    assert mgr.num_tokens("a") == 5


def test_metrics_snapshot():
    mgr = PagedKvCacheManager(num_blocks=10, block_size=4, max_blocks_per_seq=8)
    mgr.create(1)
    mgr.append_slots(1, 9)
    m = mgr.cache_metrics_snapshot()
    assert (m["total_blocks"], m["used_blocks"], m["free_blocks"], m["peak_blocks"]) == (10, 3, 7, 3)
    assert m["utilization"] == pytest.approx(0.3)


def test_prefix_cache_match_and_eviction():
    bs = 4
    mgr = PagedKvCacheManager(num_blocks=6, block_size=bs, max_blocks_per_seq=6, prefix_cache=True)
    prompt = list(range(10))
    mgr.create("a")
    mgr.append_slots("a", len(prompt), prompt)
    mgr.create("b")
    hit = mgr.match_prefix("b", prompt)
    assert hit == 8 and mgr.block_table("b") == mgr.block_table("a")[:2]
    mgr.release("a")
    mgr.release("b")
    # freed hashed blocks stay reusable
    mgr.create("c")
    assert mgr.match_prefix("c", prompt) == 8
    mgr.release("c")
    # a full prompt hit keeps the last token for recompute
    mgr.create("d")
    assert mgr.match_prefix("d", prompt[:8]) == 4
    mgr.release("d")
    # fill the pool with other tokens: cached blocks get evicted, LRU first
    mgr.create("e")
    mgr.append_slots("e", 6 * bs, [100 + i for i in range(6 * bs)])
    assert mgr.allocator.num_evictions >= 2
    mgr.release("e")
    mgr.create("f")
    assert mgr.match_prefix("f", prompt) == 0
    mgr.check_invariants()


def test_pool_sizing_default_and_env(monkeypatch):
    import mlx_ferrum as mf
    from mlx_ferrum.config import DEFAULT_KV_POOL_BYTES
    from mlx_ferrum.kv_cache import bytes_per_block, default_num_blocks
    from support.tiny_models import tiny_model

    per = bytes_per_block(2, 2, 16, 8, mx.float16)
    assert per == 2 * 2 * 2 * 16 * 8 * 2
    if not mx.metal.is_available():
        assert default_num_blocks(2, 2, 16, 8, mx.float16, 0, 0.5) <= DEFAULT_KV_POOL_BYTES // per
    assert default_num_blocks(2, 2, 16, 8, mx.float16, 0, 0.5) >= 16
    model = tiny_model("llama")
    monkeypatch.setenv("FERRUM_METAL_PAGED_KV", "1")
    monkeypatch.setenv("FERRUM_KV_MAX_BLOCKS", "37")
    monkeypatch.setenv("FERRUM_PAGED_BLOCK_SIZE", "32")
    ex = mf.LlmExecutor(model)
    assert ex.layout == "paged" and ex.manager.num_blocks == 37 and ex.pool.k[0].shape == (38, 2, 32, 8)  # +1: the scratch block of padded decode rows
    assert ex.pool.k[0].dtype == mx.float32  # the model's dtype
