"""Quantized paged-KV problems and a float64 numpy oracle, for the quantized kernel tests.

The quantize step here is written independently of ``mlx_ferrum`` from the quantized KV
storage contract (numpy, float64 arithmetic, float16 scales):

- group size G along head_dim: the largest of 64, 32, 16, 8, 4, 2, 1 dividing head_dim;
- int8 (symmetric): ``scale = max|x| / 127`` (float16; 0 for a zero group),
  ``code = clip(round(x / scale), -127, 127)``; ``x_hat = code * scale``;
- int4 (affine): ``scale = (max - min) / 15``, ``bias = min`` (both float16),
  ``code = clip(round((x - bias) / scale), 0, 15)`` (0 when scale is 0), two codes per
  byte, element ``2i`` in the low nibble of byte ``i``; ``x_hat = code * scale + bias``;
- int4 keys are rotated before quantization: ``k H`` with ``H`` the normalised
  Walsh-Hadamard (Sylvester) matrix, block-diagonal with blocks of the largest power of
  two dividing head_dim (QuaRot, Ashkboos et al. 2024; QuIP#, Tseng et al. 2024). The
  kernel receives ``q H``.

Pool slots no sequence owns keep random codes but NaN scales (and biases), so a kernel
that reads past a context shows it. The oracle dequantizes exactly the stored blocks in
float64 and computes softmax(q K^T * scale) V over the valid keys (with the window and
sinks of :mod:`support.paged_cases`' conventions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from support.paged_cases import PagedCase, decode_case, prefill_case


def group_size(head_dim: int) -> int:
    """The contract's group size for ``head_dim``."""
    return next(g for g in (64, 32, 16, 8, 4, 2, 1) if head_dim % g == 0)


def hadamard(head_dim: int) -> np.ndarray:
    """float64 ``[head_dim, head_dim]``: block-diagonal normalised Sylvester Walsh-Hadamard."""
    p = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // p), h / np.sqrt(p))


