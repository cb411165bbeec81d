"""Affine quantization with 16-weight groups, computed with MLX's 32-weight-group kernels.

GGUF's Q6_K, Q3_K and Q2_K give every 16 consecutive inputs of a row their own scale
and bias (``w = scale_j * q + bias_j``, ``j = input // 16``); MLX's affine quantization
(``mx.quantize``, ``mx.quantized_matmul``) has groups of 32 at the least. The layers here
keep such a weight exactly, as one array of codes in MLX's packing and two sets of MLX
group-32 scales and biases:

- the *even* set: for 32-group ``g``, the scale and bias of 16-group ``2g``;
- the *odd* set: for 32-group ``g``, those of 16-group ``2g + 1``.

Dequantized with the even set, the even 16-groups of a row are exact (the odd ones are
not); with the odd set, the odd ones are. So

``x @ W.T = qmm(x_even, codes, even) + qmm(x_odd, codes, odd)``

where ``x_even`` is ``x`` with its odd 16-groups set to zero and ``x_odd = x - x_even``
(its even 16-groups zero): each product reads only exact weights, and zero inputs add
exactly nothing. Both products are MLX's own quantized matmul, on every backend, at
twice the work of one; the codes are stored once, the scales and biases twice as many
as one group-32 tensor holds (as many as there are 16-groups). On Metal, decode-sized
inputs take one pass instead (:mod:`mlx_ferrum.kernels.quantized16`, the kernel
``metal_kernels/matmul16.metal``, whose reference is the two products).

Storage: ``weight`` ``uint32`` ``[out, in * bits / 32]`` (MLX's packing: code ``i`` of a
row at bits ``[i * bits, (i + 1) * bits)``), ``scales`` and ``biases`` ``[2, out, in / 32]``
(index 0 the even set, 1 the odd set; each a contiguous ``[out, in / 32]`` for
``mx.quantized_matmul``). :func:`pair_groups` builds them from per-16-group values.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..kernels.quantized16 import matmul16, split_input

#: inputs per scale in the weights these layers hold
GROUP_SIZE = 16
#: the MLX group size each of the two products uses
MLX_GROUP_SIZE = 32


def pair_groups(values: mx.array) -> mx.array:
    """Per-16-group values ``[rows, in / 16]`` -> the two MLX group-32 sets ``[2, rows, in / 32]``.

    Args:
        values: scales or biases of 16-groups, in input order (any dtype).

    Returns:
        ``[2, rows, in / 32]``, ``[0]`` the even 16-groups, ``[1]`` the odd ones.

    Raises:
        ValueError: the number of 16-groups per row is odd (``in`` not a multiple of 32).
    """
    rows, groups = values.shape
    if groups % 2:
        raise ValueError(f"16-weight groups per row must be even (inputs a multiple of 32), got {groups}")
    return mx.contiguous(values.reshape(rows, groups // 2, 2).transpose(2, 0, 1))


def dequantize16(weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """The float weight ``[..., in]`` of codes ``[..., in * bits / 32]`` with paired
    ``scales`` / ``biases`` ``[2, ..., in / 32]``: each 16-group dequantized with its own
    scale and bias (bit for bit ``scale * q + bias``, as ``mx.dequantize`` computes it)."""
    even = mx.dequantize(weight, scales[0], biases[0], group_size=MLX_GROUP_SIZE, bits=bits)
    odd = mx.dequantize(weight, scales[1], biases[1], group_size=MLX_GROUP_SIZE, bits=bits)
    shape = even.shape
    grouped = (*shape[:-1], shape[-1] // MLX_GROUP_SIZE, 2, GROUP_SIZE)
    take_even = mx.array([[True], [False]])
    return mx.where(take_even, even.reshape(grouped), odd.reshape(grouped)).reshape(shape)


def _check_bits(bits: int, input_dims: int) -> None:
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 (MLX affine), got {bits}")
    if input_dims % MLX_GROUP_SIZE:
        raise ValueError(f"input dimension must be a multiple of {MLX_GROUP_SIZE}, got {input_dims}")


class QuantizedLinear16(nn.Module):
    """A linear layer whose weight is affine-quantized in 16-input groups.

    Args:
        input_dims, output_dims: ``in`` (a multiple of 32) and ``out``.
        bits: code width (2-8).
        bias: whether the layer adds a float bias ``[out]``.

    Parameters: ``weight`` ``uint32`` ``[out, in * bits / 32]``, ``scales`` / ``biases``
    ``[2, out, in / 32]`` (see the module docstring), ``bias`` ``[out]`` when asked.
    ``__call__(x)``: ``x`` ``[..., in]`` -> ``[..., out]``
    (:func:`mlx_ferrum.kernels.quantized16.matmul16`).

    Raises:
        ValueError: ``bits`` is not an MLX affine width, or ``in`` is not a multiple of 32.
    """

    group_size = GROUP_SIZE

    def __init__(self, input_dims: int, output_dims: int, bits: int, bias: bool = False):
        super().__init__()
        _check_bits(bits, input_dims)
        self.bits = bits
        self.weight = mx.zeros((output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((2, output_dims, input_dims // MLX_GROUP_SIZE))
        self.biases = mx.zeros((2, output_dims, input_dims // MLX_GROUP_SIZE))
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def like(cls, module: nn.Module, bits: int) -> "QuantizedLinear16":
        """An empty layer of the shape of float ``module`` (``weight`` ``[out, in]``, optional ``bias``)."""
        output_dims, input_dims = module.weight.shape
        return cls(input_dims, output_dims, bits, bias="bias" in module)

    def dequantized(self) -> mx.array:
        """The float weight ``[out, in]`` (:func:`dequantize16`)."""
        return dequantize16(self.weight, self.scales, self.biases, self.bits)

    def __call__(self, x: mx.array) -> mx.array:
        y = matmul16(x, self.weight, self.scales, self.biases, self.bits)
        if "bias" in self:
            y = y + self.bias
        return y


class QuantizedEmbedding16(nn.Module):
    """An embedding table affine-quantized in 16-value groups (the rows of a tied output too).

    Args:
        num_embeddings, dims: rows and row width (a multiple of 32).
        bits: code width (2-8).

    Parameters as :class:`QuantizedLinear16` (``[num_embeddings, dims]`` for ``[out, in]``).
    ``__call__(ids)``: int ids ``[...]`` -> rows ``[..., dims]``, each row dequantized
    exactly (:func:`dequantize16` of the gathered codes, scales and biases).
    ``as_linear(x)``: ``x`` ``[..., dims]`` -> logits ``[..., num_embeddings]``
    (:func:`mlx_ferrum.kernels.quantized16.matmul16`).

    Raises:
        ValueError: as :class:`QuantizedLinear16`.
    """

    group_size = GROUP_SIZE

    def __init__(self, num_embeddings: int, dims: int, bits: int):
        super().__init__()
        _check_bits(bits, dims)
        self.num_embeddings, self.dims, self.bits = num_embeddings, dims, bits
        self.weight = mx.zeros((num_embeddings, dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((2, num_embeddings, dims // MLX_GROUP_SIZE))
        self.biases = mx.zeros((2, num_embeddings, dims // MLX_GROUP_SIZE))

    @classmethod
    def like(cls, module: nn.Module, bits: int) -> "QuantizedEmbedding16":
        """An empty table of the shape of float ``module`` (``weight`` ``[rows, dims]``)."""
        rows, dims = module.weight.shape
        return cls(rows, dims, bits)

    def dequantized(self) -> mx.array:
        """The float table ``[num_embeddings, dims]``."""
        return dequantize16(self.weight, self.scales, self.biases, self.bits)

    def __call__(self, ids: mx.array) -> mx.array:
        scales = self.scales[:, ids]
        biases = self.biases[:, ids]
        return dequantize16(self.weight[ids], scales, biases, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return matmul16(x, self.weight, self.scales, self.biases, self.bits)


def quantized16_like(module: nn.Module, bits: int) -> Optional[nn.Module]:
    """The 16-group layer replacing float ``module``: :class:`QuantizedEmbedding16` for an
    ``nn.Embedding``, :class:`QuantizedLinear16` for a module with a 2-D ``weight``
    (``nn.Linear`` and its subclasses), None for anything else."""
    if isinstance(module, nn.Embedding):
        return QuantizedEmbedding16.like(module, bits)
    weight = getattr(module, "weight", None) if isinstance(module, nn.Module) and "weight" in module else None
    if weight is not None and weight.ndim == 2:
        return QuantizedLinear16.like(module, bits)
    return None


__all__ = [
    "GROUP_SIZE", "MLX_GROUP_SIZE", "QuantizedEmbedding16", "QuantizedLinear16", "dequantize16", "matmul16",
    "pair_groups", "quantized16_like", "split_input",
]
