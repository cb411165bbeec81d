"""qwen3moe (stacked expert tensors), phi3 (fused attn_qkv and gate+up ffn_up) and gemma3
(sandwich norms stored as 1 + w, sliding-window and global layers) GGUF files: float32
logits at every position and greedy tokens through the engine (both KV layouts) against
transformers' GGUF loader, which dequantizes the file itself."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mlx_ferrum as mf  # noqa: E402
from support.gguf_fixtures import SPECIALS, VOCAB, byte_tokens, quantized_bytes, write_shape_metadata  # noqa: E402
from mlx_ferrum.models import load_model  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 4, 2, 128
EXPERTS, USED, EXPERT_FFN = 4, 2, 64
HEAD_DIM = HIDDEN // HEADS
#: gemma3: 6 layers so that one is global (llama.cpp: every 6th), a window shorter than the prompts
GEMMA_LAYERS, GEMMA_WINDOW = 6, 8


def _layers(architecture: str) -> int:
    return GEMMA_LAYERS if architecture == "gemma3" else LAYERS


def _matrix_shapes(architecture: str, layer: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp tensor name -> numpy shape of one layer's matrices."""
    p = f"blk.{layer}"
    if architecture == "gemma3":
        return {
            f"{p}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{p}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.ffn_gate.weight": (FFN, HIDDEN),
            f"{p}.ffn_up.weight": (FFN, HIDDEN),
            f"{p}.ffn_down.weight": (HIDDEN, FFN),
        }
    if architecture == "phi3":
        return {
            f"{p}.attn_qkv.weight": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            f"{p}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.ffn_up.weight": (2 * FFN, HIDDEN),  # gate rows, then up rows
            f"{p}.ffn_down.weight": (HIDDEN, FFN),
        }
    return {
        f"{p}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
        f"{p}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        f"{p}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        f"{p}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
        f"{p}.ffn_gate_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
        f"{p}.ffn_up_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
        f"{p}.ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
    }


def write_family_gguf(path: Path, architecture: str, type_name: str, seed: int = 0) -> None:
    """A tiny random ``architecture`` GGUF with every matrix in ``type_name`` (F32, F16
    or Q8_0), norms and the router in F32, an untied ``output``."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    write_shape_metadata(writer, _layers(architecture), HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM)
    if architecture == "gemma3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(GEMMA_WINDOW)
    if architecture == "qwen3moe":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(USED)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    # one merge ("a b" -> "ab"): the tokenizer needs a non-empty merge list
    tokens = byte_tokens() + SPECIALS + ["ab"] + [f"<|extra_{i}|>" for i in range(VOCAB - 257 - len(SPECIALS))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * len(SPECIALS) + [1] + [3] * (VOCAB - 257 - len(SPECIALS)))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(257)  # Phi3Config's default pad id (32000) lies outside this vocabulary
    writer.add_add_bos_token(False)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    if architecture != "gemma3":  # Gemma ties its embeddings
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(_layers(architecture)):
        shapes.update(_matrix_shapes(architecture, i))
    for name, shape in shapes.items():
        values = rng.normal(0.0, 0.05, shape).astype(np.float32)
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, values.astype(np.float32 if type_name == "F32" else np.float16))
        else:  # a stacked expert tensor is quantized row by row, as a matrix of all experts' rows
            raw = quantized_bytes(type_name, values.reshape(-1, shape[-1]), rng)
            raw = raw.reshape(shape[:-1] + raw.shape[-1:])
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[type_name])
    # gemma3 norms are stored as 1 + w (llama.cpp's converter); uniform(0.8, 1.2) either way
    norms = ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if architecture == "gemma3" else ())
    for i in range(_layers(architecture)):
        if architecture == "qwen3moe":
            router = rng.normal(0.0, 0.5, (EXPERTS, HIDDEN)).astype(np.float32)
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
        if architecture in ("qwen3moe", "gemma3"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, HEAD_DIM).astype(np.float32))
        for norm in norms:
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(folder: Path, architecture: str):
    # transformers' GGUF config mapping drops qwen3moe.expert_feed_forward_length (it
    # keeps Qwen3MoeConfig's default): pass the file's value explicitly
    # (and the gemma3 attention scale, which llama.cpp derives from head_dim and
    # transformers leaves at Gemma3TextConfig's 256)
    extra = {"qwen3moe": {"moe_intermediate_size": EXPERT_FFN},
             "gemma3": {"query_pre_attn_scalar": HEAD_DIM}}.get(architecture, {})
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf",
                                                             dtype=torch.float32, **extra).eval()


CASES = [("qwen3moe", "qwen3_moe", "F32"), ("qwen3moe", "qwen3_moe", "Q8_0"),
         ("phi3", "phi3", "F16"), ("phi3", "phi3", "Q8_0"), ("gemma3", "gemma3_text", "F32"),
         ("gemma3", "gemma3_text", "Q8_0")]


@pytest.mark.parametrize("architecture,model_type,type_name", CASES)
def test_gguf_family_logits_match_transformers(tmp_path, architecture, model_type, type_name):
    write_family_gguf(tmp_path / "model.gguf", architecture, type_name)
    ours, config, _ = load_model(tmp_path / "model.gguf", dtype="float32")
    assert config["model_type"] == model_type
    ref = _reference(tmp_path, architecture)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 24)]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].numpy()
    got = np.array(ours(mx.array([prompt]))[0])
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-3


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_qwen3moe_k_quant_experts_match_transformers(tmp_path, monkeypatch, type_name):
    # K-quant blocks hold 256 weights: widen every input axis to 256
    module = sys.modules[__name__]
    for name, value in {"HIDDEN": 256, "HEAD_DIM": 64, "FFN": 256, "EXPERT_FFN": 256}.items():
        monkeypatch.setattr(module, name, value)
    write_family_gguf(tmp_path / "model.gguf", "qwen3moe", type_name)
    ours, config, _ = load_model(tmp_path / "model.gguf", dtype="float32")
    down = "model.layers.0.mlp.switch_mlp.down_proj"
    if type_name == "Q6_K":  # 16-weight groups: stacked experts load as float32
        assert "quantization" not in config or down not in config["quantization"]
    else:
        assert config["quantization"][down]["bits"] in (4, 5)
    ref = _reference(tmp_path, "qwen3moe")
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 24)]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].numpy()
    got = np.array(ours(mx.array([prompt]))[0])
    assert np.abs(got - expected).max() <= 1e-3


@pytest.mark.parametrize("architecture", ["qwen3moe", "phi3", "gemma3"])
def test_gguf_family_greedy_tokens_match_transformers(tmp_path, architecture):
    write_family_gguf(tmp_path / "model.gguf", architecture, "Q8_0", seed=2)
    ref = _reference(tmp_path, architecture)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 256, 12)]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    model, tokenizer = mf.load(str(tmp_path / "model.gguf"), dtype="float32")
    for layout in ("contiguous", "paged"):
        config = mf.RuntimeConfig(kv_layout=layout, block_size=16)
        got = [c.token for c in mf.stream_generate(model, tokenizer, prompt, max_tokens=32, temperature=0.0,
                                                   ignore_eos=True, config=config) if c.token is not None]
        assert got == expected, layout
