"""``2 ** x`` for the softmaxes of the CPU attention paths, as arithmetic that a
compiled step fuses into one vectorised loop.

On MLX's CPU backend ``mx.exp`` costs 12-19 ns per float32 element and
``mx.power(2.0, x)`` 5-9 ns, and the softmax's exponentials are the largest
elementwise cost of attention there at small ``head_dim``. Inside ``mx.compile`` the
graph of :func:`_exp2_graph` runs at about 2.5 ns per element, and a stories260K decode
step over 32 sequences of 340 tokens ran 1.33x faster with it than with ``mx.power``
(``benchmarks/bench_cpu_attention.py`` measures all three; docs/benchmarks.md,
"The CPU softmax's 2**x"). The method:

- range reduction ``x = n + f`` with ``n = round(x)`` and ``f`` in ``[-1/2, 1/2]``;
- ``2 ** f`` by a degree-6 polynomial fitted to it (least squares with relative weights
  at Chebyshev nodes: truncation error 1.9e-9, far under float32's rounding), evaluated
  by Estrin's scheme (Estrin, 1960): a graph three products deep instead of Horner's six,
  which MLX's CPU compiler keeps in one kernel (Horner's chain was split into several,
  each a pass over the scores: 3.7 against 2.3 ns per element);
- ``2 ** n`` built directly as float32 bits (exponent field ``n + 127``), the classic
  Cody-Waite construction (Cody and Waite, *Software Manual for the Elementary
  Functions*, 1980).

Maximum relative error 1.7e-7 against float64 over ``[-126, 127]``; exactly 0 below
``-126.5`` (past the normal range; softmax weights that small are 0 to float32's sums
anyway) and for ``-inf``; ``+inf`` from 127.5 up. Not for NaN inputs.

Run eagerly, the graph is a dozen separate passes, and compiling it per call retraces
for every new shape. So :func:`exp2` builds the graph only inside :func:`fusing` (the
runner wraps its compiled decode step's trace in it) and is ``mx.power(2.0, x)``
everywhere else; :func:`exp2_eager` serves eager callers with one shapeless compile.
Even traced, it is used only between :data:`MIN_FUSED_SIZE` and :data:`MAX_FUSED_SIZE`
elements (see each).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import mlx.core as mx
import numpy as np


def _fit_coefficients(degree: int = 6, nodes: int = 4000) -> tuple[float, ...]:
    """Coefficients ``c_0 .. c_degree`` of the polynomial closest to ``2 ** f`` on
    ``[-1/2, 1/2]`` in relative error, in the least-squares sense over Chebyshev nodes
    (which comes within a small factor of the minimax polynomial)."""
    f = 0.5 * np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    target = np.exp2(f)
    weighted = np.vander(f, degree + 1, increasing=True) / target[:, None]
    coeffs, *_ = np.linalg.lstsq(weighted, np.ones(nodes), rcond=None)
    return tuple(float(c) for c in coeffs)


#: ``c_0 .. c_6`` of :func:`_fit_coefficients`
_COEFFS = _fit_coefficients()
#: 1.5 * 2**23: float32's integers past 2**23 are spaced 1 apart, so ``(x + this) - this``
#: is ``x`` rounded to the nearest integer for ``|x| < 2**22``
_ROUNDER = 12582912.0
#: Largest input that takes the fused arithmetic: past it the score passes leave the
#: cache. The Horner form ran 1.5x (2**20) to 3.5x (2**22) slower per element there than
#: ``mx.power``; the one-kernel Estrin form was still 1.6x faster than ``mx.power`` at
#: 2**22 (docs/benchmarks.md, "The CPU softmax's 2**x"), so this limit is conservative now
#: (``benchmarks/bench_cpu_attention.py`` times both at this size and 8x past it).
MAX_FUSED_SIZE = 1 << 19
#: Smallest input that takes the fused arithmetic. Its graph has many nodes where
#: ``mx.power`` has one, and at a few thousand elements their tracing and dispatch cost
#: about what the arithmetic saves: with the one-kernel Estrin form, a stories260K decode
#: step over 1 x 340 tokens (2.7 K scores) took the same time either way (0.98x), over
#: 4 x 340 tokens (11 K) it was 1.24x and over 32 x 340 (87 K) 1.33x faster fused
#: (``benchmarks/bench_cpu_attention.py``, section 3; docs/benchmarks.md, "The CPU softmax's 2**x").
#: From 2 K elements, the SwiGLU of a 32-row decode step (5.5 K) is fused too.
MIN_FUSED_SIZE = 1 << 11
#: Smallest input :func:`exp2_eager` computes with the compiled arithmetic: each call of a
#: compiled function costs tens of microseconds, which only large inputs earn back. At
#: 8 K elements it took 114 us against ``mx.power``'s 167 us, at 4 K about the same
#: (MLX 0.32, 2-core Xeon guest); a wave of prompt tails ran 3.7 M of its 26 M scores
#: through ``mx.power`` while this was 32 K.
MIN_EAGER_FUSED_SIZE = 1 << 13

_local = threading.local()


@contextlib.contextmanager
def fusing() -> Iterator[None]:
    """Within this block (on this thread), :func:`exp2` builds its arithmetic graph for
    the enclosing ``mx.compile`` trace to fuse."""
    before = getattr(_local, "fusing", False)
    _local.fusing = True
    try:
        yield
    finally:
        _local.fusing = before


def is_fusing() -> bool:
    """True inside :func:`fusing` on this thread."""
    return getattr(_local, "fusing", False)


def _exp2_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(2 ** f, the float32 bits of 2 ** n)`` for ``x = n + f``: every op elementwise
    and shape-independent (what ``mx.compile(shapeless=True)`` accepts)."""
    clipped = mx.minimum(mx.maximum(x, -127.0), 128.0)
    # round to nearest (ties to even, as mx.round) by adding and taking away 1.5 * 2**23:
    # the sum's ulp is 1. MLX's CPU compiler does not fuse mx.round, which split the
    # graph into three kernels, each a pass over the scores; this keeps it one.
    whole = (clipped + _ROUNDER) - _ROUNDER
    frac = clipped - whole
    c = _COEFFS
    frac2 = frac * frac
    poly = ((c[0] + c[1] * frac) + frac2 * (c[2] + c[3] * frac)
            + (frac2 * frac2) * ((c[4] + c[5] * frac) + frac2 * c[6]))
    # 2 ** whole: the float32 whose exponent field is whole + 127 (0 = zero, 255 = +inf);
    # no select for the ends: one cost 60 % more time than the whole function
    return poly, (whole.astype(mx.int32) + 127) << 23


