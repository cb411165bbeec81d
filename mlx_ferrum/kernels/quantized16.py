"""``x @ W.T`` for a weight affine-quantized in 16-input groups: the Metal kernel
``metal_kernels/matmul16.metal`` for decode-sized inputs, and its pure-MLX reference.

The weight (GGUF's Q6_K / Q3_K / Q2_K, see :mod:`mlx_ferrum.layers.quantized16`) is one
array of codes in MLX's packing, ``uint32`` ``[out, in * bits / 32]``, with ``scales``
and ``biases`` ``[2, out, in / 32]``: ``[0]`` holds the scale (bias) of each even 16-group,
``[1]`` of each odd one. Weight ``i`` of row ``o`` is
``scales[(i // 16) % 2, o, i // 32] * code + biases[...]``.

- Reference (:func:`matmul16_reference`): two MLX group-32 quantized matmuls over the
  same codes, one with the even set on ``x`` with its odd 16-groups zeroed, one with the
  odd set on the rest (each product reads only weights its set makes exact; zero inputs
  add exactly nothing). MLX's own kernels on every backend, twice the work of one.
- Metal (:func:`matmul16_metal`): one simdgroup per output row reads each code once
  and applies its own 16-group's scale and bias: one pass. For at most
  :data:`METAL_MAX_ROWS` input rows (a decode step); more rows (prefill) take the
  reference, whose MLX matmuls use the matrix units.

Dispatch (:func:`matmul16`): the kernel where the Metal path is on (``mx.metal`` or a
test launcher, ``FERRUM_METAL_KERNELS`` not 0: :func:`mlx_ferrum.kernels.metal_path_enabled`),
else the reference. The CPU harness runs the kernel in the tests against the reference.
"""

from __future__ import annotations

import mlx.core as mx

from . import metal

#: inputs per scale
GROUP_SIZE = 16
#: MLX's group size each reference product uses
MLX_GROUP_SIZE = 32
#: most input rows the Metal kernel takes (its per-row sums live in registers)
METAL_MAX_ROWS = 8
#: output rows per threadgroup of the kernel (one simdgroup each)
NUM_SIMD = 4
#: activation / scale dtypes the kernel reads
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _even_mask(dtype: mx.Dtype) -> mx.array:
    """``[2, 1]``: 1 for the even 16-group of a 32-group, 0 for the odd one."""
    return mx.array([[1], [0]], dtype=dtype)


def split_input(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x`` ``[..., in]`` -> ``(x_even, x_odd)``: ``x`` with its odd (even) 16-groups zeroed.

    Exact: ``x_even`` is ``x * 1`` or ``x * 0``, and ``x_odd = x - x_even`` is ``x - x`` or
    ``x - 0``.
    """
    width = x.shape[-1]
    grouped = x.reshape(*x.shape[:-1], width // MLX_GROUP_SIZE, 2, GROUP_SIZE)
    even = (grouped * _even_mask(x.dtype)).reshape(x.shape)
    return even, x - even


def matmul16_reference(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """``x @ W.T`` as two MLX group-32 quantized matmuls (see the module docstring).

    Args:
        x: ``[..., in]`` float activations, ``in`` a multiple of 32.
        weight: ``uint32`` codes ``[out, in * bits / 32]``.
        scales, biases: ``[2, out, in / 32]`` float.
        bits: code width (2, 3, 4, 5, 6 or 8).

    Returns:
        ``[..., out]``, in the promoted dtype of ``x`` and the scales.
    """
    even, odd = split_input(x)
    y = mx.quantized_matmul(even, weight, scales[0], biases[0], transpose=True, group_size=MLX_GROUP_SIZE, bits=bits)
    return y + mx.quantized_matmul(odd, weight, scales[1], biases[1], transpose=True, group_size=MLX_GROUP_SIZE,
                                   bits=bits)


def _promoted(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """MLX's promotion of two float dtypes (float16 with bfloat16 gives float32)."""
    if a == b:
        return a
    return mx.float32


def metal_unsupported_reason(x: mx.array, scales: mx.array) -> str | None:
    """Why the kernel does not take this call (None when it does)."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= METAL_MAX_ROWS:
        return f"{rows} input rows (the kernel takes 1-{METAL_MAX_ROWS})"
    if x.dtype not in KERNEL_DTYPES or scales.dtype not in KERNEL_DTYPES:
        return f"dtypes {x.dtype} / {scales.dtype}"
    return None


def matmul16_metal(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """The Metal kernel's ``x @ W.T`` (arguments and result as :func:`matmul16_reference`;
    at most :data:`METAL_MAX_ROWS` rows in ``x``)."""
    in_dims = x.shape[-1]
    out_dims = weight.shape[0]
    flat = mx.contiguous(x.reshape(-1, in_dims))
    rows = flat.shape[0]
    out_dtype = _promoted(x.dtype, scales.dtype)
    kernel = metal._kernel("matmul16", ["x", "w", "scales", "biases", "params"], ["y"])
    padded_out = -(-out_dims // NUM_SIMD) * NUM_SIMD
    y = kernel(
        inputs=[flat, weight, mx.contiguous(scales), mx.contiguous(biases), metal._params(out_dims, in_dims)],
        template=[("T", x.dtype), ("S", scales.dtype), ("OutT", out_dtype), ("BITS", bits), ("ROWS", rows),
                  ("NUM_SIMD", NUM_SIMD)],
        grid=(32, padded_out, 1),
        threadgroup=(32, NUM_SIMD, 1),
        output_shapes=[(rows, out_dims)],
        output_dtypes=[out_dtype],
    )[0]
    return y.reshape(*x.shape[:-1], out_dims)


def matmul16(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """``x @ W.T`` for a 16-group weight: the Metal kernel when the Metal path is on and
    it takes the call (:func:`metal_unsupported_reason`), else :func:`matmul16_reference`.

    Arguments and result as :func:`matmul16_reference`.

    Raises:
        ConfigurationError: ``FERRUM_METAL_KERNELS`` is malformed.
    """
    from . import metal_path_enabled

    if metal_path_enabled() and metal_unsupported_reason(x, scales) is None:
        return matmul16_metal(x, weight, scales, biases, bits)
    return matmul16_reference(x, weight, scales, biases, bits)


__all__ = [
    "GROUP_SIZE", "METAL_MAX_ROWS", "matmul16", "matmul16_metal", "matmul16_reference", "metal_unsupported_reason",
    "split_input",
]
