"""MLX 4-bit Qwen3-MoE (written by ``mlx_lm convert``) against mlx-lm's own output.

The float checkpoint comes from transformers' ``save_pretrained``; its config is
rewritten with the older key spellings mlx-lm 0.32 reads (``num_experts``,
``rope_theta``), which also checks that our loader takes both spellings. mlx-lm
quantizes it (experts as ``QuantizedSwitchLinear``, the router at 8 bits); both
runtimes then load the same folder.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from support.hf_reference import make_checkpoint
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
from mlx_ferrum.layers.moe import QuantizedSwitchLinear
from mlx_ferrum.models import load_model

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
mlx_lm_generate = pytest.importorskip("mlx_lm.generate")
mlx_lm_convert = pytest.importorskip("mlx_lm.convert")

ATOL = 1e-4
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def quantized_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_q4")
    make_checkpoint("qwen3_moe", root / "src")
    cfg = json.loads((root / "src" / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (root / "src" / "config.json").write_text(json.dumps(cfg))
    mlx_lm_convert.convert(str(root / "src"), str(root / "out"), quantize=True, q_group_size=32, q_bits=4)
    return root / "out"


def _greedy(ex, prompt):
    out = ex.prefill(PrefillInput(input_ids=mx.array([prompt])))
    toks, handle = [int(mx.argmax(out.logits[0, -1]).item())], out.kv_cache
    for _ in range(NEW_TOKENS - 1):
        step = ex.decode(DecodeInput(input_ids=mx.array([[toks[-1]]]), kv_cache=handle))
        handle = step.kv_cache
        toks.append(int(mx.argmax(step.logits.reshape(-1)).item()))
    return toks


def test_mlx_4bit_qwen3_moe_matches_mlx_lm(quantized_folder):
    ours, config, _ = load_model(quantized_folder)
    ref, _ = mlx_lm_utils.load_model(quantized_folder)
    assert isinstance(ours.model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert ours.model.layers[0].mlp.gate.bits == 8
    for seed in range(8):
        prompt = [int(t) for t in mx.random.randint(3, config["vocab_size"], (24,), key=mx.random.key(seed)).tolist()]
        expected = [int(t) for t, _ in mlx_lm_generate.generate_step(mx.array(prompt), ref, max_tokens=NEW_TOKENS)]
        seq = mx.array([prompt + expected])
        ref_logits = ref(seq)[0]
        top2 = mx.sort(ref_logits[len(prompt) - 1 : -1], axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min().item() > 10 * ATOL:
            break
    err = mx.abs(ours(seq)[0] - ref_logits).max().item()
    assert err <= ATOL, f"max |logits - mlx-lm| = {err:.3g}"
    for layout in ("contiguous", "paged"):
        cfg = RuntimeConfig(kv_layout=layout, kv_capacity=256, max_num_blocks=64 if layout == "paged" else None)
        assert _greedy(LlmExecutor(ours, config=cfg), prompt) == expected, layout


def test_mlx_quantized_gpt_oss_checkpoint_loads_as_quantized(tmp_path):
    """A gpt-oss checkpoint in mlx-lm's quantized format (stacked ``experts.*_proj``
    with per-expert biases, an 8-bit router, ``config["quantization"]``) loads into
    ``QuantizedSwitchLinear`` experts and computes what the in-memory quantized model
    computes. (mlx-lm 0.32's own gpt-oss conversion reads the fused Hub tensors in the
    MXFP4 release's orientation, so it cannot serve as the reference here.)"""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    src = tmp_path / "src"
    make_checkpoint("gpt_oss", src)
    model, config, _ = load_model(src)

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith("mlp.router"):
            return {"group_size": 32, "bits": 8}
        return {"group_size": 32, "bits": 4}

    nn.quantize(model, class_predicate=predicate)
    out = tmp_path / "q"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    quant = {"group_size": 32, "bits": 4, "mode": "affine"}
    for i in range(len(model.layers)):
        quant[f"model.layers.{i}.mlp.router"] = {"group_size": 32, "bits": 8}
    (out / "config.json").write_text(json.dumps({**config, "quantization": quant}))
    loaded, _, _ = load_model(out)
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts.gate_proj, QuantizedSwitchLinear) and "bias" in experts.gate_proj
    assert loaded.model.layers[0].mlp.router.bits == 8
    ids = mx.array([[int(t) for t in mx.random.randint(3, config["vocab_size"], (40,), key=mx.random.key(3)).tolist()]])
    assert mx.array_equal(loaded(ids), model(ids))
