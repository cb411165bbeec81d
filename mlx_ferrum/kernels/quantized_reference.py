"""Quantized KV cache in pure MLX: the storage format's math and the reference attention over it.

Format (``kv_cache_dtype``; the shared storage contract of the quantized KV cache):

- Values are quantized per token and KV head, in groups of ``G = kv_group_size(head_dim)``
  consecutive elements along ``head_dim`` (the largest of 64, 32, 16, 8, 4, 2, 1 dividing it).
- ``"int8"``: symmetric, ``scale = max|x| / 127`` (float16), codes ``round(x / scale)`` in
  ``[-127, 127]`` (int8, last axis ``head_dim``); ``x_hat = code * scale``. This is
  llama.cpp's ``q8_0`` rule (one scale per group, no offset), with its scale in float16.
- ``"int4"``: affine (asymmetric), ``scale = (max - min) / 15`` and ``bias = min`` (float16),
  codes ``round((x - bias) / scale)`` in ``[0, 15]``, two per byte (element ``2j`` in the low
  nibble of byte ``j``, ``2j + 1`` in the high nibble; uint8, last axis ``head_dim // 2``);
  ``x_hat = code * scale + bias``. This is the affine group quantization of MLX's
  ``mx.quantize`` and of llama.cpp's ``q4_1``, done with plain MLX ops because
  ``mx.quantize`` takes only groups of 32, 64 or 128 (stories260K has ``head_dim`` 8).
- Scales and biases: float16, ``[..., head_dim // G]``.

Keys (int8 and int4; the storage's ``rotate_keys``, on by default) are rotated before
quantization by a fixed normalized Walsh-Hadamard
matrix ``H`` (block-diagonal, blocks of the largest power of two dividing ``head_dim``);
``H`` is symmetric and orthonormal, so with queries rotated the same way
``(q H) . (k H) = q . k``. The rotation spreads an outlier channel over the whole
block, which shrinks the range a 4-bit group has to cover: the incoherence processing
of QuaRot (Ashkboos et al., 2024) and QuIP# (Tseng et al., 2024), as applied to the K
cache by llama.cpp / ik_llama.cpp (Hadamard-rotated K cache) and by vllm-metal's
TurboQuant. Keys are rotated after RoPE; values are never rotated. int8 keys are rotated
too: on stories260K (outlier key channels, groups of 8) it halved int8's KL divergence
against float KV (``benchmarks/bench_kv_quality.py``, ``docs/benchmarks.md``).

Attention here takes the stored codes, scales and biases and gathers only the blocks
that the block tables name; no float copy of the pool is ever built. Decode
(:func:`attention_over_codes`) attends from the codes themselves, with each group's
scale (and int4 bias) folded into the scores and the probabilities; prefill
dequantizes one sequence's gathered blocks and runs the fused SDPA.
**The attention functions rotate the queries themselves** when ``keys_rotated`` is
True: callers pass the same (post-RoPE) queries they would pass to the float path.

This module sits at the kernels layer (it imports nothing above it);
:mod:`mlx_ferrum.kv_cache.quantized` re-exports the format functions beside the storage.

Why this module is one file of over 500 lines: it is the single oracle of the quantized
KV format: the format's math and the reference attention over it change together, and
every quantized kernel's test imports it.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..config import KV_CACHE_DTYPES
from ..errors import ConfigurationError
from .float_window import (
    FIRST_TOKENS,
    FloatRows,
    entry_positions,
    prefill_attention_in_tiles,
)
from .reference import (
    _LOG2_E,
    _NEG_INF,
    DecodeIndex,
    block_rows,
    decode_index,
    softmax_base2,
    varlen_prefill_over_blocks,
)

#: The largest group size along ``head_dim`` (head_dim 64, 128, 256 use it).
KV_GROUP_SIZE = 64

#: Largest finite float16: a scale is clamped to it so that a huge (finite) input
#: cannot store an infinite scale.
_FLOAT16_MAX = 65504.0


def kv_group_size(head_dim: int) -> int:
    """The quantization group size along ``head_dim``: the largest of 64, 32, 16, 8, 4,
    2, 1 that divides ``head_dim`` (64 -> 64, 128 -> 64, 80 -> 16, 8 -> 8).

    Raises:
        ConfigurationError: ``head_dim`` is not a positive integer.
    """
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ConfigurationError(f"head_dim={head_dim!r} is not valid for a quantized KV cache: it must be a positive integer")
    group = KV_GROUP_SIZE
    while head_dim % group:
        group //= 2
    return group


def check_kv_cache_dtype(kv_cache_dtype: str, head_dim: Optional[int] = None) -> None:
    """Refuse an unknown ``kv_cache_dtype``, or int4 with an odd ``head_dim`` (two codes share a byte).

    Raises:
        ConfigurationError: names the value, the choices, or the ``head_dim`` and the fix.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigurationError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not valid: use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "int4" and head_dim is not None and head_dim % 2:
        raise ConfigurationError(
            f"kv_cache_dtype='int4' needs an even head_dim (two 4-bit codes per byte) and this model's head_dim "
            f"is {head_dim}: use kv_cache_dtype='int8' (--kv-cache-dtype int8) or 'auto'"
        )


