"""Random paged-attention problems and a float64 numpy oracle, for kernel tests.

A case builds K/V pools with shuffled block tables (physical blocks in random
order, unused table entries pointing at random in-range blocks) and fills every
pool slot no sequence owns with NaN, so a kernel that reads past a context shows
it. :func:`without_garbage` gives the same pools with those slots zeroed, for
oracles (such as ``mx.fast.scaled_dot_product_attention`` with a ``-inf`` mask)
that multiply masked values by zero.

The numpy oracle is the textbook definition, softmax(q K^T * scale) V in float64
over exactly the valid keys (Vaswani et al. 2017; paged layout of Kwon et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

#: ``(atol, rtol)`` per dtype for ``|kernel - oracle| <= atol + rtol * |oracle|``: a
#: float32 accumulation plus one or two units in the last place of the output dtype.
TOLERANCES = {
    mx.float32: (2e-5, 2e-5),
    mx.float16: (2e-3, 4e-3),
    mx.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class PagedCase:
    """Arrays of one paged-attention problem (see the module docstring).

    ``q`` is ``[num_seqs, H, D]`` (decode) or ``[num_tokens, H, D]`` (prefill);
    ``query_start_loc`` is None for decode. ``valid`` marks pool slots holding a token.
    """

    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    block_tables: mx.array
    context_lens: mx.array
    query_start_loc: mx.array | None
    scale: float
    valid: np.ndarray  # [num_blocks, block_size] bool


def _pools(rng, ctxs: Sequence[int], kvh: int, d: int, bs: int, dtype, spare_blocks: int = 2):
    nblocks = [max(1, -(-c // bs)) for c in ctxs]
    max_blocks = max(nblocks) + 1  # one more column than needed: entries past the end are ignored
    total = sum(nblocks) + spare_blocks
    perm = rng.permutation(total)
    tables = rng.integers(0, total, size=(len(ctxs), max_blocks)).astype(np.int32)
    valid = np.zeros((total, bs), dtype=bool)
    at = 0
    for i, (c, nb) in enumerate(zip(ctxs, nblocks)):
        tables[i, :nb] = perm[at : at + nb]
        for j in range(nb):
            valid[perm[at + j], : max(0, min(bs, c - j * bs))] = True
        at += nb
    k = rng.standard_normal((total, kvh, bs, d)).astype(np.float32)
    v = rng.standard_normal((total, kvh, bs, d)).astype(np.float32)
    nan_mask = ~valid[:, None, :, None]
    k = np.where(nan_mask, np.nan, k)
    v = np.where(nan_mask, np.nan, v)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype), mx.array(tables), valid


def decode_case(seed: int, ctxs: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype) -> PagedCase:
    """A decode problem: one query per sequence, contexts ``ctxs`` (each >= 1)."""
    rng = np.random.default_rng(seed)
    k, v, tables, valid = _pools(rng, ctxs, num_kv_heads, head_dim, block_size, dtype)
    q = mx.array(rng.standard_normal((len(ctxs), num_heads, head_dim)).astype(np.float32)).astype(dtype)
    return PagedCase(q, k, v, tables, mx.array(np.array(ctxs, np.int32)), None, head_dim**-0.5, valid)


def prefill_case(seed: int, ctx_qlens: Sequence[tuple[int, int]], num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype) -> PagedCase:
    """A prefill problem: per sequence ``(context_len, q_len)`` with ``q_len <= context_len``."""
    rng = np.random.default_rng(seed)
    ctxs = [c for c, _ in ctx_qlens]
    k, v, tables, valid = _pools(rng, ctxs, num_kv_heads, head_dim, block_size, dtype)
    qsl = np.concatenate([[0], np.cumsum([ql for _, ql in ctx_qlens])]).astype(np.int32)
    q = mx.array(rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(np.float32)).astype(dtype)
    return PagedCase(q, k, v, tables, mx.array(np.array(ctxs, np.int32)), mx.array(qsl), head_dim**-0.5, valid)


def without_garbage(case: PagedCase) -> PagedCase:
    """The same case with every slot no sequence owns set to zero instead of NaN."""
    mask = mx.array(case.valid)[:, None, :, None]
    zero = mx.zeros((), case.k_pool.dtype)
    return PagedCase(case.q, mx.where(mask, case.k_pool, zero), mx.where(mask, case.v_pool, zero),
                     case.block_tables, case.context_lens, case.query_start_loc, case.scale, case.valid)


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    logits = keys @ q * scale
    p = np.exp(logits - logits.max())
    return (p / p.sum()) @ values


def _seq_kv(case: PagedCase, i: int, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    bs = case.k_pool.shape[2]
    blocks = np.array(case.block_tables)[i, : -(-ctx // bs)]
    k, v = _f64(case.k_pool)[blocks], _f64(case.v_pool)[blocks]  # [nb, KVH, bs, D]
    kvh, d = k.shape[1], k.shape[3]
    k = k.transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :ctx]
    v = v.transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :ctx]
    return k, v


def numpy_decode(case: PagedCase) -> np.ndarray:
    """float64 decode attention ``[num_seqs, H, D]`` over exactly the valid keys."""
    q = _f64(case.q)
    s, h, d = q.shape
    kvh = case.k_pool.shape[1]
    out = np.zeros((s, h, d))
    for i, ctx in enumerate(np.array(case.context_lens).tolist()):
        k, v = _seq_kv(case, i, ctx)
        for j in range(h):
            g = j // (h // kvh)
            out[i, j] = _attend(q[i, j], k[g], v[g], case.scale)
    return out


def numpy_prefill(case: PagedCase) -> np.ndarray:
    """float64 causal prefill attention ``[num_tokens, H, D]``."""
    q = _f64(case.q)
    _, h, d = q.shape
    kvh = case.k_pool.shape[1]
    out = np.zeros_like(q)
    qsl = np.array(case.query_start_loc).tolist()
    for i, ctx in enumerate(np.array(case.context_lens).tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 == q0:
            continue
        k, v = _seq_kv(case, i, ctx)
        for r in range(q0, q1):
            pos = ctx - (q1 - q0) + (r - q0)
            for j in range(h):
                g = j // (h // kvh)
                out[r, j] = _attend(q[r, j], k[g, : pos + 1], v[g, : pos + 1], case.scale)
    return out


def max_violation(got: mx.array, want: np.ndarray, dtype) -> float:
    """Largest ``|got - want| - (atol + rtol*|want|)``; <= 0 means within :data:`TOLERANCES`.

    NaN anywhere in ``got`` counts as an infinite violation.
    """
    atol, rtol = TOLERANCES[dtype]
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    if not np.isfinite(g).all():
        return float("inf")
    return float((np.abs(g - want) - (atol + rtol * np.abs(want))).max())
