"""Offline throughput (vLLM's ``benchmark_throughput`` setting): mlx_ferrum's Engine against mlx-lm's BatchGenerator, one run.

Usage::

    python benchmarks/bench_throughput.py --model ../shared/models/stories260K --concurrency 1,8,32 --max-tokens 128
    python benchmarks/bench_throughput.py --qwen-shape --concurrency 32 --max-tokens 32   # fp32 random Qwen2.5-0.5B shape
    python benchmarks/bench_throughput.py ... --with-sync    # also the engine with async_scheduling=False
    python benchmarks/bench_throughput.py ... --with-eager   # also the engine with enforce_eager=True (no mx.compile)

Both sides get the same work and the same admission: N requests of ``--prompt-tokens``
random token ids (seeded, identical on both sides) arrive at once, all are prefilled
and decoded together (engine: ``max_num_seqs = N``; mlx-lm: ``prefill_batch_size =
completion_batch_size = N``), greedy, ``--max-tokens`` each, EOS ignored, no
detokenization on either side. Each side runs one untimed warm-up burst per level;
then ``--repeats`` timed bursts per side, the sides alternating (A B, B A, ...), so load
from other processes hits both. Figures are medians over the repeats with their
min-max spread; the headline is the wall time until every request has finished, and
its ratio ``mlx-lm wall / ferrum wall`` (> 1: ferrum is faster) is taken per repeat
pair, then its median and spread are printed. TTFT and ITL are in milliseconds; KV is
the memory each side holds (the engine's whole pool; mlx-lm's cache buffers at their
largest), see :mod:`mlx_ferrum.cli.bench`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from common import (  # noqa: E402
    QWEN25_05B_CONFIG,
    cached_random_checkpoint,
    fmt_bytes,
    print_header,
    print_table,
)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (e.g. ../shared/models/stories260K)")
    ap.add_argument("--qwen-shape", action="store_true", help="a random fp32 checkpoint with Qwen2.5-0.5B's shapes")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-sync", action="store_true", help="also run the engine with async_scheduling=False")
    ap.add_argument("--with-eager", action="store_true",
                    help="also run the engine with enforce_eager=True (decode passes op by op, no mx.compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-first", choices=["ferrum", "mlx-lm"], default="ferrum",
                    help="which side's model is loaded first (default: %(default)s): in one process the model "
                         "loaded second has decoded a few per cent faster on this machine's CPU backend, an "
                         "effect of where its weights were allocated, not of either runtime; run both orders")
    ap.add_argument("--speculative", default=None, help="mlx_ferrum sides only: 'ngram' (default: the config's, off)")
    ap.add_argument("--prefix-cache", type=int, choices=[0, 1], default=None,
                    help="mlx_ferrum sides only (default: the config's default, on)")
    return ap.parse_args(argv)


def _spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    med = statistics.median(xs) * scale
    return f"{fmt.format(med)} ({fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)})"


def main(argv=None) -> int:
    """Run the benchmark and print Markdown tables."""
    args = parse_args(argv)
    import mlx_lm_side

    import mlx_ferrum as mf
    from mlx_ferrum.cli import bench
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.runner import model_dtype

    if args.qwen_shape:
        path = cached_random_checkpoint("qwen2.5-0.5b-shape", QWEN25_05B_CONFIG, "float32")
    elif args.model:
        path = Path(args.model)
    else:
        raise SystemExit("give --model PATH or --qwen-shape")
    levels = [int(x) for x in args.concurrency.split(",")]
    print_header(
        "serving: Engine (paged, pipelined) vs mlx-lm BatchGenerator, equal admission",
        {"model": str(path), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
         "repeats": args.repeats, "levels": levels, "loaded first": args.load_first,
         "ferrum config": f"defaults (prefix caching on) + speculative={args.speculative}, "
                          f"prefix_cache={'default' if args.prefix_cache is None else args.prefix_cache}"},
    )
    if args.load_first == "mlx-lm":
        lm = mlx_lm_side.load_mlx_lm_model(path, None)
        model, _tok = mf.load(str(path))
        if model_dtype(model) != mlx_lm_side.parameter_dtype(lm):
            lm.set_dtype(model_dtype(model))
    else:
        model, _tok = mf.load(str(path))
        lm = mlx_lm_side.load_mlx_lm_model(path, model_dtype(model))
    vocab = model.args.vocab_size
    sides = (["ferrum"] + (["ferrum-sync"] if args.with_sync else []) + (["ferrum-eager"] if args.with_eager else [])
             + ["mlx-lm"])
    summary_rows = []
    detail_rows = []
    for n in levels:
        prompts = bench.make_prompts(vocab, n, args.prompt_tokens, args.seed)
        warm = bench.make_prompts(vocab, n, *bench.warm_up_shape(args.prompt_tokens, args.max_tokens)[:1], args.seed + 1)
        wt = bench.warm_up_shape(args.prompt_tokens, args.max_tokens)[1]
        engines = {}
        for side in sides:
            if side.startswith("ferrum"):
                cfg = bench.bench_config(n, args.prompt_tokens, args.max_tokens)
                cfg.async_scheduling = side != "ferrum-sync"
                cfg.enforce_eager = side == "ferrum-eager"
                if args.speculative is not None:
                    cfg.speculative = args.speculative
                if args.prefix_cache is not None:
                    cfg.prefix_cache = bool(args.prefix_cache)
                engines[side] = Engine(model, None, cfg)
                bench.run_burst(engines[side], warm, wt)
            else:
                mlx_lm_side.run_mlx_lm_batch(lm, warm, wt)
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        tokens: dict[str, list] = {}
        for r in range(args.repeats):
            order = sides if r % 2 == 0 else list(reversed(sides))
            for side in order:
                if side.startswith("ferrum"):
                    res, toks = bench.run_burst(engines[side], prompts, args.max_tokens)
                else:
                    res, toks = mlx_lm_side.run_mlx_lm_batch(lm, prompts, args.max_tokens)
                runs[side].append(res)
                tokens[side] = toks
        ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["ferrum"], runs["mlx-lm"])]
        agree = mlx_lm_side.token_agreement(tokens["ferrum"], tokens["mlx-lm"])
        row = [n, _spread(ratios)]
        if args.with_sync:
            sync_ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["ferrum"], runs["ferrum-sync"])]
            row.append(_spread(sync_ratios))
        if args.with_eager:
            eager_ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["ferrum"], runs["ferrum-eager"])]
            row.append(_spread(eager_ratios))
        row.append(f"{agree:.3f}")
        summary_rows.append(row)
        for side in sides:
            rs = runs[side]
            get = lambda k: [x[k] for x in rs]  # noqa: E731
            detail_rows.append([
                n, side, _spread(get("wall_s"), fmt="{:.3f}"), _spread(get("output_tps"), fmt="{:.0f}"),
                _spread(get("ttft_p50"), 1000, "{:.1f}"), _spread(get("ttft_p99"), 1000, "{:.1f}"),
                _spread(get("itl_p50"), 1000, "{:.2f}"), _spread(get("itl_p99"), 1000, "{:.2f}"),
                fmt_bytes(rs[-1]["kv_allocated_bytes"]),
            ])
        print(f"-- {n} requests done", flush=True)
    print()
    headers = ["requests", "wall ratio mlx-lm/ferrum"] + (["ferrum pipelined/sync"] if args.with_sync else []) + (
        ["ferrum compiled/eager"] if args.with_eager else []) + [
        "token agreement"]
    print_table(headers, summary_rows)
    print()
    print_table(["requests", "side", "wall s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "KV allocated"], detail_rows)
    print("\nfigures: median (min-max) over the repeats; ratios > 1 mean mlx_ferrum is faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
