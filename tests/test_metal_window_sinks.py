"""Sliding windows and attention sinks in the Metal decode and prefill kernels, run in
the CPU harness.

Each result is compared with two oracles: the pure-MLX reference
(:mod:`mlx_ferrum.kernels.reference`, whose window/sink semantics are those of Mistral
and gpt-oss) and a float64 numpy implementation written from the definitions here: the
query at position ``p`` attends keys ``p - window + 1 .. p``; a sink is one extra logit
per query head in the softmax denominator, with no value. Pool slots no sequence owns
hold NaN, and so do the blocks wholly before a sequence's window (the kernels must not
read them: a freed block's table entry may point anywhere). Tolerances as in
tests/test_metal_kernels.py.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.kernels import metal, reference
from support import metal_harness as mh
from support.paged_cases import (
    PagedCase,
    _f64,
    _seq_kv,
    decode_case,
    max_violation,
    prefill_case,
    without_garbage,
)

from test_metal_kernels import _assert_caught, _mutated

F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(
        not mh.clang_available(),
        reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
    ),
]


def _numpy_attend(q, keys, values, scale, sink):
    logits = keys @ q * scale
    m = logits.max() if len(logits) else -np.inf
    if sink is not None:
        m = max(m, sink)
    if not np.isfinite(m):
        return np.zeros(values.shape[-1])
    p = np.exp(logits - m)
    denom = p.sum() + (np.exp(sink - m) if sink is not None else 0.0)
    return (p @ values) / denom


def numpy_decode(case: PagedCase, window, sinks) -> np.ndarray:
    q = _f64(case.q)
    s, h, d = q.shape
    kvh = case.k_pool.shape[1]
    out = np.zeros((s, h, d))
    for i, ctx in enumerate(np.array(case.context_lens).tolist()):
        k, v = _seq_kv(case, i, ctx)
        lo = max(0, ctx - window) if window else 0
        for j in range(h):
            g = j // (h // kvh)
            out[i, j] = _numpy_attend(q[i, j], k[g, lo:], v[g, lo:], case.scale,
                                      None if sinks is None else float(sinks[j]))
    return out


def numpy_prefill(case: PagedCase, window, sinks) -> np.ndarray:
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
            lo = max(0, pos - window + 1) if window else 0
            for j in range(h):
                g = j // (h // kvh)
                out[r, j] = _numpy_attend(q[r, j], k[g, lo : pos + 1], v[g, lo : pos + 1], case.scale,
                                          None if sinks is None else float(sinks[j]))
    return out


def _poison_before_window(case: PagedCase, first_needed: list[int]) -> PagedCase:
    """NaN in every block wholly before each sequence's first needed position."""
    bs = case.k_pool.shape[2]
    k, v = np.array(case.k_pool.astype(F32)), np.array(case.v_pool.astype(F32))
    tables = np.array(case.block_tables)
    valid = case.valid.copy()
    for i, first in enumerate(first_needed):
        for b in tables[i, : first // bs]:
            k[b] = np.nan
            v[b] = np.nan
            valid[b] = False
    dtype = case.q.dtype
    return PagedCase(case.q, mx.array(k).astype(dtype), mx.array(v).astype(dtype), case.block_tables,
                     case.context_lens, case.query_start_loc, case.scale, valid)


def _sinks(seed, h, use):
    if not use:
        return None
    return mx.array(np.random.default_rng(seed).standard_normal(h).astype(np.float32) * 2.0)


def _check_decode(h, kvh, d, bs, ctxs, dtype, window, use_sinks, psize, monkeypatch):
    case = decode_case(len(ctxs) * 5 + d + (window or 0), ctxs, h, kvh, d, bs, dtype)
    clean = without_garbage(case)
    if window:
        case = _poison_before_window(case, [max(0, c - window) for c in ctxs])
    sinks = _sinks(d, h, use_sinks)
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    with metal.use_launcher(mh.metal_kernel):
        got = metal.paged_attention_decode(case.q, case.k_pool, case.v_pool, case.block_tables,
                                           case.context_lens, case.scale, window=window, sinks=sinks)
    assert got.shape == case.q.shape and got.dtype == dtype
    want = numpy_decode(clean, window, None if sinks is None else np.array(sinks))
    ref = reference.paged_attention_decode(clean.q, clean.k_pool, clean.v_pool, clean.block_tables,
                                           clean.context_lens, clean.scale, window=window, sinks=sinks)
    assert max_violation(got, want, dtype) <= 0, "kernel disagrees with the numpy oracle"
    assert max_violation(got, _f64(ref), dtype) <= 0, "kernel disagrees with the MLX reference"


# (num_heads, num_kv_heads, head_dim, block_size, contexts, dtype, window, sinks, partition size)
DECODE_CASES = [
    (4, 4, 16, 8, [7, 21, 40], F32, 5, False, None),        # GQA 1, window inside one block / across
    (8, 4, 32, 16, [33, 64, 16], F16, 16, True, None),      # GQA 2, window = one block, sinks
    (16, 4, 64, 16, [100, 9], BF16, 37, True, None),        # GQA 4, window crossing blocks
    (8, 2, 32, 8, [30, 12], F32, 12, False, None),          # window == one context
    (8, 2, 32, 8, [30, 12], F16, 200, True, None),          # window longer than every context
    (8, 4, 16, 8, [70, 45, 3], F32, 19, True, 16),          # split-K: early partitions hold nothing
    (8, 2, 64, 16, [130, 47], BF16, 40, True, 32),          # split-K, GQA 4, bf16
    (4, 1, 32, 8, [90], F16, None, True, 24),               # sinks alone, split-K
    (4, 2, 16, 8, [11, 1], F32, None, True, None),          # sinks alone, one pass, context 1
]


@pytest.mark.parametrize("h,kvh,d,bs,ctxs,dtype,window,use_sinks,psize", DECODE_CASES)
def test_decode_window_sinks_match_oracles(monkeypatch, h, kvh, d, bs, ctxs, dtype, window, use_sinks, psize):
    _check_decode(h, kvh, d, bs, ctxs, dtype, window, use_sinks, psize, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_decode_window_sinks_sweep(monkeypatch, dtype):
    for (h, kvh), window, use_sinks, psize in itertools.product(
        [(4, 4), (8, 4), (8, 2)], [1, 7, 8, 23, 64, 500], [False, True], [None, 16]
    ):
        _check_decode(h, kvh, 32, 8, [1, 15, 64, 101], dtype, window, use_sinks, psize, monkeypatch)


@pytest.mark.parametrize("name,old,new,psize", [
    # the window's first key dropped (off-by-one at the window edge)
    ("paged_attention_decode", "pos < tok_end && pos >= tok_begin &&", "pos < tok_end && pos > tok_begin &&", None),
    # the sink left out of the one-pass denominator
    ("paged_attention_decode", "l_all = l_all * o_scale + fast::exp2(sink - m_sink);",
     "l_all = l_all * o_scale;", None),
    # the reduce kernel forgetting the sink
    ("paged_attention_reduce", "float l_all = SINKS == 1 ? fast::exp2(sink - m_all) : 0.0f;",
     "float l_all = 0.0f;", 16),
])
def test_planted_decode_window_sink_bugs_are_caught(monkeypatch, name, old, new, psize):
    _mutated(monkeypatch, name, old, new)
    _assert_caught(lambda: _check_decode(8, 4, 16, 8, [70, 45, 3], F32, 19, True, psize, monkeypatch))


def _check_prefill(h, kvh, d, bs, cq, dtype, window, use_sinks, matrix=False):
    case = prefill_case(len(cq) * 3 + d + (window or 0), cq, h, kvh, d, bs, dtype)
    clean = without_garbage(case)
    if window:
        case = _poison_before_window(case, [max(0, c - q - window + 1) for c, q in cq])
    sinks = _sinks(d + 1, h, use_sinks)
    run = metal.paged_prefill_attention_mma if matrix else metal.paged_prefill_attention
    with metal.use_launcher(mh.metal_kernel):
        got = run(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
                  case.query_start_loc, case.scale, window=window, sinks=sinks)
    assert got.shape == case.q.shape and got.dtype == dtype
    want = numpy_prefill(clean, window, None if sinks is None else np.array(sinks))
    ref = reference.paged_prefill_attention(clean.q, clean.k_pool, clean.v_pool, clean.block_tables,
                                            clean.context_lens, clean.query_start_loc, clean.scale,
                                            window=window, sinks=sinks)
    assert max_violation(got, want, dtype) <= 0, "kernel disagrees with the numpy oracle"
    assert max_violation(got, _f64(ref), dtype) <= 0, "kernel disagrees with the MLX reference"


# (num_heads, num_kv_heads, head_dim, block_size, (context, q_len) per sequence, dtype, window, sinks)
PREFILL_CASES = [
    (4, 4, 16, 8, [(12, 12), (29, 10)], F32, 6, False),       # GQA 1, full prefill and an extend
    (8, 4, 32, 16, [(40, 9), (17, 3)], F16, 16, True),        # GQA 2, window = one block
    (8, 2, 64, 8, [(37, 16), (5, 5)], BF16, 11, True),        # GQA 4, window crossing blocks
    (4, 2, 16, 8, [(20, 4)], F32, 200, True),                 # window longer than the context
    (4, 1, 32, 16, [(33, 7), (9, 1)], F16, None, True),       # sinks alone
    (4, 2, 16, 8, [(18, 8)], F32, 1, False),                  # window 1: each row sees itself
]


@pytest.mark.parametrize("h,kvh,d,bs,cq,dtype,window,use_sinks", PREFILL_CASES)
def test_prefill_window_sinks_match_oracles(h, kvh, d, bs, cq, dtype, window, use_sinks):
    _check_prefill(h, kvh, d, bs, cq, dtype, window, use_sinks)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_prefill_window_sinks_sweep(dtype):
    for (h, kvh), window, use_sinks in itertools.product([(4, 4), (8, 4), (8, 2)], [1, 5, 8, 21, 300],
                                                         [False, True]):
        _check_prefill(h, kvh, 32, 8, [(1, 1), (30, 14), (64, 8), (23, 23)], dtype, window, use_sinks)


@pytest.mark.parametrize("old,new", [
    ("k0 + t >= row_first_key &&", "k0 + t > row_first_key &&"),      # the window's first key dropped
    ("l = l * o_scale + exp(sink - m_sink);", "l = l * o_scale;"),  # the sink left out
])
def test_planted_prefill_window_sink_bugs_are_caught(monkeypatch, old, new):
    _mutated(monkeypatch, "paged_prefill_attention", old, new)
    _assert_caught(lambda: _check_prefill(8, 2, 32, 8, [(37, 16), (5, 5)], F32, 11, True))


# ------------------------------------------------------------ dispatch, sources, costs


def test_dispatch_sends_window_and_sinks_to_the_kernels(caplog):
    import logging

    import mlx_ferrum.kernels as kernels

    dec = without_garbage(decode_case(4, [40, 9], 8, 2, 16, 8, F32))
    pre = without_garbage(prefill_case(4, [(30, 6)], 8, 2, 16, 8, F32))
    sinks = _sinks(3, 8, True)
    before = dict(mh.LAUNCHES)
    with caplog.at_level(logging.INFO, logger="mlx_ferrum.kernels"), metal.use_launcher(mh.metal_kernel):
        out_d = kernels.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables,
                                               dec.context_lens, dec.scale, window=13, sinks=sinks)
        out_p = kernels.paged_prefill_attention(pre.q, pre.k_pool, pre.v_pool, pre.block_tables,
                                                pre.context_lens, pre.query_start_loc, pre.scale,
                                                window=13, sinks=sinks)
    assert mh.LAUNCHES["paged_attention_decode"] == before.get("paged_attention_decode", 0) + 1
    assert mh.LAUNCHES["paged_prefill_attention"] == before.get("paged_prefill_attention", 0) + 1
    assert "reference" not in caplog.text
    assert max_violation(out_d, numpy_decode(dec, 13, np.array(sinks)), F32) <= 0
    assert max_violation(out_p, numpy_prefill(pre, 13, np.array(sinks)), F32) <= 0


def test_sinks_of_the_wrong_shape_are_refused():
    from mlx_ferrum.errors import KernelError

    dec = decode_case(4, [9], 8, 2, 16, 8, F32)
    with metal.use_launcher(mh.metal_kernel), pytest.raises(KernelError, match="one logit per query head"):
        metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables, dec.context_lens,
                                     dec.scale, sinks=mx.zeros((2,)))


