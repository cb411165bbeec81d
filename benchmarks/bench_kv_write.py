"""Does a decode-step KV write cost the same for a small and a huge paged pool?

Usage::

    python benchmarks/bench_kv_write.py            # 256 MiB vs 4 GiB pools
    python benchmarks/bench_kv_write.py --quick    # fewer steps (< 60 s)

``PagedKvPool.write`` stores one token per sequence through an MLX indexed update
(``pool[blocks, heads, offsets] = k``). MLX's scatter starts by copying its input into
its output, and skips the copy (reuses, "donates", the input buffer) only when
nothing else holds that buffer. So with exactly one live reference per pool a write
costs O(tokens written); with any other holder it costs O(pool size).

Scenarios, each timed at both pool sizes (median µs per step; a write step is one
K and one V write in every layer followed by ``mx.eval`` of the pools):

1. ``pool only``: the executor's pattern: write, evaluate; nothing else holds the pool.
2. ``+ view held``: a slice of each pool (``pool[:1]``, a view sharing its buffer) is
   alive across the write, as a stray reference would be.
3. ``+ pending read of old pool``: a gather of each pool built before the write and
   evaluated after it, as any unevaluated graph that still needs the old pool would be.
   (Evaluated in the same ``mx.eval`` as the write, the outcome depends on the order
   MLX schedules the nodes: a copy whenever the scatter runs before the read; in our
   runs that was every write with 1-4 layers and some writes with 8.)
4. ``copy_blocks (COW, 1 block)``: ``PagedKvPool.copy_blocks([(src, dst)])``, the
   copy-on-write of a forked sequence's shared partial block, then ``mx.eval``.
   ``pool[dst] = pool[src]`` makes the scatter's update a gather of the very array it
   overwrites, so the old pool is still referenced when the scatter runs.
5. ``copy_blocks, gather evaluated first``: the same copy done as
   ``g = pool[src]; mx.eval(g); pool[dst] = g`` (the fix).
6. ``executor decode``: one real ``LlmExecutor.batch_decode`` step of a small random
   model with the paged layout, the pool sized to the same totals.
7. ``executor decode after fork``: ``fork_cache`` of a 3-token sequence, then one
   ``decode`` of the fork (which triggers scenario 4 inside the executor).

The pool shape copies Qwen2.5-0.5B (24 layers, 2 KV heads, head_dim 64, bf16,
block 16) with the block count chosen so that all K+V pools total the target size.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import QWEN25_05B_CONFIG, cached_random_checkpoint, fmt_bytes, print_header, print_table, scaled_config  # noqa: E402

MiB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", default=None, help="total pool sizes in MiB, comma separated (default 256,4096; quick 64,1024)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=32, help="sequences (tokens written) per decode step")
    ap.add_argument("--steps", type=int, default=60, help="timed steps of the flat scenarios")
    ap.add_argument("--copy-steps", type=int, default=4, help="timed steps of the copying scenarios")
    ap.add_argument("--quick", action="store_true", help="fewer steps (CI smoke test)")
    ap.add_argument("--json", help="also write the results to this json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.copy_steps = 15, 2
    if args.sizes_mib is None:
        args.sizes_mib = "64,1024" if args.quick else "256,4096"
    return args


def _free() -> None:
    gc.collect()
    mx.clear_cache()


def _step_inputs(pool, seqs: int, rng: random.Random):
    nb, kvh, bs, d = pool.shape
    slots = mx.array(rng.sample(range(nb * bs), seqs), dtype=mx.int32)
    k = mx.random.normal((seqs, kvh, d)).astype(pool.dtype)
    v = mx.random.normal((seqs, kvh, d)).astype(pool.dtype)
    mx.eval(slots, k, v)
    return slots, k, v


def time_writes(pool, scenario: str, steps: int, seqs: int) -> float:
    """Median seconds of one decode step's writes (every layer, K and V, then ``mx.eval``)."""
    rng = random.Random(0)
    inputs = [_step_inputs(pool, seqs, rng) for _ in range(4)]
    times = []
    for i in range(steps + 1):  # the first step warms up
        slots, k, v = inputs[i % len(inputs)]
        held = []
        t0 = time.perf_counter()
        if scenario == "view":
            held = [p[:1] for p in pool.k] + [p[:1] for p in pool.v]
        elif scenario == "pending_read":
            held = [p[slots // pool.block_size] for p in pool.k] + [p[slots // pool.block_size] for p in pool.v]
        for layer in range(len(pool.k)):
            pool.write(layer, slots, k, v)
        mx.eval(pool.k, pool.v)
        mx.eval(held)
        dt = time.perf_counter() - t0
        del held
        if i:
            times.append(dt)
    return statistics.median(times)


def time_copy_blocks(pool, fixed: bool, steps: int) -> float:
    """Median seconds of a one-block copy-on-write in every layer, then ``mx.eval``.

    ``fixed``: evaluate the gathered source blocks before the scatter, so the scatter's
    input pool has no other reference and MLX can reuse its buffer.
    """
    times = []
    for i in range(steps + 1):
        src = mx.array([i % 8], dtype=mx.int32)
        dst = mx.array([8 + i % 8], dtype=mx.int32)
        mx.eval(src, dst)
        t0 = time.perf_counter()
        if fixed:
            gathered = [p[src] for p in pool.k + pool.v]
            mx.eval(gathered)
            for p, g in zip(pool.k + pool.v, gathered):
                p[dst] = g
            del gathered
        else:
            pool.copy_blocks([(i % 8, 8 + i % 8)])
        mx.eval(pool.k, pool.v)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_executor_decode(
    total_bytes: int, steps: int, seqs: int, block_size: int, fork_steps: int
) -> tuple[float, float, int]:
    """Median seconds of one paged ``batch_decode`` of ``seqs`` sequences, of one decode of a
    freshly forked sequence, and the pool bytes."""
    import mlx_ferrum as mf
    from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
    from mlx_ferrum.models.loader import load_model

    cfg = scaled_config(
        QWEN25_05B_CONFIG, hidden_size=128, num_attention_heads=2, intermediate_size=256, vocab_size=512,
        num_hidden_layers=24, max_position_embeddings=4096,
    )
    path = cached_random_checkpoint("kvwrite-tiny", cfg, "bfloat16")
    model, _, _ = load_model(str(path))
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * block_size * 64 * 2
    ex = LlmExecutor(model, mf.RuntimeConfig(kv_layout="paged", block_size=block_size, max_num_blocks=total_bytes // per_block))
    handles = [ex.prefill(PrefillInput(input_ids=mx.array([[1 + i, 2, 3]], dtype=mx.int32))).kv_cache for i in range(seqs)]
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        outs = ex.batch_decode([DecodeInput(input_ids=mx.array([[7]], dtype=mx.int32), kv_cache=h) for h in handles])
        dt = time.perf_counter() - t0
        handles = [o.kv_cache for o in outs]
        if i:
            times.append(dt)
    fork_times = []
    base = handles[0]
    for i in range(fork_steps + 1):
        f = ex.fork_cache(base)
        t0 = time.perf_counter()
        ex.decode(DecodeInput(input_ids=mx.array([[7]], dtype=mx.int32), kv_cache=f))
        dt = time.perf_counter() - t0
        ex.release_cache(f.cache_id)
        if i:
            fork_times.append(dt)
    nbytes = ex.pool.nbytes
    ex.shutdown()
    del ex, model, outs
    _free()
    return statistics.median(times), statistics.median(fork_times), nbytes


def main(argv=None) -> dict:
    """Run every scenario at every size; print a table of µs per step and the size ratios."""
    args = parse_args(argv)
    from mlx_ferrum.kv_cache import PagedKvPool

    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    info = print_header(
        "bench_kv_write: cost of a decode-step write into the paged KV pool vs pool size",
        {
            "pool shape": f"{args.layers} layers x K,V x [blocks, {args.kv_heads}, {args.block_size}, {args.head_dim}] bf16",
            "per step": f"{args.seqs} tokens written per layer (K and V), then mx.eval",
            "sizes": ", ".join(fmt_bytes(s) for s in sizes),
        },
    )
    scenarios = [("pool only", "plain", args.steps), ("+ view held", "view", args.copy_steps),
                 ("+ pending read of old pool", "pending_read", args.copy_steps)]
    res: dict[str, dict[int, float]] = {name: {} for name, _, _ in scenarios}
    res["copy_blocks (COW, 1 block)"] = {}
    res["copy_blocks, gather evaluated first"] = {}
    res["executor decode"] = {}
    res["executor decode after fork"] = {}
    block_bytes = args.kv_heads * args.block_size * args.head_dim * 2
    for size in sizes:
        nb = size // (2 * args.layers * block_bytes)
        pool = PagedKvPool(args.layers, nb, args.kv_heads, args.block_size, args.head_dim, mx.bfloat16)
        print(f"   pool {fmt_bytes(pool.nbytes)}: {nb} blocks per layer")
        for name, kind, steps in scenarios:
            res[name][size] = time_writes(pool, kind, steps, args.seqs)
        res["copy_blocks (COW, 1 block)"][size] = time_copy_blocks(pool, False, args.copy_steps)
        res["copy_blocks, gather evaluated first"][size] = time_copy_blocks(pool, True, args.steps)
        del pool
        _free()
        t, tf, _ = time_executor_decode(size, max(5, args.steps // 6), args.seqs, args.block_size, args.copy_steps)
        res["executor decode"][size] = t
        res["executor decode after fork"][size] = tf
    rows = []
    writes = 2 * args.layers
    per_write_rows = {name for name, _, _ in scenarios} | {"copy_blocks (COW, 1 block)", "copy_blocks, gather evaluated first"}
    for name, by_size in res.items():
        us = [by_size[s] * 1e6 for s in sizes]
        per_write = " / ".join(f"{u / writes:.0f}" for u in us) if name in per_write_rows else ""
        rows.append([name, " / ".join(f"{u:.0f}" for u in us), per_write or "-", f"{us[-1] / us[0]:.2f}"])
    print()
    label = " / ".join(fmt_bytes(s) for s in sizes)
    print_table(
        ["scenario", f"µs per step ({label})", f"µs per write ({label})", f"ratio {fmt_bytes(sizes[-1])} / {fmt_bytes(sizes[0])}"],
        rows,
    )
    print(f"   a step = {writes} writes ({args.layers} layers x K,V) of {args.seqs} tokens each (copy_blocks: of one "
          "block each); 'executor decode' rows are whole decode calls of a 24-layer toy model (forward included)")
    out = {"machine": info, "args": vars(args), "seconds_per_step": {k: {str(s): v for s, v in d.items()} for k, d in res.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
