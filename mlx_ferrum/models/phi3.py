"""Phi-3 / Phi-4-mini (``phi3``).

Architecture: Abdin et al., "Phi-3 Technical Report" (2024), as implemented by
transformers' ``Phi3ForCausalLM`` (the parity reference): a Llama-style decoder whose
checkpoints fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (gate
first), with LongRoPE (``longrope``, formerly ``su``) scaling, an optional
``partial_rotary_factor`` (Phi-4-mini), and ``sliding_window`` on every layer when set.

The fused tensors are split at load into the q/k/v and gate/up projections of
:mod:`mlx_ferrum.models.llama` (row slices, so MLX-quantized tensors split the same
way: quantization groups run along the input axis).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx

from . import llama
from .stacking import split_fused


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama arguments read from a Phi-3 config (window on every layer)."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Read a HF ``config.json`` dict (see :meth:`mlx_ferrum.models.llama.ModelArgs.from_dict`)."""
        # Phi-3 windows every layer, as Mistral does
        base = llama.ModelArgs.from_dict({**config, "model_type": "mistral"})
        fields = asdict(base)
        fields["model_type"] = "phi3"
        return cls(**fields)


class Model(llama.Model):
    """Phi-3 causal LM: ``input_ids [B, L] int32 -> logits [B, L, vocab]``."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Split ``qkv_proj`` and ``gate_up_proj`` (weight and, if quantized, scales and biases)."""
        weights = super().sanitize(weights)
        a = self.args
        q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        for i in range(a.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for s in ("weight", "bias", "scales", "biases"):
                split_fused(
                    weights, f"{attn}.qkv_proj.{s}",
                    {f"{attn}.q_proj.{s}": q, f"{attn}.k_proj.{s}": kv, f"{attn}.v_proj.{s}": kv},
                )
                split_fused(
                    weights, f"{mlp}.gate_up_proj.{s}",
                    {f"{mlp}.gate_proj.{s}": a.intermediate_size, f"{mlp}.up_proj.{s}": a.intermediate_size},
                )
        return weights