def _exp2_graph(x: mx.array) -> mx.array:
    poly, bits = _exp2_parts(x)
    return poly * mx.view(bits, mx.float32)


def _eager_parts():
    """This thread's shapeless compile of :func:`_exp2_parts` (a compiled graph keeps the
    streams of the thread that traced it)."""
    parts = getattr(_local, "eager_parts", None)
    if parts is None:
        parts = _local.eager_parts = mx.compile(_exp2_parts, shapeless=True)
    return parts


def exp2_eager(x: mx.array) -> mx.array:
    """``2 ** x`` for a float32 ``x`` that is evaluated op by op (not inside a trace):
    for :data:`MIN_EAGER_FUSED_SIZE` to :data:`MAX_FUSED_SIZE` elements, the arithmetic as
    one shapeless compiled kernel (one trace serves every shape) and a multiply by the
    exponent bits (``mx.view`` cannot be traced shapeless); otherwise ``mx.power``.
    Prompt-tail attention scores (the reference prefill) are its use: the compiled
    arithmetic costs about half of ``mx.power`` per element (section 1 of
    ``benchmarks/bench_cpu_attention.py``)."""
    if MIN_EAGER_FUSED_SIZE <= x.size <= MAX_FUSED_SIZE:
        poly, bits = _eager_parts()(x)
        return poly * mx.view(bits, mx.float32)
    return mx.power(2.0, x)


def exp2(x: mx.array) -> mx.array:
    """``2 ** x`` elementwise for a float32 array ``x`` of any shape; float32 of x's shape.

    Inside :func:`fusing`, and for :data:`MIN_FUSED_SIZE` to :data:`MAX_FUSED_SIZE`
    elements, the arithmetic of the module docstring; otherwise ``mx.power(2.0, x)``.
    """
    if getattr(_local, "fusing", False) and MIN_FUSED_SIZE <= x.size <= MAX_FUSED_SIZE:
        return _exp2_graph(x)
    return mx.power(2.0, x)
