"""Quantized KV cache (int8 / int4): the format against a float64 numpy implementation of
the storage contract, the Walsh-Hadamard rotation, the paged pool and contiguous cache,
the reference attention over them against a float64 oracle, and the config / CLI flag."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import ConfigurationError, KvCacheError
from mlx_ferrum.kernels import quantized_reference as qref
from mlx_ferrum.kv_cache.quantized import (
    QuantizedContiguousKvCache,
    QuantizedPagedKvPool,
    bytes_per_token,
    dequantize_kv,
    hadamard_matrix,
    kv_group_size,
    quantize_kv,
    rotate,
)

HEAD_DIMS = [8, 16, 64, 80, 96, 128]  # groups 8, 16, 64, 16, 32, 64
FP16_EPS = 2.0**-10  # float16 relative spacing at 1 (rounding error <= half of it)


# ---------------------------------------------------------------------------------------------
# float64 numpy implementation of the storage contract (independent of the MLX code)


def np_group(head_dim):
    for g in (64, 32, 16, 8, 4, 2, 1):
        if head_dim % g == 0:
            return g


def np_quantize(x, kind):
    """x float64 [..., D] -> (codes [..., D] unpacked ints, scales f64 [..., D/G], biases or None, quotient)."""
    d = x.shape[-1]
    g = np_group(d)
    xg = x.reshape(*x.shape[:-1], d // g, g)
    if kind == "int8":
        s = (np.abs(xg).max(-1) / 127.0).astype(np.float16).astype(np.float64)
        quot = np.where(s[..., None] > 0, xg / np.where(s > 0, s, 1)[..., None], 0.0)
        codes = np.clip(np.round(quot), -127, 127)
        return codes.reshape(x.shape), s, None, quot.reshape(x.shape)
    lo, hi = xg.min(-1), xg.max(-1)
    s = ((hi - lo) / 15.0).astype(np.float16).astype(np.float64)
    b = lo.astype(np.float16).astype(np.float64)
    quot = np.where(s[..., None] > 0, (xg - b[..., None]) / np.where(s > 0, s, 1)[..., None], 0.0)
    codes = np.clip(np.round(quot), 0, 15)
    return codes.reshape(x.shape), s, b, quot.reshape(x.shape)


def np_unpack(codes_u8):
    c = np.asarray(codes_u8).astype(np.int64)
    out = np.empty(c.shape[:-1] + (2 * c.shape[-1],), np.int64)
    out[..., 0::2] = c & 15
    out[..., 1::2] = c >> 4
    return out


def np_dequantize(codes, scales, biases, kind, head_dim):
    """Stored arrays (as numpy) -> float64 [..., head_dim]."""
    codes = np.asarray(codes)
    q = np_unpack(codes) if kind == "int4" else codes.astype(np.int64)
    g = np_group(head_dim)
    qg = q.reshape(*q.shape[:-1], head_dim // g, g).astype(np.float64)
    x = qg * np.asarray(scales, np.float64)[..., None]
    if biases is not None:
        x = x + np.asarray(biases, np.float64)[..., None]
    return x.reshape(*q.shape[:-1], head_dim)


def np_hadamard(head_dim):
    """Closed form of the normalized Walsh-Hadamard (Sylvester) matrix: (-1)^popcount(i & j) / sqrt(P),
    block-diagonal with P the largest power of two dividing head_dim."""
    p = head_dim & -head_dim
    i = np.arange(p)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    block = (-1.0) ** bits / np.sqrt(p)
    h = np.zeros((head_dim, head_dim))
    for b in range(head_dim // p):
        h[b * p : (b + 1) * p, b * p : (b + 1) * p] = block
    return h


def sample(shape, seed, outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        x[..., 1] *= 12.0  # an outlier channel, as real keys have
    return x


def to_np(a):
    return np.array(a.astype(mx.float32)) if a.dtype in (mx.float16, mx.bfloat16) else np.array(a)


# ---------------------------------------------------------------------------------------------
# format


@pytest.mark.parametrize("head_dim,group", [(8, 8), (16, 16), (64, 64), (80, 16), (96, 32), (128, 64), (6, 2)])
def test_group_size_is_the_largest_divisor_up_to_64(head_dim, group):
    assert kv_group_size(head_dim) == group == np_group(head_dim)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantize_matches_numpy_contract(kind, head_dim):
    x = sample((3, 5, head_dim), seed=head_dim)
    x[0, 0, :] = 0.0  # an all-zero row: scale 0, codes 0
    codes, scales, biases = quantize_kv(mx.array(x), kind)
    mx.eval(codes, scales)
    g = np_group(head_dim)
    assert scales.dtype == mx.float16 and scales.shape == (3, 5, head_dim // g)
    ref_codes, ref_s, ref_b, quot = np_quantize(x.astype(np.float64), kind)
    if kind == "int8":
        assert codes.dtype == mx.int8 and codes.shape == (3, 5, head_dim) and biases is None
        got = np.array(codes).astype(np.int64)
    else:
        assert codes.dtype == mx.uint8 and codes.shape == (3, 5, head_dim // 2)
        assert biases.dtype == mx.float16 and biases.shape == scales.shape
        np.testing.assert_allclose(to_np(biases), ref_b, rtol=FP16_EPS, atol=1e-7)
        got = np_unpack(np.array(codes))  # also checks the nibble order: element 2j low, 2j+1 high
    np.testing.assert_allclose(to_np(scales), ref_s, rtol=FP16_EPS, atol=1e-7)
    # codes agree except where float32 and float64 quotients fall on either side of a .5 tie
    near_tie = np.abs(np.abs(quot - np.floor(quot)) - 0.5) < 1e-3
    diff = np.abs(got - ref_codes)
    assert diff.max() <= 1 and np.all(diff[~near_tie] == 0)
    assert np.all(got[0, 0] == 0) and np.all(to_np(scales)[0, 0] == 0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dequantize_matches_numpy_and_error_is_at_most_half_a_step(kind, head_dim):
    x = sample((4, 3, head_dim), seed=100 + head_dim)
    codes, scales, biases = quantize_kv(mx.array(x), kind)
    got = dequantize_kv(codes, scales, biases, kind, head_dim)
    assert got.dtype == mx.float32 and got.shape == x.shape
    ref = np_dequantize(np.array(codes), to_np(scales), None if biases is None else to_np(biases), kind, head_dim)
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-6, atol=1e-6)
    g = np_group(head_dim)
    s = np.repeat(to_np(scales).astype(np.float64), g, axis=-1)
    err = np.abs(x.astype(np.float64) - ref)
    if kind == "int8":
        bound = s / 2 * (1 + 1e-6)
    else:
        # the contract rounds scale and bias to float16 before coding: the half-step bound
        # holds up to that rounding
        b = np.repeat(to_np(biases).astype(np.float64), g, axis=-1)
        bound = s / 2 + FP16_EPS * (np.abs(b) + 15 * s) + 1e-6
    assert np.all(err <= bound)
    # the dtype argument only casts
    half = dequantize_kv(codes, scales, biases, kind, head_dim, mx.float16)
    assert half.dtype == mx.float16


def test_quantize_keeps_non_finite_inputs_out_of_the_scales():
    x = sample((2, 2, 16), seed=3)
    x[0, 0, 3] = np.nan
    x[1, 1, 5] = np.inf
    for kind in ("int8", "int4"):
        codes, scales, biases = quantize_kv(mx.array(x), kind)
        assert np.all(np.isfinite(to_np(scales)))
        assert np.all(np.isfinite(np.array(dequantize_kv(codes, scales, biases, kind, 16))))


def test_bad_dtype_and_odd_head_dim_are_refused_clearly():
    with pytest.raises(ConfigurationError, match="'int3'.*auto, int8, int4"):
        quantize_kv(mx.zeros((2, 8)), "int3")
    with pytest.raises(ConfigurationError, match="head_dim.*7.*int8"):
        quantize_kv(mx.zeros((2, 7)), "int4")
    with pytest.raises(ConfigurationError, match="head_dim.*7.*int8"):
        QuantizedPagedKvPool(1, 4, 1, 8, 7, "int4")
    QuantizedPagedKvPool(1, 4, 1, 8, 7, "int8")  # int8 takes any head_dim
    with pytest.raises(ConfigurationError, match="PagedKvPool"):
        QuantizedPagedKvPool(1, 4, 1, 8, 8, "auto")


# ---------------------------------------------------------------------------------------------
# Hadamard rotation


@pytest.mark.parametrize("head_dim", [8, 16, 64, 80, 96, 128, 256])
def test_hadamard_is_the_normalized_sylvester_matrix_and_orthonormal(head_dim):
    h = hadamard_matrix(head_dim)
    assert h.dtype == mx.float32 and h.shape == (head_dim, head_dim)
    hn = np.array(h)
    np.testing.assert_allclose(hn, np_hadamard(head_dim), rtol=1e-7, atol=0)
    np.testing.assert_array_equal(hn, hn.T)
    eye = np.array(h @ h)
    np.testing.assert_allclose(eye, np.eye(head_dim), atol=1e-6)
    if (head_dim & -head_dim) in (16, 64, 256):  # 1/sqrt(P) is a power of two: exact in float32
        np.testing.assert_array_equal(eye, np.eye(head_dim))


@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
def test_rotation_preserves_dot_products_and_undoes_itself(head_dim):
    q = sample((6, head_dim), seed=1)
    k = sample((9, head_dim), seed=2)
    qr, kr = rotate(mx.array(q), head_dim), rotate(mx.array(k), head_dim)
    np.testing.assert_allclose(np.array(qr), q.astype(np.float64) @ np_hadamard(head_dim), atol=1e-5)
    dots = q.astype(np.float64) @ k.astype(np.float64).T
    np.testing.assert_allclose(np.array(qr @ kr.T), dots, rtol=1e-5, atol=1e-5 * np.abs(dots).max())
    np.testing.assert_allclose(np.array(rotate(qr, head_dim)), q, atol=1e-5)
    assert rotate(mx.array(q).astype(mx.float16), head_dim).dtype == mx.float16


def test_rotation_shrinks_int4_key_error_with_an_outlier_channel():
    k = sample((64, 4, 64), seed=9)  # channel 1 is 12x the others
    codes, s, b = quantize_kv(mx.array(k), "int4")
    plain = np.abs(np.array(dequantize_kv(codes, s, b, "int4", 64)) - k).mean()
    kr = rotate(mx.array(k), 64)
    codes, s, b = quantize_kv(kr, "int4")
    back = rotate(dequantize_kv(codes, s, b, "int4", 64), 64)
    rotated = np.abs(np.array(back) - k).mean()
    assert rotated < 0.6 * plain


# ---------------------------------------------------------------------------------------------
# paged pool + reference attention against a float64 oracle

NUM_BLOCKS, KVH, HEADS, BS, D = 40, 2, 4, 4, 16


def make_pool(kind, rotate_keys=None, num_layers=2):
    return QuantizedPagedKvPool(num_layers, NUM_BLOCKS, KVH, BS, D, kind, rotate_keys=rotate_keys)


def fill_sequences(pool, context_lens, seed, layer=0, chunks=(3,)):
    """Write ``context_lens`` tokens per sequence to fresh blocks (first a prompt chunk per
    sequence, then the rest in one pass) and return (block_tables [S, max_nb], k, v) float32 originals."""
    rng = np.random.default_rng(seed)
    max_nb = max(-(-n // BS) for n in context_lens) + 1
    free = list(rng.permutation(NUM_BLOCKS))
    tables = np.array([[free.pop() for _ in range(max_nb)] for _ in context_lens], np.int32)
    ks = [sample((n, KVH, D), seed=seed + 10 * i) for i, n in enumerate(context_lens)]
    vs = [sample((n, KVH, D), seed=seed + 10 * i + 5, outliers=False) for i, n in enumerate(context_lens)]

    def slots(i, a, b):
        pos = np.arange(a, b)
        return tables[i, pos // BS] * BS + pos % BS

    cut = [min(chunks[0], n) for n in context_lens]
    for part in ((0, cut), (cut, context_lens)):
        lo, hi = part
        lo = [0] * len(context_lens) if lo == 0 else lo
        sm = np.concatenate([slots(i, lo[i], hi[i]) for i in range(len(context_lens))]).astype(np.int32)
        if sm.size == 0:
            continue
        k = np.concatenate([ks[i][lo[i] : hi[i]] for i in range(len(context_lens))])
        v = np.concatenate([vs[i][lo[i] : hi[i]] for i in range(len(context_lens))])
        pool.write(layer, mx.array(sm), mx.array(k), mx.array(v))
    return tables, ks, vs


def oracle_seq_kv(pool, layer, table, n):
    """float64 K, V [KVH, n, D] of one sequence, dequantized by numpy from the stored arrays."""
    kc, vc, ks, vs, kb, vb = [None if a is None else to_np(a) for a in pool.layer_arrays(layer)]
    kind = pool.kv_cache_dtype
    def seq(c, s, b):
        full = np_dequantize(c[table], s[table], None if b is None else b[table], kind, D)  # [nb, KVH, BS, D]
        return full.transpose(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
    return seq(kc, ks, kb), seq(vc, vs, vb)


def oracle_attention(q, keys, values, qpos, scale, window=None, sinks=None, rotate_q=False):
    """float64: q [L, H, D] at positions qpos over keys/values [KVH, n, D] -> [L, H, D]."""
    q = q.astype(np.float64)
    if rotate_q:
        q = q @ np_hadamard(D)
    g = q.shape[1] // keys.shape[0]
    out = np.zeros(q.shape)
    for t, p in enumerate(qpos):
        for h in range(q.shape[1]):
            kk, vv = keys[h // g], values[h // g]
            pos = np.arange(kk.shape[0])
            ok = pos <= p
            if window is not None:
                ok &= pos > p - window
            logits = (kk[ok] @ q[t, h]) * scale
            extra = [] if sinks is None else [float(sinks[h])]
            m = max(logits.max(), *extra) if extra else logits.max()
            w = np.exp(logits - m)
            denom = w.sum() + sum(np.exp(e - m) for e in extra)
            out[t, h] = (w / denom) @ vv[ok]
    return out


def float_attention(q, k, qpos, v, scale, window=None):
    """float64 attention over the unquantized K/V [n, KVH, D]."""
    return oracle_attention(q, k.transpose(1, 0, 2).astype(np.float64), v.transpose(1, 0, 2).astype(np.float64),
                            qpos, scale, window)


CASES = [
    pytest.param("int8", None, None, id="int8"),
    pytest.param("int4", None, None, id="int4-rotated"),
    pytest.param("int4", 6, None, id="int4-window"),
    pytest.param("int8", None, "sinks", id="int8-sinks"),
    pytest.param("int4", 5, "sinks", id="int4-window-sinks"),
]


@pytest.mark.parametrize("kind,window,with_sinks", CASES)
def test_paged_decode_matches_float64_oracle(kind, window, with_sinks):
    pool = make_pool(kind)
    context_lens = [7, 13, 1, 16]
    tables, ks, vs = fill_sequences(pool, context_lens, seed=21, layer=1)
    sinks = mx.array(np.linspace(-1, 2, HEADS).astype(np.float32)) if with_sinks else None
    q = sample((len(context_lens), HEADS, D), seed=5)
    scale = D**-0.5
    out = qref.quantized_paged_attention_decode(
        mx.array(q), *pool.layer_arrays(1), mx.array(tables), mx.array(context_lens, dtype=mx.int32), scale,
        keys_rotated=pool.rotate_keys, window=window, sinks=sinks)
    assert out.shape == q.shape and out.dtype == mx.float32
    for i, n in enumerate(context_lens):
        keys, values = oracle_seq_kv(pool, 1, tables[i], n)
        ref = oracle_attention(q[i : i + 1], keys, values, [n - 1], scale, window,
                               None if sinks is None else np.array(sinks), rotate_q=pool.rotate_keys)
        np.testing.assert_allclose(np.array(out[i : i + 1]), ref, atol=2e-5, rtol=1e-4)
        if sinks is None:
            # and quantization noise is small against the unquantized attention
            exact = float_attention(q[i : i + 1], ks[i], [n - 1], vs[i], scale, window)
            assert np.abs(np.array(out[i : i + 1]) - exact).max() < (0.15 if kind == "int8" else 0.75)
        # one sequence with host lengths takes the sliced SDPA path: same result
        one = qref.quantized_paged_attention_decode(
            mx.array(q[i : i + 1]), *pool.layer_arrays(1), mx.array(tables[i : i + 1]),
            mx.array([n], dtype=mx.int32), scale, keys_rotated=pool.rotate_keys, host_context_lens=[n],
            window=window, sinks=sinks)
        np.testing.assert_allclose(np.array(one), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,window,with_sinks", CASES)
def test_paged_prefill_matches_float64_oracle(kind, window, with_sinks):
    pool = make_pool(kind)
    context_lens = [9, 4, 14]
    qlens = [9, 2, 5]  # a fresh prompt, a short continuation, a chunk after a prefix
    tables, _, _ = fill_sequences(pool, context_lens, seed=33, layer=0)
    sinks = mx.array(np.linspace(-1, 2, HEADS).astype(np.float32)) if with_sinks else None
    q = sample((sum(qlens), HEADS, D), seed=6)
    starts = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    scale = D**-0.5
    out = qref.quantized_paged_prefill_attention(
        mx.array(q), *pool.layer_arrays(0), mx.array(tables), mx.array(context_lens, dtype=mx.int32),
        mx.array(starts), scale, keys_rotated=pool.rotate_keys, window=window, sinks=sinks)
    assert out.shape == q.shape
    for i, n in enumerate(context_lens):
        keys, values = oracle_seq_kv(pool, 0, tables[i], n)
        ref = oracle_attention(q[starts[i] : starts[i + 1]], keys, values, list(range(n - qlens[i], n)), scale,
                               window, None if sinks is None else np.array(sinks), rotate_q=pool.rotate_keys)
        np.testing.assert_allclose(np.array(out[starts[i] : starts[i + 1]]), ref, atol=2e-5, rtol=1e-4)


def test_a_planted_unrotated_query_or_wrong_scale_is_caught_by_the_oracle():
    pool = make_pool("int4")
    tables, _, _ = fill_sequences(pool, [12], seed=4)
    q = sample((1, HEADS, D), seed=8)
    keys, values = oracle_seq_kv(pool, 0, tables[0], 12)
    ref = oracle_attention(q, keys, values, [11], D**-0.5, rotate_q=True)
    arrays = pool.layer_arrays(0)
    run = lambda arrs, rotated: np.array(qref.quantized_paged_attention_decode(  # noqa: E731
        mx.array(q), *arrs, mx.array(tables), mx.array([12], dtype=mx.int32), D**-0.5, keys_rotated=rotated))
    np.testing.assert_allclose(run(arrays, True), ref, atol=2e-5)
    assert np.abs(run(arrays, False) - ref).max() > 1e-2  # the query left unrotated
    kc, vc, ks, vs, kb, vb = arrays
    assert np.abs(run((kc, vc, ks, vs * 1.5, kb, vb), True) - ref).max() > 1e-2  # a wrong value scale


def test_reference_gathers_only_the_tables_blocks(monkeypatch):
    pool = make_pool("int4")
    context_lens = [5, 11]
    tables, _, _ = fill_sequences(pool, context_lens, seed=12)
    # poison every block no table names: a pool-wide dequantization would be NaN there
    unused = np.array([b for b in range(NUM_BLOCKS) if b not in set(tables.ravel().tolist())], np.int32)
    for lst in (pool.k_scales, pool.v_scales, pool.k_biases, pool.v_biases):
        lst[0][mx.array(unused)] = mx.array(np.nan, dtype=mx.float16)
    seen = []
    real = qref._gather_rows

    def spy(array, rows):
        # every read of the pool (codes, scales, biases) goes through this gather
        seen.append(int(np.prod(rows.shape)) * array.shape[2])
        return real(array, rows)

    monkeypatch.setattr(qref, "_gather_rows", spy)
    q = sample((2, HEADS, D), seed=2)
    out = qref.quantized_paged_attention_decode(
        mx.array(q), *pool.layer_arrays(0), mx.array(tables), mx.array(context_lens, dtype=mx.int32), D**-0.5,
        keys_rotated=True)
    assert np.all(np.isfinite(np.array(out)))
    table_rows = tables.size * KVH * BS
    assert seen and max(seen) <= table_rows < NUM_BLOCKS * KVH * BS
    seen.clear()
    starts = mx.array([0, 5, 7], dtype=mx.int32)
    out = qref.quantized_paged_prefill_attention(
        mx.array(sample((7, HEADS, D), seed=3)), *pool.layer_arrays(0), mx.array(tables),
        mx.array(context_lens, dtype=mx.int32), starts, D**-0.5, keys_rotated=True)
    assert np.all(np.isfinite(np.array(out)))
    assert max(seen) <= 3 * KVH * BS  # per sequence, only its live blocks


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [24, 128])  # 3 groups of 8, 2 groups of 64
def test_attention_over_codes_with_several_groups_matches_float64_oracle(kind, head_dim):
    """The decode attention that folds each group's scale (and int4 bias) out of its
    products, for head_dims of several groups, with a mask, sinks and grouped-query heads."""
    seqs, kvh, heads, tokens = 3, 2, 6, 11
    k = sample((seqs, kvh, tokens, head_dim), seed=40)
    v = sample((seqs, kvh, tokens, head_dim), seed=41, outliers=False)
    q = sample((seqs, heads, head_dim), seed=42)
    kc, ks, kb = qref.quantize_kv(mx.array(k), kind)
    vc, vs, vb = qref.quantize_kv(mx.array(v), kind)
    lens = np.array([11, 4, 7])
    valid = np.arange(tokens)[None, :] < lens[:, None]
    sinks = np.linspace(-1, 1, heads).astype(np.float32)
    scale = head_dim**-0.5
    out = qref.attention_over_codes(mx.array(q), kc, vc, ks, vs, kb, vb, mx.array(valid), scale, mx.array(sinks))
    keys = np_dequantize(np.array(kc), to_np(ks), None if kb is None else to_np(kb), kind, head_dim)
    values = np_dequantize(np.array(vc), to_np(vs), None if vb is None else to_np(vb), kind, head_dim)
    g = heads // kvh
    for i in range(seqs):
        for h in range(heads):
            logits = keys[i, h // g, : lens[i]] @ q[i, h].astype(np.float64) * scale
            m = max(logits.max(), sinks[h])
            w = np.exp(logits - m)
            ref = (w / (w.sum() + np.exp(sinks[h] - m))) @ values[i, h // g, : lens[i]]
            np.testing.assert_allclose(np.array(out[i, h]), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("window,lens", [(None, [5, 13, 9]), (6, [5, 13, 9]), (6, [140, 300]), (None, [7])])
def test_contiguous_backend_decode_batches_rows_of_different_lengths(kind, window, lens):
    """A contiguous decode pass over rows of different lengths (and buffer capacities)
    attends from each row's codes; every row equals the float64 oracle over what its
    cache stores. Rows past a whole read granule (128 slots) before their window start
    the read there."""
    from mlx_ferrum.layers.attention import ContiguousMetadata
    from mlx_ferrum.layers.quantized_backends import QuantizedContiguousAttentionBackend

    caches = []
    for i, n in enumerate(lens):
        cache = QuantizedContiguousKvCache(KVH, D, mx.float32, 512, kind, step=4)
        cache.append(mx.array(sample((1, KVH, n, D), seed=60 + i)), mx.array(sample((1, KVH, n, D), seed=70 + i)))
        caches.append([cache])
    backend = QuantizedContiguousAttentionBackend(kind, rotate_keys=caches[0][0].rotate_keys)
    meta = ContiguousMetadata(backend=backend, offsets=mx.array(lens, dtype=mx.int32), caches=caches)
    q = sample((len(lens), HEADS, 1, D), seed=80)
    k, v = sample((len(lens), KVH, 1, D), seed=81), sample((len(lens), KVH, 1, D), seed=82)
    sinks = np.linspace(-1, 2, HEADS).astype(np.float32)
    scale = D**-0.5
    out = backend.attention(mx.array(q), mx.array(k), mx.array(v), meta, 0, scale, window, mx.array(sinks))
    assert out.shape == q.shape
    for i, n in enumerate(lens):
        cache = caches[i][0]
        assert cache.len == n + 1
        part = lambda a: None if a is None else to_np(a)[0, :, : n + 1]  # noqa: E731
        keys = np_dequantize(part(cache.k_codes), part(cache.k_scales), part(cache.k_biases), kind, D)
        values = np_dequantize(part(cache.v_codes), part(cache.v_scales), part(cache.v_biases), kind, D)
        ref = oracle_attention(q[i, :, 0][None], keys, values, [n], scale, window, sinks, rotate_q=cache.rotate_keys)
        np.testing.assert_allclose(np.array(out[i, :, 0]), ref[0], atol=2e-5, rtol=1e-4)


def test_pool_layout_sizes_and_bytes_per_token():
    for kind, code_width in (("int8", D), ("int4", D // 2)):
        pool = make_pool(kind)
        kc, vc, ks, vs, kb, vb = pool.layer_arrays(0)
        assert kc.shape == vc.shape == (NUM_BLOCKS, KVH, BS, code_width)
        assert ks.shape == vs.shape == (NUM_BLOCKS, KVH, BS, D // kv_group_size(D))
        assert (kb is None) == (kind == "int8")
        assert pool.bytes_per_token == 2 * bytes_per_token(KVH, D, kind)  # two layers
        assert pool.nbytes == pool.bytes_per_token * NUM_BLOCKS * BS
    # the Qwen2.5-0.5B shape (2 KV heads, head_dim 64): scales included, against float16
    fp16 = bytes_per_token(2, 64, "auto", mx.float16)
    assert bytes_per_token(2, 64, "int8") / fp16 == pytest.approx((64 + 2) / 128) and (64 + 2) / 128 <= 0.53
    assert bytes_per_token(2, 64, "int4") / fp16 == pytest.approx((32 + 4) / 128) and (32 + 4) / 128 <= 0.30


def test_pool_write_stores_the_numpy_codes_at_the_slots():
    pool = make_pool("int4", rotate_keys=True, num_layers=1)
    k, v = sample((5, KVH, D), seed=1), sample((5, KVH, D), seed=2)
    slot_mapping = np.array([3, 17, 18, 40, 159], np.int32)
    pool.write(0, mx.array(slot_mapping), mx.array(k), mx.array(v))
    ref_codes, ref_s, ref_b, _ = np_quantize(k.astype(np.float64) @ np_hadamard(D), "int4")
    blocks, offsets = slot_mapping // BS, slot_mapping % BS
    stored = np_unpack(np.array(pool.k_codes[0])[blocks, :, offsets])
    assert np.abs(stored - ref_codes).max() <= 1
    np.testing.assert_allclose(to_np(pool.k_scales[0])[blocks, :, offsets], ref_s, rtol=FP16_EPS, atol=1e-6)
    v_codes, _, _, _ = np_quantize(v.astype(np.float64), "int4")  # values are not rotated
    assert np.abs(np_unpack(np.array(pool.v_codes[0])[blocks, :, offsets]) - v_codes).max() <= 1
    # every other slot is untouched
    mask = np.ones((NUM_BLOCKS, BS), bool)
    mask[blocks, offsets] = False
    assert np.all(np.array(pool.k_codes[0]).transpose(0, 2, 1, 3)[mask] == 0)


def test_with_arrays_view_writes_inside_a_compiled_function_like_the_eager_pool():
    eager, traced = make_pool("int8"), make_pool("int8")
    k, v = sample((3, KVH, D), seed=4), sample((3, KVH, D), seed=5)
    slot_mapping = mx.array([0, 9, 33], dtype=mx.int32)
    eager.write(1, slot_mapping, mx.array(k), mx.array(v))

    def step(arrays, sm, kk, vv):
        view = traced.with_arrays(arrays)
        view.write(1, sm, kk, vv)
        return view.arrays()

    out = mx.compile(step)(traced.arrays(), slot_mapping, mx.array(k), mx.array(v))
    traced.set_arrays(out)
    for a, b in zip(eager.arrays(), traced.arrays()):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    with pytest.raises(KvCacheError):
        traced.with_arrays(out[:-1])


def test_copy_blocks_copies_codes_scales_and_biases():
    pool = make_pool("int4")
    tables, _, _ = fill_sequences(pool, [8], seed=7)
    src, dst = int(tables[0, 0]), int([b for b in range(NUM_BLOCKS) if b not in tables[0]][0])
    pool.copy_blocks([(src, dst)])
    for lst in (pool.k_codes, pool.v_codes, pool.k_scales, pool.v_scales, pool.k_biases, pool.v_biases):
        np.testing.assert_array_equal(to_np(lst[0][dst]), to_np(lst[0][src]))


# ---------------------------------------------------------------------------------------------
# contiguous cache


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_contiguous_cache_appends_grows_truncates_and_fetches_what_numpy_dequantizes(kind):
    cache = QuantizedContiguousKvCache(KVH, D, mx.float32, max_capacity=40, kv_cache_dtype=kind, step=8)
    k, v = sample((1, KVH, 20, D), seed=1), sample((1, KVH, 20, D), seed=2)
    keys, values = cache.append(mx.array(k[:, :, :5]), mx.array(v[:, :, :5]))
    assert cache.len == 5 and cache.capacity == 8 and keys.shape == (1, KVH, 5, D)
    keys, values = cache.append(mx.array(k[:, :, 5:20]), mx.array(v[:, :, 5:20]))  # grows past two steps
    assert cache.len == 20 and cache.capacity == 24
    rk = k.astype(np.float64) @ np_hadamard(D) if cache.rotate_keys else k.astype(np.float64)
    for got, x, c, s, b in ((keys, rk, cache.k_codes, cache.k_scales, cache.k_biases),
                            (values, v, cache.v_codes, cache.v_scales, cache.v_biases)):
        stored = np_dequantize(np.array(c)[:, :, :20], to_np(s)[:, :, :20],
                               None if b is None else to_np(b)[:, :, :20], kind, D)
        np.testing.assert_allclose(np.array(got), stored, rtol=1e-6, atol=1e-6)
        assert np.abs(stored - x).max() <= 0.5 * to_np(s).max() + FP16_EPS * (np.abs(x).max() + 1)
    cache.truncate(10)
    keys, _ = cache.append(mx.array(k[:, :, 15:17]), mx.array(v[:, :, 15:17]))
    assert keys.shape[2] == 12
    np.testing.assert_allclose(np.array(keys[:, :, 10:12]), np.array(cache.fetch(10)[0]), atol=0)
    with pytest.raises(KvCacheError):
        cache.truncate(13)
    twin = QuantizedContiguousKvCache(KVH, D, mx.float32, 40, kind, step=8)
    twin.copy_from(cache)
    for a, b in zip(twin.fetch(), cache.fetch()):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert cache.nbytes == sum(a.nbytes for a in cache.arrays()) == 24 * bytes_per_token(KVH, D, kind)


def test_contiguous_cache_refuses_past_capacity():
    from mlx_ferrum.errors import KvCacheExhaustedError

    cache = QuantizedContiguousKvCache(KVH, D, mx.float32, 4, "int8", step=4)
    cache.append(mx.zeros((1, KVH, 4, D)), mx.zeros((1, KVH, 4, D)))
    with pytest.raises(KvCacheExhaustedError, match="FERRUM_KV_CAPACITY"):
        cache.append(mx.zeros((1, KVH, 1, D)), mx.zeros((1, KVH, 1, D)))


@pytest.mark.parametrize("kind,window,with_sinks", CASES)
def test_contiguous_attention_matches_float64_oracle(kind, window, with_sinks):
    cache = QuantizedContiguousKvCache(KVH, D, mx.float32, 64, kind, step=16)
    k, v = sample((1, KVH, 14, D), seed=3), sample((1, KVH, 14, D), seed=4)
    q = sample((1, HEADS, 14, D), seed=5)
    sinks = mx.array(np.linspace(-1, 2, HEADS).astype(np.float32)) if with_sinks else None
    scale = D**-0.5
    outs = []
    for lo, hi in ((0, 10), (10, 11), (11, 14)):  # prefill, decode, chunk
        keys, values = cache.append(mx.array(k[:, :, lo:hi]), mx.array(v[:, :, lo:hi]))
        out = qref.quantized_contiguous_attention(mx.array(q[:, :, lo:hi]), keys, values, scale,
                                                  keys_rotated=cache.rotate_keys, window=window, sinks=sinks)
        stored_k = np_dequantize(np.array(cache.k_codes)[0, :, :hi], to_np(cache.k_scales)[0, :, :hi],
                                 None if cache.k_biases is None else to_np(cache.k_biases)[0, :, :hi], kind, D)
        stored_v = np_dequantize(np.array(cache.v_codes)[0, :, :hi], to_np(cache.v_scales)[0, :, :hi],
                                 None if cache.v_biases is None else to_np(cache.v_biases)[0, :, :hi], kind, D)
        ref = oracle_attention(q[0, :, lo:hi].transpose(1, 0, 2), stored_k, stored_v, list(range(lo, hi)), scale,
                               window, None if sinks is None else np.array(sinks), rotate_q=cache.rotate_keys)
        np.testing.assert_allclose(np.array(out[0]).transpose(1, 0, 2), ref, atol=2e-5, rtol=1e-4)
        outs.append(out)


# ---------------------------------------------------------------------------------------------
# configuration and CLI


def test_config_default_environment_and_errors(monkeypatch):
    monkeypatch.delenv("FERRUM_KV_CACHE_DTYPE", raising=False)
    assert RuntimeConfig().kv_cache_dtype == "auto"
    monkeypatch.setenv("FERRUM_KV_CACHE_DTYPE", " INT4 ")
    assert RuntimeConfig().kv_cache_dtype == "int4"
    assert RuntimeConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"  # explicit beats the environment
    monkeypatch.setenv("FERRUM_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(ConfigurationError, match=r"FERRUM_KV_CACHE_DTYPE='fp8'.*auto, int8, int4"):
        RuntimeConfig()
    monkeypatch.delenv("FERRUM_KV_CACHE_DTYPE")
    with pytest.raises(ConfigurationError, match=r"RuntimeConfig.kv_cache_dtype='q8'.*auto, int8, int4"):
        RuntimeConfig(kv_cache_dtype="q8")


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_every_engine_command_takes_kv_cache_dtype(command, monkeypatch, capsys):
    from mlx_ferrum import cli
    from mlx_ferrum.cli.generation import command_config
    from mlx_ferrum.cli.serve import serve_config

    monkeypatch.delenv("FERRUM_KV_CACHE_DTYPE", raising=False)
    extra = ["--prompt", "x"] if command == "generate" else []
    parser = cli.build_parser()
    args = parser.parse_args([command, "--model", "m", *extra, "--kv-cache-dtype", "INT8"])
    assert args.kv_cache_dtype == "int8"
    if command == "serve":
        assert serve_config(args).kv_cache_dtype == "int8"
    elif command == "bench":
        from mlx_ferrum.cli.bench import bench_config

        assert bench_config(4, 8, 8, kv_cache_dtype=args.kv_cache_dtype).kv_cache_dtype == "int8"
    else:
        assert command_config(args).kv_cache_dtype == "int8"
    args = parser.parse_args([command, "--model", "m", *extra])
    config = serve_config(args) if command == "serve" else (
        RuntimeConfig() if command == "bench" else command_config(args))
    assert config.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as e:
        parser.parse_args([command, "--model", "m", *extra, "--kv-cache-dtype", "int3"])
    assert e.value.code == 2
    assert "int3" in capsys.readouterr().err
    sub = parser._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    assert "--kv-cache-dtype {auto,int8,int4}" in text and "else auto)" in text


def test_cli_refuses_a_bad_environment_value_before_loading_the_model(monkeypatch, capsys):
    import mlx_ferrum.api
    from mlx_ferrum import cli

    monkeypatch.setenv("FERRUM_KV_CACHE_DTYPE", "int2")
    loaded = []
    monkeypatch.setattr(mlx_ferrum.api, "load", lambda *args, **kwargs: loaded.append(args))
    assert cli.main(["generate", "--model", "/nonexistent", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "FERRUM_KV_CACHE_DTYPE='int2'" in err and "int8" in err and not loaded
