"""Decode speed with a quantized KV cache: ``kv_cache_dtype`` int8 / int4 against ``auto``.

Usage::

    python benchmarks/bench_kv_speed.py                       # 2,048 tokens, 1 and 32 requests, both layouts
    python benchmarks/bench_kv_speed.py --context 512 --requests 1,8 --layouts paged --rounds 3   # quick
    python benchmarks/bench_kv_speed.py --model ../shared/models/stories260K --context 448
    python benchmarks/bench_kv_speed.py --quick                # smoke run (tests/test_benchmarks_smoke.py)

For each layout (``paged``, the default layout, and ``contiguous``) one
:class:`~mlx_ferrum.executor.LlmExecutor` is built per ``kv_cache_dtype`` with the same
``RuntimeConfig`` otherwise. Each prefills the same ``max(requests)`` random prompts of
``--context`` tokens (in chunks of ``--chunk`` tokens, untimed); then only decode steps
are timed: one step is ``LlmExecutor.forward`` over the first ``n`` sequences (one new
token each; the paged layout runs its compiled decode step), a greedy argmax, and
``mx.eval`` of the tokens and the KV state. Sequences beyond ``n`` stay idle in the cache.

A round times a block of steps of every dtype in turn (the sides alternate, so load
drifting on a shared machine hits them alike); the order rotates each round. The block
has as many steps (``--steps`` .. ``--max-steps``) as make ``auto``'s last at least
``--min-block-s`` seconds. Printed:
decode steps/s and tokens/s (median over rounds), and per quantized dtype the ratio of
its steps/s to ``auto``'s in the same round (median, with min and max over rounds).
The target of the quantized cache is int8 >= 0.9x of ``auto`` at 2,048 tokens.

The default model is a random-weight checkpoint of a small Qwen2-like shape (4 layers,
hidden 256, 4 heads of head_dim 64, 2 KV heads as Qwen2.5-0.5B's 64-wide heads with
GQA, vocab 4,096, 4,096 positions): stories260K has only 512 positions, and the full
Qwen2.5-0.5B shape needs tens of minutes to prefill 32 x 2,048 tokens on a 2-core CPU.
With so small a model the step is mostly attention over the cache, so the ratio is
close to that of the attention alone (the hardest case for the quantized cache);
``--layers/--hidden/--heads`` change the shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, print_table, scaled_config  # noqa: E402


def small_qwen_config(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, positions: int) -> dict:
    """A Qwen2 ``config.json`` with head_dim 64 (``hidden / heads``) and the given sizes."""
    return scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=vocab,
                         max_position_embeddings=positions, sliding_window=positions, max_window_layers=layers)


class Side:
    """One executor (one ``kv_cache_dtype``) with ``count`` prefilled sequences."""

    def __init__(self, model, layout: str, kv_cache_dtype: str, count: int, context: int, steps_total: int,
                 block_size: int, chunk: int, prompts: list[list[int]]):
        import mlx_ferrum as mf
        from mlx_ferrum.executor import SeqWork

        capacity = context + steps_total + 8
        blocks = count * -(-capacity // block_size) + 8
        # "int4-codes": int4 without its float window (codes only)
        dtype, _, variant = kv_cache_dtype.partition("-")
        extra = {"kv_float_window": 0} if variant == "codes" else {}
        cfg = mf.RuntimeConfig(kv_layout=layout, block_size=block_size, max_num_blocks=blocks, kv_capacity=capacity,
                               kv_cache_dtype=dtype, **extra)
        self.name = kv_cache_dtype
        self.executor = mf.LlmExecutor(model, cfg)
        self.ids = [f"s{i}" for i in range(count)]
        t0 = time.perf_counter()
        # prefill a few sequences per pass, in chunks, so no pass holds a huge score matrix
        per_pass = max(1, 2048 // chunk)
        for first in range(0, count, per_pass):
            group = list(range(first, min(count, first + per_pass)))
            for start in range(0, context, chunk):
                last = start + chunk >= context
                work = [SeqWork(self.ids[i], prompts[i][start : start + chunk], return_logits=last) for i in group]
                self.executor.run(work)
        self.prefill_s = time.perf_counter() - t0
        self.tokens = mx.zeros((count,), dtype=mx.int32)
        mx.eval(self.tokens)

    def run_steps(self, n: int, steps: int) -> float:
        """Seconds for ``steps`` decode steps of the first ``n`` sequences."""
        from mlx_ferrum.executor import SeqWork

        tokens = self.tokens[:n]
        mx.eval(tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            work = [SeqWork(c, [0], prev_row=i) for i, c in enumerate(self.ids[:n])]
            logits, state = self.executor.forward(work, tokens)
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
            mx.eval(tokens, state)
        return time.perf_counter() - t0

    def release(self) -> None:
        for c in self.ids:
            self.executor.release_cache(c)


def measure(model, layout: str, dtypes: list[str], requests: list[int], args, prompts) -> list[dict]:
    """Rows ``{layout, requests, dtype, steps_s, ratios}`` for one layout."""
    count = max(requests)
    # at most this many steps per timed block (see the calibration below), plus warmup and calibration
    steps_total = len(requests) * (args.rounds * max(args.steps, args.max_steps) + args.warmup + 2)
    sides = []
    for dtype in dtypes:
        side = Side(model, layout, dtype, count, args.context, steps_total, args.block_size, args.chunk, prompts)
        print(f"   {layout} {dtype}: prefilled {count} x {args.context} tokens in {side.prefill_s:.1f} s", flush=True)
        sides.append(side)
    rows = []
    for n in requests:
        for side in sides:
            side.run_steps(n, args.warmup)
        # a timed block lasts at least --min-block-s on the auto side (a 5 ms step timed
        # a few times would measure the machine's other load more than the step)
        per_step = sides[0].run_steps(n, 2) / 2
        steps = min(args.max_steps, max(args.steps, int(args.min_block_s / per_step) + 1))
        rates: dict[str, list[float]] = {s.name: [] for s in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[: r % len(sides)]
            for side in order:
                rates[side.name].append(steps / side.run_steps(n, steps))
        for side in sides:
            ratios = ([a / b for a, b in zip(rates[side.name], rates["auto"])]
                      if "auto" in rates and side.name != "auto" else [])
            rows.append({"layout": layout, "requests": n, "dtype": side.name, "steps": steps,
                         "steps_s": statistics.median(rates[side.name]), "ratios": ratios})
    for side in sides:
        side.release()
    return rows


def main(argv=None) -> int:
    """Print the decode-speed table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the small random Qwen2-like shape)")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence before decoding")
    ap.add_argument("--requests", default="1,32", help="concurrent decoding sequences, comma-separated")
    ap.add_argument("--layouts", default="paged,contiguous")
    ap.add_argument("--dtypes", default="auto,int8,int4",
                    help="sides: auto, int8, int4 (with its float window), int4-codes (codes only)")
    ap.add_argument("--steps", type=int, default=2, help="fewest decode steps per side per round")
    ap.add_argument("--max-steps", type=int, default=64, help="most decode steps per side per round")
    ap.add_argument("--min-block-s", type=float, default=0.4,
                    help="steps per round are chosen so that auto's block of steps takes at least this long")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the rounds")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="weights of the random checkpoint")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, 1 and 4 requests, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.requests, args.rounds, args.max_steps, args.min_block_s, args.warmup = 256, "1,4", 2, 4, 0.05, 1
    import mlx_ferrum as mf
    from mlx_ferrum.cli import bench

    requests = [int(x) for x in args.requests.split(",")]
    dtypes = args.dtypes.split(",")
    if "auto" not in dtypes:
        dtypes.insert(0, "auto")
    if args.model is None:
        cfg = small_qwen_config(args.layers, args.hidden, args.heads, args.kv_heads, 4096, 4096)
        name = f"qwen2-small-l{args.layers}-h{args.hidden}-a{args.heads}-kv{args.kv_heads}"
        path = cached_random_checkpoint(name, cfg, args.dtype)
        shape = (f"random Qwen2-like: {args.layers} layers, hidden {args.hidden}, {args.heads} heads x head_dim "
                 f"{args.hidden // args.heads}, {args.kv_heads} KV heads, vocab 4096, {args.dtype}")
    else:
        path, shape = Path(args.model), args.model
    print_header("decode speed with a quantized KV cache (kv_cache_dtype) against auto",
                 {"model": shape, "context": args.context, "requests": requests, "layouts": args.layouts,
                  "rounds": f"{args.rounds} per side (alternating), each {args.steps}-{args.max_steps} steps "
                            f"(auto's block >= {args.min_block_s} s)",
                  "block_size": args.block_size})
    model, _ = mf.load(str(path))
    prompts = bench.make_prompts(model.args.vocab_size, max(requests), args.context, 0)
    rows = []
    for layout in args.layouts.split(","):
        rows += measure(model, layout, dtypes, requests, args, prompts)
    table = []
    for row in rows:
        ratios = row["ratios"]
        ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "1")
        table.append([row["layout"], row["requests"], row["dtype"], row["steps"], f"{row['steps_s']:.2f}",
                      f"{row['steps_s'] * row['requests']:.1f}", f"{1e3 / row['steps_s']:.1f}", ratio])
    print()
    print_table(["layout", "requests", "kv_cache_dtype", "steps per round", "steps/s", "tokens/s", "ms/step",
                 "vs auto (median, min-max over rounds)"], table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
