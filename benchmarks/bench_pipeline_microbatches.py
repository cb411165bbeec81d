"""Pipeline parallelism with and without micro-batches in flight: 2 ranks on loopback.

Usage::

    python benchmarks/bench_pipeline_microbatches.py              # 4-layer Qwen2.5-0.5B shape
    python benchmarks/bench_pipeline_microbatches.py --repeats 9 --requests 8 --prompt-tokens 128

What is measured: one ``mlx.launch --backend ring -n 2 --hosts 127.0.0.1`` run with
``--pipeline-parallel-size 2`` semantics (each rank one stage, ``OPENBLAS_NUM_THREADS=1``
per rank). For each repeat, and for each setting in turn (interleaved, so both see the
same background load), a fresh lockstep engine runs ``--requests`` greedy requests of
``--prompt-tokens`` random ids (new ids every time: no prefix-cache hits):

- ``prefill``: ``max_tokens=1``: the wall time of the step that runs every prompt (the
  batch's time to first token), where micro-batches can overlap the stages;
- ``decode``: prompts of 4 tokens and ``--decode-tokens`` generated tokens each: the wall
  time per engine step (decode steps of ``--requests`` rows; the short prefill is included).

Settings: ``mb=1`` (one pass per step: the stages take turns), ``mb=2`` (the default: 2
micro-batches of at least 32 tokens, so decode steps of a few sequences stay whole),
``mb=2 split decode`` (the 32-token floor lowered to 1, so decode steps split too: what
the floor avoids). Reported: the minimum and the median over the repeats (the minimum
is the least disturbed by other jobs on a shared machine).

On one 2-core machine the two stages do get two cores, so overlap can show; on a real
multi-Mac pipeline each stage has its own machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent

#: setting -> (pipeline_micro_batches, micro_batch_min_tokens or None for the default)
SETTINGS = {"mb=1": (1, None), "mb=2": (2, None), "mb=2 split decode": (2, 1)}


def rank_main(spec: dict) -> None:
    """One rank: the interleaved repeats; rank 0 writes the timings to ``spec['out']``."""
    import numpy as np

    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.distributed import init_group, load_sharded
    from mlx_ferrum.distributed.lockstep import LockstepEngine
    from mlx_ferrum.distributed.pipeline import MICRO_BATCH_MIN_TOKENS
    from mlx_ferrum.engine.sampling import SamplingParams

    group = init_group(RuntimeConfig(pipeline_parallel_size=2, tensor_parallel_size=1, distributed_backend="ring"))
    model, _ = load_sharded(spec["model"], group)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    times: dict = {name: {"prefill": [], "decode": []} for name in SETTINGS}
    n, p, d = spec["requests"], spec["prompt_tokens"], spec["decode_tokens"]
    for repeat in range(spec["repeats"] + 1):  # the first round warms up and is not recorded
        for name, (micro_batches, floor) in SETTINGS.items():
            for kind, length, max_tokens in (("prefill", p, 1), ("decode", 4, d)):
                blocks = n * (-(-(p + d + 1) // 16)) + 8
                config = RuntimeConfig(kv_layout="paged", max_num_seqs=n, max_num_blocks=blocks,
                                       pipeline_parallel_size=2, tensor_parallel_size=1,
                                       pipeline_micro_batches=micro_batches)
                engine = LockstepEngine(model, None, config, group, heartbeat_s=0)
                model.pipeline_stage.micro_batch_min_tokens = floor or MICRO_BATCH_MIN_TOKENS
                prompts = [[int(t) for t in rng.integers(3, vocab, length)] for _ in range(n)]
                if group.is_driver:
                    start = time.perf_counter()
                    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                    elapsed = time.perf_counter() - start
                    engine.close()
                    if repeat:
                        times[name][kind].append(elapsed)
                else:
                    engine.follow()
    if group.is_driver:
        Path(spec["out"]).write_text(json.dumps(times))
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    from common import OPENBLAS_PATH, QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, scaled_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a 4-layer Qwen2.5-0.5B shape)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = args.model or str(cached_random_checkpoint(
        "qwen2.5-0.5b-4layers-v32k", scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=4, vocab_size=32000),
        "float32"))
    print_header("bench_pipeline_microbatches: PP=2 on loopback (ring), with and without micro-batches",
                 {"model": model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                  "decode_tokens": args.decode_tokens, "repeats": args.repeats,
                  "runs' threads": "OPENBLAS_NUM_THREADS=1 per rank"})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                                    "decode_tokens": args.decode_tokens, "repeats": args.repeats, "out": str(out)}))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if Path(OPENBLAS_PATH).exists():
            env["LD_PRELOAD"] = OPENBLAS_PATH
        launcher = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launcher) if launcher.exists() else "mlx.launch", "--backend", "ring", "-n", "2", "--hosts",
               "127.0.0.1", "--", sys.executable, str(Path(__file__).resolve()), "--rank", str(spec)]
        proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=3600)
        if not out.exists():
            raise SystemExit(f"the run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        times = json.loads(out.read_text())
    print()
    print("| setting | prefill of the batch, min ms | median ms | decode ms per step, min | median |")
    print("|---|---|---|---|---|")
    for name in SETTINGS:
        pre = times[name]["prefill"]
        dec = [total / args.decode_tokens * 1000 for total in times[name]["decode"]]
        print(f"| {name} | {min(pre) * 1000:.0f} | {statistics.median(pre) * 1000:.0f} | {min(dec):.1f} | "
              f"{statistics.median(dec):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(json.loads(Path(sys.argv[2]).read_text()))
    sys.exit(main())
