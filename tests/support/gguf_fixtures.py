"""Tiny GGUF models written with the ``gguf`` package's writer, for the GGUF tests.

A 2-layer llama (hidden 256, so the K-quants' 256-weight blocks fit a row) with random
weights in one tensor type: the types ``gguf.quants.quantize`` supports are quantized
from random float32 values; the others (K-quants) are written as random raw blocks
whose float16 super-block factors are set to small sane values. The vocabulary is the
256 byte-level tokens plus three control tokens, a gpt2 tokenizer without merges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 256, 2, 4, 2, 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS) + 29  # a multiple of 32 rows is not needed, but keep it even: 288

#: byte offsets of the float16 factors of each raw-written block type (llama.cpp's block structs)
_FACTOR_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,), "Q3_K": (-2,), "Q2_K": (-4, -2)}
#: magnitude of those factors: keeps |w| around 0.05 (sc up to 63/127, codes up to 15/63)
_FACTOR_RANGE = {"Q4_K": (2e-5, 8e-5), "Q5_K": (1e-5, 4e-5), "Q6_K": (2e-6, 1e-5), "Q3_K": (5e-5, 2e-4),
                 "Q2_K": (1e-4, 4e-4)}


def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def quantized_bytes(type_name: str, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``values`` ``[rows, cols]`` in ``type_name``'s blocks (``uint8`` ``[rows, bytes]``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name not in _FACTOR_OFFSETS:
        return quants.quantize(values.astype(np.float32), qtype)
    rows, cols = values.shape
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    low, high = _FACTOR_RANGE[type_name]
    for offset in _FACTOR_OFFSETS[type_name]:
        at = offset % size
        factors = rng.uniform(low, high, (rows, cols // block)).astype(np.float16)
        raw[..., at:at + 2] = factors.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_shape_metadata(writer, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                         head_dim: int) -> None:
    """The shape keys every tiny test GGUF writes (sizes as given, ``VOCAB`` tokens, context
    256, RoPE base 10000, RMSNorm epsilon 1e-5), through the ``gguf`` package's writer."""
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB)


def write_llama_gguf(path: Path, type_name: str, seed: int = 0, tokenizer: bool = True,
                     architecture: str = "llama", embedding_type: Optional[str] = None,
                     heads: int = HEADS, kv_heads: int = KV_HEADS,
                     tensor_types: Optional[dict[str, str]] = None,
                     extra: Optional[Callable[[Any], None]] = None) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF at ``path`` with every matrix in ``type_name`` (the
    embedding in ``embedding_type``, and any tensor ``tensor_types`` names in its type);
    ``extra(writer)``, when given, adds metadata or tensors before the file is written.

    Returns:
        ``{gguf tensor name: float32 values as gguf dequantizes them}`` (stored row order).
    """
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    HEADS, KV_HEADS = heads, kv_heads  # noqa: N806 - the module defaults, overridden
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    write_shape_metadata(writer, LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HIDDEN // HEADS)
    writer.add_key_length(HIDDEN // HEADS)
    writer.add_value_length(HIDDEN // HEADS)
    if tokenizer:
        tokens = byte_tokens() + SPECIALS + [f"<|extra_{i}|>" for i in range(VOCAB - 256 - len(SPECIALS))]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * 256 + [3] * (VOCAB - 256))
        writer.add_token_merges([])
        writer.add_bos_token_id(256)
        writer.add_eos_token_id(258)
        writer.add_add_bos_token(False)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        head_dim = HIDDEN // HEADS
        shapes.update({
            f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        })
    reference: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        kind = embedding_type if (embedding_type and name == "token_embd.weight") else type_name
        kind = (tensor_types or {}).get(name, kind)
        values = rng.normal(0.0, 0.05, shape).astype(np.float32)
        if kind in ("F32", "F16"):
            data = values.astype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor(name, data)
            reference[name] = data.astype(np.float32)
        elif kind == "BF16":
            raw = quants.quantize(values, GGMLQuantizationType.BF16)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.BF16)
            reference[name] = quants.dequantize(raw, GGMLQuantizationType.BF16).reshape(shape)
        else:
            raw = quantized_bytes(kind, values, rng)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])
            reference[name] = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(shape)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        if architecture == "qwen2":  # q/k/v biases
            for proj, rows in (("attn_q", HEADS * head_dim), ("attn_k", KV_HEADS * head_dim),
                               ("attn_v", KV_HEADS * head_dim)):
                bias = rng.normal(0.0, 0.1, rows).astype(np.float32)
                writer.add_tensor(f"blk.{i}.{proj}.bias", bias)
                reference[f"blk.{i}.{proj}.bias"] = bias
        if architecture == "qwen3":  # RMSNorm on q and k
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, head_dim).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order -> Hugging Face's (numpy reference, written from the
    converter's ``permute``: rows ``[heads, 2, d/2]`` were stored as ``[heads, d/2, 2]``)."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, -1).transpose(0, 2, 1, 3).reshape(values.shape)
