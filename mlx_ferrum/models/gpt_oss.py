"""gpt-oss (``gpt_oss``).

Architecture: OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), as implemented
by transformers' ``GptOssForCausalLM`` (the parity reference):

- attention with biases on q/k/v/o and a learned sink logit per head
  (``self_attn.sinks``), alternating sliding-window and full layers (``layer_types``);
- YaRN rope (:mod:`mlx_ferrum.layers.rope`);
- a mixture-of-experts MLP whose router has a bias and takes the softmax of the top-k
  logits, and whose experts use the clamped SwiGLU
  (:func:`~mlx_ferrum.layers.moe.clamped_swiglu`) with biases.

Weights: the bf16 Hub layout (transformers' ``save_pretrained``) stores each layer's
experts fused, ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * intermediate]`` with
gate and up interleaved on the last axis, ``down_proj`` ``[E, intermediate, hidden]``
and their ``*_bias``. They are split and transposed at load into
``mlp.experts.{gate,up,down}_proj.{weight,bias}`` ``[E, out, in]``, mlx-lm's names,
so MLX-quantized checkpoints from ``mlx_lm convert`` load as they are.

OpenAI's own release stores the experts in MXFP4 (``quantization_config:
{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``), with the experts in
the ``[E, out, in]`` orientation:

- ``gate_up_proj_blocks`` ``[E, 2 * intermediate, hidden / 32, 16]`` uint8 and
  ``down_proj_blocks`` ``[E, hidden, intermediate / 32, 16]``: each 32-element block
  of a row is 16 bytes, byte ``b`` holding element ``2b`` in its low nibble and
  ``2b + 1`` in its high nibble, each an FP4 E2M1 code (sign, 2 exponent bits, 1
  mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6);
- ``*_scales`` ``[E, rows, in / 32]`` uint8: one E8M0 exponent per block, the block's
  scale being ``2 ** (code - 127)`` (OCP Microscaling v1.0; transformers'
  ``integrations/mxfp4.py`` decodes it the same way);
- gate and up rows interleaved, as in the bf16 layout.

That is MLX's ``mxfp4`` mode bit for bit: MLX packs eight 4-bit codes per uint32,
lowest nibble first, so reading the 16 bytes of a block as four little-endian uint32
words gives MLX's packed row, and the E8M0 exponents are MLX's uint8 scales. The
experts are therefore repacked by a reinterpreting view, never dequantized, and the
loader makes them ``mxfp4`` :class:`~mlx_ferrum.layers.moe.QuantizedSwitchLinear`
modules; attention, router and embeddings stay in the release's float dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MalformedConfigError, ModelLoadError
from ..layers.attention import AttentionMetadata, rope_attention
from ..layers.dense import Linear
from ..layers.moe import SwitchGLU, clamped_swiglu, topk_softmax
from ..layers.rope import Rope, rope_parameters
from . import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama arguments plus gpt-oss's MoE, sink and window settings."""

    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    layer_types: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Read a HF ``config.json`` dict.

        Raises:
            MalformedConfigError: missing keys, ``layer_types`` of the wrong length, or
                ``num_experts_per_tok`` out of range.
        """
        base = llama.ModelArgs.from_dict({**config, "model_type": "llama", "attention_bias": True})
        n = base.num_hidden_layers
        types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if len(types) != n:
            raise MalformedConfigError(f"layer_types has {len(types)} entries for {n} layers")
        window = config.get("sliding_window")
        experts = int(config.get("num_local_experts", config.get("num_experts", 0)) or 0)
        top_k = int(config.get("num_experts_per_tok", 1))
        if not 1 <= top_k <= max(experts, 1) or experts < 1:
            raise MalformedConfigError(
                f"num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}] with at least one expert"
            )
        fields = asdict(base)
        fields.update(
            model_type="gpt_oss",
            o_proj_bias=True,
            sliding_window=window,
            layer_windows=[window if t == "sliding_attention" else None for t in types],
            rope_params=rope_parameters(config),
        )
        return cls(
            **fields,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            layer_types=list(types),
        )


class Attention(nn.Module):
    """Biased GQA attention with per-head sinks and this layer's window."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.window = args.window(layer_idx)
        d = args.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=True)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=True)
        self.sinks = mx.zeros((self.n_heads,))
        self.rope = Rope(self.head_dim, args.rope_params, args.max_position_embeddings)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        lead = x.shape[:-1]  # [B, L], or [T] for the packed tokens of a paged pass
        q = self.q_proj(x).reshape(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.n_kv_heads, self.head_dim)
        o = rope_attention(q, k, v, self.rope, meta, self.layer_idx, self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(o)


class MoeBlock(nn.Module):
    """Biased top-k router (``router``) and clamped-SwiGLU experts (``experts``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = SwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts,
            glu=clamped_swiglu(args.swiglu_limit, args.swiglu_alpha), bias=True,
        )

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = topk_softmax(self.router(x), self.top_k)
        y = self.experts(x, indices)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    """One gpt-oss layer: attention with sinks (sliding or full) and the mixture-of-experts MLP, each pre-normed.

    ``x`` ``[B, L, hidden_size]`` -> the same shape (transformers' ``GptOssDecoderLayer``).
    """

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MoeBlock(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(llama.LlamaModel):
    """The gpt-oss decoder stack (embeddings, :class:`DecoderLayer` list, final RMSNorm).

    Token ids ``[B, L]`` int32 -> hidden states ``[B, L, hidden_size]`` (transformers' ``GptOssModel``).
    """

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    """gpt-oss causal LM: ``input_ids [B, L] int32 -> logits [B, L, vocab]``."""

    backbone = GptOssModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Split the fused Hub expert tensors into per-projection stacked ``[E, out, in]`` weights;
        repack the MXFP4 release's ``*_blocks`` / ``*_scales`` as MLX ``mxfp4`` tensors.

        Raises:
            ModelLoadError: MXFP4 blocks or scales whose shapes do not fit the config.
        """
        weights = super().sanitize(weights)
        a = self.args
        hidden, inter = a.hidden_size, a.intermediate_size
        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts"
            _repack_mxfp4(weights, p, "gate_up_proj", rows=2 * inter, in_dims=hidden)
            _repack_mxfp4(weights, p, "down_proj", rows=hidden, in_dims=inter)
            for name in ("scales", "weight"):
                fused = weights.pop(f"{p}.gate_up_proj.{name}", None)
                if fused is not None:
                    weights[f"{p}.gate_proj.{name}"] = mx.contiguous(fused[..., ::2, :])
                    weights[f"{p}.up_proj.{name}"] = mx.contiguous(fused[..., 1::2, :])
            gate_up = weights.pop(f"{p}.gate_up_proj", None)
            if gate_up is not None:
                if gate_up.shape[-2:] == (hidden, 2 * inter):
                    gate_up = gate_up.swapaxes(-1, -2)  # -> [E, 2I, H]
                weights[f"{p}.gate_proj.weight"] = mx.contiguous(gate_up[..., ::2, :])
                weights[f"{p}.up_proj.weight"] = mx.contiguous(gate_up[..., 1::2, :])
            bias = weights.pop(f"{p}.gate_up_proj_bias", None)
            if bias is not None:
                weights[f"{p}.gate_proj.bias"] = mx.contiguous(bias[..., ::2])
                weights[f"{p}.up_proj.bias"] = mx.contiguous(bias[..., 1::2])
            down = weights.pop(f"{p}.down_proj", None)
            if down is not None:
                if down.shape[-2:] == (inter, hidden):
                    down = down.swapaxes(-1, -2)  # transformers' [E, I, H] -> [E, H, I]
                weights[f"{p}.down_proj.weight"] = mx.contiguous(down)
            bias = weights.pop(f"{p}.down_proj_bias", None)
            if bias is not None:
                weights[f"{p}.down_proj.bias"] = bias
        return weights


def _repack_mxfp4(weights: dict[str, mx.array], prefix: str, name: str, rows: int, in_dims: int) -> None:
    """``{prefix}.{name}_blocks`` ``[E, rows, in/32, 16]`` uint8 and ``_scales`` ``[E, rows, in/32]``
    -> ``{prefix}.{name}.weight`` ``[E, rows, in/8]`` uint32 and ``.scales`` (a view, no dequantization;
    see the module docstring for why the bytes are already MLX's ``mxfp4`` layout)."""
    blocks = weights.pop(f"{prefix}.{name}_blocks", None)
    scales = weights.pop(f"{prefix}.{name}_scales", None)
    if blocks is None and scales is None:
        return
    if blocks is None or scales is None:
        missing = f"{prefix}.{name}_blocks" if blocks is None else f"{prefix}.{name}_scales"
        raise ModelLoadError(f"MXFP4 tensor {missing!r} is missing: re-download the checkpoint")
    groups = in_dims // 32
    if in_dims % 32 or tuple(blocks.shape[1:]) != (rows, groups, 16) or blocks.dtype != mx.uint8:
        raise ModelLoadError(
            f"MXFP4 tensor '{prefix}.{name}_blocks' has shape {tuple(blocks.shape)} and dtype {blocks.dtype}; "
            f"the config implies [num_experts, {rows}, {in_dims} / 32, 16] uint8"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:3]) or scales.dtype != mx.uint8:
        raise ModelLoadError(
            f"MXFP4 tensor '{prefix}.{name}_scales' has shape {tuple(scales.shape)} and dtype {scales.dtype}; "
            f"expected {tuple(blocks.shape[:3])} uint8 (one E8M0 exponent per 32-element block)"
        )
    packed = mx.contiguous(blocks).view(mx.uint32)  # [E, rows, groups, 4]: little-endian words of 8 nibbles
    weights[f"{prefix}.{name}.weight"] = packed.reshape(*blocks.shape[:2], groups * 4)
    weights[f"{prefix}.{name}.scales"] = scales
