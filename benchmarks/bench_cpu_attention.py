"""Attention on MLX's CPU backend: the softmax's exponential, grouped prefill, the decode step.

Three measurements behind choices in ``mlx_ferrum/kernels`` (each side alternates with
its baseline in the same process, medians over the repeats):

1. ``2 ** x`` per element: ``mx.exp``, ``mx.power(2.0, x)`` and the fused arithmetic of
   ``kernels.reference.exp2`` inside ``mx.compile``, on decode-sized (90 K) scores.
2. A wave of prompt tails: N requests sharing a prefix-cached system prompt (the chat
   workload of ``bench_serving.py``) arrive at once; the step that prefills their
   uncached tails, with the reference prefill's base-2 softmax (the default) against
   ``mx.fast.scaled_dot_product_attention``, which computes ``exp`` on this backend.
3. A decode step of the compiled paged step over 1, 4 and N sequences of C tokens, with
   the fused ``2 ** x`` (forced at every size) against ``mx.power`` (``kernels.reference.fusing``
   made a no-op); the default fuses only scores of at least ``kernels.reference.MIN_FUSED_SIZE``
   elements, and the table says which side it takes at each size.
4. Where an ``Engine.step`` goes at 8 and N requests (32-token prompts, 128 greedy tokens
   each): time blocked in ``mx.async_eval`` (the device working: on the CPU backend it
   returns once at most 10 of the step's tasks are queued), in ``runner.forward`` (the
   pass's metadata and graph) and in the rest (scheduling, sampling setup, output).
5. A compiled decode step over N sequences forked from one C-token sequence (so their
   block tables begin with the same blocks, as behind a cached system prompt): the shared
   blocks read once for all rows (``kernels.reference.plan_shared_prefix``, the default)
   against every row gathering its own blocks.
6. The prefill of one fresh C-token prompt: causal attention in query tiles
   (``kernels.reference.causal_attention_base2``, the default) against one pass over the
   whole square of scores.

Run from the repository root::

    python benchmarks/bench_cpu_attention.py [--requests 32] [--context 340] [--repeats 7] [--sections 1,2,3,4,5,6] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import mlx_ferrum as mf  # noqa: E402
from common import print_header, print_table  # noqa: E402
from mlx_ferrum.kernels import reference  # noqa: E402
from mlx_ferrum.runner.protocol import SeqWork  # noqa: E402
import mlx_ferrum.runner.compiled_decode as compiled_decode  # noqa: E402


def _per_call_ms(fn, repeats: int, calls: int = 50) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def bench_exponential(repeats: int) -> list[list]:
    scores = mx.random.uniform(-30.0, 0.0, (32, 4, 2, 352))
    mx.eval(scores)

    def fused(x):
        with reference.fusing():
            return reference.exp2(x)

    sides = {"mx.exp": mx.compile(mx.exp), "mx.power(2, x)": mx.compile(lambda x: mx.power(2.0, x)),
             "reference.exp2 (fused)": mx.compile(fused)}
    rows = []
    for name, fn in sides.items():
        ms = _per_call_ms(lambda: fn(scores), repeats)
        rows.append([name, scores.size, f"{ms:.3f}", f"{ms * 1e6 / scores.size:.2f}"])
    # the size past which kernels.reference.exp2 falls back to mx.power (MAX_FUSED_SIZE)
    graph = mx.compile(reference._exp2_graph)
    for size in (reference.MAX_FUSED_SIZE, 8 * reference.MAX_FUSED_SIZE):
        x = mx.random.uniform(-30.0, 0.0, (size,))
        mx.eval(x)
        for name, fn in (("fused arithmetic", graph), ("mx.power(2, x)", sides["mx.power(2, x)"])):
            ms = _per_call_ms(lambda: fn(x), repeats, calls=10)
            rows.append([name, size, f"{ms:.3f}", f"{ms * 1e6 / size:.2f}"])
    return rows


def _alternate(default, alternative, repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` timings of each side, the side that runs first alternating."""
    times: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        for side in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            times[side].append((default, alternative)[side]())
    return times


def _chat_prompt(question: str, wave: int) -> str:
    from bench_serving import CHAT_SYSTEM_TEXT
    # the wave number keeps every wave's tails uncached and of the same lengths
    return CHAT_SYSTEM_TEXT + f"\n\nUser: [{wave:04d}] " + question + "\nAssistant:"


