"""Step profile: host time to build one decode step, its graph size, and the whole step, against mlx-lm.

Usage::

    python benchmarks/profile_step.py --model ../shared/models/stories260K --concurrency 1,8,32

For N sequences that have each prefilled ``--prompt-tokens`` tokens, one greedy decode
step is built and evaluated ``--steps`` times per side:

- mlx_ferrum: ``LlmExecutor.forward`` (metadata, input ids, the lazy model call) plus the
  batched on-device sampler, for the paged layout (its decode pass one ``mx.compile``'d
  step), the paged layout with ``enforce_eager`` (the same pass op by op) and the
  contiguous layout;
- mlx-lm: its model called on ``[N, 1]`` tokens with ``make_prompt_cache`` caches (all
  prompts have the same length, so one plain batched ``KVCache`` serves them) and an argmax.

Printed per side (medians over the steps): ``build us`` is the host time from the step's
inputs to the lazy sampled tokens (nothing evaluated), ``step ms`` adds the ``mx.eval`` of
the tokens and the cache; ``graph ops`` is the number of nodes of the step's graph, counted
in the DOT text ``mx.export_to_dot`` writes. The build time is what the pipelined engine
hides behind the previous step's device work; the op count is what each step costs the
device's scheduler. A last table shows how long ``mx.async_eval`` itself blocks on this
backend (chains of matmuls), which bounds what pipelining can hide.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import print_header, print_table  # noqa: E402


def count_ops(*arrays: mx.array) -> int:
    """Primitive nodes of the graph that produces ``arrays`` (from ``mx.export_to_dot``)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.dot")
        mx.export_to_dot(path, *arrays)
        text = Path(path).read_text()
    # primitives are drawn as rectangles; arrays (inputs, constants) as ovals
    return len(re.findall(r"shape=rectangle", text))


def profile_ferrum(model, layout: str, n: int, prompt_tokens: int, steps: int, prompts, eager: bool = False) -> list:
    import mlx_ferrum as mf
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.engine.sampling import SamplerState, SamplingParams, sample
    from mlx_ferrum.executor import SeqWork

    cfg = RuntimeConfig(kv_layout=layout, block_size=16, max_num_blocks=n * (-(-(prompt_tokens + steps + 8) // 16)) + 8,
                        enforce_eager=eager)
    ex = mf.LlmExecutor(model, cfg)
    ids = [f"p{i}" for i in range(n)]
    ex.run([SeqWork(c, p) for c, p in zip(ids, prompts)])
    states = [SamplerState.create(SamplingParams(temperature=0.0)) for _ in ids]
    tokens = mx.zeros((n,), dtype=mx.int32)
    mx.eval(tokens)
    build, total, ops = [], [], 0
    for s in range(steps):
        t0 = time.perf_counter()
        work = [SeqWork(c, [0], prev_row=i) for i, c in enumerate(ids)]
        logits, state = ex.forward(work, tokens)
        tokens = sample(logits, states, record=False).tokens
        t1 = time.perf_counter()
        if s == 0:
            ops = count_ops(tokens, *state)
        mx.eval(tokens, state)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        total.append(t2 - t0)
    for c in ids:
        ex.release_cache(c)
    name = f"mlx_ferrum {layout}" + (" (enforce_eager)" if eager and layout == "paged" else "")
    return [name, n, f"{statistics.median(build) * 1e6:.0f}", f"{statistics.median(total) * 1e3:.2f}", ops]


def profile_mlx_lm(lm, n: int, steps: int, prompts) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm)
    logits = lm(mx.array(prompts, dtype=mx.int32), cache=cache)
    tokens = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tokens, [a for c in cache for a in c.state if isinstance(a, mx.array)])
    build, total, ops = [], [], 0
    for s in range(steps):
        t0 = time.perf_counter()
        logits = lm(tokens[:, None], cache=cache)
        tokens = mx.argmax(logits[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        state = [a for c in cache for a in c.state if isinstance(a, mx.array)]
        if s == 0:
            ops = count_ops(tokens, *state)
        mx.eval(tokens, state)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        total.append(t2 - t0)
    return ["mlx-lm", n, f"{statistics.median(build) * 1e6:.0f}", f"{statistics.median(total) * 1e3:.2f}", ops]


def async_eval_overlap(lengths=(5, 50)) -> list:
    """How long ``mx.async_eval`` blocks: for chains of ``n`` 256x256 matmul+tanh ops, the
    time until ``async_eval`` returns and until the result is ready (ms). Where it returns
    only near the end, the host cannot build the next step while this one runs."""
    x = mx.random.normal((256, 256))
    mx.eval(x)
    rows = []
    for n in lengths:
        y = x
        for _ in range(n):
            y = mx.tanh((y @ x) * 0.01)
        t0 = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        rows.append([n, f"{(t1 - t0) * 1e3:.1f}", f"{(t2 - t0) * 1e3:.1f}"])
    return rows


def main(argv=None) -> int:
    """Print the profile table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    import mlx_ferrum as mf
    from mlx_ferrum.cli import bench
    from mlx_ferrum.runner import model_dtype
    import mlx_lm_side

    print_header("step profile: host build time, graph ops and step time per decode step",
                 {"model": args.model, "prompt_tokens": args.prompt_tokens, "steps": args.steps})
    model, _ = mf.load(args.model)
    lm = mlx_lm_side.load_mlx_lm_model(args.model, model_dtype(model))
    rows = []
    for n in [int(x) for x in args.concurrency.split(",")]:
        prompts = bench.make_prompts(model.args.vocab_size, n, args.prompt_tokens, 0)
        rows.append(profile_mlx_lm(lm, n, args.steps, prompts))
        rows.append(profile_ferrum(model, "paged", n, args.prompt_tokens, args.steps, prompts))
        rows.append(profile_ferrum(model, "paged", n, args.prompt_tokens, args.steps, prompts, eager=True))
        rows.append(profile_ferrum(model, "contiguous", n, args.prompt_tokens, args.steps, prompts))
    print_table(["side", "sequences", "build us", "step ms", "graph ops"], rows)
    print()
    print_table(["chain ops", "async_eval returned after ms", "result ready after ms"], async_eval_overlap())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
