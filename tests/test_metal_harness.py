"""The CPU harness for Metal kernels (support.metal_harness).

- The source generator is compared with MLX's own text, captured through
  ``mx.export_function`` (no Metal device needed).
- Small kernels check the MSL layer against numpy: dtype conversions, simdgroup
  functions, kernel attributes on partial threadgroups.
- Kernels with deliberate faults check that the harness fails them: a missing
  barrier, divergent simdgroup calls, a barrier some threads skip, out-of-bounds
  reads and writes, a hang, unwritten outputs and threadgroup memory (NaN-filled),
  too much threadgroup memory, compile errors (reported at the .metal line), a
  pointer passed to the wrong address space.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.errors import KernelError
from support import metal_harness as mh
from support.metal_harness import source as S

needs_clang = pytest.mark.skipif(
    not mh.clang_available(),
    reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
)

# ------------------------------------------------------------ generator vs MLX

_BODY = "uint i = thread_position_in_grid.x;\n  out[i] = a[i] + small[0] + s0;"
_INPUTS = [mx.zeros((4, 4)), mx.zeros((4,), mx.int32), mx.array(1.0)]


@pytest.mark.parametrize(
    "body,outputs,template,atomic",
    [
        (_BODY, ["out"], [("T", mx.float32), ("N", 3), ("B", True)], False),
        (_BODY, ["out"], None, False),
        (_BODY + " // a_shape a_strides a_ndim small_shape", ["out", "o2"], [("T", mx.bfloat16)], False),
        # MLX's quirk: extras + two outputs + no attribute writes ") {" twice.
        ("out[0] = a[0]; // a_shape", ["out", "o2"], None, False),
        ("out[0] = a[0];", ["out", "o2"], [("F", False)], False),
        ("// threads_per_threadgroup grid_size simdgroup_index_in_threadgroup quadgroups_per_threadgroup\n"
         "out[0] = a[0];", ["out"], [("X", mx.float16), ("Y", -2)], True),
    ],
)
def test_generator_matches_mlx(body, outputs, template, atomic):
    names = ["a", "small", "s0"]
    dtypes = [mx.float16, mx.int32][: len(outputs)]
    kn, src = mh.capture_mlx_source(
        "kk", names, outputs, body, "// header\n", _INPUTS, [(2,)] * len(outputs), dtypes, template, atomic
    )
    gen = mh.generate("kk", names, outputs, body, "// header\n", [S.arg_info(n, a) for n, a in zip(names, _INPUTS)],
                      dtypes, template, atomic)
    assert (gen.kernel_name, gen.source) == (kn, src)
    assert gen.source[gen.body_span[0]:gen.body_span[1]] == body


def test_generator_matches_what_mlx_verbose_prints(capfd):
    body = "out[thread_position_in_grid.x] = a[0] * T(2);"
    k = mx.fast.metal_kernel(name="vv", input_names=["a"], output_names=["out"], source=body)

    def fn(a):
        return k(inputs=[a], template=[("T", mx.float32)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                 output_shapes=[(8,)], output_dtypes=[mx.float32], verbose=True)

    mx.export_function(lambda info: None, fn, mx.ones((16,)))
    printed = capfd.readouterr().out
    gen = mh.generate("vv", ["a"], ["out"], body, "", [S.ArgInfo("a", mx.float32, 1, 16)], [mx.float32],
                      [("T", mx.float32)])
    assert f"Generated source code for `vv`:\n```\n{gen.source}\n```" in printed


def test_generator_address_spaces_and_extras():
    gen = mh.generate("k", ["big", "small", "scalar"], ["out"], "big_shape thread_index_in_simdgroup", "",
                      [S.ArgInfo("big", mx.float32, 2, 64), S.ArgInfo("small", mx.int32, 1, 7),
                       S.ArgInfo("scalar", mx.float32, 0, 1)], [mx.float32])
    decls = {p.name: (p.decl, p.buffer) for p in gen.params}
    assert decls == {
        "big": ("const device float*", 0),
        "big_shape": ("const constant int*", 1),
        "small": ("const constant int32_t*", 2),
        "scalar": ("const constant float&", 3),
        "out": ("device float*", 4),
        "thread_index_in_simdgroup": ("uint", -1),
    }


# ------------------------------------------------------------- helpers


def _run(body, inputs, out_shape, out_dtype=mx.float32, grid=(64, 1, 1), tg=(32, 1, 1), template=None,
         header="", init_value=None, timeout=60.0, schedules=("serial", "reversed", "random"), name="t"):
    names = [f"in{i}" for i in range(len(inputs))]
    k = mh.metal_kernel(name, names, ["out"], body, header)
    with mh.options(timeout_s=timeout, schedules=schedules):
        return k(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=[out_shape], output_dtypes=[out_dtype],
                 template=template, init_value=init_value)[0]


# ------------------------------------------------------------ MSL semantics


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dtype_round_trip_is_exact(dtype):
    x = mx.random.normal((100,), key=mx.random.key(0)) * 100
    body = "uint i = thread_position_in_grid.x;\n  if (i < 100) out[i] = static_cast<T>(float(in0[i]) * 0.5f);"
    got = _run(body, [x.astype(dtype)], (100,), dtype, grid=(128, 1, 1), tg=(64, 1, 1), template=[("T", dtype)])
    want = (x.astype(dtype).astype(mx.float32) * 0.5).astype(dtype)
    assert mx.array_equal(got, want)


@pytest.mark.harness
@needs_clang
def test_simd_functions_match_numpy():
    body = """
  uint i = thread_position_in_grid.x;
  uint lane = thread_index_in_simdgroup;
  float x = in0[i];
  out[i * 8 + 0] = simd_sum(x);
  out[i * 8 + 1] = simd_max(x);
  out[i * 8 + 2] = simd_min(x);
  out[i * 8 + 3] = simd_prefix_inclusive_sum(x);
  out[i * 8 + 4] = simd_prefix_exclusive_sum(x);
  out[i * 8 + 5] = simd_shuffle_xor(x, ushort(5));
  out[i * 8 + 6] = simd_shuffle_down(x, ushort(3));
  out[i * 8 + 7] = simd_broadcast(x, ushort(lane % 7));
