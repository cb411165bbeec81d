"""GGUF files with scaled RoPE: Llama 3.1's ``llama3`` scaling, which llama.cpp's
converter stores as a ``rope_freqs.weight`` tensor of per-pair factors, and YaRN
(``{arch}.rope.scaling.type = yarn``). Each tiny model (float32 weights, written with
the ``gguf`` package) must give the logits of transformers' Llama built from the same
weights with the Hugging Face ``rope_parameters`` the file stands for (transformers' own
GGUF loader does not read these settings, so it cannot be the reference)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("gguf")

from support.gguf_fixtures import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, unpermute, write_llama_gguf  # noqa: E402
from mlx_ferrum.errors import UnsupportedArchitectureError  # noqa: E402
from mlx_ferrum.models import load_model  # noqa: E402
from mlx_ferrum.models.gguf.config import hf_name  # noqa: E402

THETA = 10000.0  # the fixture's rope.freq_base
CONTEXT = 256  # the fixture's context_length
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def llama3_rope_freqs(head_dim: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-pair divisors of each rotation angle for Llama 3.1 scaling, as llama.cpp's
    converter describes them: 1 for wavelengths under ``original / high``, ``factor``
    above ``original / low``, and the inverse of the linear blend of ``1/factor`` and 1
    (weighted by ``original / wavelength`` between ``low`` and ``high``) in between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _reference_model(reference: dict, rope: dict):
    """transformers' Llama with ``rope``, its state dict from ``reference`` and the norm names still to fill."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5,
        max_position_embeddings=CONTEXT, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_theta": THETA, **rope},
    )
    model = transformers.LlamaForCausalLM(config).eval()
    state = {}
    for name, values in reference.items():
        if ".attn_q." in name:
            values = unpermute(values, HEADS)
        elif ".attn_k." in name:
            values = unpermute(values, KV_HEADS)
        state[hf_name(name)] = torch.tensor(values)
    missing = set(model.state_dict()) - set(state) - {"lm_head.weight"}
    norms = {k for k in missing if k.endswith("layernorm.weight") or k == "model.norm.weight"}
    assert missing == norms  # the fixture does not return its norms: read them back from the file
    return model, state, norms


def _compare(path, reference, rope):
    torch = pytest.importorskip("torch")
    from mlx_ferrum.models.gguf.reader import read_gguf

    ours, config, _ = load_model(path, dtype="float32")
    model, state, norms = _reference_model(reference, rope)
    tensors = read_gguf(path).tensors
    for name, tensor in tensors.items():
        target = hf_name(name)
        if target in norms:
            state[target] = torch.tensor(np.asarray(tensor.data, dtype=np.float32))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 200)]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = np.array(ours(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(got - expected).max() < 1e-3
    return config


def test_llama3_rope_freqs_tensor_maps_to_transformers_llama3_scaling(tmp_path):
    factors = llama3_rope_freqs(HIDDEN // HEADS, THETA, LLAMA3["factor"], LLAMA3["low_freq_factor"],
                                LLAMA3["high_freq_factor"], LLAMA3["original_max_position_embeddings"])
    # all three regimes occur: unscaled, scaled by the factor, blended
    assert factors.min() == 1.0 and factors.max() == LLAMA3["factor"]
    assert ((factors > 1.0) & (factors < LLAMA3["factor"])).any()
    path = tmp_path / "llama31.gguf"
    reference = write_llama_gguf(path, "F32", extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    config = _compare(path, reference, LLAMA3)
    assert config["rope_scaling"]["short_factor"] == pytest.approx(factors.tolist())


def test_yarn_metadata_maps_to_transformers_yarn(tmp_path):
    def yarn(writer):
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        writer.add_rope_scaling_factor(YARN["factor"])
        writer.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])

    path = tmp_path / "yarn.gguf"
    reference = write_llama_gguf(path, "F32", extra=yarn)
    config = _compare(path, reference, YARN)
    assert config["rope_scaling"]["rope_type"] == "yarn"


def test_yarn_settings_without_a_mapping_are_refused(tmp_path):
    def yarn(writer):
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_rope_scaling_yarn_log_mul(0.1)

    write_llama_gguf(tmp_path / "yarn.gguf", "F32", extra=yarn)
    with pytest.raises(UnsupportedArchitectureError, match="yarn_log_multiplier"):
        load_model(tmp_path / "yarn.gguf")
