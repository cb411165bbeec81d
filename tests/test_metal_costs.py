"""The harness's cost model: counts are exact on small kernels, and the
decode kernels stay within their budgets:

- at most 1 simdgroup-wide operation per KV token per query head (amortised);
- device bytes read per KV token at most 1.1x the K+V bytes of one KV head (each KV
  head read once for all its query heads).

The budgets are asserted at the shape the outside review modelled (head_dim 128,
GQA 4, float16, 1024 tokens) and at other long-context shapes; the legacy kernel's
figures (7 simdgroup operations, 4x the bytes at that shape) are in docs/kernels.md
(``python benchmarks/kernel_costs.py``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from support import metal_harness as mh
from support.kernel_costs import measure_decode

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(
        not mh.clang_available(),
        reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
    ),
]


def test_counts_are_exact_on_a_small_kernel():
    # 2 threadgroups of 64 threads (2 simdgroups each): per thread one float load of
    # in0 and a 16-byte load of in1; 3 simd calls per simdgroup; 2 barriers per group.
    body = """
  uint i = thread_position_in_grid.x;
  float4 v = *(const device float4*)(in1 + 4 * i);
  float x = in0[i] + v.x + v.y + v.z + v.w;
  x = simd_sum(x);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x = simd_max(x) + simd_shuffle_xor(x, ushort(1));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = x;
"""
    k = mh.metal_kernel("count", ["in0", "in1"], ["out"], body)
    with mh.options(schedules=("serial", "random")), mh.record_costs() as costs:
        k(inputs=[mx.ones((128,)), mx.ones((512,))], grid=(128, 1, 1), threadgroup=(64, 1, 1),
          output_shapes=[(128,)], output_dtypes=[mx.float32])
    (c,) = costs
    assert c.simd_ops == 3 * 4
    assert c.threadgroup_barriers == 2 * 2
    assert c.device_bytes_written == 128 * 4
    assert c.device_bytes_read == 128 * 4 + 128 * 16


@pytest.mark.parametrize("h,kvh,d,bs,ctxs,dtype,psize", [
    (16, 4, 128, 16, [1024], mx.float16, 0),        # the reviewed shape, one pass
    (16, 4, 128, 16, [1024], mx.float16, None),     # the same with split-K by occupancy (+ reduce)
    (32, 8, 128, 16, [1024, 700], mx.bfloat16, 0),  # Llama-3-8B heads, two sequences
    (8, 8, 64, 32, [2048], mx.float32, 0),          # no GQA
    (32, 4, 64, 16, [1024], mx.float16, 0),         # GQA 8
])
def test_decode_within_cost_budgets(h, kvh, d, bs, ctxs, dtype, psize):
    cost = measure_decode(h, kvh, d, bs, ctxs, dtype, partition_size=psize)
    assert cost.simd_ops_per_token_per_head <= 1.0, cost
    assert cost.read_ratio <= 1.1, cost
