"""kv_cache.factory: the one place the KV store's layout, attention backend, block manager and pool size are chosen."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_ferrum import config as config_module
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import ExecutorError, InsufficientMemoryError
from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvCacheManager
from mlx_ferrum.kv_cache.factory import KvSpec, build_kv_store, pool_num_blocks
from mlx_ferrum.kv_cache.store import bytes_per_block, default_num_blocks
from mlx_ferrum.kv_cache.store import ContiguousKvStore, PagedKvStore
from mlx_ferrum.layers.attention import ContiguousAttentionBackend, PagedAttentionBackend
from mlx_ferrum.runner import LlmRunner
from support.tiny_models import tiny_model


def spec(windows=(None, None), max_seq_len=100, dtype=mx.float16) -> KvSpec:
    return KvSpec(num_layers=len(windows), num_kv_heads=2, head_dim=8, dtype=dtype, max_seq_len=max_seq_len,
                  layer_windows=tuple(windows))


def test_contiguous_layout_gives_per_sequence_caches_grown_or_preallocated():
    store = build_kv_store(spec(), RuntimeConfig(kv_layout="contiguous", kv_cache_step=32), weight_bytes=0)
    assert isinstance(store, ContiguousKvStore) and store.layout == "contiguous"
    assert type(store.backend) is ContiguousAttentionBackend
    caches = store.make_caches()
    assert len(caches) == 2 and caches[0].capacity == 0 and caches[0].max_capacity == 100
    assert caches[0].step == 32 and caches[0].dtype == mx.float16
    # an explicit capacity preallocates every layer's buffer to it
    fixed = build_kv_store(spec(max_seq_len=48), RuntimeConfig(kv_layout="contiguous", kv_capacity=48), 0)
    assert [c.capacity for c in fixed.make_caches()] == [48, 48]
    assert store.bytes_per_token == 2 * 2 * 2 * 8 * 2  # K+V, layers, heads, head_dim, fp16 bytes


def test_explicit_block_count_sizes_the_manager_and_one_scratch_block_more_in_the_pool():
    store = build_kv_store(spec(), RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=37), 0)
    assert isinstance(store, PagedKvStore) and store.layout == "paged"
    # the store keeps no block manager: it reports the geometry its owner builds one from
    assert not hasattr(store, "manager")
    manager = store.geometry.new_block_manager()
    assert type(manager) is LayerGroupKvManager and len(manager.groups) == 1
    assert type(store.backend) is PagedAttentionBackend
    assert manager.num_blocks == 37 and store.pool.num_blocks == 38
    assert store.pool.shape == (38, 2, 16, 8) and store.pool.dtype == mx.float16
    assert manager.max_blocks_per_seq == 7  # ceil(100 / 16)


def test_default_pool_is_what_max_num_seqs_sequences_use_at_least_sixteen_blocks():
    cfg = RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=None, max_num_seqs=3)
    expected = default_num_blocks(2, 2, 16, 8, mx.float16, 0, cfg.kv_memory_fraction, max_num_seqs=3, max_seq_len=100)
    assert expected == 3 * 7, "the budget, not the sequences, bounds this pool: pick smaller sizes"
    assert pool_num_blocks(spec(), cfg, weight_bytes=0) == 21
    assert build_kv_store(spec(), cfg, 0).geometry.num_blocks == 21
    one_short = RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=None, max_num_seqs=1)
    assert pool_num_blocks(spec(max_seq_len=20), one_short, 0) == 16


def test_default_pool_is_capped_by_the_memory_left_beside_the_weights(monkeypatch):
    per = bytes_per_block(2, 2, 16, 8, mx.float16)
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 1000 * per)
    monkeypatch.setattr("mlx_ferrum.kv_cache.store.available_memory_bytes", lambda: 1000 * per)
    cfg = RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=None, max_num_seqs=1000,
                        kv_memory_fraction=0.5)
    big = spec(max_seq_len=100_000)
    assert pool_num_blocks(big, cfg, weight_bytes=0) == 500
    assert pool_num_blocks(big, cfg, weight_bytes=200 * per) == 400


@pytest.mark.parametrize("windows, group_windows, layer_groups", [
    ((None, None), [None], [0, 0]),
    ((64, 64), [64], [0, 0]),
    ((None, 64, None), [None, 64], [0, 1, 0]),
])
def test_layer_windows_pick_the_layer_groups(windows, group_windows, layer_groups):
    store = build_kv_store(spec(windows), RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=32,
                                                        prefix_cache=True), 0)
    manager = store.geometry.new_block_manager()
    assert type(manager) is LayerGroupKvManager and manager.prefix_cache
    assert manager.group_windows == group_windows and store.group_windows == group_windows
    assert store.layer_groups == layer_groups and manager.layer_groups == layer_groups
    # each group frees the blocks outside its own window
    assert [g.sliding_window for g in manager.groups] == group_windows


def test_a_given_manager_sizes_the_pool_and_needs_the_paged_layout():
    manager = LayerGroupKvManager(12, 8, max_blocks_per_seq=13)
    store = build_kv_store(spec(), RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=99), 0, manager)
    assert store.geometry.num_blocks == 12 and store.geometry.block_size == 8 and store.pool.shape == (13, 2, 8, 8)
    assert store.layer_groups == [0, 0]  # one group serves every layer
    with pytest.raises(ExecutorError, match="paged layout"):
        build_kv_store(spec(), RuntimeConfig(kv_layout="contiguous"), 0, manager)
    with pytest.raises(ExecutorError, match="LayerGroupKvManager"):
        build_kv_store(spec(), RuntimeConfig(kv_layout="paged"), 0, PagedKvCacheManager(12, 8, 13))


def test_a_pool_beyond_free_memory_is_refused_before_any_allocation(monkeypatch):
    per = bytes_per_block(2, 2, 16, 8, mx.float16)
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 100 * per)
    built = []
    monkeypatch.setattr(PagedKvCacheManager, "__init__", lambda *a, **k: built.append(a))
    monkeypatch.setattr("mlx_ferrum.kv_cache.store.PagedKvPool.__init__", lambda *a, **k: built.append(a))
    with pytest.raises(InsufficientMemoryError, match="FERRUM_KV_MAX_BLOCKS"):
        build_kv_store(spec(), RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=10_000), 0)
    assert not built, "the manager's host bookkeeping was built before the memory check"


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_runner_uses_the_store_the_factory_builds(layout):
    model = tiny_model("llama")
    runner = LlmRunner(model, RuntimeConfig(kv_layout=layout, block_size=8, max_num_blocks=24))
    assert runner.layout == layout and runner.store.layout == layout
    if layout == "paged":
        assert runner.kv_geometry is runner.store.geometry and runner.pool is runner.store.pool
        assert runner.kv_geometry.num_blocks == 24 and runner.pool.num_blocks == 25
        assert not hasattr(runner, "manager"), "the runner must hold no block manager"
    else:
        assert runner.kv_geometry is None and runner.pool is None
