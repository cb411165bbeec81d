"""Resources are bounded before they are allocated."""

import mlx.core as mx
import pytest

import mlx_ferrum.config as config_module
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import ConfigurationError, PromptTooLongError
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.kv_cache import PagedKvPool, bytes_per_block
from support.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, max_position_embeddings=256)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("capacity", [257, 10**8, 10**9])
def test_kv_capacity_above_max_position_embeddings_is_refused_naming_both(model, layout, capacity):
    cfg = RuntimeConfig(kv_layout=layout, kv_capacity=capacity, max_num_blocks=64 if layout == "paged" else None)
    with pytest.raises(ConfigurationError, match="FERRUM_KV_CAPACITY") as err:
        LlmExecutor(model, cfg)
    assert "max_position_embeddings = 256" in str(err.value) and str(capacity) in str(err.value)
    LlmExecutor(model, RuntimeConfig(kv_layout=layout, kv_capacity=256, max_num_blocks=64 if layout == "paged" else None))


def test_pool_larger_than_available_memory_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 1 << 20)  # 1 MiB "free"
    per = bytes_per_block(2, 2, 16, 64, mx.float32)
    blocks = (64 << 20) // per  # a 64 MiB pool
    with pytest.raises(ConfigurationError, match="FERRUM_KV_MAX_BLOCKS"):
        PagedKvPool(2, blocks, 2, 16, 64, mx.float32)
    PagedKvPool(2, 8, 2, 16, 64, mx.float32)  # 256 KiB fits


def test_default_paged_pool_is_sized_from_max_num_seqs_and_capacity(model):
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=16, max_num_seqs=4))
    assert ex.manager.num_blocks == 4 * 256 // 16
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=16, max_num_seqs=2, kv_capacity=64))
    assert ex.manager.num_blocks == 16  # the floor: 2 * 64 / 16 = 8 is raised to 16
    assert ex.pool.nbytes < 1 << 20


def test_prompt_too_long_names_a_fix_that_exists(model):
    eng = Engine(model, None, RuntimeConfig(kv_layout="paged", max_num_blocks=64))
    with pytest.raises(PromptTooLongError) as err:
        eng.add_request([1] * 300, SamplingParams(max_tokens=2))
    assert "raise FERRUM_KV_CAPACITY" not in str(err.value) and "max_position_embeddings" in str(err.value)
    eng = Engine(model, None, RuntimeConfig(kv_layout="paged", max_num_blocks=64, kv_capacity=100))
    with pytest.raises(PromptTooLongError, match="raise FERRUM_KV_CAPACITY"):
        eng.add_request([1] * 150, SamplingParams(max_tokens=2))
