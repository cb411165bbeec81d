"""Gemma 3 text (``gemma3_text``, and the language model of ``gemma3`` checkpoints).

Architecture: Gemma Team, "Gemma 3 Technical Report" (2025), as implemented by
transformers' ``Gemma3ForCausalLM`` (the parity reference):

- token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weights' dtype);
- (1 + w) RMSNorms (:class:`~mlx_ferrum.layers.norms.GemmaRMSNorm`) before and after
  both attention and the feed-forward, and on q and k;
- softmax scale ``query_pre_attn_scalar ** -0.5``;
- GeGLU feed-forward with tanh-approximated GELU;
- local (sliding-window) and global layers from ``layer_types``, or from
  ``sliding_window_pattern`` (every ``pattern``-th layer global), each kind with its
  own rope (``rope_parameters`` per layer type, or ``rope_theta`` / ``rope_scaling``
  for global and ``rope_local_base_freq`` for local layers);
- tied embeddings; optional ``final_logit_softcapping``.

Multimodal ``gemma3`` checkpoints: ``text_config`` is read (missing keys take
transformers' ``Gemma3TextConfig`` defaults) and the vision tower is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MalformedConfigError, UnsupportedArchitectureError
from ..layers.attention import AttentionMetadata, rope_attention
from ..layers.dense import GatedMLP, Linear
from ..layers.norms import GemmaRMSNorm
from ..layers.rope import Rope, rope_parameters
from . import llama
from .config_validation import validate_config

# transformers' Gemma3TextConfig defaults: Hub gemma3 text_configs omit many keys
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


@dataclass
class ModelArgs:
    """Gemma 3 text hyper-parameters (sizes in counts; windows in tokens).

    ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``;
    ``rope`` maps each layer type to its :func:`~mlx_ferrum.layers.rope.rope_parameters`.
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
    query_pre_attn_scalar: float = 256.0
    sliding_window: Optional[int] = 4096
    layer_types: list = field(default_factory=list)
    rope: dict = field(default_factory=dict)
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: Optional[float] = None
    attention_bias: bool = False

    def window(self, layer_idx: int) -> Optional[int]:
        """The sliding window of layer ``layer_idx`` (None for a global layer)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Read a ``gemma3_text`` config, or the ``text_config`` of a ``gemma3`` one.

        Raises:
            MalformedConfigError: ``layer_types`` has the wrong length, or a key has the wrong type.
            UnsupportedArchitectureError: ``attn_logit_softcapping`` is set (Gemma 2's
                soft-capped attention is not implemented).
        """
        if config.get("model_type") == "gemma3":
            config = dict(config.get("text_config") or {})
        config = {**_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
        # types and ranges of the shared keys; Gemma's MLP runs the tanh-approximated GELU
        validate_config(config, activations=("gelu_pytorch_tanh", "gelu_tanh"))
        if config.get("attn_logit_softcapping"):
            raise UnsupportedArchitectureError(
                "attn_logit_softcapping is not supported (Gemma 2 style soft-capped attention); "
                "Gemma 3 checkpoints leave it null"
            )
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config["num_key_value_heads"])
            types = config.get("layer_types")
            if types is None:
                pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
                types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
            if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
                raise MalformedConfigError(
                    f"layer_types must list {layers} entries of 'sliding_attention'/'full_attention', found {types!r}"
                )
            rope = {t: rope_parameters(config, t) for t in ("sliding_attention", "full_attention")}
            window = config.get("sliding_window")
            return cls(
                model_type="gemma3_text",
                hidden_size=int(config["hidden_size"]),
                num_hidden_layers=layers,
                intermediate_size=int(config["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(config["head_dim"]),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config["rms_norm_eps"]),
                query_pre_attn_scalar=float(config["query_pre_attn_scalar"]),
                sliding_window=None if window is None else int(window),
                layer_types=list(types),
                rope=rope,
                max_position_embeddings=int(config["max_position_embeddings"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                hidden_activation=config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
                final_logit_softcapping=config.get("final_logit_softcapping"),
                attention_bias=bool(config.get("attention_bias", False)),
            )
        except (TypeError, ValueError) as e:
            raise MalformedConfigError(f"config.json has a value of the wrong type: {e}") from None


class Attention(nn.Module):
    """Gemma 3 attention: q/k (1+w) RMSNorm, per-layer-type rope and window."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.query_pre_attn_scalar ** -0.5
        self.window = args.window(layer_idx)
        d, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = Rope(self.head_dim, args.rope[args.layer_types[layer_idx]], args.max_position_embeddings)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        lead = x.shape[:-1]  # [B, L], or [T] for the packed tokens of a paged pass
        q = self.q_norm(self.q_proj(x).reshape(*lead, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim)
        return self.o_proj(rope_attention(q, k, v, self.rope, meta, self.layer_idx, self.scale, window=self.window))


class DecoderLayer(nn.Module):
    """Sandwich-norm block: norms before and after attention and the feed-forward."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        eps = args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    """The Gemma 3 decoder stack: embeddings scaled by sqrt(hidden_size), local and global layers, final (1+w) RMSNorm.

    Input ``[B, L]`` int32 token ids and an :class:`AttentionMetadata`; returns hidden states ``[B, L, hidden_size]``
    in the model dtype (transformers' ``Gemma3TextModel``).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = GemmaRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        h = self.embed_tokens(input_ids)
        h = h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, meta)
        return self.norm(h)


class Model(llama.Model):
    """Gemma 3 causal LM: ``input_ids [B, L] int32 -> logits [B, L, vocab]`` (see
    :class:`mlx_ferrum.models.llama.Model` for ``meta``)."""

    backbone = Gemma3Model

    def __call__(self, input_ids: mx.array, meta: Optional[AttentionMetadata] = None) -> mx.array:
        logits = super().__call__(input_ids, meta)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Keep the language model's tensors under ``model.`` (multimodal checkpoints
        store them as ``language_model.model.*`` or ``model.language_model.*``); drop the
        vision tower, the projector, rotary tables and a tied head."""
        out = {}
        for k, v in weights.items():
            if k.startswith("language_model."):
                k = k[len("language_model."):]
            elif k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model."):]
            elif k.startswith(("vision_tower", "multi_modal_projector", "model.vision_tower", "model.multi_modal_projector")):
                continue
            if "rotary_emb.inv_freq" in k:
                continue
            out[k] = v
        if self.args.tie_word_embeddings:
            for s in ("weight", "scales", "biases"):
                out.pop(f"lm_head.{s}", None)
        return out