def test_generated_source_with_window_and_sinks_matches_mlx(monkeypatch):
    launches = []

    def factory(**fkw):
        def call(**ckw):
            launches.append((fkw, ckw))
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    dec = decode_case(1, [30, 3], 8, 2, 64, 16, BF16)
    pre = prefill_case(1, [(12, 5)], 4, 4, 8, 8, F16)
    with metal.use_launcher(factory):
        for psize in (None, 16):
            monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
            metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables, dec.context_lens, 0.1,
                                         window=7, sinks=mx.zeros((8,), BF16))
        for run in (metal.paged_prefill_attention, metal.paged_prefill_attention_mma):
            run(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens, pre.query_start_loc, 0.1,
                window=7, sinks=mx.zeros((4,)))
    assert sorted({f["name"] for f, _ in launches}) == [
        "paged_attention_decode", "paged_attention_reduce", "paged_prefill_attention",
        "paged_prefill_attention_mma"]
    for fkw, ckw in launches:
        assert ("SINKS", 1) in ckw["template"]
        _, mlx_source = mh.capture_mlx_source(
            name=fkw["name"], input_names=fkw["input_names"], output_names=fkw["output_names"],
            source=fkw["source"], header=fkw["header"], inputs=ckw["inputs"],
            output_shapes=ckw["output_shapes"], output_dtypes=ckw["output_dtypes"], template=ckw["template"],
        )
        gen = mh.generate(
            fkw["name"], fkw["input_names"], fkw["output_names"], fkw["source"], fkw["header"],
            [mh.source.arg_info(n, a) for n, a in zip(fkw["input_names"], ckw["inputs"])],
            ckw["output_dtypes"], ckw["template"],
        )
        assert gen.source == mlx_source
        sinks_param = [p for p in gen.params if p.name == "sinks"]
        assert sinks_param and sinks_param[0].decl.startswith("const device"), sinks_param


