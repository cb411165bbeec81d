"""The 16-input-group matmul kernel (metal_kernels/matmul16.metal), run in the CPU harness.

Its output is compared with two oracles: the pure-MLX reference (two MLX group-32
quantized matmuls, ``mlx_ferrum.kernels.quantized16.matmul16_reference``) and a float64
numpy product of the weights written out from the codes, scales and biases (the codes
unpacked here from MLX's bit stream independently of the kernel). Shapes: every code
width (2, 3, 4, 5, 6, 8; 3 and 6 bits cross word boundaries), 1, 3 and 8 input rows,
output rows not a multiple of the threadgroup's 4, inputs with fewer 16-groups than a
simdgroup has lanes, float32 / float16 / bfloat16 activations and scales; the harness's
counting, ubsan and C++14 builds. A planted bug (the odd 16-groups read with the even
scales) must be caught.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.kernels import metal
from mlx_ferrum.kernels import quantized16 as q16
from support import metal_harness as mh
from test_metal_kernels import _assert_caught, _mutated

needs_clang = pytest.mark.skipif(
    not mh.clang_available(),
    reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
)
pytestmark = [pytest.mark.harness, needs_clang]

#: |got - want| <= ATOL[dtype] * max|want| (float32 sums in the kernel; the output dtype's rounding)
ATOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _case(bits: int, rows: int, out_dims: int, in_dims: int, seed: int, x_dtype=mx.float32, s_dtype=mx.float32):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, (out_dims, in_dims)).astype(np.uint64)
    # MLX's packing: code i of a row at bits [i * bits, (i + 1) * bits) of one little-endian stream
    stream = np.zeros((out_dims, in_dims * bits // 8), dtype=np.uint8)
    for i in range(in_dims):
        for b in range(bits):
            bit = i * bits + b
            stream[:, bit // 8] |= (((codes[:, i] >> np.uint64(b)) & np.uint64(1)).astype(np.uint8) << (bit % 8))
    weight = mx.array(stream.view(np.uint32).reshape(out_dims, -1))
    scales16 = rng.uniform(-0.05, 0.05, (out_dims, in_dims // 16)).astype(np.float32)
    biases16 = rng.uniform(-0.1, 0.1, (out_dims, in_dims // 16)).astype(np.float32)
    pair = lambda v: mx.array(np.ascontiguousarray(v.reshape(out_dims, -1, 2).transpose(2, 0, 1)))  # noqa: E731
    scales, biases = pair(scales16).astype(s_dtype), pair(biases16).astype(s_dtype)
    x = mx.array(rng.normal(size=(rows, in_dims)).astype(np.float32)).astype(x_dtype)
    # the numpy oracle uses the values the kernel reads (after the dtype casts)
    s64 = np.array(scales.astype(mx.float32)).transpose(1, 2, 0).reshape(out_dims, -1).astype(np.float64)
    b64 = np.array(biases.astype(mx.float32)).transpose(1, 2, 0).reshape(out_dims, -1).astype(np.float64)
    w64 = np.repeat(s64, 16, axis=1) * codes.astype(np.float64) + np.repeat(b64, 16, axis=1)
    want = np.array(x.astype(mx.float32)).astype(np.float64) @ w64.T
    return x, weight, scales, biases, want


def _check(bits, rows, out_dims, in_dims, seed=0, x_dtype=mx.float32, s_dtype=mx.float32):
    x, weight, scales, biases, want = _case(bits, rows, out_dims, in_dims, seed, x_dtype, s_dtype)
    with metal.use_launcher(mh.metal_kernel):
        assert q16.metal_unsupported_reason(x, scales) is None
        got = q16.matmul16(x, weight, scales, biases, bits)
        mx.eval(got)
    reference = q16.matmul16_reference(x, weight, scales, biases, bits)
    assert got.shape == (rows, out_dims) and got.dtype == reference.dtype
    tolerance = ATOL[got.dtype] * np.abs(want).max()
    got64 = np.array(got.astype(mx.float32)).astype(np.float64)
    assert np.abs(got64 - want).max() <= tolerance, "kernel disagrees with the numpy oracle"
    # the reference rounds each of its two products to the output dtype: a looser bound
    assert np.abs(got64 - np.array(reference.astype(mx.float32))).max() <= 4 * tolerance, \
        "kernel disagrees with the MLX reference"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_every_code_width(bits):
    _check(bits, 1, 37, 1024, seed=bits)


@pytest.mark.parametrize("rows", [3, 8])
def test_several_rows_and_few_groups(rows):
    _check(6, rows, 10, 96, seed=rows)  # 6 16-groups: most lanes idle


@pytest.mark.parametrize("x_dtype,s_dtype", [(mx.float16, mx.float16), (mx.bfloat16, mx.bfloat16),
                                             (mx.float16, mx.float32)])
def test_dtypes(x_dtype, s_dtype):
    _check(3, 2, 9, 512, seed=5, x_dtype=x_dtype, s_dtype=s_dtype)


def test_leading_dims_and_the_layer():
    from mlx_ferrum.layers.quantized16 import QuantizedLinear16

    x, weight, scales, biases, want = _case(6, 4, 12, 256, seed=9)
    layer = QuantizedLinear16(256, 12, 6)
    layer.update({"weight": weight, "scales": scales, "biases": biases})
    with metal.use_launcher(mh.metal_kernel):
        got = layer(x.reshape(2, 2, 256))
        mx.eval(got)
    assert got.shape == (2, 2, 12)
    np.testing.assert_allclose(np.array(got).reshape(4, 12), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_many_rows_and_metal_off_take_the_reference(monkeypatch):
    x, weight, scales, biases, _ = _case(2, q16.METAL_MAX_ROWS + 1, 8, 64, seed=1)
    assert "rows" in q16.metal_unsupported_reason(x, scales)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(q16, "matmul16_metal", refuse)
    with metal.use_launcher(mh.metal_kernel):
        q16.matmul16(x, weight, scales, biases, 2)
        monkeypatch.setenv("FERRUM_METAL_KERNELS", "0")
        q16.matmul16(x[:1], weight, scales, biases, 2)


@pytest.mark.parametrize("variant", ["counting", "ubsan", "cxx14"])
def test_harness_variants(variant):
    """Every output element written once; no out-of-bounds index, overflow or misaligned
    access (a 3-bit code straddling the last word of the last row included); C++14-clean."""
    with mh.options(variant=variant):
        _check(3, 2, 5, 96, seed=2)


def test_planted_bug_even_scales_for_odd_groups_is_caught(monkeypatch):
    _mutated(monkeypatch, "matmul16", "(int64_t(g & 1) * n_out + o)", "(int64_t(0) * n_out + o)")
    _assert_caught(lambda: _check(6, 1, 8, 256, seed=3))
