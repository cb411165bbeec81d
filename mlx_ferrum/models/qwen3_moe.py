"""Qwen3-MoE (``qwen3_moe``): Qwen3 attention with a sparse mixture-of-experts MLP.

Architecture: Qwen team, "Qwen3 Technical Report" (2025), as implemented by
transformers' ``Qwen3MoeForCausalLM`` (the parity reference). Attention is Qwen3's
(RMSNorm on q and k, explicit ``head_dim``; :mod:`mlx_ferrum.models.llama`). A
layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; its router takes a softmax over all experts,
keeps the top ``num_experts_per_tok`` and renormalizes them when ``norm_topk_prob``.
Experts run through ``mx.gather_mm`` / ``mx.gather_qmm`` (:mod:`mlx_ferrum.layers.moe`).

Weights: the Hub's per-expert tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight``
are stacked at load into ``mlp.switch_mlp.{gate,up,down}_proj.weight``
``[num_experts, out, in]``, the names mlx-lm's converted (and quantized) checkpoints
already use, so both load; so does transformers' fused in-memory layout
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import MalformedConfigError
from ..layers.dense import Linear
from ..layers.moe import SwitchGLU, softmax_topk
from . import llama
from .stacking import stack_experts


@dataclass
class ModelArgs(llama.ModelArgs):
    """Qwen3's arguments plus the MoE ones (both ``num_experts`` and
    ``num_local_experts`` spellings are read)."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Read a HF ``config.json`` dict.

        Raises:
            MalformedConfigError: a required key is missing, or ``num_experts_per_tok``
                exceeds the number of experts.
        """
        base = llama.ModelArgs.from_dict({**config, "model_type": "qwen3"})
        experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)
        top_k = int(config.get("num_experts_per_tok", 1))
        if experts and not 1 <= top_k <= experts:
            raise MalformedConfigError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        fields = asdict(base)
        fields["model_type"] = "qwen3_moe"
        return cls(
            **fields,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(config.get("moe_intermediate_size", base.intermediate_size)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` has the MoE MLP."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and stacked experts (``switch_mlp``): ``[..., hidden] -> [..., hidden]``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        y = self.switch_mlp(x, indices)  # [..., k, hidden]
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(llama.DecoderLayer):
    """Qwen3 decoder block whose MLP is sparse on the layers ``args.is_sparse`` picks."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        if args.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(args)


class Qwen3MoeModel(llama.LlamaModel):
    """The Qwen3-MoE decoder stack: Qwen3 attention with sparse-MoE (or dense, per ``mlp_only_layers`` /
    ``decoder_sparse_step``) MLPs. Token ids ``[B, L]`` int32 -> hidden states ``[B, L, hidden_size]``
    (transformers' ``Qwen3MoeModel``).
    """

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    """Qwen3-MoE causal LM: ``input_ids [B, L] int32 -> logits [B, L, vocab]`` (see
    :class:`mlx_ferrum.models.llama.Model` for ``meta``)."""

    backbone = Qwen3MoeModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Stack per-expert Hub tensors into ``switch_mlp``; drop what the model computes.

        Raises:
            MissingWeightError: a sparse layer lacks some expert's tensor.
        """
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                prefix = f"model.layers.{i}.mlp"
                stack_experts(weights, f"{prefix}.experts", f"{prefix}.switch_mlp", self.args.num_experts)
                # transformers' in-memory layout, if a checkpoint was written with it:
                # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
                fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
                if fused is not None:
                    gate, up = mx.split(fused, 2, axis=1)
                    weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
                    weights[f"{prefix}.switch_mlp.up_proj.weight"] = up
                down = weights.pop(f"{prefix}.experts.down_proj", None)
                if down is not None:
                    weights[f"{prefix}.switch_mlp.down_proj.weight"] = down
        return weights