def _decode_bytes(ctx, window, psize, monkeypatch):
    case = decode_case(1, [ctx], 16, 4, 128, 16, F16)
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("serial",)), mh.record_costs() as costs:
        metal.paged_attention_decode(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
                                     case.scale, window=window, sinks=_sinks(1, 16, True))
    return sum(c.device_bytes_read for c in costs), sum(c.simd_ops for c in costs)


def test_decode_work_grows_with_the_window_not_the_context(monkeypatch):
    # head_dim 128, GQA 4, float16, a 2048-token context with a 256-token window.
    # One pass: the bytes read stay within 1.1x the K+V bytes of the window's tokens
    # (plus one partial block) and the simdgroup operations within 1 per windowed token
    # per head, the budgets of tests/test_metal_costs.py.
    ctx, window, kvh, heads = 2048, 256, 4, 16
    kv_bytes_per_token = 2 * 128 * 2 * kvh
    read, simd_ops = _decode_bytes(ctx, window, 1 << 30, monkeypatch)
    assert read <= 1.1 * (window + 16) * kv_bytes_per_token, read / (window * kv_bytes_per_token)
    assert simd_ops <= (window + 16) * heads, simd_ops / (window * heads)
    # Split-K (8 partitions of 256): the partitions before the window read only their
    # launch metadata and q, so each extra windowed token costs its K+V bytes, and the
    # whole call reads under a quarter of the context's K+V bytes.
    read_256, _ = _decode_bytes(ctx, window, 256, monkeypatch)
    read_512, _ = _decode_bytes(ctx, 2 * window, 256, monkeypatch)
    assert read_512 - read_256 <= 1.1 * window * kv_bytes_per_token
    assert read_256 <= 0.25 * ctx * kv_bytes_per_token


