"""The harness's cost model applied to the decode kernels.

:func:`measure_decode` runs ``mlx_ferrum.kernels.metal.paged_attention_decode`` (or any
launch function with its arguments) in the harness's ``counting`` build and reduces the
:class:`~support.metal_harness.LaunchCost` of every launch (decode and, when
the context is split, reduce) to the per-token figures the budgets are stated in:

- ``simd_ops_per_token_per_head``: simdgroup functions per KV token per query head,
  ``sum(simd_ops) / (sum(context_lens) * num_heads)``; MLX's ``sdpa_vector`` spends
  about 1 (one ``simd_sum`` per key per query head);
- ``read_ratio``: device bytes read per KV token per KV head over the K+V bytes of
  one token of one KV head (``2 * head_dim * itemsize``): 1.0 means K and V are read
  once for all the query heads of their KV head, and nothing else is read;
- ``bytes_per_token_per_kv_head``: the bytes read per KV token per KV head themselves
  (for a quantized cache, ``kv_cache_dtype`` "int8" or "int4", codes, scales and biases
  included; compare it with the fp16 figure of the same shape).

Each thread's loads count (there are no caches in the model), which makes it a
machine-independent upper bound on DRAM traffic rather than a prediction of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

from mlx_ferrum.kernels import metal
from support import metal_harness as mh
from support.paged_cases import decode_case


@dataclass(frozen=True)
class DecodeCost:
    """Per-token cost of one decode call (see the module docstring)."""

    simd_ops_per_token_per_head: float
    read_ratio: float
    threadgroup_barriers: int
    launches: int
    bytes_read: int
    bytes_per_token_per_kv_head: float = 0.0


def measure_decode(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: Sequence[int],
    dtype: mx.Dtype,
    *,
    partition_size: Optional[int] = None,
    launch: Optional[Callable] = None,
    kv_cache_dtype: str = "auto",
) -> DecodeCost:
    """Run one decode call in the counting build and return its :class:`DecodeCost`.

    Args:
        num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype: the problem
            (random q and pools from :func:`support.paged_cases.decode_case`).
        partition_size: forces split-K partitions of this many tokens
            (``metal.DECODE_PARTITION_SIZE``); None uses the occupancy policy, 0 or a
            size above the context gives one pass.
        launch: called as ``launch(q, k_pool, v_pool, block_tables, context_lens, scale)``
            instead of ``metal.paged_attention_decode`` (e.g. an older kernel).
        kv_cache_dtype: "auto" (pools of ``dtype``), "int8" or "int4": the same problem
            with its pools quantized (:mod:`support.quantized_cases`).
    """
    case = decode_case(1, list(context_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    run = launch or metal.paged_attention_decode
    if kv_cache_dtype != "auto":
        from support.quantized_cases import quantize_case

        quantized = quantize_case(case, kv_cache_dtype)
        case = quantized.base
        case = type(case)(quantized.q, quantized.k_codes, quantized.v_codes, case.block_tables,
                          case.context_lens, None, case.scale, case.valid)
        run = functools.partial(launch or metal.paged_attention_decode, **quantized.kernel_kwargs())
    old = metal.DECODE_PARTITION_SIZE
    try:
        metal.DECODE_PARTITION_SIZE = partition_size if partition_size else None
        if partition_size == 0:
            metal.DECODE_PARTITION_SIZE = 1 << 30
        with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("serial",)), mh.record_costs() as costs:
            run(case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, case.scale)
    finally:
        metal.DECODE_PARTITION_SIZE = old
    tokens = sum(context_lens)
    kv_bytes = 2 * head_dim * dtype.size
    bytes_read = sum(c.device_bytes_read for c in costs)
    return DecodeCost(
        simd_ops_per_token_per_head=sum(c.simd_ops for c in costs) / (tokens * num_heads),
        read_ratio=bytes_read / (tokens * num_kv_heads * kv_bytes),
        threadgroup_barriers=sum(c.threadgroup_barriers for c in costs),
        launches=len(costs),
        bytes_read=bytes_read,
        bytes_per_token_per_kv_head=bytes_read / (tokens * num_kv_heads),
    )
