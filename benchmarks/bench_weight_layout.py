"""Projection weight layout on MLX's CPU backend: ``x @ W.T`` (a transposed view of the
``[out, in]`` checkpoint weight, what ``nn.Linear`` and mlx_ferrum's ``Linear`` multiply
by) against ``x @ Wt`` (the same weight copied once into a contiguous ``[in, out]`` array).

Usage::

    python benchmarks/bench_weight_layout.py                 # stories260K and Qwen2.5-0.5B shapes
    python benchmarks/bench_weight_layout.py --rows 1,8,32,64 --repeats 7
    python benchmarks/bench_weight_layout.py --quick             # a smoke run (CI)

Why it exists: with OpenBLAS the two layouts take different kernels (a transposed
operand goes through the packed ``tn`` path, a contiguous one through the small-matrix
``nn`` kernel), so the layout is a real choice for the runner. The figures decide it per
shape: it is kept only if the contiguous copy is faster on the shapes users run, in
particular one row (single-stream decode) on a real model's matrices.

Each shape multiplies a random float32 ``[rows, in]`` input by both layouts, the sides
alternating within each repeat; a figure is the median over ``--repeats`` of the mean
time of ``--calls`` products evaluated together, in microseconds, and the ratio is
``view / contiguous`` (> 1: the contiguous copy is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import QWEN25_05B_CONFIG, print_header, print_table  # noqa: E402

#: stories260K's ``config.json`` (``../shared/models/stories260K``): hidden 64, MLP 172, vocab 512
STORIES_SHAPES = [("stories260K q/o", 64, 64), ("stories260K gate/up", 64, 172),
                  ("stories260K down", 172, 64), ("stories260K head", 64, 512)]


def qwen_shapes() -> list[tuple[str, int, int]]:
    """``(name, in, out)`` of Qwen2.5-0.5B's attention and MLP projections."""
    h, i = QWEN25_05B_CONFIG["hidden_size"], QWEN25_05B_CONFIG["intermediate_size"]
    return [("Qwen2.5-0.5B q/o", h, h), ("Qwen2.5-0.5B gate/up", h, i), ("Qwen2.5-0.5B down", i, h)]


def _mean_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    mx.eval([fn() for _ in range(calls)])
    return (time.perf_counter() - t0) / calls * 1e6


def measure(rows: int, fan_in: int, fan_out: int, repeats: int, calls: int) -> tuple[float, float, list[float]]:
    """Median microseconds of the view and of the contiguous layout, and the per-repeat ratios."""
    x = mx.random.normal((rows, fan_in))
    weight = mx.random.normal((fan_out, fan_in))
    view = weight.T
    contiguous = mx.contiguous(weight.T)
    mx.eval(x, weight, view, contiguous)
    _mean_us(lambda: x @ view, 2)
    _mean_us(lambda: x @ contiguous, 2)
    as_view, as_copy = [], []
    for r in range(repeats):
        sides = [(as_view, view), (as_copy, contiguous)]
        for times, w in (sides if r % 2 == 0 else sides[::-1]):
            times.append(_mean_us(lambda: x @ w, calls))
    return statistics.median(as_view), statistics.median(as_copy), [a / b for a, b in zip(as_view, as_copy)]


def main(argv=None) -> int:
    """Run the benchmark and print a Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32,64", help="input rows (tokens in the step)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=0, help="products per timing (0: by size)")
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8, one repeat, three products per timing")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeats, args.calls = "1,8", 1, 3
    rows_list = [int(r) for r in args.rows.split(",")]
    print_header("weight layout: x @ W.T (view) vs x @ contiguous(W.T), float32",
                 {"rows": rows_list, "repeats": args.repeats})
    table = []
    for name, fan_in, fan_out in STORIES_SHAPES + qwen_shapes():
        for rows in rows_list:
            calls = args.calls or max(3, min(200, int(2e7 // (rows * fan_in * fan_out + 1))))
            view_us, copy_us, ratios = measure(rows, fan_in, fan_out, args.repeats, calls)
            table.append([name, f"{fan_in}->{fan_out}", rows, f"{view_us:.1f}", f"{copy_us:.1f}",
                          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"])
    print()
    print_table(["projection", "shape", "rows", "view us", "contiguous us", "view / contiguous"], table)
    print("\nfigures: median over the repeats; ratios > 1 mean the contiguous [in, out] copy is faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
