"""The Llama family, driven by a Hugging Face ``config.json``.

Covers Llama 2/3/3.1/3.2 (``rope_scaling`` of type ``llama3``, ``linear`` and
``dynamic``), Mistral (with ``sliding_window``: every layer attends to its last
``sliding_window`` tokens, as transformers' ``MistralModel`` does), Qwen2/2.5 (bias
on q/k/v) and Qwen3 (RMSNorm on q and k, an explicit ``head_dim``), with
grouped-query attention and tied or untied embeddings. Qwen2/3 configs with
``use_sliding_window`` get windows on the layers ``layer_types`` (or
``max_window_layers``) marks as sliding.

Architecture: Touvron et al., "Llama 2" (2023) and Meta's Llama 3 reference code;
RoPE from Su et al., "RoFormer" (2021) in the rotate-half convention of Hugging Face
``transformers``; llama3 frequency scaling as in Meta's ``apply_scaling``.

The layers know nothing of caches or requests: every attention layer receives the
pass's metadata (``mlx_ferrum.layers.attention.AttentionMetadata``, built by the KV
store) and hands its q/k/v to :func:`~mlx_ferrum.layers.attention.rope_attention`,
which calls the attention backend the metadata carries (it reads and writes the KV
cache of its layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MalformedConfigError, UnsupportedArchitectureError
from ..layers.attention import AttentionMetadata, rope_attention
from ..layers.dense import GatedMLP, Linear
from .config_validation import validate_config
from ..layers.rope import Rope, rope_parameters

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
    sliding_window: Optional[int] = None
    layer_windows: list = field(default_factory=list)
    rope_params: dict = field(default_factory=dict)

    def window(self, layer_idx: int) -> Optional[int]:
        """The sliding window (tokens) of layer ``layer_idx``, or None for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

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
        windows = layer_windows(config, mt, layers)
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
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            rope_params=rope_parameters(config),
        )


def layer_windows(config: dict[str, Any], model_type: str, num_layers: int) -> list[Optional[int]]:
    """Per-layer sliding window (tokens) of a Llama-family config, None for full attention.

    Mistral applies ``sliding_window`` to every layer (transformers' ``MistralModel``).
    Qwen2/Qwen3 apply it only with ``use_sliding_window``, to the layers ``layer_types``
    marks ``sliding_attention`` (else those from ``max_window_layers`` on). Llama has none.

    Raises:
        MalformedConfigError: ``sliding_window`` is not a positive integer.
    """
    window = config.get("sliding_window")
    if window is None:
        return [None] * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise MalformedConfigError(f"sliding_window must be a positive integer or null, found {window!r}")
    if model_type == "mistral":
        return [window] * num_layers
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        types = config.get("layer_types")
        if isinstance(types, list) and len(types) == num_layers:
            return [window if t == "sliding_attention" else None for t in types]
        start = int(config.get("max_window_layers", num_layers))
        return [window if i >= start else None for i in range(num_layers)]
    return [None] * num_layers


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
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.window = args.window(layer_idx)
        self.rope = Rope(args.head_dim, args.rope_params or _legacy_rope(args), args.max_position_embeddings)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        lead = x.shape[:-1]  # [B, L], or [T] for the packed tokens of a paged pass
        q = self.q_proj(x).reshape(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return self.o_proj(rope_attention(q, k, v, self.rope, meta, self.layer_idx, self.scale, window=self.window))


def _legacy_rope(args: ModelArgs) -> dict:
    """Rope settings of a ``ModelArgs`` built by hand (without ``rope_params``)."""
    params = dict(args.rope_scaling or {})
    params["rope_theta"] = args.rope_theta
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


class MLP(GatedMLP):
    """SwiGLU feed-forward (Shazeer, "GLU Variants Improve Transformer", 2020) sized from ``args``."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.hidden_size, args.intermediate_size, "silu", bias=args.mlp_bias)


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

    A paged pass may give its packed tokens as ``[T]`` (``packed_tokens`` tells the
    runner so):
    then every activation is ``[T, ...]`` and the logits ``[T, vocab]``, with no
    flatten/unflatten around each projection (two graph ops per matmul of a 3-D input).

    ``meta`` is the pass's metadata (:mod:`mlx_ferrum.layers.attention`: its attention
    backend, positions, caches or slot mappings ...) built by the runner's KV store. ``meta=None`` runs plain
    causal attention over the given tokens at positions ``0..L-1``, with no cache.
    ``meta.logits_indices`` (optional, ``[N]`` int32 over the flattened ``B*L`` tokens)
    restricts the LM head to those rows, returning ``[1, N, vocab]``.
    Logits come back in the model dtype.
    """

    #: the decoder stack; other families subclass this model and name their own
    backbone = LlamaModel
    #: takes a paged pass's packed tokens as ``[T]`` (see the class docstring)
    packed_tokens = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata] = None) -> mx.array:
        h = self.model(input_ids, meta)
        idx = getattr(meta, "logits_indices", None) if meta is not None else None
        if idx is not None:
            h = h.reshape(-1, h.shape[-1])[idx]
            if input_ids.ndim == 2:
                h = h[None]
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