def quantize(x: np.ndarray, bits: int, group: int):
    """``(codes, scales, biases)`` of rows ``x [..., head_dim]`` (biases None for int8)."""
    shape = x.shape
    g = x.astype(np.float64).reshape(*shape[:-1], shape[-1] // group, group)
    if bits == 8:
        scale = (np.abs(g).max(-1) / 127).astype(np.float16)
        s = scale.astype(np.float64)[..., None]
        codes = np.where(s > 0, np.clip(np.round(g / np.where(s > 0, s, 1)), -127, 127), 0)
        return codes.reshape(shape).astype(np.int8), scale, None
    lo, hi = g.min(-1), g.max(-1)
    scale = ((hi - lo) / 15).astype(np.float16)
    bias = lo.astype(np.float16)
    s, b = scale.astype(np.float64)[..., None], bias.astype(np.float64)[..., None]
    codes = np.where(s > 0, np.clip(np.round((g - b) / np.where(s > 0, s, 1)), 0, 15), 0).astype(np.uint8)
    codes = codes.reshape(shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale, bias


def dequantize(codes: np.ndarray, scales: np.ndarray, biases: Optional[np.ndarray], bits: int) -> np.ndarray:
    """float64 ``[..., head_dim]`` of stored codes and float16 scales (and biases)."""
    if bits == 8:
        c = codes.astype(np.float64)
    else:
        c = np.empty((*codes.shape[:-1], codes.shape[-1] * 2))
        c[..., 0::2] = codes & 0xF
        c[..., 1::2] = codes >> 4
    ng = scales.shape[-1]
    g = c.reshape(*c.shape[:-1], ng, -1) * scales.astype(np.float64)[..., None]
    if biases is not None:
        g = g + biases.astype(np.float64)[..., None]
    return g.reshape(c.shape)


@dataclass
class QuantizedCase:
    """A :class:`~support.paged_cases.PagedCase` with its pools quantized.

    ``q`` is what the kernel receives (rotated for int4 keys); ``q_unrotated`` the
    query before rotation. ``k_codes``/``v_codes`` are the code pools, ``k_scales``... the
    float16 scale (bias) pools as MLX arrays; ``kv_cache_dtype`` "int8" or "int4".
    """

    base: PagedCase
    kv_cache_dtype: str
    q: mx.array
    q_unrotated: mx.array
    k_codes: mx.array
    v_codes: mx.array
    k_scales: mx.array
    v_scales: mx.array
    k_biases: Optional[mx.array]
    v_biases: Optional[mx.array]

    @property
    def bits(self) -> int:
        return 8 if self.kv_cache_dtype == "int8" else 4

    def kernel_kwargs(self) -> dict:
        """The quantized keyword arguments of the kernel wrappers."""
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scales=self.k_scales, v_scales=self.v_scales,
                    k_biases=self.k_biases, v_biases=self.v_biases)

    def dequantized_pools(self) -> tuple[np.ndarray, np.ndarray]:
        """float64 K (as stored: rotated for int4) and V pools of the stored blocks."""
        def f(a):
            return None if a is None else np.array(a)
        k = dequantize(f(self.k_codes), f(self.k_scales), f(self.k_biases), self.bits)
        v = dequantize(f(self.v_codes), f(self.v_scales), f(self.v_biases), self.bits)
        return k, v


def quantize_case(base: PagedCase, kv_cache_dtype: str, seed: int = 0) -> QuantizedCase:
    """Quantize ``base``'s pools per the contract; unowned slots get random codes and NaN scales."""
    bits = 8 if kv_cache_dtype == "int8" else 4
    d = base.q.shape[-1]
    g = group_size(d)
    valid = base.valid[:, None, :, None]  # [num_blocks, 1, block_size, 1]
    k = np.where(valid, np.array(base.k_pool.astype(mx.float32)).astype(np.float64), 0.0)
    v = np.where(valid, np.array(base.v_pool.astype(mx.float32)).astype(np.float64), 0.0)
    q = np.array(base.q.astype(mx.float32)).astype(np.float64)
    q_kernel = q
    if bits == 4:
        h = hadamard(d)
        k = k @ h
        q_kernel = q @ h
    rng = np.random.default_rng(seed)
    arrays = []
    for x in (k, v):
        codes, scales, biases = quantize(x, bits, g)
        noise = rng.integers(0, 256, size=codes.shape).astype(np.uint8).view(codes.dtype)
        codes = np.where(valid, codes, noise)
        scales = np.where(valid, scales, np.float16(np.nan))
        if biases is not None:
            biases = np.where(valid, biases, np.float16(np.nan))
        arrays.append((codes, scales, biases))
    (kc, ks, kb), (vc, vs, vb) = arrays
    dtype = base.q.dtype

    def opt(a):
        return None if a is None else mx.array(a)
    return QuantizedCase(base, kv_cache_dtype, mx.array(q_kernel.astype(np.float32)).astype(dtype), base.q,
                         mx.array(kc), mx.array(vc), mx.array(ks), mx.array(vs), opt(kb), opt(vb))


def quantized_decode_case(seed: int, ctxs: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype, kv_cache_dtype: str) -> QuantizedCase:
    """:func:`support.paged_cases.decode_case` with quantized pools."""
    base = decode_case(seed, ctxs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    return quantize_case(base, kv_cache_dtype, seed)


def quantized_prefill_case(seed: int, ctx_qlens, num_heads: int, num_kv_heads: int, head_dim: int,
                           block_size: int, dtype, kv_cache_dtype: str) -> QuantizedCase:
    """:func:`support.paged_cases.prefill_case` with quantized pools."""
    base = prefill_case(seed, ctx_qlens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    return quantize_case(base, kv_cache_dtype, seed)


def attend_one_query(q, keys, values, scale, sink):
    """float64 softmax attention of one query `[D]` over `keys`, `values` `[n, D]`, with an optional sink logit."""
    logits = keys @ q * scale
    m = logits.max() if sink is None else max(logits.max(), sink)
    p = np.exp(logits - m)
    den = p.sum() + (0.0 if sink is None else np.exp(sink - m))
    return (p @ values) / den


def sequence_kv(k_pool, v_pool, table, ctx, block_size):
    """One sequence's first `ctx` K and V rows `[kvh, ctx, D]` gathered from its blocks."""
    blocks = table[: -(-ctx // block_size)]
    k, v = k_pool[blocks], v_pool[blocks]
    kvh, d = k.shape[1], k.shape[3]
    return (k.transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :ctx],
            v.transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :ctx])


def numpy_quantized_attention(case: QuantizedCase, q: Optional[np.ndarray] = None, window: Optional[int] = None,
                              sinks: Optional[np.ndarray] = None) -> np.ndarray:
    """float64 attention over the dequantized stored blocks, decode or prefill (by
    ``case.base.query_start_loc``); ``q`` defaults to the query the kernel receives."""
    qq = np.array(case.q.astype(mx.float32)).astype(np.float64) if q is None else q
    k_pool, v_pool = case.dequantized_pools()
    tables = np.array(case.base.block_tables)
    ctxs = np.array(case.base.context_lens).tolist()
    bs = k_pool.shape[2]
    h, kvh = qq.shape[1], k_pool.shape[1]
    scale = case.base.scale
    out = np.zeros_like(qq)
    if case.base.query_start_loc is None:
        rows = [(i, i, ctx - 1) for i, ctx in enumerate(ctxs)]
    else:
        qsl = np.array(case.base.query_start_loc).tolist()
        rows = [(i, r, ctx - (qsl[i + 1] - qsl[i]) + (r - qsl[i]))
                for i, ctx in enumerate(ctxs) for r in range(qsl[i], qsl[i + 1])]
    for i, r, pos in rows:
        if pos < 0:
            continue
        k, v = sequence_kv(k_pool, v_pool, tables[i], ctxs[i], bs)
        first = max(0, pos - window + 1) if window else 0
        for j in range(h):
            g = j // (h // kvh)
            out[r, j] = attend_one_query(qq[r, j], k[g, first : pos + 1], v[g, first : pos + 1], scale,
                                None if sinks is None else float(sinks[j]))
    return out
