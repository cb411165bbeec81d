"""Decode kernel costs in the harness's cost model: the kernel before the GQA-packed rewrite vs now.

Usage::

    python benchmarks/kernel_costs.py           # the table of docs/kernels.md
    python benchmarks/kernel_costs.py --quick   # one shape
    python benchmarks/kernel_costs.py --kv-cache-dtype   # fp16 vs int8 vs int4 KV (the quantized table)

Machine-independent (counted, not timed; see tests/support/kernel_costs.py):
simdgroup-wide operations per KV token per query head, device bytes read per KV token
per KV head over the K+V bytes of one KV head, threadgroup barriers per call. "before"
is the decode kernel as it was before the GQA-packed rewrite (``benchmarks/legacy_paged_attention_decode.metal``,
one threadgroup per query head, run in one pass); "after" is ``metal_kernels/`` in one
pass and with split-K chosen by the occupancy policy (10 GPU cores assumed off a Mac),
reduce kernel included. With ``--kv-cache-dtype``: the decode kernel over fp16, int8 and
int4 (rotated keys) pools of the same problem, bytes read per KV token per KV head (codes,
scales and biases included) and their ratio to fp16. Needs clang-19 (the Metal harness).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU harness (tests/support), dev only

from mlx_ferrum.kernels import metal  # noqa: E402
from support import metal_harness as mh  # noqa: E402
from support.kernel_costs import measure_decode  # noqa: E402

LEGACY = Path(__file__).resolve().parent / "legacy_paged_attention_decode.metal"


def legacy_decode(q, k_pool, v_pool, block_tables, context_lens, scale):
    """The pre-issue-9 decode kernel in one pass (its launch geometry: a threadgroup per query head)."""
    src = metal.parse_kernel_file("legacy_decode", LEGACY, LEGACY.read_text())
    kernel = mh.metal_kernel("legacy_decode", ["q", "k_pool", "v_pool", "block_tables", "context_lens", "params",
                                               "scale"], ["out", "max_logits", "exp_sums"], src.body, src.header)
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pool.shape
    # Its one-pass launch leaves the 1-element statistics outputs unwritten.
    with mh.options(check_writes=False):
        return _legacy_launch(kernel, q, k_pool, v_pool, block_tables, context_lens, scale)


def _legacy_launch(kernel, q, k_pool, v_pool, block_tables, context_lens, scale):
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pool.shape
    return kernel(
        inputs=[q, k_pool, v_pool, metal._pad(block_tables), metal._pad(context_lens),
                metal._params(num_heads, num_kv_heads, block_tables.shape[1], 1), mx.array(scale, dtype=mx.float32)],
        template=[("T", q.dtype), ("OutT", q.dtype), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size),
                  ("NUM_SIMD", 4), ("PARTITION_SIZE", 0)],
        grid=(num_heads * 128, num_seqs, 1), threadgroup=(128, 1, 1),
        output_shapes=[q.shape, (1,), (1,)], output_dtypes=[q.dtype, mx.float32, mx.float32],
    )[0]


SHAPES = [
    # name, num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype
    ("head_dim 128, GQA 4, fp16, 1024 tokens (reviewed shape)", 16, 4, 128, 16, [1024], mx.float16),
    ("Llama-3-8B heads (32/8), fp16, 2 seqs x 1024", 32, 8, 128, 16, [1024, 1024], mx.float16),
    ("head_dim 64, GQA 8, bf16, 1024 tokens", 32, 4, 64, 16, [1024], mx.bfloat16),
    ("head_dim 64, no GQA, fp32, 1024 tokens", 8, 8, 64, 32, [1024], mx.float32),
    ("stories260K (8/4, head_dim 8), fp32, 256 tokens", 8, 4, 8, 16, [256], mx.float32),
]


QUANTIZED_SHAPES = [
    # name, num_heads, num_kv_heads, head_dim, block_size, context_lens, partition_size (0: one pass, None: policy)
    ("head_dim 128, GQA 4, 1024 tokens", 16, 4, 128, 16, [1024], 0),
    ("the same, split-K by occupancy (+ reduce)", 16, 4, 128, 16, [1024], None),
    ("Qwen2.5-0.5B heads (14/2, head_dim 64), 1024 tokens", 14, 2, 64, 16, [1024], 0),
    ("Llama-3-8B heads (32/8, head_dim 128), 2 x 1024", 32, 8, 128, 16, [1024, 1024], 0),
    ("head_dim 80 (groups of 16), GQA 4, 1024 tokens", 16, 4, 80, 16, [1024], 0),
    ("stories260K (8/4, head_dim 8), 256 tokens", 8, 4, 8, 16, [256], 0),
]


def quantized_table() -> None:
    """The decode kernel's bytes read per KV token over fp16, int8 and int4 pools."""
    print("| shape | kv_cache_dtype | bytes read / KV token / KV head | ratio to fp16 | "
          "simd ops / KV token / query head | threadgroup barriers |")
    print("|---|---|---|---|---|---|")
    for name, h, kvh, d, bs, ctxs, psize in QUANTIZED_SHAPES:
        fp16 = None
        for kv in ("auto", "int8", "int4"):
            c = measure_decode(h, kvh, d, bs, ctxs, mx.float16, partition_size=psize, kv_cache_dtype=kv)
            fp16 = fp16 or c.bytes_per_token_per_kv_head
            label = "fp16 (auto)" if kv == "auto" else kv
            print(f"| {name} | {label} | {c.bytes_per_token_per_kv_head:.2f} | "
                  f"{c.bytes_per_token_per_kv_head / fp16:.3f} | {c.simd_ops_per_token_per_head:.3f} | "
                  f"{c.threadgroup_barriers} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    ap.add_argument("--kv-cache-dtype", action="store_true", help="the fp16 / int8 / int4 KV table")
    args = ap.parse_args()
    if not mh.clang_available():
        sys.exit("clang++-19 is needed (apt-get install -y clang-19)")
    if args.kv_cache_dtype:
        quantized_table()
        return
    shapes = SHAPES[:1] if args.quick else SHAPES
    print("| shape | kernel | simd ops / KV token / query head | bytes read / (K+V bytes) per KV token per KV head | threadgroup barriers | launches |")
    print("|---|---|---|---|---|---|")
    for name, h, kvh, d, bs, ctxs, dtype in shapes:
        rows = [
            ("before (one pass)", measure_decode(h, kvh, d, bs, ctxs, dtype, partition_size=0, launch=legacy_decode)),
            ("after (one pass)", measure_decode(h, kvh, d, bs, ctxs, dtype, partition_size=0)),
            ("after (split-K by occupancy)", measure_decode(h, kvh, d, bs, ctxs, dtype)),
        ]
        for label, c in rows:
            print(f"| {name} | {label} | {c.simd_ops_per_token_per_head:.3f} | {c.read_ratio:.3f} | "
                  f"{c.threadgroup_barriers} | {c.launches} |")


if __name__ == "__main__":
    main()