def test_planted_window_reading_every_block_is_caught(monkeypatch):
    # The mask alone keeps the result right; only the cost check sees the wasted reads.
    _mutated(monkeypatch, "paged_attention_decode",
             "const int first_block = tok_begin / BLOCK_SIZE;",
             "const int first_block = PARTITION_SIZE > 0 ? min(ctx, part * PARTITION_SIZE) / BLOCK_SIZE : 0;")
    _check_decode(8, 4, 16, 8, [70, 45, 3], F32, 19, True, None, monkeypatch)
    with pytest.raises(AssertionError):
        test_decode_work_grows_with_the_window_not_the_context(monkeypatch)


# (num_heads, num_kv_heads, head_dim, block_size, (context, q_len) per sequence, dtype, window, sinks)
MATRIX_CASES = [
    (4, 4, 16, 8, [(40, 33), (29, 10)], F32, 6, False),       # GQA 1, windows across steps
    (8, 2, 32, 16, [(50, 20), (17, 17)], F16, 16, True),      # GQA 4, window = one block, sinks
    (12, 2, 16, 8, [(45, 24)], BF16, 11, True),               # GQA 6 (two heads per simdgroup)
    (4, 1, 16, 8, [(26, 18)], F32, None, True),               # sinks alone
]


@pytest.mark.parametrize("h,kvh,d,bs,cq,dtype,window,use_sinks", MATRIX_CASES)
def test_matrix_prefill_window_sinks_match_oracles(h, kvh, d, bs, cq, dtype, window, use_sinks):
    _check_prefill(h, kvh, d, bs, cq, dtype, window, use_sinks, matrix=True)


