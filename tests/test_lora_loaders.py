"""LoRA loaders against hand-built safetensors (PEFT and mlx-lm formats), and every refusal named."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import ExecutorError, LoraError, UnknownLoraError
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.lora import load_adapter, match_adapter
from support.tiny_models import tiny_model

Q = "model.layers.0.self_attn.q_proj"  # tiny_model: hidden 32, 4 heads of 8 -> q [32 -> 32]
DOWN = "model.layers.1.mlp.down_proj"  # [64 -> 32]


def peft_folder(tmp: Path, tensors: dict, **config) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": False}
    cfg.update(config)
    (tmp / "adapter_config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(tmp / "adapter_model.safetensors"), tensors)
    return tmp


def mlx_lm_folder(tmp: Path, tensors: dict, **config) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 3.0, "dropout": 0.0}}
    cfg.update(config)
    (tmp / "adapter_config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(tmp / "adapters.safetensors"), tensors)
    return tmp


def peft_pair(path: str, fan_in: int, fan_out: int, r: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"base_model.model.{path}.lora_A.weight": mx.array(rng.standard_normal((r, fan_in), dtype=np.float32)),
            f"base_model.model.{path}.lora_B.weight": mx.array(rng.standard_normal((fan_out, r), dtype=np.float32))}


def test_peft_reads_factors_and_scales(tmp_path):
    tensors = {**peft_pair(Q, 32, 32), **peft_pair(DOWN, 64, 32, r=2, seed=1)}
    adapter = load_adapter(peft_folder(tmp_path / "a", tensors, rank_pattern={"down_proj": 2},
                                       alpha_pattern={"down_proj": 6}))
    assert adapter.format == "peft" and adapter.name == "a" and adapter.rank == 4
    q, down = adapter.modules[Q], adapter.modules[DOWN]
    assert q.a.shape == (32, 4) and q.b.shape == (4, 32) and q.scale == 2.0  # alpha / r
    assert down.rank == 2 and down.scale == 3.0  # alpha_pattern 6 / r 2
    a = np.array(tensors[f"base_model.model.{Q}.lora_A.weight"])
    b = np.array(tensors[f"base_model.model.{Q}.lora_B.weight"])
    np.testing.assert_allclose(np.array(q.a) @ np.array(q.b), 2.0 * a.T @ b.T, rtol=1e-5, atol=1e-5)
    rs = load_adapter(peft_folder(tmp_path / "rs", peft_pair(Q, 32, 32), use_rslora=True))
    assert rs.modules[Q].scale == pytest.approx(8 / 2.0)  # alpha / sqrt(4)


def test_mlx_lm_reads_factors_and_scale(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((32, 4), dtype=np.float32), rng.standard_normal((4, 32), dtype=np.float32)
    adapter = load_adapter(mlx_lm_folder(tmp_path / "m", {f"{Q}.lora_a": mx.array(a), f"{Q}.lora_b": mx.array(b)}),
                           name="mine")
    assert adapter.format == "mlx_lm" and adapter.name == "mine"
    np.testing.assert_allclose(np.array(adapter.modules[Q].b), 3.0 * b, rtol=1e-6)


@pytest.mark.parametrize("case,expected", [
    ("peft_dora", "DoRA"),
    ("peft_ia3", "IA3"),
    ("peft_magnitude", "DoRA magnitude"),
    ("peft_modules_to_save", "modules_to_save"),
    ("peft_target_parameters", "target_parameters"),
    ("peft_bin", "adapter_model.bin"),
    ("peft_half_pair", "not both lora_A and lora_B"),
    ("mlx_dora", "DoRA"),
    ("mlx_full", "fine_tune_type 'full'"),
    ("mlx_no_scale", "'scale'"),
    ("mlx_moe_3d", "mixture-of-experts"),
    ("no_config", "no adapter_config.json"),
    ("not_a_folder", "no LoRA adapter folder"),
    ("peft_rank_disagrees", r"r = 4 in adapter_config.json but its factors have rank 8.*disagree"),
    ("peft_rank_pattern_disagrees", r"r = 2 in adapter_config.json but its factors have rank 4.*disagree"),
    ("peft_integer", "dtype int32"),
    ("mlx_rank_disagrees", r"lora_parameters.rank = 4 in adapter_config.json but its factors have rank 8.*disagree"),
    ("mlx_integer", "dtype int8"),
])
def test_refusals_are_named(tmp_path, case, expected):
    pair = peft_pair(Q, 32, 32)
    folder = tmp_path / case
    if case == "peft_dora":
        peft_folder(folder, pair, use_dora=True)
    elif case == "peft_ia3":
        peft_folder(folder, pair, peft_type="IA3")
    elif case == "peft_magnitude":
        peft_folder(folder, {**pair, f"base_model.model.{Q}.lora_magnitude_vector": mx.ones((32,))})
    elif case == "peft_modules_to_save":
        peft_folder(folder, pair, modules_to_save=["lm_head"])
    elif case == "peft_target_parameters":
        peft_folder(folder, pair, target_parameters=["mlp.experts.gate_up_proj"])
    elif case == "peft_bin":
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        (folder / "adapter_model.bin").write_bytes(b"pickle")
    elif case == "peft_half_pair":
        peft_folder(folder, {k: v for k, v in pair.items() if "lora_A" in k})
    elif case == "mlx_dora":
        mlx_lm_folder(folder, {f"{Q}.lora_a": mx.ones((32, 4)), f"{Q}.lora_b": mx.ones((4, 32))}, fine_tune_type="dora")
    elif case == "mlx_full":
        mlx_lm_folder(folder, {}, fine_tune_type="full")
    elif case == "mlx_no_scale":
        mlx_lm_folder(folder, {f"{Q}.lora_a": mx.ones((32, 4)), f"{Q}.lora_b": mx.ones((4, 32))},
                      lora_parameters={"rank": 4})
    elif case == "mlx_moe_3d":
        mlx_lm_folder(folder, {f"{Q}.lora_a": mx.ones((8, 32, 4)), f"{Q}.lora_b": mx.ones((8, 4, 32))})
    elif case == "peft_rank_disagrees":  # the config's r is what lora_alpha / r scales by
        peft_folder(folder, peft_pair(Q, 32, 32, r=8), r=4)
    elif case == "peft_rank_pattern_disagrees":
        peft_folder(folder, pair, rank_pattern={"q_proj": 2})
    elif case == "peft_integer":
        peft_folder(folder, {k: (v * 10).astype(mx.int32) for k, v in pair.items()})
    elif case == "mlx_rank_disagrees":
        mlx_lm_folder(folder, {f"{Q}.lora_a": mx.ones((32, 8)), f"{Q}.lora_b": mx.ones((8, 32))})
    elif case == "mlx_integer":
        mlx_lm_folder(folder, {f"{Q}.lora_a": mx.ones((32, 4), dtype=mx.int8), f"{Q}.lora_b": mx.ones((4, 32), dtype=mx.int8)})
    elif case == "no_config":
        folder.mkdir()
    elif case == "not_a_folder":
        folder = tmp_path / "missing" / "x" / "y"
    with pytest.raises(LoraError, match=expected):
        load_adapter(folder)


@pytest.mark.parametrize("case,expected", [
    ("shape", r"q_proj expects A \[32, r\] and B \[r, 32\].*A \[48, 4\]"),
    ("unknown_module", "model.layers.7.self_attn.q_proj.*does not have"),
    ("norm", r"input_layernorm \(RMSNorm\) is not supported"),
    ("lm_head", "lm_head.*outside the decoder layers"),
    ("rank", "rank 32, above max_lora_rank=16"),
])
def test_mismatched_adapters_are_refused_by_name(tmp_path, case, expected):
    model = tiny_model("llama")
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64, enable_lora=True,
                                          max_lora_rank=16))
    tensors = {
        "shape": peft_pair(Q, 48, 32),
        "unknown_module": peft_pair("model.layers.7.self_attn.q_proj", 32, 32),
        "norm": peft_pair("model.layers.0.input_layernorm", 32, 32),
        "lm_head": peft_pair("lm_head", 32, 97),
        "rank": peft_pair(Q, 32, 32, r=32),
    }[case]
    with pytest.raises(LoraError, match=expected):
        ex.add_lora(case, str(peft_folder(tmp_path / case, tensors, **({"r": 32} if case == "rank" else {}))))
    assert ex.list_loras() == []


def test_moe_experts_are_refused_by_name(tmp_path):
    """Qwen3-MoE experts are SwitchLinear stacks: refused, naming the module and type."""
    from mlx_ferrum.models.qwen3_moe import Model, ModelArgs

    args = ModelArgs.from_dict(dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                    moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, num_experts=4, num_experts_per_tok=2, vocab_size=50))
    model = Model(args)
    path = next(p for p, m in model.named_modules() if type(m).__name__ == "SwitchLinear")
    adapter = load_adapter(peft_folder(tmp_path / "moe", peft_pair(path, 32, 16)))
    with pytest.raises(LoraError, match=rf"{path} \(SwitchLinear\) is not supported"):
        match_adapter(adapter, model, 16)


def test_fused_qkv_lora_is_split_into_the_models_projections(tmp_path):
    """Phi-3 checkpoints fuse q/k/v; the model splits them at load, and so is a LoRA on qkv_proj."""
    model = tiny_model("llama")  # q 32, k 16, v 16 outputs
    pair = peft_pair("model.layers.0.self_attn.qkv_proj", 32, 64)
    adapter = load_adapter(peft_folder(tmp_path / "fused", pair))
    modules = match_adapter(adapter, model, 16)
    full = np.array(adapter.modules["model.layers.0.self_attn.qkv_proj"].b)
    widths = {"q_proj": (0, 32), "k_proj": (32, 48), "v_proj": (48, 64)}
    for name, (lo, hi) in widths.items():
        np.testing.assert_array_equal(np.array(modules[f"model.layers.0.self_attn.{name}"].b), full[:, lo:hi])


def test_registry_names_and_slots(tmp_path):
    model = tiny_model("llama")
    off = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64))
    with pytest.raises(ExecutorError, match="enable_lora"):
        off.add_lora("a", str(tmp_path))
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64, enable_lora=True,
                                          max_loras=1, max_cpu_loras=2))
    for i, name in enumerate("abc"):
        ex.add_lora(name, str(peft_folder(tmp_path / name, peft_pair(Q, 32, 32, seed=i))))
    assert ex.list_loras() == ["a", "b", "c"]
    with pytest.raises(UnknownLoraError, match="unknown LoRA adapter 'zzz'.*'a', 'b', 'c'"):
        ex.acquire_lora("zzz", "r0")
    assert ex.acquire_lora("a", "r1") == 0  # a was dropped from memory (max_cpu_loras 2) by c: read again
    assert ex.acquire_lora("b", "r2") is None  # the only slot is pinned by r1
    ex.release_lora("r1")
    assert ex.acquire_lora("b", "r2") == 0  # a evicted from the slot
    with pytest.raises(LoraError, match="used by 1 running request"):
        ex.remove_lora("b")
    ex.release_lora("r2")
    assert ex.acquire_lora("a", "r3") == 0
    m = ex.lora_metrics_snapshot()
    # 3 registrations, then a and b read again after the memory LRU (2) dropped them
    assert m["slot_evictions"] == 2 and m["cpu_evictions"] == 3 and m["loads"] == 5
    assert len(m["loaded"]) == 2
    assert m["requests"] == {"a": 2, "b": 1, "c": 0} and m["resident"] == {"a": 0}
    ex.release_lora("r3")
    ex.remove_lora("a")
    assert ex.list_loras() == ["b", "c"] and ex.lora_metrics_snapshot()["resident"] == {}


def test_lora_settings_from_the_environment(monkeypatch):
    from mlx_ferrum.errors import ConfigurationError

    monkeypatch.setenv("FERRUM_ENABLE_LORA", "1")
    monkeypatch.setenv("FERRUM_MAX_LORAS", "3")
    monkeypatch.setenv("FERRUM_MAX_LORA_RANK", "32")
    cfg = RuntimeConfig()
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (True, 3, 32, 3)
    assert RuntimeConfig(max_loras=2).max_loras == 2  # an explicit argument beats the environment
    monkeypatch.setenv("FERRUM_MAX_CPU_LORAS", "2")
    with pytest.raises(ConfigurationError, match="FERRUM_MAX_CPU_LORAS=2 is not valid.*at least max_loras=3"):
        RuntimeConfig()
    monkeypatch.setenv("FERRUM_MAX_LORAS", "abc")
    with pytest.raises(ConfigurationError, match="FERRUM_MAX_LORAS='abc' is not an integer"):
        RuntimeConfig()
