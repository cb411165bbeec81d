"""The Llama family, driven by a Hugging Face ``config.json``.

Covers Llama 2/3/3.1/3.2 (``rope_scaling`` of type ``llama3``, ``linear`` and
``dynamic``), Mistral, Qwen2/2.5 (bias on q/k/v) and Qwen3 (RMSNorm on q and k, an
explicit ``head_dim``), with grouped-query attention and tied or untied embeddings.

Architecture: Touvron et al., "Llama 2" (2023) and Meta's Llama 3 reference code;
RoPE from Su et al., "RoFormer" (2021) in the rotate-half convention of Hugging Face
``transformers``; llama3 frequency scaling as in Meta's ``apply_scaling``.

The layers know nothing of caches or requests: every attention layer receives an
``AttentionMetadata`` (``mlx_ferrum.layers.attention``) from the executor and hands
its q/k/v to :func:`~mlx_ferrum.layers.attention.attention`, which reads and writes
the KV cache of whichever layout the metadata carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MalformedConfigError, UnsupportedArchitectureError
from ..layers.attention import AttentionMetadata, apply_rope, attention
from .config_validation import validate_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    """Hyper-parameters of a Llama-family model, read from ``config.json``.

    Sizes are counts (heads, layers, tokens); ``rope_scaling`` is the HF dict (or
    ``None``). ``qk_norm`` is true for Qwen3. Build one with :meth:`from_dict`.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Read a HF ``config.json`` dict.

        Raises:
            UnsupportedArchitectureError: ``model_type`` is not one of ``SUPPORTED_MODEL_TYPES``.
            MalformedConfigError: a required key is missing or has the wrong type.
        """
        if not isinstance(config, dict):
            raise MalformedConfigError("config.json must hold a JSON object")
        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {mt!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        validate_config(config)  # types and ranges of every key read below
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
            inter = int(config["intermediate_size"])
            vocab = int(config["vocab_size"])
        except KeyError as e:
            raise MalformedConfigError(f"config.json lacks the required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise MalformedConfigError(f"config.json has a non-integer size: {e}") from None
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise MalformedConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        rope_params = config.get("rope_parameters") or {}
        rope_scaling = config.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if mt == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v bias; its config has no key for it
        else:
            attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=mt,
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and mt != "qwen2",
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
        )


class Rope(nn.Module):
    """Rotary embedding with explicit positions (rotate-half convention).

    Scaling types: ``default``, ``linear`` (positions divided by ``factor``),
    ``llama3`` (per-frequency scaling of Llama 3.1), ``dynamic`` (NTK-aware base
    growth, applied from the original context length, as in HF's dynamic RoPE when the
    sequence exceeds it; we apply it statically for a ``max_position_embeddings`` context).

    Raises:
        UnsupportedArchitectureError: an unknown ``rope_scaling`` type.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dims = args.head_dim
        self.scale = 1.0
        base = args.rope_theta
        freqs = None
        rs = args.rope_scaling
        kind = None
        if rs:
            kind = rs.get("rope_type", rs.get("type", "default"))
        if kind in (None, "default"):
            pass
        elif kind == "linear":
            self.scale = 1.0 / float(rs["factor"])
        elif kind == "llama3":
            freqs = _llama3_freqs(args.head_dim, base, rs)
        elif kind == "dynamic":
            factor = float(rs["factor"])
            orig = int(rs.get("original_max_position_embeddings", args.max_position_embeddings))
            seq = max(args.max_position_embeddings, orig)
            if seq > orig:
                d = args.head_dim
                base = base * ((factor * seq / orig) - (factor - 1)) ** (d / (d - 2))
        else:
            raise UnsupportedArchitectureError(
                f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, dynamic"
            )
        self.base = None if freqs is not None else base
        self._freqs = freqs

    def __call__(self, x: mx.array, offset) -> mx.array:
        """Rotate ``x`` ``[B, H, L, D]``; row ``b`` token ``l`` sits at position ``offset[b] + l``."""
        return mx.fast.rope(
            x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offset, freqs=self._freqs
        )


def _llama3_freqs(dims: int, base: float, rs: dict) -> mx.array:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, smooth in between."""
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    orig = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen = orig / low
    high_wavelen = orig / high
    out = []
    for i in range(0, dims, 2):
        inv = 1.0 / (base ** (i / dims))
        wavelen = 2 * math.pi / inv
        if wavelen < high_wavelen:
            new = inv
        elif wavelen > low_wavelen:
            new = inv / factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            new = (1 - smooth) * inv / factor + smooth * inv
        out.append(1.0 / new)  # mx.fast.rope takes wavelength-like "freqs": angle = pos / freqs
    return mx.array(out, dtype=mx.float32)


class Attention(nn.Module):
    """Multi-head attention with GQA; the KV cache is reached only through ``meta``."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim ** -0.5
        d = args.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = Rope(args)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        b, l, _ = x.shape
        q = self.q_proj(x).reshape(b, l, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, l, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, l, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        q = apply_rope(self.rope, q, meta)
        k = apply_rope(self.rope, k, meta)
        o = attention(q, k, v, meta, self.layer_idx, self.scale)  # [B, H, L, D]
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, l, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.up_proj = nn.Linear(d, h, bias=args.mlp_bias)
        self.down_proj = nn.Linear(h, d, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: attention then MLP, each with a residual."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, meta)
        return self.norm(h)


class Model(nn.Module):
    """A Llama-family causal LM: ``input_ids [B, L] int32 -> logits [B, L, vocab]``.

    ``meta`` is an :class:`~mlx_ferrum.layers.attention.AttentionMetadata` built by an
    executor (cache layout, positions, slot mapping ...). ``meta=None`` runs plain
    causal attention over the given tokens at positions ``0..L-1``, with no cache.
    ``meta.logits_indices`` (optional, ``[N]`` int32 over the flattened ``B*L`` tokens)
    restricts the LM head to those rows, returning ``[1, N, vocab]``.
    Logits come back in the model dtype.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata] = None) -> mx.array:
        h = self.model(input_ids, meta)
        idx = getattr(meta, "logits_indices", None) if meta is not None else None
        if idx is not None:
            h = h.reshape(-1, h.shape[-1])[idx][None]
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop tensors HF checkpoints carry but this model computes (rotary tables, tied head)."""
        out = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
            out.pop("lm_head.scales", None)
            out.pop("lm_head.biases", None)
        return out

    @property
    def layers(self) -> list:
        """The decoder layers (``len == num_hidden_layers``)."""
        return self.model.layers
