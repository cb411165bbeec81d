"""The LoRA product of a batch whose tokens use different adapters: which MLX form is fastest?

Usage::

    python benchmarks/bench_lora_products.py            # Qwen2.5-0.5B projection shapes, decode and prefill sizes
    python benchmarks/bench_lora_products.py --quick    # fewer repeats (smoke test)

Every method computes ``delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]]`` for ``N`` tokens,
with ``A`` ``[S, in, r]`` and ``B`` ``[S, r, out]`` stacked over ``S`` adapter slots
(slot ``S - 1`` all zeros: the tokens without an adapter), fp32 on this machine's
default device:

- ``gather_mm``: two ``mx.gather_mm`` calls with per-token ``rhs_indices`` (Punica's BGMV).
- ``gather_mm_sorted``: tokens sorted by slot on the device (``mx.argsort``), ``gather_mm``
  with ``sorted_indices=True``, then un-permuted (the MoE path of mlx-lm's SwitchGLU).
- ``segmented``: the host knows each slot's tokens (sorted order and segment bounds), one
  dense matmul pair per adapter present, then un-permuted (S-LoRA's SGMV, segment by segment).
- ``take``: ``A[slot]`` and ``B[slot]`` materialised per token, then batched matmuls
  (what per-token ``mx.take`` Punica ports do).

Slots are drawn uniformly from 8 adapters and "none" (so about 1/9 of the tokens have no
adapter). Each figure is the median of ``--repeats`` timed evaluations after 3 warm-ups,
for the 7 projections of one Qwen2.5-0.5B layer (q, k, v, o, gate, up, down).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_ferrum.layers.lora import lora_delta_gather  # noqa: E402

QWEN_05B_PROJECTIONS = {  # (in, out) of one Qwen2.5-0.5B decoder layer
    "q": (896, 896), "k": (896, 128), "v": (896, 128), "o": (896, 896),
    "gate": (896, 4864), "up": (896, 4864), "down": (4864, 896),
}


def lora_delta_segmented(
    x: mx.array, a: mx.array, b: mx.array, order: mx.array, inverse: mx.array,
    segments: Sequence[tuple[int, int, int]],
) -> mx.array:
    """The same product as ``lora_delta_gather``, one dense matmul pair per adapter
    present (S-LoRA's SGMV done segment by segment): the alternative this benchmark
    measured against the gather that the runtime uses.

    Args:
        x: ``[N, in]``; a, b: as for :func:`lora_delta_gather`.
        order: ``[N]`` int32 token order sorted by slot; inverse: its inverse permutation.
        segments: ``(slot, start, stop)`` ranges of ``order`` per adapter present; tokens
            outside every segment get zeros.

    Returns:
        ``[N, out]``.
    """
    xs = x[order]
    out_dim = b.shape[-1]
    parts = []
    done = 0
    for slot, start, stop in segments:
        if start > done:
            parts.append(mx.zeros((start - done, out_dim), dtype=x.dtype))
        parts.append((xs[start:stop] @ a[slot]) @ b[slot])
        done = stop
    if done < x.shape[0]:
        parts.append(mx.zeros((x.shape[0] - done, out_dim), dtype=x.dtype))
    return mx.concatenate(parts, axis=0)[inverse]


def _take(x, a, b, slots):
    return ((x[:, None, :] @ a[slots]) @ b[slots])[:, 0, :]


def _gather_sorted(x, a, b, slots):
    order = mx.argsort(slots)
    inverse = mx.argsort(order)
    xs = x[order][:, None, :]
    ss = slots[order]
    h = mx.gather_mm(xs, a, rhs_indices=ss, sorted_indices=True)
    return mx.gather_mm(h, b, rhs_indices=ss, sorted_indices=True)[:, 0, :][inverse]


def run(tokens: int, rank: int, adapters: int, repeats: int, seed: int = 0) -> dict:
    """Median milliseconds of each method for one layer's 7 projections at ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    host_slots = rng.integers(0, adapters + 1, size=tokens).astype(np.int32)  # adapters == "none"
    slots = mx.array(host_slots)
    layer = []
    for fan_in, fan_out in QWEN_05B_PROJECTIONS.values():
        a = mx.array(rng.standard_normal((adapters + 1, fan_in, rank), dtype=np.float32) * 0.02)
        b = mx.array(rng.standard_normal((adapters + 1, rank, fan_out), dtype=np.float32) * 0.02)
        a[adapters] = 0
        b[adapters] = 0
        x = mx.array(rng.standard_normal((tokens, fan_in), dtype=np.float32))
        layer.append((x, a, b))
    mx.eval(layer)
    order = np.argsort(host_slots, kind="stable").astype(np.int32)
    present, starts = np.unique(host_slots[order], return_index=True)
    bounds = list(zip(present.tolist(), starts.tolist(), list(starts[1:]) + [tokens]))
    bounds = [(s, lo, hi) for s, lo, hi in bounds if s != adapters]  # no work for "none"
    perm = mx.array(order)
    inverse = mx.array(np.argsort(order).astype(np.int32))
    methods = {
        "gather_mm": lambda x, a, b: lora_delta_gather(x, a, b, slots),
        "gather_mm_sorted": lambda x, a, b: _gather_sorted(x, a, b, slots),
        "segmented": lambda x, a, b: lora_delta_segmented(x, a, b, perm, inverse, bounds),
        "take": lambda x, a, b: _take(x, a, b, slots),
    }
    ref = [methods["take"](*p) for p in layer]
    mx.eval(ref)
    out = {}
    for name, fn in methods.items():
        got = [fn(*p) for p in layer]
        mx.eval(got)
        err = max(float(mx.abs(g - r).max()) for g, r in zip(got, ref))
        assert err < 1e-3, f"{name} differs from the reference by {err}"
        times = []
        for i in range(3 + repeats):
            t0 = time.perf_counter()
            mx.eval([fn(*p) for p in layer])
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1000)
        out[name] = statistics.median(times)
    # the base projections' own cost, for scale
    ws = [mx.array(rng.standard_normal((fo, fi), dtype=np.float32) * 0.02) for fi, fo in QWEN_05B_PROJECTIONS.values()]
    mx.eval(ws)
    times = []
    for i in range(3 + repeats):
        t0 = time.perf_counter()
        mx.eval([p[0] @ w.T for p, w in zip(layer, ws)])
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1000)
    out["base_matmuls"] = statistics.median(times)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, two sizes")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [1, 32, 512] if args.quick else [1, 8, 32, 128, 512, 2048]
    repeats = 3 if args.quick else args.repeats
    import os
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
          f"MLX {mx.__version__}, device {mx.default_device()}, openblas mapped: {'openblas' in maps}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, load {os.getloadavg()[0]:.2f}")
    print(f"rank {args.rank}, {args.adapters} adapters + none, one Qwen2.5-0.5B layer (7 projections), ms (median)")
    rows = []
    print("| tokens | gather_mm | gather_mm sorted | segmented | take | base matmuls |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        r = run(n, args.rank, args.adapters, repeats)
        rows.append({"tokens": n, **r})
        print(f"| {n} | {r['gather_mm']:.2f} | {r['gather_mm_sorted']:.2f} | {r['segmented']:.2f} | "
              f"{r['take']:.2f} | {r['base_matmuls']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