def bench_wave(model, tokenizer, requests: int, repeats: int) -> list[list]:
    from bench_serving import chat_questions
    engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged"))
    questions = chat_questions(requests)
    params = mf.SamplingParams(max_tokens=8, temperature=0.0)
    engine.generate([_chat_prompt(q, 9999) for q in questions[:8]], params)  # caches the system prompt
    used = 0

    def wave() -> float:
        nonlocal used
        ids = [engine.add_request(_chat_prompt(q, used), params) for q in questions]
        used += 1
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    def fused_sdpa(q, keys, values, allowed, scale, sinks, visible=0):
        mask = mx.where(allowed, 0.0, float("-inf")).astype(q.dtype)
        extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, **extra)

    wave()
    default = reference._masked_attention_base2
    def fused_wave() -> float:
        reference._masked_attention_base2 = fused_sdpa
        try:
            return wave()
        finally:
            reference._masked_attention_base2 = default

    base2, fused = _alternate(wave, fused_wave, repeats)
    b, f = statistics.median(base2) * 1e3, statistics.median(fused) * 1e3
    ratios = sorted(y / x for x, y in zip(base2, fused))
    return [[f"{requests} tails, base-2 softmax (default)", f"{b:.1f}", ""],
            [f"{requests} tails, mx.fast.scaled_dot_product_attention", f"{f:.1f}",
             f"{f / b:.2f}x slower ({ratios[0]:.2f}-{ratios[-1]:.2f})"]]


def bench_decode_step(model, tokenizer, shapes: list[tuple[int, int]], repeats: int) -> list[list]:
    """Rows of :func:`_decode_step_rows` for each ``(requests, context)`` shape."""
    return [row for requests, context in shapes
            for row in _decode_step_rows(model, tokenizer, requests, context, repeats)]


def _step_timer(runner, ids: list, context: int, rng):
    """``(step, timed)``: one decode step of the caches ``ids`` (each trimmed back to
    ``context`` tokens after it), and the mean ms per step of ``steps`` of them."""

    def step() -> None:
        mx.eval(runner.forward([SeqWork(c, [int(rng.integers(1, 500))]) for c in ids], None)[0])
        for c in ids:
            runner.trim_cache(c, context)

    def timed(steps: int = 20) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps * 1e3

    return step, timed


def _decode_step_rows(model, tokenizer, requests: int, context: int, repeats: int) -> list[list]:
    # the low-level executor: it owns the blocks its direct forward passes write
    runner = mf.LlmExecutor(model, mf.RuntimeConfig(kv_layout="paged", prefix_cache=False))
    rng = np.random.default_rng(0)
    ids = [f"seq{i}" for i in range(requests)]
    mx.eval(runner.forward([SeqWork(c, rng.integers(1, 500, context).tolist()) for c in ids], None)[0])
    step, timed = _step_timer(runner, ids, context, rng)

    def fused_side() -> float:
        runner.runner._compiled_decode = {}  # retrace with the fused 2**x, whatever the size
        real = reference.MIN_FUSED_SIZE
        reference.MIN_FUSED_SIZE = 0
        try:
            step()
        finally:
            reference.MIN_FUSED_SIZE = real
        return timed()

    def power_side() -> float:
        runner.runner._compiled_decode = {}
        with _power_only():
            step()  # the trace of this step takes mx.power
        return timed()

    fused, power = _alternate(fused_side, power_side, repeats)
    f, p = statistics.median(fused), statistics.median(power)
    ratios = sorted(b / a for a, b in zip(fused, power))
    # the scores' size decides which one the default takes (kernels.reference.MIN_FUSED_SIZE)
    scores = requests * model.args.num_attention_heads * context
    default = "fused" if scores >= reference.MIN_FUSED_SIZE else "mx.power"
    return [[f"{requests} x {context} tokens (~{scores} scores), fused 2**x", f"{f:.2f}", "", default],
            [f"{requests} x {context} tokens, mx.power", f"{p:.2f}",
             f"{p / f:.2f}x the fused time ({ratios[0]:.2f}-{ratios[-1]:.2f})", ""]]


def bench_step_split(model, tokenizer, levels: list[int], repeats: int) -> list[list]:
    import mlx_ferrum.engine.engine as engine_module
    rows = []
    for requests in levels:
        engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged"))
        rng = np.random.default_rng(requests)
        prompts = [rng.integers(5, 500, 32).tolist() for _ in range(requests)]
        params = mf.SamplingParams(max_tokens=128, temperature=0.0)
        engine.generate(prompts, params)
        totals = {"eval": [], "forward": [], "step": []}
        for _ in range(repeats):
            spent = {"eval": 0.0, "forward": 0.0}
            real_async, real_forward = engine_module.mx.async_eval, engine.runner.forward

            def timed(name, fn):
                def wrapper(*a, **k):
                    start = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        spent[name] += time.perf_counter() - start
                return wrapper

            engine_module.mx.async_eval = timed("eval", real_async)
            engine.runner.forward = timed("forward", real_forward)
            try:
                steps = engine.num_steps
                start = time.perf_counter()
                engine.generate(prompts, params)
                wall = time.perf_counter() - start
            finally:
                engine_module.mx.async_eval = real_async
                engine.runner.forward = real_forward
            n = engine.num_steps - steps
            totals["step"].append(wall / n * 1e3)
            totals["eval"].append(spent["eval"] / n * 1e3)
            totals["forward"].append(spent["forward"] / n * 1e3)
        step, wait, build = (statistics.median(totals[k]) for k in ("step", "eval", "forward"))
        rows.append([requests, f"{step:.2f}", f"{wait:.2f}", f"{build:.2f}", f"{step - wait - build:.2f}",
                     f"{(step - wait) / step:.0%}"])
    return rows