"""
    x = np.random.default_rng(0).integers(-50, 50, size=64).astype(np.float32)
    got = np.array(_run(body, [mx.array(x)], (64 * 8,))).reshape(64, 8)
    g = x.reshape(2, 32)
    want = np.zeros((2, 32, 8), np.float32)
    lanes = np.arange(32)
    for s in range(2):
        want[s, :, 0] = g[s].sum()
        want[s, :, 1] = g[s].max()
        want[s, :, 2] = g[s].min()
        want[s, :, 3] = np.cumsum(g[s])
        want[s, :, 4] = np.cumsum(g[s]) - g[s]
        want[s, :, 5] = g[s][lanes ^ 5]
        want[s, :, 6] = np.where(lanes + 3 < 32, g[s][np.minimum(lanes + 3, 31)], g[s])
        want[s, :, 7] = g[s][lanes % 7]
    np.testing.assert_array_equal(got, want.reshape(64, 8))


@pytest.mark.harness
@needs_clang
def test_attributes_on_a_partial_grid():
    # grid (70, 3) with threadgroups (32, 2): the last column and row of groups are partial.
    body = """
  uint gx = thread_position_in_grid.x, gy = thread_position_in_grid.y;
  uint o = (gy * 70 + gx) * 6;
  out[o + 0] = threadgroup_position_in_grid.x;
  out[o + 1] = threadgroup_position_in_grid.y;
  out[o + 2] = thread_position_in_threadgroup.x;
  out[o + 3] = thread_position_in_threadgroup.y;
  out[o + 4] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
  out[o + 5] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y;
