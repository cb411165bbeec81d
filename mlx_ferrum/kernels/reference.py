"""Pure-MLX paged attention: the test oracle and the fallback where Metal is absent.

Layout (vLLM's, see Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023):

- ``k_pool``, ``v_pool``: ``[num_blocks, num_kv_heads, block_size, head_dim]`` in the
  model dtype, shared by all sequences.
- ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32; row ``i`` maps logical block
  ``j`` of sequence ``i`` to a physical block. Entries past a sequence's last block
  are ignored (any value in range).
- ``context_lens``: ``[num_seqs]`` int32, tokens stored for each sequence, the new
  tokens included (they are written to the pool before attention runs).

Decode gathers each sequence's blocks into a dense ``[num_kv_heads, T, head_dim]`` view
and takes the scores in float32; prefill does the same per sequence, with a causal
mask. Both take a base-2 softmax (:func:`softmax_base2`; off the CPU backend prefill
calls the fused ``mx.fast.scaled_dot_product_attention``) and are exact up to the
dtype's rounding of the gathered values.

The softmaxes' ``2 ** x`` (:func:`exp2`, :func:`exp2_eager`, :func:`fusing`) is here
too: the CPU attention paths' exponential, computed as arithmetic that a compiled step
fuses (section "2 ** x" below, which gives its method, error bounds and measurements).

Why this module is one file of over 500 lines: the pure-MLX reference of every paged-
attention kernel (decode, partitioned reduce, prefill, KV writes) and the base-2
exponential its softmaxes take: the oracle each Metal kernel's test compares with, and
everything a request's attention on MLX's CPU backend calls, kept in one module.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

_NEG_INF = float("-inf")
_LOG2_E = 1.4426950408889634  # log2(e): exp(x) == 2 ** (x * log2(e))


# ---------------------------------------------------------------------------- 2 ** x
# ``2 ** x`` for the softmaxes of the CPU attention paths, as arithmetic that a
# compiled step fuses into one vectorised loop.
#
# On MLX's CPU backend ``mx.exp`` costs 12-19 ns per float32 element and
# ``mx.power(2.0, x)`` 5-9 ns, and the softmax's exponentials are the largest
# elementwise cost of attention there at small ``head_dim``. Inside ``mx.compile`` the
# graph of :func:`_exp2_graph` runs at about 2.5 ns per element, and a stories260K decode
# step over 32 sequences of 340 tokens ran 1.33x faster with it than with ``mx.power``
# (``benchmarks/bench_cpu_attention.py`` measures all three; docs/benchmarks.md,
# "The CPU softmax's 2**x"). The method:
#
# - range reduction ``x = n + f`` with ``n = round(x)`` and ``f`` in ``[-1/2, 1/2]``;
# - ``2 ** f`` by a degree-6 polynomial fitted to it (least squares with relative weights
#   at Chebyshev nodes: truncation error 1.9e-9, far under float32's rounding), evaluated
#   by Estrin's scheme (Estrin, 1960): a graph three products deep instead of Horner's six,
#   which MLX's CPU compiler keeps in one kernel (Horner's chain was split into several,
#   each a pass over the scores: 3.7 against 2.3 ns per element);
# - ``2 ** n`` built directly as float32 bits (exponent field ``n + 127``), the classic
#   Cody-Waite construction (Cody and Waite, *Software Manual for the Elementary
#   Functions*, 1980).
#
# Maximum relative error 1.7e-7 against float64 over ``[-126, 127]``; exactly 0 below
# ``-126.5`` (past the normal range; softmax weights that small are 0 to float32's sums
# anyway) and for ``-inf``; ``+inf`` from 127.5 up. Not for NaN inputs.
#
# Run eagerly, the graph is a dozen separate passes, and compiling it per call retraces
# for every new shape. So :func:`exp2` builds the graph only inside :func:`fusing` (the
# runner wraps its compiled decode step's trace in it) and is ``mx.power(2.0, x)``
# everywhere else; :func:`exp2_eager` serves eager callers with one shapeless compile.
# Even traced, it is used only between :data:`MIN_FUSED_SIZE` and :data:`MAX_FUSED_SIZE`
# elements (see each).


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


def block_rows(table: mx.array, num_kv_heads: int) -> mx.array:
    """``table * num_kv_heads + head``: ``[..., nb]`` block ids -> ``[..., num_kv_heads, nb]``
    int32 rows of a pool viewed as ``[num_blocks * num_kv_heads, block_size, head_dim]``."""
    return table[..., None, :] * num_kv_heads + mx.arange(num_kv_heads, dtype=table.dtype)[:, None]


def _gather(pool: mx.array, table: mx.array, rows: Optional[mx.array] = None) -> mx.array:
    """``pool[table]`` as a dense ``[..., num_kv_heads, len(table)*block_size, head_dim]``.

    Gathers whole (block, kv head) rows (:func:`block_rows`; ``rows`` when the caller
    has them) in the order the result wants them, so the dense layout comes out of one
    gather with no transposed copy after it (on MLX's CPU backend that copy cost as much
    as the gather: 196 vs 114 us for K and V at 32 sequences of 160 tokens).
    """
    num_blocks, kvh, bs, d = pool.shape
    if rows is None:
        rows = block_rows(table, kvh)
    g = pool.reshape(num_blocks * kvh, bs, d)[rows]  # [..., KVH, nb, bs, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * bs, d)


#: fewest sequences whose decode rows read a shared prefix once for all of them
#: (:func:`plan_shared_prefix`); a verified draft's rows are one sequence: its few rows
#: gain less than the plan and the extra graph nodes cost
SHARED_PREFIX_MIN_SEQS = 4
#: fewest shared blocks worth the extra graph nodes of reading them apart
SHARED_PREFIX_MIN_BLOCKS = 4


@dataclass
class SharedPrefix:
    """Blocks at the head of many decode rows' tables (a cached system prompt), which
    :func:`paged_attention_decode` reads once for all of those rows: every row's queries
    of a KV head meet the shared keys in one product, and each row gathers only its tail.

    The arrays are numpy on the host (:func:`plan_shared_prefix`) and MLX arrays once
    moved (:meth:`to_device`), or inputs of a compiled step.

    Attributes:
        table: ``[shared_blocks]`` int32 block ids, the same in every member row.
        tails: ``[num_seqs, tail_blocks]`` int32 block ids of each row's own blocks: a
            member's table after the shared blocks, another row's whole table;
            unused entries are any valid block id (masked).
        tail_starts: ``[num_seqs]`` int32 tokens before each row's tail:
            ``shared_blocks * block_size`` for a member row, 0 for the others.
    """

    table: Any
    tails: Any
    tail_starts: Any

    def to_device(self) -> "SharedPrefix":
        """The same plan as MLX int32 arrays."""
        return SharedPrefix(mx.array(self.table), mx.array(self.tails), mx.array(self.tail_starts))


def _floor_bucket(n: int) -> int:
    """The largest size of the compiled step's buckets (``runner.shape_bucket``'s: sizes
    up to 8, then four per octave) not above ``n``, rounding down where the runner
    rounds up (kernels sit below the runner): a shared prefix a block longer reuses the
    same trace."""
    if n <= 8:
        return n
    granule = 1 << (n.bit_length() - 3)
    return n // granule * granule


def plan_shared_prefix(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                       min_seqs: int = SHARED_PREFIX_MIN_SEQS,
                       min_blocks: int = SHARED_PREFIX_MIN_BLOCKS,
                       row_seqs: Optional[np.ndarray] = None) -> Optional[SharedPrefix]:
    """The :class:`SharedPrefix` of a decode batch, or None when too little is shared.

    The member rows are those whose table starts with the most common first block (at
    least ``min_seqs`` sequences and half the batch's sequences); the shared blocks are the leading
    blocks all members hold, cut to blocks every member has filled before its current
    token (so each member sees all of their keys) and rounded down to a trace bucket.
    At least ``min_blocks`` must remain. Only for full-attention tables: a sliding
    window's freed entries read as block 0 in every row.

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int32 (host).
        context_lens: ``[num_seqs]`` int32 tokens per row, the current one included.
        block_size: tokens per block.
        row_seqs: ``[num_seqs]`` the sequence each row belongs to (a verified draft
            lays one sequence out as several decode rows); None: one row per sequence.

    The idea is the shared-prefix ("cascade") attention of Juravsky et al., "Hydragen:
    High-Throughput LLM Inference with Shared Prefixes" (2024) and FlashInfer's cascade
    inference: the prefix's attention is one matrix product over all rows, merged with
    each row's own attention through the softmax's running maximum and denominator.
    """
    num_seqs = block_tables.shape[0]
    if num_seqs < min_seqs or block_tables.shape[1] <= min_blocks:
        return None
    first = block_tables[:, 0]
    if row_seqs is None:
        num_sequences, heads = num_seqs, first
    else:
        # one entry per (first block, sequence): a draft's rows count once
        pairs = np.unique(np.stack([first, np.asarray(row_seqs, dtype=first.dtype)], axis=1), axis=0)
        num_sequences, heads = len(np.unique(pairs[:, 1])), pairs[:, 0]
        if num_sequences < min_seqs:
            return None
    need = max(min_seqs, (num_sequences + 1) // 2)
    ordered = np.sort(heads)
    if not (ordered[need - 1 :] == ordered[: len(ordered) - need + 1]).any():
        return None  # no first block heads ``need`` tables: the common case, without np.unique
    ids, counts = np.unique(heads, return_counts=True)
    if counts.max() < need:
        return None
    members = first == ids[counts.argmax()]
    member_tables = block_tables[members]
    differs = (member_tables != member_tables[0]).any(axis=0)
    shared = int(differs.argmax()) if differs.any() else member_tables.shape[1]
    shared = _floor_bucket(min(shared, (int(context_lens[members].min()) - 1) // block_size))
    if shared < min_blocks:
        return None
    cols = block_tables.shape[1]
    everyone = bool(members.all())
    tails = np.zeros((num_seqs, cols - shared if everyone else cols), dtype=np.int32)
    tails[members, : cols - shared] = block_tables[members, shared:]
    if not everyone:
        tails[~members] = block_tables[~members]
    tail_starts = np.where(members, shared * block_size, 0).astype(np.int32)
    return SharedPrefix(member_tables[0, :shared].astype(np.int32), tails, tail_starts)


@dataclass
class DecodeIndex:
    """Index arrays of :func:`paged_attention_decode`, built once per forward pass by
    :func:`decode_index` and shared by every layer (each layer building its own added
    about ten graph ops per layer to a compiled decode step).

    Attributes:
        rows: ``[num_seqs, num_kv_heads, max_blocks]`` int32, :func:`block_rows` of the
            block tables (of the tails, with a shared prefix).
        valid: ``[num_seqs, max_blocks * block_size]`` bool, key position < context length
            (the tail's keys, with a shared prefix).
        shared_rows: ``[num_kv_heads, shared_blocks]`` int32, :func:`block_rows` of a
            :class:`SharedPrefix`'s blocks, or None.
        members: ``[num_seqs]`` bool, the rows that read the shared blocks, or None.
    """

    rows: mx.array
    valid: mx.array
    shared_rows: Optional[mx.array] = None
    members: Optional[mx.array] = None


def decode_index(block_tables: mx.array, context_lens: mx.array, num_kv_heads: int, block_size: int,
                 shared: Optional[SharedPrefix] = None) -> DecodeIndex:
    """The :class:`DecodeIndex` of ``block_tables`` ``[num_seqs, max_blocks]`` and
    ``context_lens`` ``[num_seqs]`` (int32) for pools of ``num_kv_heads`` heads and
    ``block_size`` tokens per block; with ``shared`` (MLX arrays), the index of its
    shared blocks and of each row's tail instead."""
    if shared is None:
        tokens = block_tables.shape[1] * block_size
        valid = mx.arange(tokens)[None] < context_lens[:, None]
        return DecodeIndex(block_rows(block_tables, num_kv_heads), valid)
    tokens = shared.tails.shape[1] * block_size
    valid = (mx.arange(tokens)[None] + shared.tail_starts[:, None]) < context_lens[:, None]
    return DecodeIndex(block_rows(shared.tails, num_kv_heads), valid,
                       block_rows(shared.table, num_kv_heads), shared.tail_starts > 0)


def softmax_base2(scores: mx.array, sinks: Optional[mx.array], num_kv_heads: int, group: int) -> tuple[mx.array, mx.array]:
    """Unnormalised base-2 softmax of GQA-grouped decode scores (already scaled by
    ``log2(e)``), with the attention sinks' logits in the denominator.

    Args:
        scores: ``[S, KVH, group, T]`` (or ``[S, KVH, group, Q, T]``, several queries per
            row) float32, masked positions ``-inf``.
        sinks: ``[num_heads]`` natural-log sink logits, or None.

    Returns:
        ``(p, denom)`` shaped like ``scores`` and ``scores`` with a last axis of 1: the
        attention is ``(p @ v) / denom``.
    """
    m = scores.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = (sinks.astype(mx.float32) * _LOG2_E).reshape((1, num_kv_heads, group) + (1,) * (scores.ndim - 3))
        m = mx.maximum(m, sink)
    p = exp2(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + exp2(sink - m)
    return p, denom


def weighted_values(parts: list, values: mx.array) -> tuple[mx.array, mx.array]:
    """``(sum_i p_i @ V_i, sum_i row sums of p_i)`` for unnormalised softmax weights split
    over consecutive key ranges: the attention is ``out / denom``.

    Args:
        parts: ``(p, first)`` pairs, ``p`` ``[..., rows, n]`` float32 weights of the keys
            ``first .. first + n - 1``.
        values: ``[..., T, head_dim]``; the weights are cast to its dtype for the product.

    Returns:
        ``out`` ``[..., rows, head_dim]`` in the values' dtype and ``denom``
        ``[..., rows, 1]``, summed in float32.

    When the rows outnumber ``head_dim`` and the values are float32, the denominator is
    the last column of ``p @ [V | 1]`` (one BLAS product, the values being the smaller
    operand) instead of a pass summing the weights: on MLX's CPU backend the passes over
    the scores, not the products, are the cost of prefill attention.
    """
    head_dim = values.shape[-1]
    with_sum = values.dtype == mx.float32 and parts[0][0].shape[-2] > head_dim
    if with_sum:
        values = mx.concatenate([values, mx.ones(values.shape[:-1] + (1,), values.dtype)], axis=-1)
    out = denom = None
    for p, first in parts:
        part = p.astype(values.dtype) @ values[..., first : first + p.shape[-1], :]
        out = part if out is None else out + part
        if not with_sum:
            total = p.sum(axis=-1, keepdims=True)
            denom = total if denom is None else denom + total
    if with_sum:
        out, denom = out[..., :head_dim], out[..., head_dim:]
    return out, denom


def paged_attention_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    index: Optional[DecodeIndex] = None,
) -> mx.array:
    """Attention of one query token per sequence over its paged K/V.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, float32/float16/bfloat16.
        k_pool, v_pool: ``[num_blocks, num_kv_heads, block_size, head_dim]``, q's dtype.
            ``num_heads % num_kv_heads == 0`` (grouped-query attention).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32. ``max_blocks_per_seq *
            block_size`` must cover the longest context; the cost grows with it.
        context_lens: ``[num_seqs]`` int32, each in ``[1, max_blocks_per_seq*block_size]``.
            Slots past a context are masked, which is exact only while they hold finite
            values: :func:`write_kv_slots` keeps every pool finite (a NaN there would
            survive a ``-inf`` mask). The Metal kernel never reads those slots.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        host_context_lens: the same lengths as Python ints, when the caller has them;
            a single sequence then slices its context and uses the fused SDPA.
        window: sliding window in tokens (None: full). Only the last ``window`` tokens
            of each context are read; blocks before them may have been freed (their
            table entries are then any valid block id).
        sinks: ``[num_heads]`` attention-sink logits (gpt-oss), or None: one extra
            logit per head in the softmax denominator, with no value.
        index: :func:`decode_index` of ``block_tables`` and ``context_lens``, when the
            caller built it once for every layer; None builds it here.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype: for sequence ``i``,
        ``softmax(q_i K_i^T * scale) V_i`` over its first ``context_lens[i]`` tokens
        (the last ``window`` of them with a window).
    """
    num_seqs, num_heads, head_dim = q.shape
    nb = block_tables.shape[1]
    bs, kvh = k_pool.shape[2], k_pool.shape[1]
    g = num_heads // kvh
    if host_context_lens is not None and num_seqs == 1:
        # one sequence: slice its context and use the fused SDPA, which sums in the same
        # order as the contiguous layout does
        n = int(host_context_lens[0])
        start = max(0, n - window) if window is not None else 0
        keys = _gather(k_pool, block_tables, index.rows if index is not None else None)[:, :, start:n]
        values = _gather(v_pool, block_tables, index.rows if index is not None else None)[:, :, start:n]
        extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
        return mx.fast.scaled_dot_product_attention(q[:, :, None, :], keys, values, scale=scale, **extra)[:, :, 0, :]
    # The gathered blocks are laid out densely ([S, KVH, T, D]), so each score and
    # output product is one matrix product per (sequence, kv head) rather than per
    # block; only the small score tensor is masked, which is exact because pools stay
    # finite. The softmax runs in base 2 with log2(e) folded into the scale, as
    # FlashAttention-2 kernels do: 2**x costs a fraction of exp(x) on MLX's CPU backend.
    f32 = mx.float32
    if index is None:
        index = decode_index(block_tables, context_lens, kvh, bs)
    if index.shared_rows is not None:
        return _decode_over_shared_prefix(q, k_pool, v_pool, index, scale, sinks)
    keys = _gather(k_pool, block_tables, index.rows).astype(f32)  # [S, KVH, T, D]
    values = _gather(v_pool, block_tables, index.rows).astype(f32)
    qg = (q.astype(f32) * (scale * _LOG2_E)).reshape(num_seqs, kvh, g, head_dim)
    scores = qg @ keys.swapaxes(-1, -2)  # [S, KVH, g, T]
    valid = index.valid  # [S, T]
    if window is not None:
        valid = valid & (mx.arange(nb * bs)[None] >= context_lens[:, None] - window)
    scores = mx.where(valid[:, None, None, :], scores, _NEG_INF)
    p, denom = softmax_base2(scores, sinks, kvh, g)
    out = (p @ values) / denom  # [S, KVH, g, D]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def _decode_over_shared_prefix(q: mx.array, k_pool: mx.array, v_pool: mx.array, index: DecodeIndex, scale: float,
                               sinks: Optional[mx.array]) -> mx.array:
    """:func:`paged_attention_decode` with ``index.shared_rows``: the shared blocks are
    gathered once and met by all rows' queries of a KV head in one product
    (``[KVH, num_seqs * group, P]`` scores); each row's tail is attended as usual; the two
    merge through one maximum and one denominator. Rows that are not members take no
    weight from the shared blocks (their shift is ``+inf``, so ``2 ** (s - shift)`` is 0).
    """
    num_seqs, num_heads, head_dim = q.shape
    kvh = k_pool.shape[1]
    g = num_heads // kvh
    f32 = mx.float32
    qg = (q.astype(f32) * (scale * _LOG2_E)).reshape(num_seqs, kvh, g, head_dim)

    def by_row(x: mx.array) -> mx.array:  # [KVH, S * g, n] -> [S, KVH, g, n]
        return x.reshape(kvh, num_seqs, g, x.shape[-1]).transpose(1, 0, 2, 3)

    def by_head(x: mx.array) -> mx.array:  # [S, KVH, g, n] -> [KVH, S * g, n]
        return x.transpose(1, 0, 2, 3).reshape(kvh, num_seqs * g, x.shape[-1])

    prefix_keys = _gather(k_pool, None, index.shared_rows).astype(f32)  # [KVH, P, D]
    prefix_values = _gather(v_pool, None, index.shared_rows).astype(f32)
    prefix_scores = by_head(qg) @ prefix_keys.swapaxes(-1, -2)  # [KVH, S * g, P]
    keys = _gather(k_pool, None, index.rows).astype(f32)  # [S, KVH, T, D]
    values = _gather(v_pool, None, index.rows).astype(f32)
    scores = mx.where(index.valid[:, None, None, :], qg @ keys.swapaxes(-1, -2), _NEG_INF)  # [S, KVH, g, T]
    members = index.members[:, None, None, None]
    m = mx.maximum(scores.max(axis=-1, keepdims=True),
                   mx.where(members, by_row(prefix_scores.max(axis=-1, keepdims=True)), _NEG_INF))
    sink = None
    if sinks is not None:
        sink = (sinks.astype(f32) * _LOG2_E).reshape(1, kvh, g, 1)
        m = mx.maximum(m, sink)
    prefix_out, prefix_denom = weighted_values(
        [(exp2(prefix_scores - by_head(mx.where(members, m, float("inf")))), 0)], prefix_values)
    out, denom = weighted_values([(exp2(scores - m), 0)], values)
    denom = denom + by_row(prefix_denom)
    if sink is not None:
        denom = denom + exp2(sink - m)
    out = (out + by_row(prefix_out)) / denom
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def paged_prefill_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Causal attention of several new tokens per sequence over cached prefix plus themselves.

    Queries are packed (varlen): sequence ``i`` owns rows ``query_start_loc[i] :
    query_start_loc[i+1]`` of ``q``; call that count ``q_len_i``. Those are the last
    ``q_len_i`` tokens of its context, already written to the pool, so query ``j``
    sits at position ``p = context_lens[i] - q_len_i + j`` and attends keys ``0..p``.
    Used for prefill, chunked prefill, prefix-cache hits and ``forward_verify``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, float32/float16/bfloat16.
        k_pool, v_pool: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        context_lens: ``[num_seqs]`` int32, including the new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32 prefix sums of the query lengths.
        scale: softmax scale.
        host_context_lens, host_query_start_loc: the same values as Python ints, when
            the caller has them, to avoid reading the arrays back.
        window: sliding window in tokens (None: full); query ``p`` attends keys
            ``p - window + 1 .. p`` only, and blocks wholly before the first query's
            window are never read.
        sinks: ``[num_heads]`` attention-sink logits, or None (see the decode function).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.
    """
    ctx = list(host_context_lens) if host_context_lens is not None else context_lens.tolist()
    qsl = list(host_query_start_loc) if host_query_start_loc is not None else query_start_loc.tolist()
    return varlen_prefill_over_blocks(q, lambda table: (_gather(k_pool, table), _gather(v_pool, table)),
                                      k_pool.shape[2], block_tables, ctx, qsl, scale, window, sinks)


#: Most padded scores (sequences x heads x queries x keys) that one call of the reference
#: prefill takes for a group of sequences. Short sequences (a prompt chunk over a short
#: cached prefix) are grouped up to it, since op by op each call costs more than its
#: arithmetic; long ones (a prompt tail over a long prefix) are past it alone and keep a
#: call each, as padding them together made the score passes leave the cache (no faster
#: at 0.25 M scores a call, 20 % slower at 0.5 M: 32 tails of a 340-token prefix).
PREFILL_GROUP_SCORES = 1 << 17


def _prefill_groups(seqs: list, num_heads: int, window: Optional[int]) -> list[list]:
    """Consecutive runs of ``seqs`` (``(row, q0, qlen, clen)``) that one padded call serves:
    at most :data:`PREFILL_GROUP_SCORES` padded scores and at most twice the real ones.
    With a window each sequence reads its own range of blocks, so each keeps its own call."""
    if window is not None:
        return [[x] for x in seqs]
    groups: list[list] = []
    qmax = kmax = real = 0  # the last group's longest query run and context, its real scores
    for x in seqs:
        _, _, qlen, clen = x
        if groups:
            q2, k2, r2 = max(qmax, qlen), max(kmax, clen), real + qlen * clen
            padded = (len(groups[-1]) + 1) * q2 * k2
            if padded * num_heads <= PREFILL_GROUP_SCORES and padded <= 2 * r2:
                groups[-1].append(x)
                qmax, kmax, real = q2, k2, r2
                continue
        groups.append([x])
        qmax, kmax, real = qlen, clen, qlen * clen
    return groups


def varlen_prefill_over_blocks(q: mx.array, gather, block_size: int, block_tables: mx.array, ctx: Sequence[int],
                               qsl: Sequence[int], scale: float, window: Optional[int] = None,
                               sinks: Optional[mx.array] = None) -> mx.array:
    """The varlen causal prefill loop shared by the float and the quantized references.

    ``gather(table)`` returns the keys and values ``[..., KVH, nb * block_size, D]`` of
    the blocks ``table`` ``[..., nb]`` names (float pools: a gather; quantized pools: a
    gather and a dequantize). ``ctx`` / ``qsl``: host context lengths and query start
    offsets. Returns ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Each sequence attends over its own blocks (with a window, from the first block the
    window reaches) through :func:`_masked_attention`. Consecutive short sequences share
    one call (:func:`_prefill_groups`): their queries and blocks are padded to the
    group's longest, and each query's mask keeps it to its own context; the padded
    queries' rows are dropped. Long sequences keep a call each (see
    :data:`PREFILL_GROUP_SCORES`).
    """
    num_heads = q.shape[1]
    seqs = [(i, qsl[i], qsl[i + 1] - qsl[i], clen) for i, clen in enumerate(ctx) if qsl[i + 1] > qsl[i]]
    if not seqs:
        return mx.zeros_like(q)
    outs = []
    for group in _prefill_groups(seqs, num_heads, window):
        if len(group) == 1:
            outs.append(_prefill_one(q, gather, block_size, block_tables, *group[0], scale, window, sinks))
        else:
            outs.append(_prefill_group(q, gather, block_size, block_tables, group, scale, sinks))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _prefill_one(q: mx.array, gather, block_size: int, block_tables: mx.array, i: int, q0: int, qlen: int,
                 clen: int, scale: float, window: Optional[int], sinks: Optional[mx.array]) -> mx.array:
    """Sequence ``i``'s ``qlen`` queries (rows ``q0 ..`` of ``q``) over its blocks: ``[qlen, H, D]``."""
    nb = -(-clen // block_size)
    # with a window, blocks wholly before the first query's window are skipped
    first = max(0, clen - qlen - window + 1) // block_size if window is not None else 0
    keys, values = gather(block_tables[i, first:nb])
    start = first * block_size
    keys = keys[None, :, : clen - start]  # [1, KVH, clen - start, D]
    values = values[None, :, : clen - start]
    qi = mx.swapaxes(q[q0 : q0 + qlen], 0, 1)[None]  # [1, H, qlen, D]
    qpos = mx.arange(clen - qlen, clen)[:, None]
    kpos = mx.arange(start, clen)[None, :]
    allowed = kpos <= qpos  # [qlen, clen - start]
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    # without a window every query sees all the cached keys before the first query
    visible = clen - qlen - start if window is None else 0
    o = _masked_attention(qi, keys, values, allowed[None, None], scale, sinks, visible)
    return mx.swapaxes(o[0], 0, 1)  # [qlen, H, D]


def _prefill_group(q: mx.array, gather, block_size: int, block_tables: mx.array, group: list, scale: float,
                   sinks: Optional[mx.array]) -> mx.array:
    """One padded call for ``group`` (``(row, q0, qlen, clen)`` each, no window):
    ``[sum of qlen, H, D]`` in the packed order of ``q``."""
    qmax = max(x[2] for x in group)
    kmax = max(x[3] for x in group)
    nb = -(-kmax // block_size)
    # a table's entries past a sequence's last block are valid block ids (any value in
    # range): their slots are read and masked
    keys, values = gather(block_tables[mx.array([x[0] for x in group], dtype=mx.int32), :nb])
    keys, values = keys[:, :, :kmax], values[:, :, :kmax]  # [G, KVH, kmax, D]
    # query j of a sequence with fewer than qmax queries repeats its last one (dropped below)
    j = np.arange(qmax)[None, :]
    qlen = np.array([x[2] for x in group])[:, None]
    last = np.minimum(j, qlen - 1)
    rows = np.array([x[1] for x in group])[:, None] + last  # [G, qmax] rows of q
    qpos = np.array([x[3] for x in group])[:, None] - qlen + last  # their positions
    qg = mx.swapaxes(q[mx.array(rows.astype(np.int32))], 1, 2)  # [G, H, qmax, D]
    allowed = mx.arange(kmax)[None, None, :] <= mx.array(qpos.astype(np.int32))[:, :, None]  # [G, qmax, kmax]
    visible = min(x[3] - x[2] for x in group)
    o = _masked_attention(qg, keys, values, allowed[:, None], scale, sinks, visible)  # [G, H, qmax, D]
    o = mx.swapaxes(o, 1, 2)  # [G, qmax, H, D]
    o = o.reshape(len(group) * qmax, o.shape[2], o.shape[3])
    keep = (np.arange(len(group))[:, None] * qmax + j)[j < qlen]
    return o[mx.array(keep.astype(np.int32))]


#: Fewest queries in a tile of :func:`causal_attention_base2`: below, each tile's calls
#: cost more than its smaller score arrays save. One layer of a 2,048-token prompt in
#: Qwen2.5-0.5B's shapes (14 heads, 2 KV heads, head_dim 64) took 993 ms untiled, 561 ms
#: in 4-query tiles, 452-456 ms in 16- to 32-query tiles and 495 ms in 128-query tiles
#: (MLX 0.32 CPU, 2-core Xeon guest, OpenBLAS, one thread).
MIN_CAUSAL_TILE = 16


def causal_attention_base2(q: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: Optional[mx.array],
                           tile_scores: int = PREFILL_GROUP_SCORES) -> mx.array:
    """Causal attention in query tiles, on MLX's CPU backend: ``q`` ``[B, H, L_q, D]`` are
    the last ``L_q`` of the ``L_k`` positions of ``keys`` / ``values`` ``[B, KVH, L_k, D]``
    (query ``i`` sees keys ``0 .. L_k - L_q + i``) -> ``[B, H, L_q, D]`` in q's dtype.

    Each tile of queries takes the scores of the keys up to its last query only (the
    keys before its first query unmasked, :func:`_masked_attention_base2`), so a fresh
    prompt computes about half the square of scores instead of all of it, and a tile's
    scores (at most ``tile_scores``, as :data:`PREFILL_GROUP_SCORES`, or
    :data:`MIN_CAUSAL_TILE` queries) stay in the cache through the softmax's passes.
    The tiling of FlashAttention (Dao et al., 2022), at the granularity of op-by-op MLX
    calls.
    """
    b, num_heads, lq, _ = q.shape
    lk = keys.shape[2]
    tile = max(MIN_CAUSAL_TILE, tile_scores // (b * num_heads * lk))
    offset = lk - lq
    outs = []
    for first in range(0, lq, tile):
        last = min(lq, first + tile)
        end = offset + last  # keys this tile's last query sees
        allowed = mx.arange(end)[None, :] <= (mx.arange(first, last) + offset)[:, None]
        outs.append(_masked_attention_base2(q[:, :, first:last], keys[:, :, :end], values[:, :, :end],
                                            allowed[None, None], scale, sinks, offset + first))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _masked_attention(q: mx.array, keys: mx.array, values: mx.array, allowed: mx.array, scale: float,
                      sinks: Optional[mx.array], visible: int = 0) -> mx.array:
    """Masked grouped-query attention, ``[S, H, Q, D]`` in q's dtype: on MLX's CPU backend
    :func:`_masked_attention_base2`; elsewhere the fused
    ``mx.fast.scaled_dot_product_attention`` (a GPU's flash kernel, matrix units on Metal).
    ``allowed`` ``[S, 1, Q, T]`` bool; ``visible``: how many leading keys every query
    sees (``allowed`` is all True there), which lets the CPU path skip their mask.

    The CPU backend's fused call is itself an unfused composition computing ``exp``:
    there the base-2 softmax prefilled a wave of 32 prompt tails faster
    (``benchmarks/bench_cpu_attention.py`` measures both)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return _masked_attention_base2(q, keys, values, allowed, scale, sinks, visible)
    mask = mx.where(allowed, 0.0, _NEG_INF).astype(q.dtype)
    extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, **extra)


def _masked_attention_base2(q: mx.array, keys: mx.array, values: mx.array, allowed: mx.array, scale: float,
                            sinks: Optional[mx.array], visible: int = 0) -> mx.array:
    """Grouped-query attention with a boolean mask and a base-2 softmax, in float32.

    ``q`` ``[S, H, Q, D]``, ``keys`` / ``values`` ``[S, KVH, T, D]``, ``allowed``
    ``[S, 1, Q, T]`` bool -> ``[S, H, Q, D]`` in q's dtype; ``visible``: the leading keys
    that every query sees. The same arithmetic as the decode reference
    (:func:`softmax_base2`): ``2**x`` costs a third of ``exp`` on MLX's CPU backend, and
    the softmax's elementwise passes over the scores, not the products, dominate
    prompt-tail attention at small ``head_dim`` (``benchmarks/bench_cpu_attention.py``).
    So the passes are cut where the result allows:

    - the scores of the ``visible`` keys are never masked (a prompt tail over its cached
      prefix: most of its scores), only those of the keys after them;
    - when the score rows outnumber ``head_dim``, the softmax's denominator comes out of
      the value product (:func:`weighted_values`).
    """
    num, num_heads, qlen, head_dim = q.shape
    kvh, tokens = keys.shape[1], keys.shape[2]
    group = num_heads // kvh
    rows = group * qlen
    f32 = mx.float32
    # a query head's rows stay together: [S, KVH, group * Q, D] against its KV head
    qg = (q.astype(f32) * (scale * _LOG2_E)).reshape(num, kvh, rows, head_dim)
    keys_t = keys.astype(f32).swapaxes(-1, -2)
    values = values.astype(f32)
    visible = max(0, min(int(visible), tokens))
    parts = []  # (scores [S, KVH, rows, n], the index of their first key)
    if visible:
        parts.append((qg @ keys_t[..., :visible], 0))
    if visible < tokens:
        tail = (qg @ keys_t[..., visible:]).reshape(num, kvh, group, qlen, tokens - visible)
        tail = mx.where(allowed[:, :, None, :, visible:], tail, _NEG_INF)
        parts.append((tail.reshape(num, kvh, rows, tokens - visible), visible))
    top = parts[0][0].max(axis=-1, keepdims=True)
    for scores, _ in parts[1:]:
        top = mx.maximum(top, scores.max(axis=-1, keepdims=True))
    sink = None
    if sinks is not None:
        # [S, KVH, group * Q, 1]: each query head's sink logit on its rows
        sink = mx.repeat((sinks.astype(f32) * _LOG2_E).reshape(1, kvh, group, 1), qlen, axis=2)
        top = mx.maximum(top, sink)
    out, denom = weighted_values([(exp2_eager(scores - top), first) for scores, first in parts], values)
    if sink is not None:
        denom = denom + exp2_eager(sink - top)
    out = out / denom
    return out.reshape(num, num_heads, qlen, head_dim).astype(q.dtype)


def slot_indices(slot_mapping: mx.array, num_kv_heads: int, block_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Index arrays ``(blocks [T,1], heads [1,KVH], offsets [T,1])`` that address the
    slots of ``slot_mapping`` ``[T]`` in a ``[num_blocks, num_kv_heads, block_size, head_dim]``
    pool. Built once per forward pass and shared by every layer's K and V write."""
    blocks = (slot_mapping // block_size)[:, None]
    offsets = (slot_mapping % block_size)[:, None]
    return blocks, mx.arange(num_kv_heads)[None, :], offsets


def write_kv_slots(
    pool: mx.array,
    slot_mapping: mx.array,
    new: mx.array,
    *,
    indices: Optional[tuple[mx.array, mx.array, mx.array]] = None,
) -> None:
    """Write new tokens' K (or V) into a pool in place, through an MLX indexed update.

    Args:
        pool: ``[num_blocks, num_kv_heads, block_size, head_dim]``; updated in place (the
            Python object is rebound to the scatter's result; MLX reuses the buffer when
            this object holds the only reference).
        slot_mapping: ``[num_tokens]`` int32, ``block * block_size + offset`` per token.
        new: ``[num_tokens, num_kv_heads, head_dim]``, cast to the pool dtype. Non-finite
            values are replaced by finite ones (``nan_to_num``), so a block a diverged
            sequence leaves behind cannot poison the masked slots of its next owner.
        indices: :func:`slot_indices` of ``slot_mapping``, when the caller has them.
    """
    if indices is None:
        indices = slot_indices(slot_mapping, pool.shape[1], pool.shape[2])
    pool[indices] = mx.nan_to_num(new.astype(pool.dtype))