def bench_shared_prefix_step(model, tokenizer, requests: int, context: int, repeats: int) -> list[list]:
    runner = mf.LlmExecutor(model, mf.RuntimeConfig(kv_layout="paged", prefix_cache=False))
    rng = np.random.default_rng(5)
    mx.eval(runner.forward([SeqWork("base", rng.integers(1, 500, context).tolist())], None)[0])
    ids = [f"seq{i}" for i in range(requests)]
    for c in ids:
        runner.manager.fork("base", c)  # shared blocks, in the block manager the executor owns
    step, timed = _step_timer(runner, ids, context, rng)

    def own_blocks() -> float:
        with _patched(reference, "plan_shared_prefix", lambda *a, **k: None):
            step()  # its own trace
            return timed()

    step()
    return _versus_rows(timed, own_blocks, repeats, 2, f"{requests} x {context} tokens, shared blocks read once",
                        f"{requests} x {context} tokens, every row gathers its blocks")


def bench_fresh_prefill(model, tokenizer, context: int, repeats: int) -> list[list]:
    # the module, not the package's ``attention`` function of the same name
    attention_module = importlib.import_module("mlx_ferrum.layers.attention")
    engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged", prefix_cache=False))
    rng = np.random.default_rng(6)
    params = mf.SamplingParams(max_tokens=1, temperature=0.0)

    def prefill() -> float:
        engine.add_request(rng.integers(5, 500, context).tolist(), params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed * 1e3

    def untiled() -> float:
        with _patched(attention_module, "PREFILL_GROUP_SCORES", 1 << 62):
            return prefill()

    prefill()
    return _versus_rows(prefill, untiled, repeats, 1, f"{context}-token prompt, query tiles",
                        f"{context}-token prompt, the whole square of scores")


def _versus_rows(default, alternative, repeats: int, digits: int, default_label: str, label: str) -> list[list]:
    """Table rows of two sides timed alternately (ms): their medians and the alternative's
    slowdown with the spread of its per-repeat ratios."""
    first, second = _alternate(default, alternative, repeats)
    a, b = statistics.median(first), statistics.median(second)
    ratios = sorted(y / x for x, y in zip(first, second))
    return [[default_label + " (default)", f"{a:.{digits}f}", ""],
            [label, f"{b:.{digits}f}", f"{b / a:.2f}x slower ({ratios[0]:.2f}-{ratios[-1]:.2f})"]]


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """``owner.name = value`` for the block."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def _power_only():
    real = compiled_decode.exp2_fusing
    compiled_decode.exp2_fusing = contextlib.nullcontext
    try:
        yield
    finally:
        compiled_decode.exp2_fusing = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=340, help="cached tokens per sequence in the decode step")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 requests of 64 tokens, 1 repeat")
    ap.add_argument("--sections", default="1,2,3,4,5,6", help="which measurements to run, comma-separated (default: all)")
    args = ap.parse_args(argv)
    sections = {int(x) for x in args.sections.split(",")}
    if args.quick:
        args.requests, args.context, args.repeats = 4, 64, 1
    print_header("CPU attention: 2**x, grouped prefill, decode step",
                 {"model": args.model, "requests": args.requests, "context": args.context, "repeats": args.repeats})
    model, tokenizer = mf.load(args.model)
    if 1 in sections:
        print("\n1. 2**x, compiled: decode-sized scores, then at kernels.reference.MAX_FUSED_SIZE and 8x past it")
        print_table(["function", "elements", "ms per call", "ns per element"], bench_exponential(args.repeats))
    if 2 in sections:
        print("\n2. the step that prefills a wave of prompt tails (prefix-cached system prompt)")
        print_table(["step", "ms", "vs default"], bench_wave(model, tokenizer, args.requests, args.repeats))
    if 3 in sections:
        print("\n3. one compiled paged decode step, fused 2**x against mx.power at 1, 4 and N sequences")
        shapes = [(n, args.context) for n in sorted({1, min(4, args.requests), args.requests})]
        print_table(["step", "ms", "mx.power vs fused", "the default takes"],
                    bench_decode_step(model, tokenizer, shapes, args.repeats))
    if 4 in sections:
        print("\n4. where an Engine.step goes (ms per step, medians)")
        print_table(["requests", "step", "blocked in async_eval", "runner.forward", "rest", "host share"],
                    bench_step_split(model, tokenizer, sorted({min(8, args.requests), args.requests}), args.repeats))
    if 5 in sections:
        print("\n5. one compiled paged decode step over N sequences whose tables begin with the same blocks")
        print_table(["step", "ms", "vs default"],
                    bench_shared_prefix_step(model, tokenizer, args.requests, args.context, args.repeats))
    if 6 in sections:
        print("\n6. the prefill step of one fresh prompt of C tokens")
        print_table(["step", "ms", "vs default"], bench_fresh_prefill(model, tokenizer, args.context, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