"""
    got = np.array(_run(body, [mx.zeros((8,))], (3 * 70 * 6,), mx.uint32, grid=(70, 3, 1), tg=(32, 2, 1)))
    got = got.reshape(3, 70, 6)
    for y in range(3):
        for x in range(70):
            tw = min(32, 70 - 32 * (x // 32))
            th = min(2, 3 - 2 * (y // 2))
            assert got[y, x].tolist() == [x // 32, y // 2, x % 32, y % 2, tw * 100 + th, 3 * 100 + 2]


@pytest.mark.harness
@needs_clang
def test_barriers_share_threadgroup_memory():
    body = """
  threadgroup float buf[64];
  uint t = thread_index_in_threadgroup;
  buf[t] = in0[thread_position_in_grid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = buf[63 - t];
"""
    x = mx.arange(128).astype(mx.float32)
    got = _run(body, [x], (128,), grid=(128, 1, 1), tg=(64, 1, 1))
    want = mx.concatenate([x[:64][::-1], x[64:][::-1]])
    assert mx.array_equal(got, want)


@pytest.mark.harness
@needs_clang
def test_unwritten_outputs_are_nan_and_init_value_is_honoured():
    body = "uint i = thread_position_in_grid.x;\n  if (i % 2 == 0) out[i] = in0[i];"
    x = mx.ones((64,))
    got = np.array(_run(body, [x], (64,)))
    assert np.isnan(got[1::2]).all() and (got[::2] == 1).all()
    got = np.array(_run(body, [x], (64,), init_value=3.0))
    assert (got[1::2] == 3).all()


@pytest.mark.harness
@needs_clang
def test_unwritten_threadgroup_memory_reads_nan():
    body = """
  threadgroup float buf[32];
  if (thread_index_in_threadgroup < 16) buf[thread_index_in_threadgroup] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[thread_position_in_grid.x] = buf[thread_index_in_threadgroup];
"""
    got = np.array(_run(body, [mx.ones((8,))], (64,)))
    assert (got.reshape(2, 32)[:, :16] == 1).all() and np.isnan(got.reshape(2, 32)[:, 16:]).all()


# --------------------------------------------------------- faults it catches


@pytest.mark.harness
@needs_clang
def test_missing_barrier_is_a_race():
    body = """
  threadgroup float buf[64];
  buf[thread_index_in_threadgroup] = in0[thread_position_in_grid.x];
  out[thread_position_in_grid.x] = buf[63 - thread_index_in_threadgroup];
"""
    with pytest.raises(KernelError, match="differs between schedules"):
        _run(body, [mx.arange(128).astype(mx.float32)], (128,), grid=(128, 1, 1), tg=(64, 1, 1))


@pytest.mark.harness
@needs_clang
def test_divergent_simd_calls_deadlock_with_lines():
    body = "uint i = thread_position_in_grid.x;\n" \
           "if (i % 2) {\n  out[i] = simd_sum(in0[i]);\n} else {\n  out[i] = simd_max(in0[i]);\n}"
    mh.register_origin(body, "/virtual/divergent.metal", 40)
    with pytest.raises(KernelError) as e:
        _run(body, [mx.ones((64,))], (64,))
    msg = str(e.value)
    assert "deadlock" in msg and "/virtual/divergent.metal:42" in msg and "/virtual/divergent.metal:44" in msg


@pytest.mark.harness
@needs_clang
def test_barrier_skipped_by_returned_threads_fails():
    body = "uint i = thread_position_in_grid.x;\nif (i >= 16) return;\n" \
           "threadgroup_barrier(mem_flags::mem_threadgroup);\nout[i] = in0[i];"
    with pytest.raises(KernelError, match="already returned"):
        _run(body, [mx.ones((64,))], (64,))


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("body,what", [
    ("uint i = thread_position_in_grid.x;\n  out[i] = in0[i + 1];", "past the end of buffer 'in0'"),
    ("uint i = thread_position_in_grid.x;\n  out[i + 1] = in0[i];", "past the end of buffer 'out'"),
])
def test_out_of_bounds_access_fails_the_launch(body, what):
    mh.register_origin(body, "/virtual/oob.metal", 10)
    with pytest.raises(KernelError) as e:
        _run(body, [mx.ones((64,))], (64,), schedules=("serial",))
    assert what in str(e.value)
    assert "/virtual/oob.metal:11" in str(e.value)  # the faulting line, from the symbolizer


@pytest.mark.harness
@needs_clang
def test_small_overflow_write_is_caught_by_canary():
    # 6 floats = 24 bytes: the buffer ends 8 bytes before its guard page.
    body = "uint i = thread_position_in_grid.x;\n  if (i < 7) out[i] = 1.0f;"
    with pytest.raises(KernelError, match="past the end of buffer 'out'"):
        _run(body, [mx.ones((8,))], (6,), grid=(8, 1, 1), tg=(8, 1, 1))


@pytest.mark.harness
@needs_clang
def test_hang_times_out():
    body = "uint i = thread_position_in_grid.x;\n  while (in0[i] > 0.0f) {}\n  out[i] = 1.0f;"
    with pytest.raises(KernelError, match="did not finish"):
        _run(body, [mx.ones((64,))], (64,), timeout=2.0, schedules=("serial",))


@pytest.mark.harness
@needs_clang
def test_too_much_threadgroup_memory_fails():
    body = "threadgroup float buf[9000];\n  buf[0] = 1.0f;\n  out[thread_position_in_grid.x] = buf[0];"
    with pytest.raises(KernelError, match="32 KiB"):
        _run(body, [mx.ones((8,))], (64,), schedules=("serial",))


@pytest.mark.harness
@needs_clang
def test_compile_error_names_the_metal_line():
    body = "uint i = thread_position_in_grid.x;\n  out[i] = no_such_name + in0[i];"
    mh.register_origin(body, "/virtual/broken.metal", 20)
    with pytest.raises(KernelError, match=r"/virtual/broken\.metal:21:\d+: error: use of undeclared identifier"):
        _run(body, [mx.ones((64,))], (64,))


@pytest.mark.harness
@needs_clang
def test_wrong_address_space_does_not_compile():
    header = "inline float first(threadgroup const float* p) { return p[0]; }\n"
    body = "out[thread_position_in_grid.x] = first(in0);"
    with pytest.raises(KernelError, match="could not compile"):
        _run(body, [mx.ones((64,))], (64,), header=header)


@pytest.mark.harness
@needs_clang
def test_small_inputs_are_constant_pointers():
    # A 4-element input arrives in the constant address space, as on Metal: a helper
    # taking a device pointer does not accept it.
    header = "inline float first(const device float* p) { return p[0]; }\n"
    body = "out[thread_position_in_grid.x] = first(in0);"
    assert float(_run(body, [mx.full((8,), 2.0)], (64,), header=header)[0]) == 2.0
    with pytest.raises(KernelError, match="could not compile"):
        _run(body, [mx.full((4,), 2.0)], (64,), header=header)


@pytest.mark.harness
@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_simdgroup_matrix_functions_match_numpy(dtype):
    # Two simdgroups: out[g] = A_g @ B_g^T + 1 (B loaded transposed from threadgroup memory).
    body = """
  const uint g = simdgroup_index_in_threadgroup;
  threadgroup T b_shared[2 * 64];
  for (int i = thread_index_in_simdgroup; i < 64; i += 32) {
    b_shared[g * 64 + i] = in1[g * 64 + i];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> a;
  simdgroup_matrix<T, 8, 8> b;
  simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  const ulong2 no_offset = {0, 0};
  const ulong2 row_offset = {0, g * 8};
  simdgroup_load(a, in0 + g * 64, 8);
  simdgroup_load(b, b_shared + g * 64, 8, no_offset, true);
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, out, 8, row_offset);
"""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 8, 8)).astype(np.float32)
    b = rng.standard_normal((2, 8, 8)).astype(np.float32)
    k = mh.metal_kernel("mma", ["in0", "in1"], ["out"], body)
    with mh.options(variant="counting"):  # the write-set check: each element stored once
        got = k(inputs=[mx.array(a).astype(dtype), mx.array(b).astype(dtype)], grid=(64, 1, 1),
                threadgroup=(64, 1, 1), output_shapes=[(16, 8)], output_dtypes=[mx.float32],
                template=[("T", dtype)])[0]
    a_r = np.array(mx.array(a).astype(dtype).astype(mx.float32))
    b_r = np.array(mx.array(b).astype(dtype).astype(mx.float32))
    want = (a_r @ b_r.transpose(0, 2, 1) + 1).reshape(16, 8)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.harness
@needs_clang
def test_simdgroup_matrix_load_in_divergent_code_deadlocks():
    body = """
  simdgroup_float8x8 a;
  if (thread_index_in_simdgroup < 16) {
    simdgroup_load(a, in0, 8);
  }
  out[thread_position_in_grid.x] = 0.0f;
"""
    with pytest.raises(KernelError, match="deadlock|all 32 lanes"):
        _run(body, [mx.ones((64,))], (32,), grid=(32, 1, 1), tg=(32, 1, 1), schedules=("serial",))
