"""Mixture-of-experts feed-forward: stacked expert weights run with ``mx.gather_mm``.

Every expert's projection is one slice of a stacked ``[num_experts, out, in]`` weight.
A token's ``top_k`` chosen experts are applied with one ``mx.gather_mm`` (or
``mx.gather_qmm`` for MLX-quantized weights) per projection, indexed by the router's
choice, so no per-expert Python loop runs. For many tokens the (token, expert) pairs
are sorted by expert first, which lets the kernel read each expert's weight once per
run of equal indices. This is the technique of mlx-lm's ``SwitchGLU``; the code here
is written from MLX's ``gather_mm`` / ``gather_qmm`` documentation.

Routers (Fedus et al., "Switch Transformers", 2021; Jiang et al., "Mixtral of
Experts", 2024):

- :func:`softmax_topk`: softmax over all experts, keep the top ``k``, optionally
  renormalize them (``norm_topk_prob``; Qwen3-MoE, transformers' ``Qwen3MoeSparseMoeBlock``).
- :func:`topk_softmax`: keep the top ``k`` logits, softmax over those (gpt-oss's
  biased router, transformers' ``GptOssTopKRouter``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .dense import swiglu

# below this many (token, expert) pairs sorting costs more than it saves
_SORT_THRESHOLD = 64


def softmax_topk(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Softmax over experts, then the ``k`` largest probabilities.

    Args:
        logits: ``[..., num_experts]`` router logits.
        k: experts per token.
        normalize: divide the kept probabilities by their sum (``norm_topk_prob``).

    Returns:
        ``(indices [..., k] uint32, weights [..., k] float32)``.
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    indices = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices.astype(mx.uint32), weights


def topk_softmax(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest logits, then a softmax over them.

    Args:
        logits: ``[..., num_experts]``.
        k: experts per token.

    Returns:
        ``(indices [..., k] uint32, weights [..., k] float32)``.
    """
    indices = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    top = mx.take_along_axis(logits, indices, axis=-1)
    return indices.astype(mx.uint32), mx.softmax(top.astype(mx.float32), axis=-1)


class SwitchLinear(nn.Module):
    """``num_experts`` linear maps in one stacked weight, applied per chosen expert.

    Args:
        input_dims, output_dims: per-expert shape.
        num_experts: experts stacked in ``weight`` ``[num_experts, output_dims, input_dims]``.
        bias: an ``[num_experts, output_dims]`` bias.

    Call ``layer(x, indices, sorted_indices=False)``: ``x`` ``[..., 1 or k, 1, input_dims]``,
    ``indices`` ``[..., k]`` uint32 -> ``[..., k, 1, output_dims]`` (the broadcast of
    ``mx.gather_mm``).
    """

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        bound = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedSwitchLinear":
        """The MLX-quantized form in ``mode`` (used by ``nn.quantize`` and the loader)."""
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """:class:`SwitchLinear` with MLX-quantized weights, run with ``mx.gather_qmm``.

    Parameters as mlx-lm stores them: ``weight`` (packed uint32 ``[num_experts,
    output_dims, input_dims * bits / 32]``), ``scales`` (``[num_experts, output_dims,
    input_dims / group_size]``; float for ``affine``, uint8 for ``mxfp4`` / ``mxfp8`` /
    ``nvfp4``), ``biases`` (same shape as ``scales``, ``affine`` only) and an optional
    float ``bias``. See :mod:`mlx_ferrum.models.quantization` for the modes.
    """

    def __init__(
        self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False,
        group_size: int = 64, bits: int = 4, mode: str = "affine",
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._set_quantized(mx.zeros((num_experts, output_dims, input_dims)))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    def _set_quantized(self, weight: mx.array) -> None:
        # the microscaling modes return no biases: store none, so the parameter tree
        # matches the checkpoint's tensors
        self.weight, self.scales, *biases = mx.quantize(
            weight, group_size=self.group_size, bits=self.bits, mode=self.mode
        )
        if biases:
            self.biases = biases[0]
        elif "biases" in self:
            del self["biases"]

    @classmethod
    def from_switch_linear(cls, layer: SwitchLinear, group_size: int, bits: int, mode: str = "affine"):
        """Quantize a float :class:`SwitchLinear` (its weights and bias) with ``mode``."""
        num_experts, output_dims, input_dims = layer.weight.shape
        q = cls(input_dims, output_dims, num_experts, "bias" in layer, group_size, bits, mode)
        q._set_quantized(layer.weight)
        if "bias" in layer:
            q.bias = layer.bias
        return q

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(
            x, self.weight, self.scales, self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y


def _sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Flatten (token, choice) pairs and order them by expert id.

    Returns ``(x_sorted [N*k, 1, D], indices_sorted [N*k], inverse [N*k])``.
    """
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    x_sorted = x.reshape(-1, 1, x.shape[-1])[order // k]
    return x_sorted, flat[order], inverse


class SwitchGLU(nn.Module):
    """Gated MLP per chosen expert: ``down(act(gate(x), up(x)))``.

    Args:
        hidden_size, intermediate_size: per-expert widths.
        num_experts: experts stacked per projection.
        glu: ``glu(gate, up) -> hidden`` (default ``silu(gate) * up``).
        bias: projections carry per-expert biases.

    Call ``mlp(x, indices)``: ``x`` ``[..., hidden]``, ``indices`` ``[..., k]`` uint32
    -> ``[..., k, hidden]`` (one output per chosen expert; the caller weights and sums).
    Parameter names ``gate_proj`` / ``up_proj`` / ``down_proj`` match mlx-lm's
    checkpoints, so MLX-quantized MoE models load as they are.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int,
        glu: Optional[Callable[[mx.array, mx.array], mx.array]] = None, bias: bool = False,
    ):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden_size, intermediate_size, num_experts, bias)
        self.up_proj = SwitchLinear(hidden_size, intermediate_size, num_experts, bias)
        self.down_proj = SwitchLinear(intermediate_size, hidden_size, num_experts, bias)
        self._glu = glu or swiglu

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        lead = indices.shape
        do_sort = indices.size >= _SORT_THRESHOLD
        if do_sort:
            xs, idx, inverse = _sort_by_expert(x, indices)  # [N*k,1,D], [N*k]
        else:
            xs, idx = mx.expand_dims(x, (-2, -3)), indices  # [..., 1, 1, D], [..., k]
        h = self._glu(self.gate_proj(xs, idx, do_sort), self.up_proj(xs, idx, do_sort))
        y = self.down_proj(h, idx, do_sort)  # [..., 1, D]
        if do_sort:
            return y[inverse].reshape(*lead, -1)
        return y.squeeze(-2)


def clamped_swiglu(limit: float, alpha: float) -> Callable[[mx.array, mx.array], mx.array]:
    """gpt-oss's GLU: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (OpenAI's gpt-oss reference, transformers' ``GptOssExperts``)."""

    def glu(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(alpha * gate))

    return glu
