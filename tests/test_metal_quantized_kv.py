"""The Metal paged-attention kernels over a quantized KV cache (int8, and int4 with
rotated keys), run in the CPU harness.

Each kernel reads the stored blocks (codes, float16 scales, int4 biases) and
dequantizes in registers (decode) or while staging a tile (prefill). Its output is
compared with two oracles over the same stored blocks: a float64 numpy implementation
that dequantizes them (:mod:`support.quantized_cases`, whose quantize step is written
from the storage contract independently of mlx_ferrum), and the pure-MLX reference
(``mlx_ferrum.kernels.reference``) run on the dequantized pools. Slots no sequence owns
hold random codes and NaN scales, so reading past a context (or before a window) fails.

Planted bugs the comparison must catch: a vector dequantized with the scale of the
neighbouring group (decode, at groups shared by 8, 4 and 2 lanes; prefill), the scale
of the wrong token group, and an int4 query passed unrotated. The cost model's bytes
read per KV token fall with the dtype: at most 0.55x (int8) and 0.32x (int4) of fp16.
The wider sweep runs under ``-m slow``.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from support import metal_harness as mh
from support.kernel_costs import measure_decode
from support.paged_cases import max_violation
from support.quantized_cases import (
    attend_one_query,
    dequantize,
    group_size,
    hadamard,
    numpy_quantized_attention,
    quantize,
    quantized_decode_case,
    quantized_prefill_case,
    sequence_kv,
)
from test_metal_kernels import _assert_caught, _mutated

from mlx_ferrum.errors import KernelError
from mlx_ferrum.kernels import metal, reference

F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16

needs_clang = pytest.mark.skipif(
    not mh.clang_available(),
    reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
)
harness = [pytest.mark.harness, needs_clang]


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _sinks(seed: int, num_heads: int, use: bool):
    if not use:
        return None
    return mx.array(np.random.default_rng(seed).standard_normal(num_heads).astype(np.float32))


def _dequantized_pools(case):
    """float32 K/V pools of the stored blocks (slots no sequence owns zeroed), for the reference."""
    k, v = case.dequantized_pools()
    valid = case.base.valid[:, None, :, None]
    return mx.array(np.where(valid, k, 0).astype(np.float32)), mx.array(np.where(valid, v, 0).astype(np.float32))


def _poison_before_window(case, first_keys):
    """NaN scales in the blocks wholly before each sequence's first attended key, which
    the kernels must not read (their oracle values are never used)."""
    bs = case.k_codes.shape[2]
    tables = np.array(case.base.block_tables)
    names = ["k_scales", "v_scales"] + (["k_biases", "v_biases"] if case.k_biases is not None else [])
    arrays = {n: np.array(getattr(case, n)) for n in names}
    for i, first in enumerate(first_keys):
        for b in range(first // bs):
            for a in arrays.values():
                a[tables[i, b]] = np.nan
    for n, a in arrays.items():
        setattr(case, n, mx.array(a))


def _run_decode(case, q=None, window=None, sinks=None):
    with metal.use_launcher(mh.metal_kernel):
        return metal.paged_attention_decode(
            case.q if q is None else q, case.k_codes, case.v_codes, case.base.block_tables,
            case.base.context_lens, case.base.scale, window=window, sinks=sinks, **case.kernel_kwargs(),
        )


def _run_prefill(case, q=None, window=None, sinks=None):
    with metal.use_launcher(mh.metal_kernel):
        return metal.paged_prefill_attention(
            case.q if q is None else q, case.k_codes, case.v_codes, case.base.block_tables,
            case.base.context_lens, case.base.query_start_loc, case.base.scale, window=window, sinks=sinks,
            **case.kernel_kwargs(),
        )


def _check_decode(case, dtype, window=None, use_sinks=False, q=None):
    sinks = _sinks(7, case.q.shape[1], use_sinks)
    want = numpy_quantized_attention(case, window=window, sinks=None if sinks is None else np.array(sinks))
    k, v = _dequantized_pools(case)
    ctxs = np.array(case.base.context_lens).tolist()
    if window:
        _poison_before_window(case, [max(0, c - window) for c in ctxs])
    got = _run_decode(case, q=q, window=window, sinks=sinks)
    assert got.shape == case.q.shape and got.dtype == dtype
    assert max_violation(got, want, dtype) <= 0, "kernel disagrees with the numpy oracle"
    ref = reference.paged_attention_decode(case.q.astype(F32), k, v, case.base.block_tables,
                                           case.base.context_lens, case.base.scale, window=window, sinks=sinks)
    assert max_violation(got, _f64(ref), dtype) <= 0, "kernel disagrees with the MLX reference"


def _check_prefill(case, dtype, window=None, use_sinks=False, q=None):
    sinks = _sinks(8, case.q.shape[1], use_sinks)
    want = numpy_quantized_attention(case, window=window, sinks=None if sinks is None else np.array(sinks))
    k, v = _dequantized_pools(case)
    if window:
        ctxs = np.array(case.base.context_lens).tolist()
        qsl = np.array(case.base.query_start_loc).tolist()
        _poison_before_window(case, [max(0, c - (qsl[i + 1] - qsl[i]) - window + 1) for i, c in enumerate(ctxs)])
    got = _run_prefill(case, q=q, window=window, sinks=sinks)
    assert got.shape == case.q.shape and got.dtype == dtype
    assert max_violation(got, want, dtype) <= 0, "kernel disagrees with the numpy oracle"
    ref = reference.paged_prefill_attention(case.q.astype(F32), k, v, case.base.block_tables,
                                            case.base.context_lens, case.base.query_start_loc, case.base.scale,
                                            window=window, sinks=sinks)
    assert max_violation(got, _f64(ref), dtype) <= 0, "kernel disagrees with the MLX reference"


# ------------------------------------------------------------ the test's own quantizer


def test_test_quantizer_follows_the_contract():
    rng = np.random.default_rng(0)
    assert {d: group_size(d) for d in (8, 48, 64, 80, 96, 128, 256)} == {
        8: 8, 48: 16, 64: 64, 80: 16, 96: 32, 128: 64, 256: 64}
    for d in (8, 48, 64, 96, 128):
        h = hadamard(d)
        assert np.allclose(h, h.T) and np.allclose(h @ h, np.eye(d), atol=1e-12)
        g = group_size(d)
        x = rng.standard_normal((5, d)) * 3
        for bits in (8, 4):
            codes, scales, biases = quantize(x, bits, g)
            assert codes.shape[-1] == (d if bits == 8 else d // 2) and scales.dtype == np.float16
            err = np.abs(dequantize(codes, scales, biases, bits) - x).reshape(5, d // g, g)
            step = scales.astype(np.float64)[..., None]
            # half a step from rounding, plus the float16 rounding of the scale (and bias)
            assert (err <= 0.5 * step + 2.0**-10 * np.abs(x).max() + 1e-9).all()
    # int4 packing: element 2i in the low nibble of byte i, 2i + 1 in the high nibble
    codes, scales, biases = quantize(np.array([[0, 15, 1, 14, 2, 13, 3, 12.0]]), 4, 8)
    assert codes.tolist() == [[0xF0, 0xE1, 0xD2, 0xC3]] and float(scales[0, 0]) == 1.0 and float(biases[0, 0]) == 0.0


# ------------------------------------------------------------ decode and prefill vs oracles

# (kv_cache_dtype, num_heads, num_kv_heads, head_dim, block_size, context lengths, q dtype)
# head_dim 128 (2 groups of 64: 8 lanes share each scale), 96 (3 of 32: 4 lanes), 48 (3 of
# 16: 2 lanes); 8 is stories260K's (one group of 8 per row, one lane per token).
DECODE_CASES = [
    ("int8", 8, 2, 128, 16, [33, 5], F16),
    ("int4", 8, 2, 128, 8, [40, 16, 1], F32),
    ("int8", 4, 1, 96, 16, [50], BF16),
    ("int4", 12, 3, 48, 8, [23, 9], F16),
    ("int8", 8, 4, 8, 16, [19, 16], F32),
    ("int4", 8, 4, 8, 16, [31], F32),
]


@pytest.mark.parametrize("kv,h,kvh,d,bs,ctxs,dtype", DECODE_CASES)
@pytest.mark.harness
@needs_clang
def test_quantized_decode_matches_oracles(kv, h, kvh, d, bs, ctxs, dtype):
    _check_decode(quantized_decode_case(len(ctxs) + d, ctxs, h, kvh, d, bs, dtype, kv), dtype)


@pytest.mark.parametrize("kv,psize", [("int8", 32), ("int4", 16)])
@pytest.mark.harness
@needs_clang
def test_quantized_decode_partitions(monkeypatch, kv, psize):
    # Several partitions (the reduce kernel merges them), contexts ending on and off a
    # partition boundary, one partition past a short sequence's context.
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    before = mh.LAUNCHES["paged_attention_reduce"]
    _check_decode(quantized_decode_case(psize, [100, 64, 3], 8, 2, 64, 8, F16, kv), F16)
    assert mh.LAUNCHES["paged_attention_reduce"] == before + 1, "the reduce kernel did not run"


@pytest.mark.parametrize("kv,window,use_sinks,psize", [
    ("int8", 19, True, None),
    ("int4", 9, False, None),
    ("int4", 37, True, 16),     # split-K: partitions wholly before the window
])
@pytest.mark.harness
@needs_clang
def test_quantized_decode_window_and_sinks(monkeypatch, kv, window, use_sinks, psize):
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    case = quantized_decode_case(window, [70, 45, 3], 8, 4, 32, 8, F32, kv)
    _check_decode(case, F32, window=window, use_sinks=use_sinks)


# ------------------------------------------------------------ decode with a float window
#
# int4 caches keep each sequence's last positions and first FLOAT_FIRST positions in float16
# entries beside the codes (mlx_ferrum.kernels.float_window): each query reads those positions
# from the entries and every other one from the codes, in one softmax. The oracle below is
# written from that definition over the stored arrays; the entries hold values unrelated to
# the codes, so reading a position from the wrong side is caught, and the scales of every
# position the entries cover are NaN, so reading such a code at all is caught.

FLOAT_FIRST = 4


def _float_ring(rng, last: int, entries: int, kvh: int, d: int):
    """A ring of ``entries`` float16 entries written token by token up to position ``last``:
    position p < FLOAT_FIRST at entry p, a later one at FLOAT_FIRST + (p - FLOAT_FIRST) % ring.
    Returns (keys [kvh, entries, d], values, position held per entry (-1: none))."""
    ring = entries - FLOAT_FIRST
    keys = np.zeros((kvh, entries, d), np.float16)
    values = np.zeros((kvh, entries, d), np.float16)
    held = np.full(entries, -1)
    for p in range(last + 1):
        e = p if p < FLOAT_FIRST else FLOAT_FIRST + (p - FLOAT_FIRST) % ring
        keys[:, e] = rng.standard_normal((kvh, d)).astype(np.float16)
        values[:, e] = rng.standard_normal((kvh, d)).astype(np.float16)
        held[e] = p
    return keys, values, held


def _reads_float(p, t, start, window, oldest):
    # the definition: at or after the window start, one of the first tokens or one of the
    # query's last `window` positions that the ring still holds
    return p >= start and (p < FLOAT_FIRST or (p > t - window and p >= oldest))


def _float_window_oracle(case, keys, values, held, starts, lasts, window, entries, sliding=None, sinks=None):
    """float64 attention of each decode row over its codes and its float entries."""
    qq = np.array(case.q.astype(mx.float32)).astype(np.float64)
    k_pool, v_pool = case.dequantized_pools()
    tables = np.array(case.base.block_tables)
    ctxs = np.array(case.base.context_lens).tolist()
    h, kvh = qq.shape[1], k_pool.shape[1]
    out = np.zeros_like(qq)
    for i, ctx in enumerate(ctxs):
        t, oldest = ctx - 1, lasts[i] - (entries - FLOAT_FIRST) + 1
        k, v = sequence_kv(k_pool, v_pool, tables[i], ctx, k_pool.shape[2])
        seen = lambda p: p <= t and (sliding is None or p > t - sliding)  # noqa: E731
        codes = [p for p in range(ctx) if seen(p) and not _reads_float(p, t, starts[i], window, oldest)]
        floats = [e for e in range(entries)
                  if held[i][e] >= 0 and seen(held[i][e]) and _reads_float(held[i][e], t, starts[i], window, oldest)]
        assert sorted(codes + [held[i][e] for e in floats]) == [p for p in range(ctx) if seen(p)], \
            "the test's ring must hold every position a row reads from floats"
        for j in range(h):
            g = j // (h // kvh)
            kk = np.concatenate([k[g, codes], keys[i][g, floats].astype(np.float64)])
            vv = np.concatenate([v[g, codes], values[i][g, floats].astype(np.float64)])
            out[i, j] = attend_one_query(qq[i, j], kk, vv, case.base.scale, None if sinks is None else float(sinks[j]))
    return out


def _poison_float_positions(case, starts, lasts, window, entries):
    """NaN scales at every position a row reads from its float entries."""
    bs = case.k_codes.shape[2]
    tables = np.array(case.base.block_tables)
    names = ["k_scales", "v_scales"] + (["k_biases", "v_biases"] if case.k_biases is not None else [])
    arrays = {n: np.array(getattr(case, n)) for n in names}
    for i, ctx in enumerate(np.array(case.base.context_lens).tolist()):
        oldest = lasts[i] - (entries - FLOAT_FIRST) + 1
        for p in range(ctx):
            if _reads_float(p, ctx - 1, starts[i], window, oldest):
                for a in arrays.values():
                    a[tables[i, p // bs], :, p % bs] = np.nan
    for n, a in arrays.items():
        setattr(case, n, mx.array(a))


@pytest.mark.parametrize("kv,window,psize,sliding,use_sinks,lookahead", [
    ("int4", 16, None, None, False, 0),
    ("int4", 8, 16, None, True, 2),      # split-K: partitions wholly inside the window
    ("int4", 12, None, 20, False, 0),    # the model's sliding window cuts both sides
    ("int8", 5, 16, None, False, 0),
])
@pytest.mark.harness
@needs_clang
def test_quantized_decode_with_float_window(monkeypatch, kv, window, psize, sliding, use_sinks, lookahead):
    from mlx_ferrum.kernels import metal_quantized_paged_attention_decode
    from mlx_ferrum.kernels.float_window import FloatRows
    from mlx_ferrum.kernels.quantized_reference import quantized_paged_attention_decode
    from mlx_ferrum.layers.attention import NO_FLOAT_WINDOW

    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    ctxs = [70, 45, 3, 30]
    # window starts: from the first position, after a prefix-cache hit (codes only before
    # it), after the first tokens, and a sequence without a window slot
    starts = [0, 20, 2, NO_FLOAT_WINDOW]
    lasts = [c - 1 + (lookahead if i == 0 else 0) for i, c in enumerate(ctxs)]  # row 0: a draft's earlier row
    h, kvh, d, bs = 8, 2, 64, 8
    entries = FLOAT_FIRST + window + lookahead
    base = quantized_decode_case(window + 1, ctxs, h, kvh, d, bs, F32, kv)
    q_plain = base.q_unrotated if kv == "int4" else base.q
    rng = np.random.default_rng(window)
    rings = [_float_ring(rng, last, entries, kvh, d) for last in lasts]
    keys, values, held = ([r[n] for r in rings] for n in range(3))
    sinks = _sinks(9, h, use_sinks)
    want = _float_window_oracle(base, keys, values, held, starts, lasts, window, entries, sliding,
                                None if sinks is None else np.array(sinks))
    rows = FloatRows(mx.array(np.stack(keys)), mx.array(np.stack(values)), mx.array(lasts, dtype=mx.int32),
                     mx.array(starts, dtype=mx.int32), window, entries)
    args = (base.k_codes, base.v_codes, base.k_scales, base.v_scales, base.k_biases, base.v_biases,
            base.base.block_tables, base.base.context_lens, base.base.scale)
    rotated = kv == "int4"
    # the pure-MLX reference multiplies whole gathered blocks (its masked slots by 0): the
    # NaN scales of the slots no sequence owns are zeroed for it
    clean = tuple(None if a is None else mx.nan_to_num(a, nan=0.0) for a in args[2:6])
    ref = quantized_paged_attention_decode(q_plain, *args[:2], *clean, *args[6:], keys_rotated=rotated,
                                           window=sliding, sinks=sinks, float_rows=rows)
    assert max_violation(ref, want, F32) <= 0, "the MLX reference disagrees with the oracle"
    _poison_float_positions(base, starts, lasts, window, entries)
    args = (base.k_codes, base.v_codes, base.k_scales, base.v_scales, base.k_biases, base.v_biases) + args[6:]
    before = mh.LAUNCHES["paged_attention_decode"]
    with metal.use_launcher(mh.metal_kernel):
        got = metal_quantized_paged_attention_decode(q_plain, *args, kv_cache_dtype=kv, keys_rotated=rotated,
                                                     window=sliding, sinks=sinks, float_rows=rows)
    assert mh.LAUNCHES["paged_attention_decode"] == before + 1, "the decode kernel did not run"
    assert got.shape == q_plain.shape and got.dtype == F32
    assert max_violation(got, want, F32) <= 0, "kernel + float entries disagree with the oracle"


# (kv_cache_dtype, num_heads, num_kv_heads, head_dim, block_size, (context, q_len) per sequence, dtype)
PREFILL_CASES = [
    ("int8", 8, 2, 128, 8, [(33, 5), (9, 9)], F16),
    ("int4", 8, 2, 96, 16, [(40, 12), (17, 3)], F32),
    ("int4", 8, 4, 8, 16, [(19, 19)], F32),
    ("int8", 6, 3, 48, 8, [(26, 7)], BF16),
]


@pytest.mark.parametrize("kv,h,kvh,d,bs,cq,dtype", PREFILL_CASES)
@pytest.mark.harness
@needs_clang
def test_quantized_prefill_matches_oracles(kv, h, kvh, d, bs, cq, dtype):
    _check_prefill(quantized_prefill_case(len(cq) + d, cq, h, kvh, d, bs, dtype, kv), dtype)


@pytest.mark.parametrize("kv,window,use_sinks", [("int8", 11, True), ("int4", 6, False), ("int4", None, True)])
@pytest.mark.harness
@needs_clang
def test_quantized_prefill_window_and_sinks(kv, window, use_sinks):
    case = quantized_prefill_case(3, [(37, 16), (5, 5)], 8, 2, 64, 8, F32, kv)
    _check_prefill(case, F32, window=window, use_sinks=use_sinks)


# ------------------------------------------------------------ planted bugs

_VEC_GROUP = "vec_group[j] = ((r + j * LPT) * VEC) / GROUP_SIZE;"
_NEIGHBOUR_GROUP = "vec_group[j] = (((r + j * LPT) * VEC) / GROUP_SIZE + 1) % NG;"


@pytest.mark.parametrize("kv,d,old,new", [
    # each vector dequantized with the scale (and bias) of the next group, at groups
    # shared by 8, 4 and 2 lanes
    ("int8", 128, _VEC_GROUP, _NEIGHBOUR_GROUP),
    ("int4", 96, _VEC_GROUP, _NEIGHBOUR_GROUP),
    ("int8", 48, _VEC_GROUP, _NEIGHBOUR_GROUP),
    # the shuffle taking the scale (and bias) of the next token's group
    ("int8", 96, "const ushort reader = ushort(lane - lane % SHARE);",
     "const ushort reader = ushort((lane + LPT) % 32 - lane % SHARE);"),
    ("int4", 128, "const ushort reader = ushort(lane - lane % SHARE);",
     "const ushort reader = ushort((lane + LPT) % 32 - lane % SHARE);"),
])
@pytest.mark.harness
@needs_clang
def test_planted_wrong_group_scale_in_decode_is_caught(monkeypatch, kv, d, old, new):
    _mutated(monkeypatch, "paged_attention_decode", old, new)
    case = quantized_decode_case(d, [37, 12], 8, 2, d, 8, F32, kv)
    assert _assert_caught(lambda: _check_decode(case, F32)) == "oracle"


@pytest.mark.harness
@needs_clang
def test_planted_wrong_group_scale_in_prefill_is_caught(monkeypatch):
    _mutated(monkeypatch, "paged_prefill_attention", "const int64_t at = scale_base + t * NG + group;",
             "const int64_t at = scale_base + t * NG + (group + 1) % NG;")
    case = quantized_prefill_case(4, [(30, 6)], 8, 2, 96, 8, F32, "int8")
    assert _assert_caught(lambda: _check_prefill(case, F32)) == "oracle"


@pytest.mark.harness
@needs_clang
def test_unrotated_int4_query_is_caught():
    # The kernels take q already rotated (q H); q H . k H = q . k, so the oracle over the
    # rotated stored keys equals plain attention over the unrotated dequantized keys.
    decode = quantized_decode_case(2, [45, 17], 8, 2, 64, 16, F32, "int4")
    prefill = quantized_prefill_case(2, [(30, 6)], 8, 2, 64, 16, F32, "int4")
    for case, check in ((decode, _check_decode), (prefill, _check_prefill)):
        h = hadamard(64)
        k_rot, v = case.dequantized_pools()
        unrotated = type(case)(**{**case.__dict__})
        want_rotated = numpy_quantized_attention(case)
        # the same attention in the original basis: q . (k_hat_rot H)
        unrotated.dequantized_pools = lambda: (k_rot @ h, v)
        want_plain = numpy_quantized_attention(unrotated, q=_f64(case.q_unrotated))
        assert np.abs(want_rotated - want_plain).max() < 1e-5
        check(case, F32)  # the rotated query passes
        assert _assert_caught(lambda: check(case, F32, q=case.q_unrotated)) == "oracle"


# ------------------------------------------------------------ dispatch


def test_quantized_arguments_are_checked():
    case = quantized_decode_case(1, [9], 4, 2, 64, 8, F16, "int4")
    args = (case.q, case.k_codes, case.v_codes, case.base.block_tables, case.base.context_lens)
    kw = case.kernel_kwargs()
    assert metal.decode_unsupported_reason(*args, **kw) is None
    assert metal.prefill_unsupported_reason(case.q, case.k_codes, case.v_codes, case.base.block_tables,
                                            [9], [0, 1], **kw) is None
    int8 = quantized_decode_case(1, [9], 4, 2, 64, 8, F16, "int8")
    int8_pools = (int8.k_codes, int8.v_codes)
    bad = [
        ("k_biases is missing", dict(kw, k_biases=None), None),
        ("v_scales is missing", dict(kw, v_scales=None), None),
        ("codes, but the pools are", kw, (case.k_codes.view(mx.int8), case.v_codes.view(mx.int8))),
        ("symmetric", dict(int8.kernel_kwargs(), k_biases=case.k_biases), int8_pools),
        ("kv_cache_dtype 'fp8'", dict(kw, kv_cache_dtype="fp8"), None),
        ("must be float16", dict(kw, k_scales=case.k_scales.astype(F32)), None),
        ("'auto'", dict(kw, kv_cache_dtype="auto"), None),
        # int8 codes need head_dim elements per row; int4 packs two per byte
        ("last dimension of 32", kw, (int8.k_codes.view(mx.uint8), int8.v_codes.view(mx.uint8))),
    ]
    for want, kwargs, pools in bad:
        pools = pools or (case.k_codes, case.v_codes)
        reason = metal.decode_unsupported_reason(case.q, *pools, case.base.block_tables, case.base.context_lens,
                                                 **kwargs)
        assert reason and want in reason, (want, reason)
        with pytest.raises(KernelError, match="paged_attention_decode kernel"):
            metal.paged_attention_decode(case.q, *pools, case.base.block_tables, case.base.context_lens, 0.1,
                                         **kwargs)
    # the opt-in matrix prefill kernel takes float pools only
    with pytest.raises(KernelError, match="differ in dtype"):
        metal.paged_prefill_attention_mma(case.q, case.k_codes, case.v_codes, case.base.block_tables,
                                          case.base.context_lens, mx.array([0, 1], dtype=mx.int32), 0.1)


def test_float_pools_pass_unread_scale_placeholders():
    launches = []

    def factory(**fkw):
        def call(**ckw):
            launches.append((fkw, ckw))
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    case = quantized_decode_case(1, [9], 4, 2, 64, 8, F16, "int8")
    with metal.use_launcher(factory):
        metal.paged_attention_decode(case.base.q, case.base.k_pool, case.base.v_pool, case.base.block_tables,
                                     case.base.context_lens, 0.1)
        metal.paged_attention_decode(case.q, case.k_codes, case.v_codes, case.base.block_tables,
                                     case.base.context_lens, 0.1, **case.kernel_kwargs())
    (f_fp, c_fp), (f_q, c_q) = launches
    names = f_fp["input_names"]
    unread = ["k_scales", "v_scales", "k_biases", "v_biases", "code_bounds"]
    assert names[-5:] == unread
    assert dict(c_fp["template"])["KV_BITS"] == 0 and dict(c_q["template"])["KV_BITS"] == 8
    assert dict(c_q["template"])["GROUP_SIZE"] == 64
    assert dict(c_fp["template"])["FLOAT_FIRST"] == 0 and dict(c_q["template"])["FLOAT_FIRST"] == 0
    assert c_q["inputs"][names.index("k_scales")] is case.k_scales
    # float pools: the scales and biases, and without a float window the code bounds, are
    # small placeholders the kernel never reads
    assert all(c_fp["inputs"][names.index(n)].size == metal.MIN_DEVICE_ELEMENTS for n in unread)


@pytest.mark.harness
@needs_clang
def test_generated_quantized_source_matches_mlx():
    # The source the harness runs is MLX's, for the quantized launch configurations too.
    launches = []
    case = quantized_decode_case(1, [9], 4, 2, 64, 8, F16, "int4")
    pre = quantized_prefill_case(1, [(9, 3)], 4, 2, 64, 8, F16, "int8")

    def factory(**fkw):
        def call(**ckw):
            launches.append((fkw, ckw))
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    with metal.use_launcher(factory):
        metal.paged_attention_decode(case.q, case.k_codes, case.v_codes, case.base.block_tables,
                                     case.base.context_lens, 0.1, **case.kernel_kwargs())
        metal.paged_prefill_attention(pre.q, pre.k_codes, pre.v_codes, pre.base.block_tables,
                                      pre.base.context_lens, pre.base.query_start_loc, 0.1, **pre.kernel_kwargs())
    assert len(launches) == 2
    for fkw, ckw in launches:
        mlx_name, mlx_source = mh.capture_mlx_source(
            name=fkw["name"], input_names=fkw["input_names"], output_names=fkw["output_names"],
            source=fkw["source"], header=fkw["header"], inputs=ckw["inputs"],
            output_shapes=ckw["output_shapes"], output_dtypes=ckw["output_dtypes"], template=ckw["template"],
        )
        gen = mh.generate(
            fkw["name"], fkw["input_names"], fkw["output_names"], fkw["source"], fkw["header"],
            [mh.source.arg_info(n, a) for n, a in zip(fkw["input_names"], ckw["inputs"])],
            ckw["output_dtypes"], ckw["template"],
        )
        assert gen.kernel_name == mlx_name and gen.source == mlx_source


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("variant", ["ubsan", "cxx14", "counting"])
def test_quantized_kernels_build_in_every_variant(variant):
    # signed overflow, bounds and alignment checks (ubsan); C++14 with warnings (cxx14);
    # every output element written exactly once (counting)
    with mh.options(variant=variant, schedules=("serial",)):
        for kv in ("int8", "int4"):
            _check_decode(quantized_decode_case(6, [40, 9], 8, 2, 128, 8, F32, kv), F32)
            _check_prefill(quantized_prefill_case(6, [(20, 5)], 8, 2, 96, 8, F32, kv), F32)


# ------------------------------------------------------------ cost model


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("h,kvh,d", [(16, 4, 128), (14, 2, 64)])
def test_bytes_read_per_kv_token_fall_with_the_dtype(h, kvh, d):
    # One pass over 1024 tokens (head_dim 128, GQA 4; the Qwen2.5-0.5B heads, head_dim 64).
    cost = {kv: measure_decode(h, kvh, d, 16, [1024], F16, partition_size=0, kv_cache_dtype=kv)
            for kv in ("auto", "int8", "int4")}
    fp16 = cost["auto"].bytes_per_token_per_kv_head
    assert cost["int8"].bytes_per_token_per_kv_head <= 0.55 * fp16, cost
    assert cost["int4"].bytes_per_token_per_kv_head <= 0.32 * fp16, cost
    # Beyond the stored bytes (codes plus one float16 scale, and bias, per group, for K
    # and V: each read once), the quantized kernels read no more than the fp16 one does
    # beyond its K+V rows (q, block tables, launch parameters).
    groups = d // group_size(d)
    overhead = fp16 - 2 * d * 2
    assert cost["int8"].bytes_per_token_per_kv_head - 2 * (d + 2 * groups) <= overhead + 0.01, cost
    assert cost["int4"].bytes_per_token_per_kv_head - 2 * (d // 2 + 4 * groups) <= overhead + 0.01, cost


# ------------------------------------------------------------ sweep


@pytest.mark.slow
@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_sweep(monkeypatch, kv):
    for (h, kvh), d, bs, dtype in itertools.product([(4, 4), (8, 2), (16, 2)], [16, 32, 64, 80, 128, 256],
                                                    [8, 32], [F32, F16, BF16]):
        ctxs = [1, 15, 64, 130]
        _check_decode(quantized_decode_case(h + d + bs, ctxs, h, kvh, d, bs, dtype, kv), dtype)
        _check_prefill(quantized_prefill_case(h + d + bs, [(1, 1), (30, 14), (64, 8)], h, kvh, d, bs, dtype, kv),
                       dtype)
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", 32)
    for window, use_sinks in itertools.product([None, 1, 8, 21, 300], [False, True]):
        _check_decode(quantized_decode_case(3, [1, 15, 64, 101], 8, 2, 64, 8, F16, kv), F16, window, use_sinks)
        _check_prefill(quantized_prefill_case(3, [(30, 14), (23, 23)], 8, 2, 64, 8, F16, kv), F16, window,
                       use_sinks)
