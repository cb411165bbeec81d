"""Tensor and pipeline parallelism on ONE machine: 2 ranks over loopback vs one process
with the same total threads.

Usage::

    python benchmarks/bench_parallel.py                 # stories260K and a 4-layer Qwen2.5-0.5B-shaped model
    python benchmarks/bench_parallel.py --quick         # stories260K only, requests 1,8
    python benchmarks/bench_parallel.py --model PATH --concurrency 1,8,32

What is measured: ``mlx-ferrum bench`` (see :mod:`mlx_ferrum.cli.bench`: N simultaneous
greedy requests of ``--prompt-tokens`` random ids, ``--max-tokens`` each, EOS ignored;
steady-state decode tok/s, TTFT, inter-token latency), run three ways:

- ``1 process``: one process, ``OPENBLAS_NUM_THREADS=2``;
- ``TP=2``: ``mlx.launch --backend ring -n 2 --hosts 127.0.0.1``, ``--tensor-parallel-size 2``,
  ``OPENBLAS_NUM_THREADS=1`` per rank (2 threads in all);
- ``PP=2``: the same launch with ``--pipeline-parallel-size 2`` (each engine step split into
  2 micro-batches in flight, the default ``FERRUM_PIPELINE_MICRO_BATCHES=2``);
- ``PP=2 mb=1``: the same with ``FERRUM_PIPELINE_MICRO_BATCHES=1`` (one pass at a time: the
  stages never overlap).

This says what the parallel machinery costs (two ``all_sum`` per layer and one
broadcast per engine step over TCP loopback, processes competing for the same cores),
not what it gains: on one machine there is nothing to gain, since both ranks share the
cores and the memory bandwidth. The speedup on a real multi-Mac cluster (Thunderbolt
ring or JACCL over RDMA) depends on the link and the model and is for users to
measure there with the same script's launch lines (README "Multiple Macs").

The MLX CPU backend runs the ring's collectives on the host; OpenBLAS is preloaded
(``LD_PRELOAD``) for every run when Debian's ``libopenblas0-pthread`` is installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OPENBLAS_PATH, QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, scaled_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STORIES = Path(os.environ.get("FERRUM_SHARED_MODELS", ROOT.parent / "shared" / "models")) / "stories260K"


#: the runs, in table order
MODES = ("1 process", "TP=2", "PP=2 mb=1", "PP=2")


def _launcher() -> str:
    local = Path(sys.executable).with_name("mlx.launch")
    return str(local) if local.exists() else "mlx.launch"


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    if Path(OPENBLAS_PATH).exists():
        env["LD_PRELOAD"] = OPENBLAS_PATH
    return env


def run(model: str, mode: str, concurrency: str, prompt_tokens: int, max_tokens: int) -> list[dict]:
    """One ``mlx-ferrum bench`` run; its table rows as dicts (column -> text)."""
    bench = [sys.executable, "-m", "mlx_ferrum", "bench", "--model", model, "--concurrency", concurrency,
             "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens)]
    if mode == "1 process":
        cmd, env = bench, _env(2)
    else:
        flag = "--tensor-parallel-size" if mode == "TP=2" else "--pipeline-parallel-size"
        cmd = [_launcher(), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--", *bench, flag, "2"]
        env = _env(1)
        if mode.startswith("PP=2"):
            env["FERRUM_PIPELINE_MICRO_BATCHES"] = "1" if mode == "PP=2 mb=1" else "2"
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=1800)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    if proc.returncode != 0 or len(rows) < 3:
        raise SystemExit(f"{mode} run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    headers = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(headers, (c.strip() for c in row.strip("|").split("|")))) for row in rows[2:]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: stories260K and a 4-layer Qwen2.5 shape)")
    ap.add_argument("--quick", action="store_true", help="stories260K only, requests 1,8")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated runs among {', '.join(MODES)} (the first is the baseline of 'vs')")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; use among {', '.join(MODES)}")
    if args.model:
        models = [args.model]
    else:
        models = [str(STORIES)]
        if not args.quick:
            cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=4, vocab_size=32000)
            models.append(str(cached_random_checkpoint("qwen2.5-0.5b-4layers-v32k", cfg, "float32")))
    print_header("bench_parallel: 2 ranks on loopback (ring) vs one process, same total threads (2)",
                 {"runs' OpenBLAS": f"LD_PRELOAD={OPENBLAS_PATH}" if Path(OPENBLAS_PATH).exists() else "not installed",
                  "runs' threads": "OPENBLAS_NUM_THREADS=2 (1 process), =1 per rank (TP=2, PP=2)",
                  "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens})
    print()
    print(f"| model | concurrency | run | decode tok/s | vs {modes[0]} | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        name = Path(model).name
        results = {mode: run(model, mode, args.concurrency, args.prompt_tokens, args.max_tokens) for mode in modes}
        for i, base in enumerate(results[modes[0]]):
            for mode, rows in results.items():
                row = rows[i]
                ratio = float(row["decode tok/s"]) / float(base["decode tok/s"])
                print(f"| {name} | {row['concurrency']} | {mode} | {row['decode tok/s']} | {ratio:.2f}x | "
                      f"{row['TTFT p50 ms']} | {row['ITL p50 ms']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