def _quantized(kv_cache_dtype: str, head_dim: int) -> None:
    check_kv_cache_dtype(kv_cache_dtype, head_dim)
    if kv_cache_dtype == "auto":
        raise ConfigurationError("kv_cache_dtype='auto' stores the model dtype: there is nothing to quantize")


def quantize_kv(x: mx.array, kv_cache_dtype: str) -> tuple[mx.array, mx.array, Optional[mx.array]]:
    """Quantize ``x`` ``[..., head_dim]`` (any float dtype) group-wise along its last axis.

    Non-finite inputs are first replaced by finite values (``nan_to_num``, as the float
    pool's writes do), so a stored group never holds a NaN or infinite scale.

    Returns:
        ``(codes, scales, biases)``: for ``"int8"`` codes ``[..., head_dim]`` int8, scales
        ``[..., head_dim // G]`` float16 and biases None; for ``"int4"`` codes
        ``[..., head_dim // 2]`` uint8 (two per byte, low nibble first), scales and biases
        ``[..., head_dim // G]`` float16.

    Raises:
        ConfigurationError: ``kv_cache_dtype`` is not "int8" or "int4", or int4 with an odd head_dim.
    """
    head_dim = x.shape[-1]
    _quantized(kv_cache_dtype, head_dim)
    group = kv_group_size(head_dim)
    lead = x.shape[:-1]
    xg = mx.nan_to_num(x.astype(mx.float32)).reshape(*lead, head_dim // group, group)
    if kv_cache_dtype == "int8":
        amax = mx.abs(xg).max(axis=-1)
        scales = mx.minimum(amax / 127.0, _FLOAT16_MAX).astype(mx.float16)
        s = scales.astype(mx.float32)[..., None]
        # a zero scale (an all-zero group) stores code 0; the where keeps 0/0 out
        q = mx.where(s > 0, xg / mx.where(s > 0, s, 1.0), 0.0)
        codes = mx.clip(mx.round(q), -127, 127).astype(mx.int8).reshape(*lead, head_dim)
        return codes, scales, None
    lo = xg.min(axis=-1)
    hi = xg.max(axis=-1)
    scales = mx.minimum((hi - lo) / 15.0, _FLOAT16_MAX).astype(mx.float16)
    biases = mx.clip(lo, -_FLOAT16_MAX, _FLOAT16_MAX).astype(mx.float16)
    s = scales.astype(mx.float32)[..., None]
    q = mx.where(s > 0, (xg - biases.astype(mx.float32)[..., None]) / mx.where(s > 0, s, 1.0), 0.0)
    u = mx.clip(mx.round(q), 0, 15).astype(mx.uint8).reshape(*lead, head_dim // 2, 2)
    codes = u[..., 0] | (u[..., 1] << 4)
    return codes, scales, biases


def dequantize_kv(
    codes: mx.array,
    scales: mx.array,
    biases: Optional[mx.array],
    kv_cache_dtype: str,
    head_dim: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """Invert :func:`quantize_kv` (up to its rounding): ``[..., head_dim]`` in ``dtype``.

    Args:
        codes: ``[..., head_dim]`` int8 (int8) or ``[..., head_dim // 2]`` uint8 (int4).
        scales, biases: ``[..., head_dim // G]`` float16; ``biases`` None for int8.
        kv_cache_dtype: "int8" or "int4".
        head_dim: the unpacked last axis.
        dtype: the result's dtype; the arithmetic is float32.

    Raises:
        ConfigurationError: ``kv_cache_dtype`` is not "int8" or "int4", or int4 with an odd head_dim.
    """
    _quantized(kv_cache_dtype, head_dim)
    group = kv_group_size(head_dim)
    lead = codes.shape[:-1]
    s = scales.astype(mx.float32)[..., None]
    if kv_cache_dtype == "int8":
        q = codes.astype(mx.float32).reshape(*lead, head_dim // group, group)
        return (q * s).reshape(*lead, head_dim).astype(dtype)
    u = mx.stack([codes & 15, codes >> 4], axis=-1).astype(mx.float32)
    u = u.reshape(*lead, head_dim // group, group)
    x = u * s + biases.astype(mx.float32)[..., None]
    return x.reshape(*lead, head_dim).astype(dtype)


def hadamard_block_size(head_dim: int) -> int:
    """The block size ``P`` of :func:`hadamard_matrix`: the largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


@functools.lru_cache(maxsize=None)
def _hadamard_numpy(head_dim: int) -> np.ndarray:
    size = hadamard_block_size(head_dim)
    block = np.ones((1, 1))
    while block.shape[0] < size:  # Sylvester's construction: H_2n = [[H, H], [H, -H]]
        block = np.block([[block, block], [block, -block]])
    block = block / np.sqrt(size)
    return np.kron(np.eye(head_dim // size), block)


@functools.lru_cache(maxsize=None)
def _hadamard_block(head_dim: int) -> mx.array:
    size = hadamard_block_size(head_dim)
    return mx.array(_hadamard_numpy(head_dim)[:size, :size].astype(np.float32))


def hadamard_matrix(head_dim: int) -> mx.array:
    """The normalized Walsh-Hadamard rotation ``[head_dim, head_dim]`` float32.

    Block-diagonal, with Sylvester Hadamard blocks of size ``P`` (the largest power of
    two dividing ``head_dim``: ``P = head_dim`` for 64/128/256, 16 for 80) scaled by
    ``1 / sqrt(P)``; symmetric and orthonormal (``H @ H = I``). Source: Sylvester's
    construction; its use on the K cache follows QuaRot / QuIP# and llama.cpp's
    Hadamard-rotated K cache.

    Raises:
        ConfigurationError: ``head_dim`` is not a positive integer.
    """
    kv_group_size(head_dim)  # validates head_dim
    return mx.array(_hadamard_numpy(head_dim).astype(np.float32))


def rotate(x: mx.array, head_dim: int) -> mx.array:
    """``x @ hadamard_matrix(head_dim)`` for ``x`` ``[..., head_dim]``, in x's dtype
    (computed in float32). The matrix is its own inverse, so ``rotate`` undoes itself.

    Applied block by block (``[..., head_dim // P, P] @ H_P``), which costs ``P`` rather
    than ``head_dim`` multiply-adds per element when ``P < head_dim``.

    Raises:
        ConfigurationError: ``head_dim`` is not a positive integer, or ``x``'s last axis differs from it.
    """
    if x.shape[-1] != head_dim:
        raise ConfigurationError(f"rotate: the last axis of x is {x.shape[-1]}, not head_dim={head_dim}")
    kv_group_size(head_dim)
    size = hadamard_block_size(head_dim)
    lead = x.shape[:-1]
    xb = x.astype(mx.float32).reshape(*lead, head_dim // size, size)
    return (xb @ _hadamard_block(head_dim)).reshape(*lead, head_dim).astype(x.dtype)


def _kind(codes: mx.array) -> str:
    """The ``kv_cache_dtype`` a codes array stores (its dtype says: int8 or packed uint8)."""
    if codes.dtype == mx.int8:
        return "int8"
    if codes.dtype == mx.uint8:
        return "int4"
    raise ConfigurationError(f"quantized KV codes must be int8 (int8) or uint8 (int4), not {codes.dtype}")


def _gather_rows(pool: mx.array, rows: mx.array) -> mx.array:
    """``pool`` ``[num_blocks, KVH, bs, C]`` rows ``[..., KVH, nb]`` (see ``block_rows``)
    -> ``[..., KVH, nb * bs, C]``: only the named blocks are read."""
    num_blocks, kvh, bs, c = pool.shape
    g = pool.reshape(num_blocks * kvh, bs, c)[rows]
    return g.reshape(*g.shape[:-3], g.shape[-3] * bs, c)


def gather_dequantized(
    codes: mx.array,
    scales: mx.array,
    biases: Optional[mx.array],
    table: mx.array,
    head_dim: int,
    dtype: mx.Dtype = mx.float32,
    rows: Optional[mx.array] = None,
) -> mx.array:
    """The blocks ``table`` ``[..., nb]`` of one layer's quantized pool, dequantized:
    ``[..., num_kv_heads, nb * block_size, head_dim]`` in ``dtype``.

    Only the table's blocks are gathered (codes, scales and biases alike) before the
    dequantization, so the cost follows the table, never the pool.

    Args:
        codes: ``[num_blocks, num_kv_heads, block_size, head_dim or head_dim // 2]``.
        scales, biases: ``[num_blocks, num_kv_heads, block_size, head_dim // G]`` float16
            (biases None for int8).
        rows: ``block_rows(table, num_kv_heads)``, when the caller has it.
    """
    if rows is None:
        rows = block_rows(table, codes.shape[1])
    kind = _kind(codes)
    return dequantize_kv(
        _gather_rows(codes, rows), _gather_rows(scales, rows),
        None if biases is None else _gather_rows(biases, rows), kind, head_dim, dtype,
    )


def _unpack(codes: mx.array) -> tuple[mx.array, mx.array]:
    """Packed int4 codes ``[..., n]`` -> (even elements, odd elements), each ``[..., n]``
    float32 (the low and the high nibbles)."""
    return (codes & 15).astype(mx.float32), (codes >> 4).astype(mx.float32)


def attention_over_codes(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    valid: Optional[mx.array],
    scale: float,
    sinks: Optional[mx.array] = None,
    float_keys: Optional[mx.array] = None,
    float_values: Optional[mx.array] = None,
    float_valid: Optional[mx.array] = None,
) -> mx.array:
    """One query per sequence over that sequence's quantized K/V, computed from the codes:
    no dequantized copy of K or V is built.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` queries in the keys' basis (already rotated
            when the keys are).
        k_codes, v_codes: ``[num_seqs, num_kv_heads, T, C]`` each sequence's stored codes,
            dense (gathered blocks, or a contiguous cache's rows); int8 (``C = head_dim``)
            or packed uint8 (int4, ``C = head_dim // 2``).
        k_scales, v_scales, k_biases, v_biases: ``[num_seqs, num_kv_heads, T, head_dim // G]``
            float16 (biases None for int8).
        valid: ``[num_seqs, T]`` bool, the key positions each query may see, or None (all).
        scale: softmax scale.
        sinks: ``[num_heads]`` attention-sink logits, or None.
        float_keys, float_values: ``[num_seqs, num_kv_heads, F, head_dim]`` float entries
            attended in the same softmax as the codes (the float window,
            :mod:`~mlx_ferrum.kernels.float_window`; keys in the codes' basis), or None.
        float_valid: ``[num_seqs, F]`` bool, the float entries each query sees (the
            positions they hold must be masked out of ``valid``).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype.

    The group scale (and the int4 bias) is folded out of the products instead of being
    applied to every stored element: with ``k = code * s + b`` over a group,
    ``q . k = s * (q . code) + b * sum(q)`` per group, so the scores take one multiply per
    key token and group; for the values, ``sum_t p_t (code_t s_t + b_t) = (p * s) @ code +
    p @ b``. The int4 nibbles stay in two arrays (even and odd elements) that multiply the
    matching halves of the query, so the codes are never interleaved back. What remains
    per stored element is its cast to float32 for the products. Softmax in base 2 with
    ``log2(e)`` folded into the scale (FlashAttention-2), as the float reference.
    """
    num_seqs, num_heads, head_dim = q.shape
    kvh = k_codes.shape[1]
    g = num_heads // kvh
    groups = k_scales.shape[-1]
    width = head_dim // groups  # G
    code_width = k_codes.shape[-1] // groups  # code columns per group (G, or G // 2 packed)
    affine = k_biases is not None
    f32 = mx.float32

    def per_token(x: mx.array) -> mx.array:  # [S, KVH, T, groups] -> [S, KVH, groups, T] float32
        return x.astype(f32).swapaxes(-1, -2)

    def group_codes(codes: mx.array, i: int):  # one group's codes as float32 [S, KVH, T, ...]
        part = codes[..., i * code_width : (i + 1) * code_width]
        return _unpack(part) if affine else part.astype(f32)

    # Group by group: the cast of one group's columns is a contiguous matrix for the
    # product (a product over a strided view of all groups at once made MLX copy it).
    qg = (q.astype(f32) * (scale * _LOG2_E)).reshape(num_seqs, kvh, g, head_dim)
    k_s = per_token(k_scales)
    k_b = per_token(k_biases) if affine else None
    scores = None
    for i in range(groups):
        qi = qg[..., i * width : (i + 1) * width]  # [S, KVH, g, G]
        codes = group_codes(k_codes, i)
        if affine:
            even, odd = codes
            part = qi[..., 0::2] @ even.swapaxes(-1, -2) + qi[..., 1::2] @ odd.swapaxes(-1, -2)
            part = part * k_s[:, :, i : i + 1] + qi.sum(axis=-1, keepdims=True) * k_b[:, :, i : i + 1]
        else:
            part = (qi @ codes.swapaxes(-1, -2)) * k_s[:, :, i : i + 1]  # [S, KVH, g, T]
        scores = part if scores is None else scores + part
    if valid is not None:
        scores = mx.where(valid[:, None, None, :], scores, _NEG_INF)
    num_codes = scores.shape[-1]
    if float_keys is not None:
        float_scores = qg @ float_keys.astype(f32).swapaxes(-1, -2)  # [S, KVH, g, F]
        float_scores = mx.where(float_valid[:, None, None, :], float_scores, _NEG_INF)
        scores = mx.concatenate([scores, float_scores], axis=-1)
    p, denom = softmax_base2(scores, sinks, kvh, g)
    float_out = None
    if float_keys is not None:
        float_out = p[..., num_codes:] @ float_values.astype(f32)  # [S, KVH, g, D]
        p = p[..., :num_codes]
    v_s = per_token(v_scales)
    v_b = per_token(v_biases) if affine else None
    outs = []
    for i in range(groups):
        weighted = p * v_s[:, :, i : i + 1]
        codes = group_codes(v_codes, i)
        if affine:
            even, odd = codes
            halves = mx.stack([weighted @ even, weighted @ odd], axis=-1)  # [S, KVH, g, G // 2, 2]
            out = halves.reshape(num_seqs, kvh, g, width)  # even and odd elements interleaved back
            out = out + (p * v_b[:, :, i : i + 1]).sum(axis=-1, keepdims=True)
        else:
            out = weighted @ codes  # [S, KVH, g, G]
        outs.append(out)
    out = outs[0] if groups == 1 else mx.concatenate(outs, axis=-1)
    if float_out is not None:
        out = out + float_out
    return (out / denom).reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def quantized_paged_attention_decode(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    keys_rotated: bool = False,
    host_context_lens: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    index: Optional[DecodeIndex] = None,
    float_rows: Optional[FloatRows] = None,
) -> mx.array:
    """:func:`~mlx_ferrum.kernels.reference.paged_attention_decode` over a quantized pool.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, un-rotated (post-RoPE) queries.
        k_codes, v_codes: one layer's codes, ``[num_blocks, num_kv_heads, block_size, C]``
            int8 (``C = head_dim``) or uint8 (int4, ``C = head_dim // 2``); the dtype tells
            which format the pool stores.
        k_scales, v_scales, k_biases, v_biases: ``[num_blocks, num_kv_heads, block_size,
            head_dim // G]`` float16; the biases None for int8.
        block_tables, context_lens, scale, host_context_lens, window, sinks, index: as in
            the float reference (``index``: :func:`decode_index`, shared by the layers).
        keys_rotated: the pool's keys were rotated before quantization (int4 with
            ``rotate_keys``): the queries are rotated here by the same matrix.
        float_rows: the rows' float window (:class:`~mlx_ferrum.kernels.float_window.FloatRows`),
            attended in the same softmax as the codes; the positions it covers are
            masked out of the codes. None: codes only.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype.

    Only the blocks of ``block_tables`` are gathered (codes, scales and biases, never a
    float copy), and :func:`attention_over_codes` attends over them with the group
    scales folded into the scores and probabilities (Kwon et al.'s paged layout). With
    ``host_context_lens`` and one sequence, only its live blocks (those inside the
    window) are gathered.
    """
    num_seqs, num_heads, head_dim = q.shape
    kvh, bs = k_codes.shape[1], k_codes.shape[2]
    nb = block_tables.shape[1]
    if keys_rotated:
        q = rotate(q, head_dim)
    pick = lambda a, rows: None if a is None else _gather_rows(a, rows)  # noqa: E731
    if host_context_lens is not None and num_seqs == 1:
        # one sequence: read just its live blocks, and from them just the live tokens
        n = int(host_context_lens[0])
        start = max(0, n - window) if window is not None else 0
        first, last = start // bs, -(-n // bs)
        rows = block_rows(block_tables[:, first:last], kvh)
        lo, hi = start - first * bs, n - first * bs
        live = lambda a: None if a is None else pick(a, rows)[:, :, lo:hi]  # noqa: E731
        valid, floats = None, {}
        if float_rows is not None:
            from_float, entries_valid = float_rows.masks(context_lens - 1, mx.arange(start, n)[None], window,
                                                         memo_key=("live", start, n))
            valid = ~from_float
            floats = _float_args(float_rows, entries_valid)
        return attention_over_codes(q, live(k_codes), live(v_codes), live(k_scales), live(v_scales),
                                    live(k_biases), live(v_biases), valid, scale, sinks, **floats)
    if index is None:
        index = decode_index(block_tables, context_lens, kvh, bs)
    valid = index.valid
    if window is not None:
        valid = valid & (mx.arange(nb * bs)[None] >= context_lens[:, None] - window)
    floats = {}
    if float_rows is not None:
        from_float, entries_valid = float_rows.masks(context_lens - 1, mx.arange(nb * bs)[None], window,
                                                     memo_key=("blocks", nb * bs))
        valid = valid & ~from_float
        floats = _float_args(float_rows, entries_valid)
    rows = index.rows
    return attention_over_codes(q, pick(k_codes, rows), pick(v_codes, rows), pick(k_scales, rows),
                                pick(v_scales, rows), pick(k_biases, rows), pick(v_biases, rows), valid, scale, sinks,
                                **floats)


def _float_args(float_rows: FloatRows, entries_valid: mx.array) -> dict:
    return {"float_keys": float_rows.keys, "float_values": float_rows.values, "float_valid": entries_valid}


def quantized_paged_prefill_attention(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    keys_rotated: bool = False,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """:func:`~mlx_ferrum.kernels.reference.paged_prefill_attention` over a quantized pool.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` packed (varlen) un-rotated queries.
        k_codes ... v_biases: as in :func:`quantized_paged_attention_decode`.
        block_tables, context_lens, query_start_loc, scale, host_*, window, sinks: as in
            the float reference.
        keys_rotated: rotate the queries (the pool's keys are rotated).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Per sequence, only the blocks from the first one inside the window to the last
    one holding its context are gathered and dequantized (to q's dtype), then one
    causal ``mx.fast.scaled_dot_product_attention`` runs over them.
    """
    ctx = list(host_context_lens) if host_context_lens is not None else context_lens.tolist()
    starts = list(host_query_start_loc) if host_query_start_loc is not None else query_start_loc.tolist()
    head_dim = q.shape[-1]
    if keys_rotated:
        q = rotate(q, head_dim)

    def gather(table):
        return (gather_dequantized(k_codes, k_scales, k_biases, table, head_dim, q.dtype),
                gather_dequantized(v_codes, v_scales, v_biases, table, head_dim, q.dtype))

    return varlen_prefill_over_blocks(q, gather, k_codes.shape[2], block_tables, ctx, starts, scale, window, sinks)


def quantized_paged_prefill_with_float(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    block_tables: mx.array,
    host_context_lens: Sequence[int],
    host_query_start_loc: Sequence[int],
    scale: float,
    float_rows: Sequence[tuple],
    float_window: int,
    entries: int,
    *,
    keys_rotated: bool = False,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """:func:`quantized_paged_prefill_attention` with each sequence's float window: every
    query reads its last ``float_window`` positions and its sequence's first tokens from
    float K/V, all other positions from the codes, in one softmax
    (:func:`~mlx_ferrum.kernels.float_window.prefill_attention`, one call per sequence).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` packed, un-rotated queries.
        k_codes ... v_biases: one layer's pool (after this pass's writes).
        block_tables: ``[num_seqs, max_blocks]`` int32.
        host_context_lens, host_query_start_loc: per sequence, tokens stored after the
            pass and the offsets of its queries in ``q``.
        float_rows: per sequence ``(ring_keys, ring_values, new_keys, new_values,
            window_start)``: its ring entries as they were BEFORE this pass's writes
            (``[entries, num_kv_heads, head_dim]``, keys in the pool's basis), this pass's
            own K/V ``[n, num_kv_heads, head_dim]`` (keys in the pool's basis), and its first
            position with a float entry (int).
        float_window: the float window in tokens; entries: ring entries per sequence.
        keys_rotated, window, sinks: as in :func:`quantized_paged_prefill_attention`.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.
    """
    head_dim = q.shape[-1]
    if keys_rotated:
        q = rotate(q, head_dim)
    bs = k_codes.shape[2]
    ring = entries - FIRST_TOKENS
    outs = []
    for i, (ring_keys, ring_values, new_keys, new_values, window_start) in enumerate(float_rows):
        q0, q1 = host_query_start_loc[i], host_query_start_loc[i + 1]
        if q1 == q0:
            continue
        clen = int(host_context_lens[i])
        start = clen - (q1 - q0)
        first = max(0, start - window + 1) // bs if window is not None else 0
        table = block_tables[i, first : -(-clen // bs)]
        keys = gather_dequantized(k_codes, k_scales, k_biases, table, head_dim, q.dtype)[None, :, : clen - first * bs]
        values = gather_dequantized(v_codes, v_scales, v_biases, table, head_dim, q.dtype)[None, :, : clen - first * bs]
        if first:
            # a sliding window skipped the blocks before `first`: pad the codes back to
            # position 0 (never read: the window masks them) so positions index them
            pad = [(0, 0), (0, 0), (first * bs, 0), (0, 0)]
            keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        as_batch = lambda x: x.swapaxes(0, 1)[None]  # noqa: E731  [n, KVH, D] -> [1, KVH, n, D]
        out = prefill_attention_in_tiles(
            as_batch(q[q0:q1]), keys, values, as_batch(ring_keys), as_batch(ring_values),
            entry_positions(mx.array([start - 1], dtype=mx.int32), entries)[0], as_batch(new_keys),
            as_batch(new_values), start, window_start, float_window, start - ring, scale,
            sliding_window=window, sinks=sinks,
        )
        outs.append(out[0].swapaxes(0, 1))
    if not outs:
        return mx.zeros_like(q)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def quantized_contiguous_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    *,
    keys_rotated: bool = False,
    mask=None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention of ``q`` ``[1, num_heads, L, head_dim]`` (the last ``L`` positions) over
    the dequantized contents of one sequence's quantized contiguous cache.

    Args:
        q: un-rotated (post-RoPE) queries, ``[1, num_heads, L, head_dim]``.
        keys, values: ``[1, num_kv_heads, n, head_dim]``, what
            ``QuantizedContiguousKvCache.append`` returns (keys still rotated when the
            cache rotates them).
        keys_rotated: rotate ``q`` to match the keys.
        mask: an additive mask ``[L, n]`` / "causal" / None (None: "causal" when L > 1).
        window: sliding window in tokens; a decode step (L == 1) reads only its last
            ``window`` keys, a prefill builds the windowed causal mask.
        sinks: ``[num_heads]`` attention-sink logits, or None.

    Returns:
        ``[1, num_heads, L, head_dim]`` in q's dtype (``mx.fast.scaled_dot_product_attention``).
    """
    head_dim, length = q.shape[-1], q.shape[2]
    if keys_rotated:
        q = rotate(q, head_dim)
    n = keys.shape[2]
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    if mask is None and length > 1:
        mask = "causal"
    if window is not None and n > window:
        if length == 1:
            keys, values = keys[:, :, n - window :], values[:, :, n - window :]
        else:
            qpos = mx.arange(n - length, n)[:, None]
            kpos = mx.arange(n)[None, :]
            allowed = (kpos <= qpos) & (kpos > qpos - window)
            mask = mx.where(allowed, 0.0, _NEG_INF).astype(q.dtype)
    extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
    if mask is not None:
        extra["mask"] = mask
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, **extra)
