"""RuntimeConfig: environment parsing, precedence, and errors that name the variable."""

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import ConfigurationError

FLAGS = ["FERRUM_METAL_PAGED_KV", "FERRUM_PAGED_BLOCK_SIZE", "FERRUM_KV_MAX_BLOCKS", "FERRUM_KV_CAPACITY",
         "FERRUM_PAGED_MAX_SEQS", "FERRUM_CHUNKED_PREFILL", "FERRUM_PREFIX_CACHE", "FERRUM_METAL_KERNELS"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for f in FLAGS:
        monkeypatch.delenv(f, raising=False)


def test_defaults():
    c = RuntimeConfig()
    assert (c.kv_layout, c.block_size, c.max_num_blocks, c.kv_capacity) == ("contiguous", 16, None, None)
    # prefix caching is on by default, as in vLLM V1 (and mlx_lm.server's prompt cache)
    assert (c.max_num_seqs, c.prefill_chunk_size, c.prefix_cache, c.metal_kernels) == (32, 512, True, True)
    assert (c.speculative_disable_by_batch_size, c.speculative_min_acceptance) == (2, 0.2)


def test_environment_and_explicit_precedence(monkeypatch):
    monkeypatch.setenv("FERRUM_METAL_PAGED_KV", "1")
    monkeypatch.setenv("FERRUM_PAGED_BLOCK_SIZE", "32")
    monkeypatch.setenv("FERRUM_KV_MAX_BLOCKS", "100")
    monkeypatch.setenv("FERRUM_PREFIX_CACHE", "1")
    monkeypatch.setenv("FERRUM_METAL_KERNELS", "0")
    c = RuntimeConfig()
    assert (c.kv_layout, c.block_size, c.max_num_blocks, c.prefix_cache, c.metal_kernels) == ("paged", 32, 100, True, False)
    c2 = RuntimeConfig(kv_layout="contiguous", block_size=8)
    assert (c2.kv_layout, c2.block_size) == ("contiguous", 8)
    monkeypatch.setenv("FERRUM_METAL_PAGED_KV", "0")
    assert RuntimeConfig().kv_layout == "contiguous"


@pytest.mark.parametrize(
    "var,value",
    [("FERRUM_PAGED_BLOCK_SIZE", "abc"), ("FERRUM_PAGED_BLOCK_SIZE", "24"), ("FERRUM_PAGED_BLOCK_SIZE", "4"),
     ("FERRUM_PAGED_BLOCK_SIZE", "256"), ("FERRUM_METAL_PAGED_KV", "maybe"), ("FERRUM_KV_MAX_BLOCKS", "0"),
     ("FERRUM_KV_CAPACITY", "-5"), ("FERRUM_PAGED_MAX_SEQS", "x"), ("FERRUM_CHUNKED_PREFILL", "0"),
     ("FERRUM_PREFIX_CACHE", "2")],
)
def test_malformed_values_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigurationError, match=var):
        RuntimeConfig()


def test_malformed_explicit_value_names_the_field():
    with pytest.raises(ConfigurationError, match="RuntimeConfig.block_size"):
        RuntimeConfig(block_size=12)
    with pytest.raises(ConfigurationError, match="kv_layout"):
        RuntimeConfig(kv_layout="ring")
