"""The Metal paged-attention kernels (metal_kernels/*.metal), run in the CPU harness.

Each kernel is compared with two independent oracles: the pure-MLX reference
(mlx_ferrum.kernels.reference, gather + mx.fast.scaled_dot_product_attention) and a
float64 numpy implementation of softmax(q K^T * scale) V over exactly the valid
keys. Pool slots no sequence owns hold NaN in the kernels' input, so reading past a
context fails the test. Tolerances per dtype (|got - want| <= atol + rtol*|want|):
float32 2e-5/2e-5, float16 2e-3/4e-3, bfloat16 1.6e-2/1.6e-2 (see
support.paged_cases.TOLERANCES).

The default sample covers GQA ratios 1/2/4/8, head dims 8..256 (8, 16, 24, 32, 40,
64, 80, 96, 128, 256), block sizes 8/16/32, all three dtypes, context length 1,
lengths on and off block boundaries and multi-partition contexts; the full cross
product runs under ``-m slow``.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_ferrum.kernels as kernels
from mlx_ferrum.errors import KernelError
from mlx_ferrum.kernels import metal, reference
from support import metal_harness as mh
from support.paged_cases import (
    decode_case,
    max_violation,
    numpy_decode,
    numpy_prefill,
    prefill_case,
    without_garbage,
)

REPO = Path(__file__).resolve().parents[1]
F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16

needs_clang = pytest.mark.skipif(
    not mh.clang_available(),
    reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
)
harness = [pytest.mark.harness, needs_clang]


def _run_decode(case):
    with metal.use_launcher(mh.metal_kernel):
        return metal.paged_attention_decode(
            case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, case.scale
        )


def _run_prefill(case):
    with metal.use_launcher(mh.metal_kernel):
        return metal.paged_prefill_attention(
            case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
            case.query_start_loc, case.scale,
        )


def _check_decode(case, dtype):
    got = _run_decode(case)
    assert got.shape == case.q.shape and got.dtype == dtype
    clean = without_garbage(case)
    ref = reference.paged_attention_decode(
        clean.q, clean.k_pool, clean.v_pool, clean.block_tables, clean.context_lens, clean.scale
    )
    assert max_violation(got, numpy_decode(case), dtype) <= 0, "kernel disagrees with the numpy oracle"
    assert max_violation(got, np.array(ref.astype(mx.float32)).astype(np.float64), dtype) <= 0, \
        "kernel disagrees with the MLX reference"


def _check_prefill(case, dtype):
    got = _run_prefill(case)
    assert got.shape == case.q.shape and got.dtype == dtype
    clean = without_garbage(case)
    ref = reference.paged_prefill_attention(
        clean.q, clean.k_pool, clean.v_pool, clean.block_tables, clean.context_lens,
        clean.query_start_loc, clean.scale,
    )
    assert max_violation(got, numpy_prefill(case), dtype) <= 0, "kernel disagrees with the numpy oracle"
    assert max_violation(got, np.array(ref.astype(mx.float32)).astype(np.float64), dtype) <= 0, \
        "kernel disagrees with the MLX reference"


# (num_heads, num_kv_heads, head_dim, block_size, context lengths, dtype)
DECODE_CASES = [
    (8, 4, 8, 16, [1], F32),               # the test model's shape, context 1
    (4, 4, 16, 8, [7, 8, 9], F16),         # GQA 1, around a block boundary
    (8, 4, 32, 32, [33, 64], BF16),        # GQA 2
    (16, 4, 64, 16, [100, 1], F32),        # GQA 4
    (8, 1, 80, 8, [45], F16),              # GQA 8, head_dim 80
    (8, 1, 96, 16, [17, 250], BF16),       # head_dim 96
    (4, 2, 128, 32, [31, 129], F16),       # head_dim 128
    (4, 1, 256, 8, [60], F32),             # head_dim 256
    (2, 2, 24, 16, [15, 16], BF16),        # 3 dims per lane
    (2, 1, 40, 8, [3, 10, 19, 26], F32),   # four sequences
    (24, 1, 64, 16, [77, 5], F16),         # GQA 24: three threadgroups of 8 heads per KV head
    (20, 2, 32, 8, [40], BF16),            # GQA 10: two threadgroups of 5 heads per KV head
]


@pytest.mark.parametrize("h,kvh,d,bs,ctxs,dtype", DECODE_CASES)
@pytest.mark.harness
@needs_clang
def test_decode_matches_oracles(h, kvh, d, bs, ctxs, dtype):
    _check_decode(decode_case(len(ctxs) * 7 + d, ctxs, h, kvh, d, bs, dtype), dtype)


def _random_shapes(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ratio = int(rng.choice([1, 2, 4, 8]))
        kvh = int(rng.choice([1, 2]))
        d = int(rng.choice([8, 16, 32, 48, 64, 80, 96, 112, 128, 256]))
        bs = int(rng.choice([8, 16, 32]))
        ctxs = [int(c) for c in rng.integers(1, 200, size=int(rng.integers(1, 4)))]
        yield ratio * kvh, kvh, d, bs, ctxs, [F32, F16, BF16][int(rng.integers(3))]


@pytest.mark.parametrize("h,kvh,d,bs,ctxs,dtype", list(_random_shapes(2024, 4)))
@pytest.mark.harness
@needs_clang
def test_decode_random_shapes(h, kvh, d, bs, ctxs, dtype):
    _check_decode(decode_case(sum(ctxs), ctxs, h, kvh, d, bs, dtype), dtype)


@pytest.mark.parametrize(
    "h,kvh,d,bs,ctxs,dtype,psize",
    [
        (4, 2, 8, 16, [200, 65, 1], F32, 64),   # 4 partitions; the short sequences leave some empty
        (8, 2, 128, 16, [150], BF16, 32),
        (4, 1, 64, 8, [96, 40], F16, 32),       # contexts ending exactly on a partition boundary
    ],
)
@pytest.mark.harness
@needs_clang
def test_decode_partitions(monkeypatch, h, kvh, d, bs, ctxs, dtype, psize):
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
    before = mh.LAUNCHES["paged_attention_reduce"]
    _check_decode(decode_case(psize + d, ctxs, h, kvh, d, bs, dtype), dtype)
    assert mh.LAUNCHES["paged_attention_reduce"] == before + 1, "the reduce kernel did not run"


@pytest.mark.harness
@needs_clang
def test_decode_long_context_default_partitions():
    # One sequence on one KV head is one threadgroup: far too few to fill a GPU, so the
    # default policy splits its 1100 tokens (split-K) and the reduce kernel merges them.
    case = decode_case(11, [1100, 513], 4, 1, 16, 32, F16)
    parts, psize = metal.decode_partitions(2, 1, case.block_tables.shape[1] * 32, 32)
    assert parts >= 3 and psize % 32 == 0 and psize >= metal.DECODE_MIN_PARTITION_TOKENS
    before = mh.LAUNCHES["paged_attention_reduce"]
    _check_decode(case, F16)
    assert mh.LAUNCHES["paged_attention_reduce"] == before + 1


def test_split_k_only_when_threadgroups_are_few(monkeypatch):
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", None)
    target = metal.gpu_cores() * metal.DECODE_THREADGROUPS_PER_CORE
    assert metal.decode_partitions(target, 1, 8192, 16) == (1, 0)        # enough groups: one pass
    assert metal.decode_partitions(1, 8, 256, 16) == (1, 0)              # short context: one pass
    parts, psize = metal.decode_partitions(1, 1, 8192, 16)
    assert parts * psize >= 8192 and (parts - 1) * psize < 8192 and psize % 16 == 0
    assert 1 < parts <= target
    monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", 512)            # the forced test hook
    assert metal.decode_partitions(64, 8, 1024, 16) == (2, 512)


@pytest.mark.harness
@needs_clang
def test_decode_empty_context_gives_zero(monkeypatch):
    # context_len 0 (a padded batch row): 0, not 0/0, on the one-pass and split paths.
    case = decode_case(5, [1, 40], 4, 2, 16, 8, F32)
    case = replace(case, context_lens=mx.array([0, 40], dtype=mx.int32))
    for psize in (None, 16):
        monkeypatch.setattr(metal, "DECODE_PARTITION_SIZE", psize)
        got = np.array(_run_decode(case))
        assert np.all(got[0] == 0.0), got[0]
        assert np.all(np.isfinite(got[1]))


def test_prebuilt_metadata_is_used(monkeypatch):
    launches = []

    def factory(**fkw):
        def call(**ckw):
            launches.append(ckw)
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    dec = decode_case(1, [30, 3], 8, 2, 64, 16, F16)
    meta = metal.decode_metadata(dec.block_tables, dec.context_lens, 2, 16)
    with metal.use_launcher(factory):
        for _ in range(2):  # two layers of one step
            metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables, dec.context_lens,
                                         0.1, metadata=meta)
    assert len(launches) == 2
    assert all(c["inputs"][3] is meta.block_tables and c["inputs"][4] is meta.context_lens for c in launches)


# (num_heads, num_kv_heads, head_dim, block_size, [(context_len, q_len), ...], dtype)
PREFILL_CASES = [
    (8, 4, 8, 16, [(5, 5)], F32),                     # the test model's prompt
    (4, 2, 16, 8, [(1, 1), (20, 20), (9, 3)], F16),   # context 1, whole prompt, chunk after a prefix
    (8, 2, 64, 16, [(40, 13)], BF16),                 # two row tiles over a cached prefix
    (4, 1, 128, 32, [(70, 70)], F32),                 # staged 16 tokens at a time
    (2, 2, 256, 8, [(17, 4), (5, 0), (9, 9)], BF16),  # a sequence with no new token
    (16, 2, 80, 16, [(33, 17)], F16),                 # GQA 8, head_dim 80
    (4, 4, 96, 32, [(64, 1), (3, 2)], F32),           # one-token verify step
]


@pytest.mark.parametrize("h,kvh,d,bs,cq,dtype", PREFILL_CASES)
@pytest.mark.harness
@needs_clang
def test_prefill_matches_oracles(h, kvh, d, bs, cq, dtype):
    _check_prefill(prefill_case(d + len(cq), cq, h, kvh, d, bs, dtype), dtype)


MMA_CASES = PREFILL_CASES + [
    (12, 4, 64, 16, [(45, 45)], F16),                 # GQA 3: three simdgroups
    (16, 1, 32, 8, [(19, 11), (30, 30)], BF16),      # GQA 16: four heads per simdgroup
]


@pytest.mark.parametrize("h,kvh,d,bs,cq,dtype", MMA_CASES)
@pytest.mark.harness
@needs_clang
def test_prefill_matrix_kernel_matches_oracles(monkeypatch, h, kvh, d, bs, cq, dtype):
    monkeypatch.setattr(metal, "paged_prefill_attention", metal.paged_prefill_attention_mma)
    _check_prefill(prefill_case(d + len(cq), cq, h, kvh, d, bs, dtype), dtype)


@pytest.mark.harness
@needs_clang
def test_prefill_matrix_kernel_writes_each_element_once_and_dispatches(monkeypatch):
    monkeypatch.setattr(metal, "PREFILL_MATRIX_KERNEL", True)
    case = without_garbage(prefill_case(5, [(60, 40), (9, 9)], 8, 2, 32, 16, F16))
    before = mh.LAUNCHES["paged_prefill_attention_mma"]
    with metal.use_launcher(mh.metal_kernel), mh.options(variant="counting"):
        got = kernels.paged_prefill_attention(case.q, case.k_pool, case.v_pool, case.block_tables,
                                              case.context_lens, case.query_start_loc, case.scale)
    assert mh.LAUNCHES["paged_prefill_attention_mma"] == before + 1
    assert max_violation(got, numpy_prefill(case), F16) <= 0


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("old,new", [
    ("d_mine[lane * 8 + j] = j == lane ? correction : 0.0f;", "d_mine[lane * 8 + j] = j == lane ? 1.0f : 0.0f;"),
    ("simdgroup_load(kt, k_tile, HEAD_DIM, at, true);", "simdgroup_load(kt, k_tile, HEAD_DIM, at, false);"),
    ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n    for (int hh", "\n    for (int hh"),
    ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n  }\n\n  for (int hh", "\n  }\n\n  for (int hh"),
])
def test_planted_matrix_kernel_bugs_are_caught(monkeypatch, old, new):
    monkeypatch.setattr(metal, "paged_prefill_attention", metal.paged_prefill_attention_mma)
    _mutated(monkeypatch, "paged_prefill_attention_mma", old, new)
    _assert_caught(lambda: _check_prefill(prefill_case(7, [(40, 30)], 8, 2, 16, 8, F32), F32))


# ------------------------------------------------------------ planted bugs


def _mutated(monkeypatch, name: str, old: str, new: str) -> None:
    """Serve kernel ``name`` with ``old`` replaced by ``new`` (same line count)."""
    src = metal.load_kernel_source(name)
    assert src.body.count(old) == 1, f"planted-bug anchor {old!r} not found once in {name}"
    assert old.count("\n") == new.count("\n")
    body = src.body.replace(old, new)
    mh.register_origin(body, str(src.path), src.body_line)
    bad = replace(src, body=body)
    original = metal.load_kernel_source
    monkeypatch.setattr(metal, "load_kernel_source", lambda n: bad if n == name else original(n))
    monkeypatch.setattr(metal, "_kernels", {})


def _assert_caught(check) -> str:
    """Run ``check``; return "harness" when the harness failed the launch, "oracle" when
    the result disagreed with the oracles; fail the test when neither happened."""
    try:
        check()
    except KernelError:
        return "harness"
    except AssertionError:
        return "oracle"
    pytest.fail("the planted bug went unnoticed")


@pytest.mark.harness
@needs_clang
def test_planted_off_by_one_block_index_is_caught(monkeypatch):
    _mutated(monkeypatch, "paged_attention_decode",
             "block_tables[int64_t(seq) * max_blocks + chunk_block + i]",
             "block_tables[int64_t(seq) * max_blocks + chunk_block + i + 1]")
    _assert_caught(lambda: _check_decode(decode_case(3, [40, 17], 4, 2, 16, 16, F32), F32))


@pytest.mark.harness
@needs_clang
def test_planted_wrong_kv_head_for_the_query_group_is_caught(monkeypatch):
    _mutated(monkeypatch, "paged_attention_decode",
             "const int64_t kv_offset = int64_t(kv_head) * head_stride;",
             "const int64_t kv_offset = int64_t((kv_head + 1) % num_kv_heads) * head_stride;")
    assert _assert_caught(lambda: _check_decode(decode_case(8, [37, 5], 8, 2, 32, 8, F16), F16)) == "oracle"


@pytest.mark.harness
@needs_clang
def test_planted_lane_reading_the_wrong_vector_slice_is_caught(monkeypatch):
    _mutated(monkeypatch, "paged_attention_decode",
             "raw = *(const device uint4*)(k_pool + row + (r + j * LPT) * VEC);",
             "raw = *(const device uint4*)(k_pool + row + ((r + 1) % LPT + j * LPT) * VEC);")
    assert _assert_caught(lambda: _check_decode(decode_case(9, [29], 4, 2, 64, 16, F16), F16)) == "oracle"


_BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("which", [0, 1, 2, 3, 4])
def test_planted_missing_decode_barrier_is_caught(monkeypatch, which):
    src = metal.load_kernel_source("paged_attention_decode").body
    lines = src.splitlines(keepends=True)
    at = [i for i, ln in enumerate(lines) if ln.strip() == _BARRIER]
    assert len(at) == 5
    i = at[which]
    context = 1
    while src.count("".join(lines[i - context : i + 1])) > 1:  # enough lines before it to be unique
        context += 1
    anchor = "".join(lines[i - context : i + 1])
    _mutated(monkeypatch, "paged_attention_decode", anchor, "".join(lines[i - context : i]) + "\n")
    # 300 tokens in blocks of 8: two chunks of block ids; GQA 2: two merges.
    _assert_caught(lambda: _check_decode(decode_case(4, [300, 70], 4, 2, 32, 8, F32), F32))


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("which", [0, 1])
def test_planted_missing_prefill_barrier_is_caught(monkeypatch, which):
    src = metal.load_kernel_source("paged_prefill_attention").body
    barrier = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
    assert src.count(barrier) == 2
    # Remove one of the two barriers: keep the text before it unique by including context.
    start = src.index(barrier) if which == 0 else src.rindex(barrier)
    anchor = src[start - 40 : start + len(barrier)]
    _mutated(monkeypatch, "paged_prefill_attention", anchor, anchor.replace(barrier, "\n"))
    with pytest.raises(KernelError, match="differs between schedules"):
        _run_prefill(prefill_case(5, [(60, 20)], 4, 2, 16, 8, F32))


@pytest.mark.harness
@needs_clang
def test_planted_off_by_one_causal_mask_is_caught(monkeypatch):
    _mutated(monkeypatch, "paged_prefill_attention", "k0 + t <= pos;", "k0 + t <= pos + 1;")
    _assert_caught(lambda: _check_prefill(prefill_case(6, [(30, 10)], 4, 2, 16, 8, F32), F32))


@pytest.mark.harness
@needs_clang
def test_compile_error_points_into_the_metal_file(monkeypatch):
    anchor = "const float correction = fast::exp2(m[h] - m_new);"
    src = metal.load_kernel_source("paged_attention_decode")
    line = src.body_line + src.body[: src.body.index(anchor)].count("\n")
    _mutated(monkeypatch, "paged_attention_decode", anchor, "const float correction = fast::exp2(m[h] - m_newer);")
    with pytest.raises(KernelError) as e:
        _run_decode(decode_case(1, [5], 4, 2, 16, 8, F32))
    assert f"paged_attention_decode.metal:{line}:" in str(e.value)
    assert "m_newer" in str(e.value)


# ----------------------------------------------------------------- dispatch


@pytest.mark.harness
@needs_clang
def test_dispatch_uses_the_kernel_with_a_launcher():
    case = without_garbage(decode_case(1, [20], 4, 2, 16, 8, F32))
    before = mh.LAUNCHES["paged_attention_decode"]
    with metal.use_launcher(mh.metal_kernel):
        assert kernels.metal_path_enabled()
        out = kernels.paged_attention_decode(
            case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, case.scale
        )
    assert mh.LAUNCHES["paged_attention_decode"] == before + 1
    assert max_violation(out, numpy_decode(case), F32) <= 0


def test_dispatch_respects_ferrum_metal_kernels_0(monkeypatch):
    monkeypatch.setenv("FERRUM_METAL_KERNELS", "0")
    calls = []
    case = without_garbage(decode_case(2, [9], 4, 2, 16, 8, F32))
    with metal.use_launcher(lambda **kw: calls.append(kw)):
        assert not kernels.metal_path_enabled()
        out = kernels.paged_attention_decode(
            case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, case.scale
        )
    assert not calls
    assert max_violation(out, numpy_decode(case), F32) <= 0


def test_dispatch_without_metal_uses_the_reference():
    if mx.metal.is_available():
        pytest.skip("Metal is available here")
    assert not metal.launcher_forced()
    assert not kernels.metal_path_enabled()


def test_unsupported_shape_falls_back_and_logs_once(caplog):
    case = without_garbage(decode_case(3, [9], 4, 2, 12, 8, F32))  # head_dim 12: not a multiple of 8
    calls = []
    caplog.set_level(logging.INFO, logger="mlx_ferrum.kernels")
    with metal.use_launcher(lambda **kw: calls.append(kw)):
        for _ in range(3):
            out = kernels.paged_attention_decode(
                case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, case.scale
            )
    assert not calls
    assert max_violation(out, numpy_decode(case), F32) <= 0
    msgs = [r.getMessage() for r in caplog.records if "head_dim 12" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_prefill_unsupported_reasons():
    case = prefill_case(1, [(9, 3)], 4, 2, 16, 8, F32)
    args = (case.q, case.k_pool, case.v_pool, case.block_tables)
    assert metal.prefill_unsupported_reason(*args, [9], [0, 3]) is None
    assert "cover" in metal.prefill_unsupported_reason(*args, [9], [0, 2])
    assert "new tokens" in metal.prefill_unsupported_reason(*args, [2], [0, 3])
    assert "multiple" in metal.decode_unsupported_reason(
        case.q[:, :3], case.k_pool, case.v_pool, case.block_tables, case.context_lens)


def test_prefill_tiles_never_span_sequences():
    tiles = np.array(metal.prefill_tiles([20, 5, 9], [0, 20, 20, 23], rows=8)).reshape(-1, 4)
    assert tiles.tolist() == [[0, 0, 8, 0], [0, 8, 8, 8], [0, 16, 4, 16], [2, 20, 3, 6]]


# --------------------------------------------------------- sources and MLX


def test_kernel_files_parse_and_are_found():
    d = metal.kernels_dir()
    names = sorted(p.stem for p in d.glob("*.metal"))
    assert names == ["matmul16", "paged_attention_decode", "paged_attention_reduce", "paged_prefill_attention",
                     "paged_prefill_attention_mma"]
    for n in names:
        src = metal.load_kernel_source(n)
        lines = src.path.read_text().splitlines()
        assert lines[src.body_line - 2].strip() == metal.BODY_MARK
        assert src.body.splitlines()[0] == lines[src.body_line - 1]
        assert metal.source_origin(src.body) == (str(src.path), src.body_line)


def test_kernel_dir_found_from_an_installed_layout(tmp_path):
    # A wheel puts the sources at mlx_ferrum/metal_kernels (package-dir mapping).
    site = tmp_path / "site"
    shutil.copytree(REPO / "mlx_ferrum", site / "mlx_ferrum", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "metal_kernels", site / "mlx_ferrum" / "metal_kernels")
    code = "from mlx_ferrum.kernels import metal; print(metal.kernels_dir())"
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == site / "mlx_ferrum" / "metal_kernels"


def _record_launches():
    """Launch each wrapper with a recording launcher; returns (factory kwargs, call kwargs) pairs."""
    launches = []

    def factory(**fkw):
        def call(**ckw):
            launches.append((fkw, ckw))
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    dec = decode_case(1, [30, 3], 8, 2, 64, 16, BF16)
    pre = prefill_case(1, [(12, 5)], 4, 4, 8, 8, F16)
    old = metal.DECODE_PARTITION_SIZE
    try:
        with metal.use_launcher(factory):
            for psize in (None, 16):
                metal.DECODE_PARTITION_SIZE = psize
                metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables, dec.context_lens, 0.1)
            metal.paged_prefill_attention(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens,
                                          pre.query_start_loc, 0.1)
            metal.paged_prefill_attention_mma(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens,
                                              pre.query_start_loc, 0.1)
    finally:
        metal.DECODE_PARTITION_SIZE = old
    return launches


def test_generated_source_of_every_kernel_matches_mlx():
    launches = _record_launches()
    assert sorted({f["name"] for f, _ in launches}) == [
        "paged_attention_decode", "paged_attention_reduce", "paged_prefill_attention",
        "paged_prefill_attention_mma"]
    for fkw, ckw in launches:
        args = dict(
            name=fkw["name"], input_names=fkw["input_names"], output_names=fkw["output_names"],
            source=fkw["source"], header=fkw["header"], inputs=ckw["inputs"],
            output_shapes=ckw["output_shapes"], output_dtypes=ckw["output_dtypes"], template=ckw["template"],
        )
        mlx_name, mlx_source = mh.capture_mlx_source(**args)
        gen = mh.generate(
            fkw["name"], fkw["input_names"], fkw["output_names"], fkw["source"], fkw["header"],
            [mh.source.arg_info(n, a) for n, a in zip(fkw["input_names"], ckw["inputs"])],
            ckw["output_dtypes"], ckw["template"],
        )
        assert gen.kernel_name == mlx_name
        assert gen.source == mlx_source
        # Small metadata arrays are padded, so they stay device pointers.
        meta = [p for p in gen.params if p.name in ("block_tables", "context_lens", "params", "tiles")]
        assert meta and all(p.decl.startswith("const device") for p in meta), meta


def test_grids_are_whole_threadgroups():
    for fkw, ckw in _record_launches():
        grid, tg = ckw["grid"], ckw["threadgroup"]
        assert all(g % t == 0 for g, t in zip(grid, tg)), (fkw["name"], grid, tg)
        assert tg[0] * tg[1] * tg[2] <= 1024


# ------------------------------------------------------------ full sweep


@pytest.mark.slow
@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_exhaustive_sweep(dtype):
    seed = 0
    for ratio, d, bs in itertools.product([1, 2, 4, 8], [8, 16, 32, 64, 80, 96, 128, 256], [8, 16, 32]):
        seed += 1
        ctxs = [1, bs, bs + 1, 3 * bs - 1]
        _check_decode(decode_case(seed, ctxs, 2 * ratio, 2, d, bs, dtype), dtype)
        _check_prefill(prefill_case(seed, [(1, 1), (2 * bs + 3, bs + 1)], 2 * ratio, 2, d, bs, dtype), dtype)


def test_long_prefill_chunks_go_to_the_reference(caplog):
    # Up to PREFILL_KERNEL_MAX_QUERY_LEN rows the kernel runs; above it MLX's SDPA does,
    # and that is a dispatch rule, not a fallback (nothing logged at INFO).
    limit = metal.PREFILL_KERNEL_MAX_QUERY_LEN
    calls = []

    def factory(**fkw):
        def call(**ckw):
            calls.append(fkw["name"])
            return [mx.zeros(s, d) for s, d in zip(ckw["output_shapes"], ckw["output_dtypes"])]
        return call

    caplog.set_level(logging.INFO, logger="mlx_ferrum.kernels")
    for q_len, expect_kernel in ((limit, True), (limit + 1, False)):
        case = without_garbage(prefill_case(2, [(q_len + 3, q_len), (4, 2)], 4, 2, 16, 8, F32))
        calls.clear()
        with metal.use_launcher(factory):
            out = kernels.paged_prefill_attention(case.q, case.k_pool, case.v_pool, case.block_tables,
                                                  case.context_lens, case.query_start_loc, case.scale)
        assert calls == (["paged_prefill_attention"] if expect_kernel else [])
        if not expect_kernel:
            assert max_violation(out, numpy_prefill(case), F32) <= 0
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_kernels_are_built_with_an_explicit_math_mode():
    launches = _record_launches()
    modes = {f["name"]: f["compile_options"] for f, _ in launches}
    assert modes["paged_attention_decode"] == {"math_mode": "fast"}
    assert modes["paged_attention_reduce"] == {"math_mode": "fast"}
    assert modes["paged_prefill_attention"] == {"math_mode": "fast"}
    assert modes["paged_prefill_attention_mma"] == {"math_mode": "fast"}
    assert metal._accepts_compile_options(mx.fast.metal_kernel)
