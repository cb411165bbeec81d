"""``2 ** x`` for the base-2 softmax and SiLU of MLX's CPU backend.

On MLX's CPU backend ``mx.power(2.0, x)`` calls the C library once per element (about
3.5 ns an element on the test machine; ``mx.exp`` about 11 ns), and in a 32-sequence
stories260K decode step it was the largest part of the attention softmax. :func:`exp2`
computes the same value with a range reduction and a polynomial, the scheme of
vectorised math libraries (Cephes ``exp2f``, SLEEF, Eigen's ``pexp``), from elementwise
ops that ``mx.compile`` fuses into one kernel:

    x = n + r,  n = floor(x),  r in [0, 1)
    2 ** x = P(r) * 2 ** n

``P`` is the degree-6 least-squares fit of ``2 ** r`` on ``[0, 1]`` (coefficients below,
from ``numpy.polynomial.polynomial.polyfit`` over 20001 points; fit error 6e-9);
``2 ** n`` is built from the float32 exponent bits ``(n + 127) << 23``. Evaluated in
float32 the relative error stays below 1e-7 (``2 ** x`` itself is off by up to 6e-8),
checked against float64 numpy in ``tests/test_attention_paths.py``.

The bit cast (``mx.view``) cannot be traced by a shapeless ``mx.compile``, and run op by
op the polynomial costs more than ``2 ** x``. So :func:`exp2` emits it only while a
fixed-shape trace is being built, inside :func:`fixed_shape_trace` (the executor's
compiled decode step, where it took a 32-request stories260K run from 0.341 to 0.317 s,
min of 7); everywhere else it is ``mx.power(2.0, x)``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

# 2**r ~= sum(_COEFFS[k] * r**k) on [0, 1]
_COEFFS = (
    1.0000000061582048,
    0.693146837700718,
    0.24023109676166138,
    0.05547891246254166,
    0.00968618629081987,
    0.0012382415534888211,
    0.00021871262330607985,
)

_trace = threading.local()


@contextmanager
def fixed_shape_trace() -> Iterator[None]:
    """Within this block (on this thread) :func:`exp2` emits the polynomial.

    Enter it only around code that ``mx.compile`` traces for fixed shapes (not
    ``shapeless=True``), so that its ops are fused into the trace's kernels.
    """
    before = getattr(_trace, "active", False)
    _trace.active = True
    try:
        yield
    finally:
        _trace.active = before


def in_fixed_shape_trace() -> bool:
    """True inside :func:`fixed_shape_trace` on this thread."""
    return getattr(_trace, "active", False)


def exp2_polynomial(x: mx.array) -> mx.array:
    """The polynomial ``2 ** x`` of the module docstring, in float32, returned in ``x``'s dtype.

    Args:
        x: any shape, a float dtype.

    Returns:
        An array like ``x``: relative error < 1e-7 for results in the normal float32
        range; inputs below -126 (``-inf`` included) give 2**-126 (1.2e-38) rather than
        a subnormal or 0, which adds at most 1.2e-38 per masked key to a softmax
        denominator of at least 1; inputs from 128 (``inf`` included) give ``inf``; NaN
        stays NaN.
    """
    y = mx.clip(x.astype(mx.float32), -126.0, 128.0)
    n = mx.floor(y)
    r = y - n
    p = _COEFFS[-1]
    for c in reversed(_COEFFS[:-1]):
        p = p * r + c
    # p is NaN for a NaN input (clip keeps NaN), so NaN propagates as with 2 ** x
    scale = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)
    return (p * scale).astype(x.dtype)


def exp2(x: mx.array) -> mx.array:
    """``2 ** x`` elementwise, in ``x``'s float dtype.

    Args:
        x: any shape, float32, float16 or bfloat16.

    Returns:
        An array like ``x``: :func:`exp2_polynomial` on MLX's CPU backend inside
        :func:`fixed_shape_trace`, else ``mx.power(2.0, x)`` (on a GPU a native
        instruction).
    """
    if in_fixed_shape_trace() and mx.default_device().type == mx.DeviceType.cpu:
        return exp2_polynomial(x)
    return mx.power(2.0, x)
