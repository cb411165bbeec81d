"""LoRA parity: PEFT adapters against transformers + peft, the same adapters in mlx-lm's
format, an MLX 4-bit base against mlx-lm's ``LoRALinear``, and mixed-adapter batches
against solo runs in both KV layouts (compiled and eager decode)."""

from __future__ import annotations

import numpy as np
import pytest

from support.lora_support import (
    executor_with,
    make_base,
    make_peft_adapter,
    peft_to_mlx_lm,
    reference_greedy,
    reference_logits,
    run_greedy,
)

import mlx.core as mx

from mlx_ferrum.models.loader import load_model

PROMPT = [1, 17, 42, 99, 5, 23, 64, 8, 77, 31, 12]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """A tiny base (transformers) and three PEFT adapters: plain, rsLoRA with patterns, q/v only."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_base(root / "base", request.param, seed=3)
    adapters = {
        "plain": make_peft_adapter(base, root / "plain", seed=11, rank=4, alpha=8),
        "rslora": make_peft_adapter(base, root / "rslora", seed=12, rank=8, alpha=4, use_rslora=True,
                                    rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 16}),
        "qv": make_peft_adapter(base, root / "qv", seed=13, rank=4, alpha=4, targets=("q_proj", "v_proj")),
    }
    model, _, _ = load_model(root / "base", dtype=mx.float32)
    return root, base, adapters, model


def test_peft_adapters_match_transformers_peft(setup):
    """fp32 logits at every position within 1e-4 of transformers + peft; 32 greedy tokens identical."""
    root, base, adapters, model = setup
    ex = executor_with(model)
    for name, ref_model in adapters.items():
        ex.add_lora(name, str(root / name))
        slot = ex.acquire_lora(name, f"req-{name}")
        ref_tokens = reference_greedy(ref_model, PROMPT, 32)
        tokens, logits = run_greedy(ex, [PROMPT], [slot], 32)
        assert tokens[0] == ref_tokens, f"{name}: greedy tokens differ from transformers + peft"
        ref = reference_logits(ref_model, PROMPT + ref_tokens[:-1])
        err = float(np.abs(logits[0] - ref).max())
        assert err < 1e-4, f"{name}: max |logit difference| {err:.2e} at some position"
        ex.release_lora(f"req-{name}")
    # the base (no slot) is transformers without the adapter, and the adapters do change the output
    tokens, logits = run_greedy(ex, [PROMPT], [-1], 4)
    assert np.abs(logits[0][: len(PROMPT)] - reference_logits(base, PROMPT)).max() < 1e-4
    assert np.abs(reference_logits(adapters["plain"], PROMPT) - reference_logits(base, PROMPT)).max() > 1e-2


def test_mlx_lm_format_gives_the_same_logits(setup):
    root, base, adapters, model = setup
    ex = executor_with(model)
    for name in ("plain", "qv"):
        ex.add_lora(name, str(root / name))
        ex.add_lora(name + "-mlx", str(peft_to_mlx_lm(root / name, root / (name + "-mlx"))))
        a = ex.acquire_lora(name, "a")
        b = ex.acquire_lora(name + "-mlx", "b")
        (_, (la,)), (_, (lb,)) = run_greedy(ex, [PROMPT], [a], 3), run_greedy(ex, [PROMPT], [b], 3)
        assert np.abs(la - lb).max() < 1e-6
        ex.release_lora("a")
        ex.release_lora("b")


@pytest.mark.parametrize("layout,eager", [("paged", False), ("paged", True), ("contiguous", None)])
def test_mixed_adapter_batch_equals_solo_runs(setup, layout, eager):
    """Three adapters and no adapter in one batch (prefill and every decode step): each row
    gets exactly its solo output (tokens; logits to float rounding of the batched base)."""
    root, _, adapters, model = setup
    ex = executor_with(model, layout=layout, eager=eager)
    slots = []
    for name in adapters:
        ex.add_lora(name, str(root / name))
        slots.append(ex.acquire_lora(name, name))
    slots.append(-1)
    prompts = [PROMPT, PROMPT[:7], PROMPT[2:], PROMPT] if layout == "paged" else [PROMPT] * 4
    batch_tokens, batch_logits = run_greedy(ex, prompts, slots, 12, "batch")
    for i, (p, s) in enumerate(zip(prompts, slots)):
        (tokens,), (logits,) = run_greedy(ex, [p], [s], 12, "solo")
        assert batch_tokens[i] == tokens, f"row {i} (slot {s}) differs from its solo run"
        np.testing.assert_allclose(batch_logits[i], logits, atol=1e-5, rtol=0)
    assert len({tuple(t) for t in batch_tokens[:3]} | {tuple(batch_tokens[3])}) > 1


def test_compiled_decode_sees_a_slot_reloaded_with_another_adapter(setup):
    """One slot, two adapters in turn: the compiled decode step takes the stacks as inputs,
    so the second adapter's decode is its own (not the first's, baked into a trace)."""
    root, _, adapters, model = setup
    ex = executor_with(model, max_loras=1)
    ex.add_lora("plain", str(root / "plain"))
    ex.add_lora("qv", str(root / "qv"))
    first = run_greedy(ex, [PROMPT], [ex.acquire_lora("plain", "r1")], 8)[0][0]
    ex.release_lora("r1")
    second = run_greedy(ex, [PROMPT], [ex.acquire_lora("qv", "r2")], 8)[0][0]
    assert ex.lora_metrics_snapshot()["slot_evictions"] == 1
    assert first == reference_greedy(adapters["plain"], PROMPT, 8)
    assert second == reference_greedy(adapters["qv"], PROMPT, 8)
    assert ex.compiled_decode


def test_quantized_base_matches_mlx_lm_lora_linear(tmp_path):
    """An MLX 4-bit base (written by mlx_lm.convert): logits within 1e-4 of mlx-lm with the
    same adapter loaded by ``mlx_lm.tuner.utils.load_adapters`` (unfused ``LoRALinear``)."""
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    from mlx_lm.tuner.utils import load_adapters

    from support.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path / "q4", "llama3", quantized=True)
    ours, _, _ = load_model(folder, dtype=mx.float32)
    theirs = mlx_lm_utils.load_model(folder)[0]
    theirs.set_dtype(mx.float32)
    mx.random.seed(5)
    weights = {}
    keys = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    modules = dict(ours.named_modules())
    from mlx_ferrum.lora.registry import module_dims

    for layer in range(len(ours.layers)):
        for key in keys:
            path = f"model.layers.{layer}.{key}"
            fan_in, fan_out = module_dims(modules[path])
            weights[f"{path}.lora_a"] = mx.random.normal((fan_in, 8)) * 0.1
            weights[f"{path}.lora_b"] = mx.random.normal((8, fan_out)) * 0.1
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    import json

    (adapter / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                                         "keys": keys}}))
    theirs = load_adapters(theirs, str(adapter))
    ids = [3, 9, 27, 81, 40, 12, 6, 50]
    ref = np.array(theirs(mx.array([ids]))[0].astype(mx.float32))
    ex = executor_with(ours)
    ex.add_lora("q4", str(adapter))
    _, (logits,) = run_greedy(ex, [ids], [ex.acquire_lora("q4", "r")], 1)
    err = float(np.abs(logits - ref).max())
    assert err < 1e-4, f"max |logit difference| {err:.2e}"
    base = np.array(mlx_lm_utils.load_model(folder)[0](mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(base - ref).max() > 1e-2  # the adapter matters
