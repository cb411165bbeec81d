"""Config spellings and checkpoint wrappers of the new families, each checked against
a load of the same weights in the canonical layout, or against transformers."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from support.hf_reference import VOCAB, make_checkpoint, torch, transformers
from mlx_ferrum.errors import UnsupportedArchitectureError
from mlx_ferrum.layers.rope import Rope, rope_parameters
from mlx_ferrum.models import SUPPORTED_MODEL_TYPES, family, load_model


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_text")
    make_checkpoint("gemma3_text", folder, window=6)
    return folder


def _ids(n=40):
    return mx.array([[int(t) for t in np.random.default_rng(1).integers(3, VOCAB, n)]])


def test_gemma3_multimodal_wrapper_loads_the_text_model(gemma_folder, tmp_path):
    ref, _, _ = load_model(gemma_folder)
    folder = tmp_path / "gemma3"
    folder.mkdir()
    text = json.loads((gemma_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    weights = mx.load(str(gemma_folder / "model.safetensors"))
    renamed = {"language_model." + k: v for k, v in weights.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = mx.zeros((2, 2))
    mx.save_safetensors(str(folder / "model.safetensors"), renamed)
    model, _, _ = load_model(folder)
    assert model.args.model_type == "gemma3_text"
    assert mx.array_equal(model(_ids()), ref(_ids()))


def test_gemma3_legacy_config_keys_give_the_same_model(gemma_folder, tmp_path):
    """``sliding_window_pattern`` + ``rope_local_base_freq`` + ``rope_scaling`` (Hub
    configs before transformers 5) describe the same layers as ``layer_types`` +
    per-type ``rope_parameters``."""
    ref, _, _ = load_model(gemma_folder)
    folder = tmp_path / "legacy"
    shutil.copytree(gemma_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    rope = cfg.pop("rope_parameters")
    del cfg["layer_types"]
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 3
    cfg["rope_theta"] = rope["full_attention"]["rope_theta"]
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, _ = load_model(folder)
    assert mx.array_equal(model(_ids()), ref(_ids()))


def test_every_registered_family_builds(gemma_folder):
    for model_type in SUPPORTED_MODEL_TYPES:
        module = family(model_type)
        assert hasattr(module, "Model") and hasattr(module.ModelArgs, "from_dict")
    with pytest.raises(UnsupportedArchitectureError, match="qwen3_moe.*gpt_oss|gpt_oss.*qwen3_moe"):
        family("mamba")


@pytest.mark.parametrize("start", [0, 300])
def test_longrope_matches_transformers_on_both_sides_of_the_original_context(start):
    """Short factors up to ``original_max_position_embeddings``, long ones past it, and
    the attention factor, as transformers' ``Phi3RotaryEmbedding`` computes them."""
    half = 8
    cfg = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)],
        },
    )
    from transformers.models.phi3 import modeling_phi3

    rotary = modeling_phi3.Phi3RotaryEmbedding(cfg)
    x = np.random.default_rng(0).standard_normal((1, 4, 10, 16)).astype(np.float32)
    xt = torch.tensor(x)
    cos, sin = rotary(xt, torch.arange(start, start + 10)[None])
    expected, _ = modeling_phi3.apply_rotary_pos_emb(xt, xt, cos, sin)
    ours = Rope(16, rope_parameters(cfg.to_dict()), 1024)(mx.array(x), mx.array([start]))
    assert np.abs(np.array(ours) - expected.numpy()).max() < 1e-4


@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_qwen2_sliding_layers_follow_transformers_layer_types(use_sliding_window):
    from mlx_ferrum.models.llama import layer_windows

    cfg = transformers.Qwen2Config(
        num_hidden_layers=6, sliding_window=32, use_sliding_window=use_sliding_window, max_window_layers=4
    )
    expected = [32 if t == "sliding_attention" else None for t in cfg.layer_types]
    as_saved = cfg.to_dict()
    assert layer_windows(as_saved, "qwen2", 6) == expected
    del as_saved["layer_types"]  # older configs: from max_window_layers
    if not use_sliding_window:
        as_saved["sliding_window"] = 32
    assert layer_windows(as_saved, "qwen2", 6) == expected


def test_qwen3_moe_fused_expert_layout_loads_the_same(tmp_path):
    """transformers 5 keeps Qwen3-MoE experts fused in memory (``experts.gate_up_proj``
    ``[E, 2I, H]``, gate rows first; ``experts.down_proj`` ``[E, H, I]``); a checkpoint
    written that way must give the same model as the per-expert Hub layout."""
    src = tmp_path / "hub"
    make_checkpoint("qwen3_moe", src)
    ref, cfg, _ = load_model(src)
    weights = mx.load(str(src / "model.safetensors"))
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(src / "config.json", fused / "config.json")
    out = {k: v for k, v in weights.items() if ".experts." not in k}
    experts = cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in weights:
            continue
        gate = mx.stack([weights[f"{p}.{e}.gate_proj.weight"] for e in range(experts)])
        up = mx.stack([weights[f"{p}.{e}.up_proj.weight"] for e in range(experts)])
        out[f"{p}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[f"{p}.down_proj"] = mx.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(experts)])
    mx.save_safetensors(str(fused / "model.safetensors"), out)
    model, _, _ = load_model(fused)
    assert mx.array_equal(model(_ids()), ref(_ids()))
