"""Harness checks for bug classes the default build cannot see.

- Build variants: ``ubsan`` (signed overflow, misaligned access, out-of-bounds array
  indexing trap and name the ``.metal`` line), ``cxx14`` (MSL before 3.2 is C++14: a
  C++17 construct in kernel text fails), finite math (Metal's fast math: a comparison
  with infinity may fold away), ``counting`` (each output element written exactly once).
- The real kernels pass under each variant (about 10 s together).
- A KV pool of more than 2^31 elements, mapped sparse (``MAP_NORESERVE``), with block
  tables pointing at its top blocks: 64-bit offsets everywhere.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.errors import KernelError
from mlx_ferrum.kernels import metal
from support import metal_harness as mh
from support.paged_cases import decode_case, max_violation, numpy_decode, numpy_prefill, prefill_case

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(
        not mh.clang_available(),
        reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
    ),
]


def _run(body, inputs, out_shape, variant="default", grid=(32, 1, 1), tg=(32, 1, 1), compile_options=None,
         name="hard"):
    names = [f"in{i}" for i in range(len(inputs))]
    k = mh.metal_kernel(name, names, ["out"], body, "", compile_options=compile_options)
    with mh.options(variant=variant, schedules=("serial",)):
        return k(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=[out_shape],
                 output_dtypes=[mx.float32])[0]


# ------------------------------------------------------------ ubsan


@pytest.mark.parametrize("body,line,default_build_runs", [
    # signed overflow: 3 * 10^9 does not fit an int
    ("uint i = thread_position_in_grid.x;\n  int big = int(in0[i]) * 1000000000;\n  out[i] = float(big);", 31, True),
    # an index past a fixed-size array (in bounds of the stack, so no guard page sees it)
    ("uint i = thread_position_in_grid.x;\n  float a[4] = {1, 2, 3, 4};\n  out[i] = a[int(in0[i]) + 2];", 32, True),
    # a 16-byte vector load at a 4-byte offset (x86's aligned load faults too, but
    # without saying why; a GPU may silently load the aligned address below)
    ("uint i = thread_position_in_grid.x;\n  float4 v = *(const device float4*)(in0 + 1 + int(in0[i]) * 4);\n"
     "  out[i] = v.x + v.w;", 31, False),
])
def test_ubsan_variant_traps_at_the_metal_line(body, line, default_build_runs):
    mh.register_origin(body, "/virtual/ub.metal", 30)
    x = mx.full((256,), 3.0)
    if default_build_runs:
        assert _run(body, [x], (32,), "default").shape == (32,)  # the default build does not notice
    with pytest.raises(KernelError) as e:
        _run(body, [x], (32,), "ubsan")
    assert "undefined behaviour" in str(e.value) and f"/virtual/ub.metal:{line}:" in str(e.value)


# ------------------------------------------------------------- C++14


def test_cxx14_variant_fails_on_cxx17_in_kernel_text():
    body = "uint i = thread_position_in_grid.x;\n  if constexpr (sizeof(float) == 4) {\n    out[i] = in0[i];\n  }"
    mh.register_origin(body, "/virtual/cxx17.metal", 5)
    _run(body, [mx.ones((32,))], (32,), "default")
    with pytest.raises(KernelError, match=r"/virtual/cxx17\.metal:6:\d+: warning"):
        _run(body, [mx.ones((32,))], (32,), "cxx14")


# -------------------------------------------------------- finite math


def test_fast_math_mode_builds_with_finite_math():
    # The hazard of the old decode kernel: a test against -infinity folds away.
    body = "uint i = thread_position_in_grid.x;\n  out[i] = in0[i] == -INFINITY ? 0.0f : 1.0f;"
    x = mx.full((32,), -np.inf)
    safe = np.array(_run(body, [x], (32,), compile_options={"math_mode": "safe"}))
    fast = np.array(_run(body, [x], (32,), compile_options={"math_mode": "fast"}))
    assert (safe == 0).all() and (fast == 1).all()


# ---------------------------------------------------------- write set


@pytest.mark.parametrize("body,what", [
    ("uint i = thread_position_in_grid.x;\n  out[i / 2 * 2] = in0[i];", "element 0 of output 'out' was written 2 times"),
    ("uint i = thread_position_in_grid.x;\n  if (i != 5) out[i] = in0[i];", "element 5 of output 'out' was written 0 times"),
])
def test_write_set_check_needs_each_element_written_once(body, what):
    # Identical values, so no schedule difference shows it: only the write set does.
    x = mx.ones((32,))
    _run(body, [x], (32,), "default")
    with pytest.raises(KernelError, match=what):
        _run(body, [x], (32,), "counting")


# --------------------------------------------- the kernels in each variant


def _kernels_agree(variant: str, finite_math: bool = False):
    dec = decode_case(3, [40, 300, 1], 8, 2, 64, 16, mx.float16)
    pre = prefill_case(3, [(20, 9), (7, 7)], 8, 2, 64, 16, mx.bfloat16)
    old = metal.DECODE_PARTITION_SIZE
    try:
        with metal.use_launcher(mh.metal_kernel), mh.options(variant=variant, finite_math=finite_math):
            for psize in (None, 64):  # one pass, and split + reduce
                metal.DECODE_PARTITION_SIZE = psize
                got = metal.paged_attention_decode(dec.q, dec.k_pool, dec.v_pool, dec.block_tables,
                                                   dec.context_lens, dec.scale)
                assert max_violation(got, numpy_decode(dec), mx.float16) <= 0
            for prefill in (metal.paged_prefill_attention, metal.paged_prefill_attention_mma):
                got = prefill(pre.q, pre.k_pool, pre.v_pool, pre.block_tables, pre.context_lens,
                              pre.query_start_loc, pre.scale)
                assert max_violation(got, numpy_prefill(pre), mx.bfloat16) <= 0
    finally:
        metal.DECODE_PARTITION_SIZE = old


def test_kernels_write_every_output_element_once():
    _kernels_agree("counting")


@pytest.mark.parametrize("variant,finite_math", [("ubsan", False), ("cxx14", False), ("default", True)])
def test_kernels_pass_in_each_build_variant(variant, finite_math):
    _kernels_agree(variant, finite_math)


# ------------------------------------------------ pool above 2^31 elements


def test_decode_and_prefill_on_a_pool_above_2_31_elements():
    bs, d, kvh, h = 16, 128, 1, 2
    num_blocks = (1 << 31) // (kvh * bs * d) + 8  # 2^31 + 16384 elements, 4 GiB of float16
    assert num_blocks * kvh * bs * d > 2**31
    ctx, q_len = 50, 5
    top = [num_blocks - 1, num_blocks - 3, num_blocks - 2, num_blocks - 5]  # the top blocks, shuffled
    rng = np.random.default_rng(0)
    k_blocks = rng.standard_normal((4, kvh, bs, d)).astype(np.float16)
    v_blocks = rng.standard_normal((4, kvh, bs, d)).astype(np.float16)
    per_block = kvh * bs * d
    k_pool = mh.SparseArray((num_blocks, kvh, bs, d), mx.float16, {b * per_block: k_blocks[i] for i, b in enumerate(top)})
    v_pool = mh.SparseArray((num_blocks, kvh, bs, d), mx.float16, {b * per_block: v_blocks[i] for i, b in enumerate(top)})
    tables = mx.array([top], dtype=mx.int32)
    lens = mx.array([ctx], dtype=mx.int32)
    q = mx.array(rng.standard_normal((1, h, d)).astype(np.float16))
    qp = mx.array(rng.standard_normal((q_len, h, d)).astype(np.float16))
    qsl = mx.array([0, q_len], dtype=mx.int32)
    # The same problem on a compact pool holding just those blocks, for the oracles.
    small = decode_case(0, [ctx], h, kvh, d, bs, mx.float16)
    small.q, small.block_tables, small.context_lens = q, mx.array([[0, 1, 2, 3]], dtype=mx.int32), lens
    small.k_pool, small.v_pool = mx.array(k_blocks), mx.array(v_blocks)
    small.valid = np.ones((4, bs), bool)
    small_pre = prefill_case(0, [(ctx, q_len)], h, kvh, d, bs, mx.float16)
    small_pre.q, small_pre.block_tables, small_pre.context_lens = qp, small.block_tables, lens
    small_pre.k_pool, small_pre.v_pool, small_pre.valid = small.k_pool, small.v_pool, small.valid
    with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("serial",)):
        got = metal.paged_attention_decode(q, k_pool, v_pool, tables, lens, d**-0.5)
        got_pre = metal.paged_prefill_attention(qp, k_pool, v_pool, tables, lens, qsl, d**-0.5)
    assert max_violation(got, numpy_decode(small), mx.float16) <= 0
    assert max_violation(got_pre, numpy_prefill(small_pre), mx.float16) <= 0