@pytest.mark.parametrize("old,new", [
    ("window > 0 ? pos - window + 1 : 0;", "window > 0 ? pos - window + 2 : 0;"),  # window edge off by one
    ("l_all = l_all * o_scale + fast::exp2(sink - m_sink);", "l_all = l_all * o_scale;"),  # sink left out
])
def test_planted_matrix_window_sink_bugs_are_caught(monkeypatch, old, new):
    _mutated(monkeypatch, "paged_prefill_attention_mma", old, new)
    _assert_caught(lambda: _check_prefill(8, 2, 32, 16, [(50, 20), (17, 17)], F32, 16, True, matrix=True))


def test_long_windowed_chunks_go_to_the_matrix_kernel_when_enabled(monkeypatch):
    import mlx_ferrum.kernels as kernels

    pre = without_garbage(prefill_case(5, [(40, 30)], 8, 2, 16, 8, F32))  # 30 rows > 16
    sinks = _sinks(5, 8, True)
    monkeypatch.setattr(metal, "PREFILL_MATRIX_KERNEL", True)
    before = mh.LAUNCHES.get("paged_prefill_attention_mma", 0)
    with metal.use_launcher(mh.metal_kernel):
        out = kernels.paged_prefill_attention(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens,
                                              pre.query_start_loc, pre.scale, window=9, sinks=sinks)
    assert mh.LAUNCHES["paged_prefill_attention_mma"] == before + 1
    assert max_violation(out, numpy_prefill(pre, 9, np.array(sinks)), F32) <= 0


@pytest.mark.parametrize("variant,finite_math", [("counting", False), ("ubsan", False), ("cxx14", False),
                                                 ("default", True)])
def test_window_sink_kernels_pass_in_each_build_variant(monkeypatch, variant, finite_math):
    # counting checks every output element is written exactly once; ubsan, C++14 text
    # and -ffinite-math-only as in tests/test_metal_hardening.py.
    dec = decode_case(6, [40, 300, 1], 8, 2, 64, 16, F16)
    pre = prefill_case(6, [(20, 9), (7, 7)], 8, 2, 64, 16, BF16)
    sinks = _sinks(6, 8, True)
    with metal.use_launcher(mh.metal_kernel), mh.options(variant=variant, finite_math=finite_math):
        for psize in (None, 64):
            monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
            got = metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables,
                                               dec.context_lens, dec.scale, window=70, sinks=sinks)
            assert max_violation(got, numpy_decode(dec, 70, np.array(sinks)), F16) <= 0
        for prefill in (metal.paged_prefill_attention, metal.paged_prefill_attention_mma):
            got = prefill(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens,
                          pre.query_start_loc, pre.scale, window=5, sinks=sinks)
            assert max_violation(got, numpy_prefill(pre, 5, np.array(sinks)), BF16) <= 0
