"""Does the order in which two models are loaded into one process change their speed?

Why: in one process, the benchmarks load mlx_ferrum's model and mlx-lm's side by side, and
on this machine's CPU backend the model loaded second has decoded faster (by a few per cent
to 40 %), which moves every single-process ratio. This script measures the effect apart
from either runtime's loop: for each load order (each in a fresh process) it evaluates one
decode step of each model, graph already built, so only the arithmetic over the weights is
timed; with ``--swap`` it also gives mlx-lm's model mlx_ferrum's weight arrays, to tell
the weights from the code.

Run: ``python benchmarks/bench_load_order.py --model /tmp/smollm2-f32`` (add
``--context 1000`` for a long context, ``--swap`` for the weight swap). Prints, per load
order, the median milliseconds of one evaluated decode step for each side (min-max over
the rounds), the sides alternating within each round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_header  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (e.g. the float32 copy of SmolLM2)")
    ap.add_argument("--context", type=int, default=16, help="tokens of context before the timed steps (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per side per round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, sides alternating (default: %(default)s)")
    ap.add_argument("--swap", action="store_true", help="also time mlx-lm's model on mlx_ferrum's weight arrays")
    ap.add_argument("--child", choices=["ferrum", "mlx-lm"], help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def child(args) -> dict:
    """One process: load in the order ``args.child`` names first, time both sides."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as lm_load_model

    import mlx_ferrum as mf
    from mlx_ferrum.api import executor_for
    from mlx_ferrum.executor import PrefillInput
    from mlx_ferrum.runner.llm_runner import SeqWork

    path = Path(args.model)

    def load_lm():
        lm, _ = lm_load_model(path)
        mx.eval(lm.parameters())
        return lm

    if args.child == "mlx-lm":
        lm = load_lm()
        model, _ = mf.load(str(path))
    else:
        model, _ = mf.load(str(path))
        lm = load_lm()
    vocab = model.args.vocab_size
    prompt = [random.Random(0).randrange(3, vocab) for _ in range(args.context)]
    executor = executor_for(model, mf.RuntimeConfig(kv_layout="contiguous"))
    cache_id = executor.prefill(PrefillInput(input_ids=mx.array([prompt], dtype=mx.int32))).kv_cache.cache_id
    runner = executor.runner

    def lm_side(lm_model):
        cache = make_prompt_cache(lm_model)
        mx.eval(lm_model(mx.array([prompt]), cache=cache))

        def step() -> float:
            y = lm_model(mx.array([[5]]), cache=cache)
            t = time.perf_counter()
            mx.eval(y, [c.state for c in cache])
            return time.perf_counter() - t
        return step

    def ferrum_step() -> float:
        logits, state, _undo = runner._build([SeqWork(cache_id, [5])], None, None)
        t = time.perf_counter()
        mx.eval(logits, state)
        return time.perf_counter() - t

    sides = {"mlx_ferrum": ferrum_step, "mlx-lm": lm_side(lm)}
    if args.swap:
        swapped = lm_load_model(path)[0]
        swapped.update(model.parameters())  # the same arrays mlx_ferrum multiplies by
        mx.eval(swapped.parameters())
        sides["mlx-lm on mlx_ferrum's weights"] = lm_side(swapped)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(1e3 * statistics.fmean(sides[name]() for _ in range(args.steps)))
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print_header("bench_load_order: one evaluated decode step per side, by load order",
                 {"model": args.model, "context": args.context, "steps x rounds": f"{args.steps} x {args.rounds}"})
    print()
    print("| loaded first | side | ms per step, median (min-max) |")
    print("|---|---|---|")
    for first in ("ferrum", "mlx-lm"):
        cmd = [sys.executable, __file__, "--model", args.model, "--context", str(args.context), "--steps",
               str(args.steps), "--rounds", str(args.rounds), "--child", first] + (["--swap"] if args.swap else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        for name, values in json.loads(out).items():
            print(f"| {first} | {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")


if __name__ == "__main__":
    main()
