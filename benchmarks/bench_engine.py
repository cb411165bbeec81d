"""Concurrent serving: mlx_ferrum's Engine vs mlx-lm's BatchGenerator, same process, same prompts.

Usage::

    python benchmarks/bench_engine.py                   # Qwen2.5-0.5B-shaped random checkpoint, 1/8/32/64 requests
    python benchmarks/bench_engine.py --quick           # 4 layers, vocab 32k, 1/8 requests, 1 repeat: < 60 s
    python benchmarks/bench_engine.py --dtype bfloat16 --concurrency 1,8 --prompt-tokens 32 --max-tokens 8
    python benchmarks/bench_engine.py --openblas off    # MLX's bundled reference BLAS

What is measured (see :mod:`mlx_ferrum.cli.bench` for the exact definitions): for
each concurrency level N, N requests of ``--prompt-tokens`` random token ids (seeded,
the same on both sides) arrive at once and each generates ``--max-tokens`` greedy
tokens with EOS ignored. Reported per side: steady-state aggregate decode tok/s (all N
decoding), output and total tok/s over the whole burst, TTFT p50/p90, inter-token
latency p50/p90/p99, wall time; then the ratio mlx_ferrum / mlx-lm. Each timed run is
preceded by an untimed warm-up burst at the same concurrency; ``--repeats`` (default 2)
timed runs per side alternate the sides (so load from other processes hits both), and
each figure is the median over them.

Settings: mlx_ferrum's Engine runs the paged KV layout with ``max_num_seqs = N`` and
its default chunked-prefill budgets (``FERRUM_*`` variables apply); mlx-lm's
BatchGenerator runs with ``prefill_batch_size = completion_batch_size = N``: the same
admission (all requests prefilled and decoded together).

The checkpoint has Qwen2.5-0.5B's published shapes (hidden 896, 24 layers, 14 heads,
2 KV heads, head_dim 64, intermediate 4864, vocab 151936, tied embeddings, q/k/v bias)
and random weights, written in the Hugging Face layout by ``benchmarks/common.py`` and
loaded by both libraries' own loaders.

CPU notes (Linux): ``--dtype auto`` is bfloat16 with Metal and float32 elsewhere,
because MLX's CPU backend has no BLAS path for bf16 matmuls (measured on a 2-core
EPYC: bf16 decodes ~2.5x slower than fp32 with OpenBLAS at one request, and prefills
about 20x slower). ``--openblas auto`` re-runs the script with
``LD_PRELOAD=<libopenblas>`` when Debian's ``libopenblas0-pthread`` is installed, since
MLX's fp32 matmuls then go through OpenBLAS instead of the bundled reference BLAS
(4-5x faster here). The defaults (64-token prompts, 32 generated tokens) are cut down
from a typical serving benchmark so that the full run stays within ~10 minutes on
2 cores (measured: 6.5 minutes with OpenBLAS and 2 repeats); the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import (  # noqa: E402
    OPENBLAS_PATH,
    QWEN25_05B_CONFIG,
    cached_random_checkpoint,
    openblas_preloaded,
    print_header,
    scaled_config,
)

_REEXEC_MARK = "MLX_FERRUM_BENCH_REEXEC"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a random Qwen2.5-0.5B-shaped one, built once in $TMPDIR)")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated request counts (default 1,8,32,64)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length per request (default 64)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (auto: bf16 on Metal, fp32 on CPU)")
    ap.add_argument("--openblas", choices=["auto", "on", "off"], default="auto",
                    help="auto/on: re-run under LD_PRELOAD=<libopenblas> when it is not loaded; off: run without")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per side and level, alternating the sides; each figure is the median")
    ap.add_argument("--quick", action="store_true", help="4 layers, vocab 32000, requests 1,8, short prompts (< 60 s)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the random checkpoint")
    ap.add_argument("--json", help="also write the results to this json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency = "1,8"
        args.prompt_tokens = min(args.prompt_tokens, 32)
        args.max_tokens = min(args.max_tokens, 8)
        args.repeats = 1
    return args


def ensure_blas(choice: str) -> None:
    """Re-execute this script with OpenBLAS preloaded (``on``/``auto``) or not (``off``)
    when the current process disagrees; returns only when no re-run is needed.

    Raises:
        SystemExit: ``on`` while the library is not installed.
    """
    loaded = openblas_preloaded()
    if os.environ.get(_REEXEC_MARK):
        return
    env = dict(os.environ, **{_REEXEC_MARK: "1"})
    if choice in ("auto", "on") and not loaded:
        if not os.path.exists(OPENBLAS_PATH):
            if choice == "on":
                raise SystemExit(f"{OPENBLAS_PATH} is missing: apt-get install -y libopenblas0-pthread")
            return
        env["LD_PRELOAD"] = ":".join(p for p in (OPENBLAS_PATH, os.environ.get("LD_PRELOAD", "")) if p)
    elif choice == "off" and loaded:
        env["LD_PRELOAD"] = ":".join(p for p in os.environ.get("LD_PRELOAD", "").split(":") if "openblas" not in p)
    else:
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def resolve_dtype(name: str) -> str:
    """``auto`` -> ``bfloat16`` with Metal, else ``float32``; other names pass through."""
    if name != "auto":
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)
    return "bfloat16" if mx.metal.is_available() else "float32"


def median_result(runs: list[dict]) -> dict:
    """Figure-wise median of several results of the same side and level (tokens of the first)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    return out


def checkpoint_path(args) -> Path:
    """``--model`` or the cached random checkpoint (4 layers and vocab 32000 with ``--quick``)."""
    if args.model:
        return Path(args.model)
    if args.quick:
        cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=4, vocab_size=32000)
        return cached_random_checkpoint("qwen2.5-0.5b-4layer-v32k", cfg, "bfloat16", args.rebuild)
    return cached_random_checkpoint("qwen2.5-0.5b", QWEN25_05B_CONFIG, "bfloat16", args.rebuild)


def main(argv=None) -> dict:
    """Run the benchmark, print the tables, and return the results."""
    args = parse_args(argv)
    if argv is None:
        ensure_blas(args.openblas)
    import mlx_ferrum as mf
    from mlx_ferrum.cli.bench import TABLE_HEADERS, bench_engine, format_table, parse_concurrency, table_rows
    from mlx_lm_side import RATIO_HEADERS, bench_mlx_lm_batch, load_mlx_lm_model, ratio_row, token_agreement

    levels = parse_concurrency(args.concurrency)
    dtype = resolve_dtype(args.dtype)
    path = checkpoint_path(args)
    cfg = json.loads((path / "config.json").read_text())
    settings = {
            "checkpoint": str(path),
            "model": f"{cfg.get('model_type')} hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
            f"heads={cfg['num_attention_heads']}/{cfg['num_key_value_heads']} "
            f"inter={cfg['intermediate_size']} vocab={cfg['vocab_size']}",
            "dtype": f"{dtype}" + (" (auto)" if args.dtype == "auto" else ""),
            "requests": f"concurrency {levels}; prompt {args.prompt_tokens} tokens, {args.max_tokens} generated "
            f"each, greedy, EOS ignored, seed {args.seed}, {max(1, args.repeats)} timed run(s) per side (median)",
            "ferrum engine": "paged, max_num_seqs=N, block_size={0.block_size}, prefill_chunk_size={0.prefill_chunk_size}, "
            "max_num_batched_tokens={0.max_num_batched_tokens}".format(mf.RuntimeConfig(kv_layout="paged")),
            "mlx-lm": "BatchGenerator, prefill_batch_size=completion_batch_size=N (equal admission), "
            "prefill_step_size=2048",
    }
    if not mx.metal.is_available():
        settings["note"] = "prompt/generation lengths are cut down to fit a 2-core CPU run (defaults 64/32)"
        if not openblas_preloaded() and dtype == "float32":
            settings["warning"] = ("OpenBLAS is not loaded: fp32 matmuls run on MLX's bundled reference BLAS, "
                                   "about 5x slower; the full run then takes well over 15 minutes")
    info = print_header(
        "bench_engine: concurrent greedy requests, mlx_ferrum Engine (paged) vs mlx-lm BatchGenerator", settings
    )
    t_load = time.perf_counter()
    model, tokenizer = mf.load(str(path), dtype=dtype)
    lm = load_mlx_lm_model(path, dtype)
    mx.eval(model.parameters())
    print(f"   loaded both models in {time.perf_counter() - t_load:.1f} s")
    print()

    results, ratios, agree = [], [], []
    t_all = time.perf_counter()
    for i, c in enumerate(levels):
        def ferrum():
            return bench_engine(model, tokenizer, c, args.prompt_tokens, args.max_tokens, seed=args.seed)

        def mlx_lm():
            return bench_mlx_lm_batch(None, c, args.prompt_tokens, args.max_tokens, seed=args.seed, model=lm)

        t = time.perf_counter()
        fs, ms = [], []
        for r in range(max(1, args.repeats)):
            if (i + r) % 2 == 0:
                fs.append(ferrum())
                ms.append(mlx_lm())
            else:
                ms.append(mlx_lm())
                fs.append(ferrum())
        f, m = median_result(fs), median_result(ms)
        agree.append(token_agreement(f["tokens"], m["tokens"]))
        results.extend([f, m])
        ratios.append(ratio_row(f, m))
        print(f"   concurrency {c}: done in {time.perf_counter() - t:.1f} s (both sides, warm-ups included); "
              f"greedy outputs agree on {100 * agree[-1]:.0f}% of requests", flush=True)
    print()
    print(format_table(TABLE_HEADERS, table_rows(results)))
    print()
    print("ratio mlx_ferrum / mlx-lm (rates: above 1 is better; times: below 1 is better)")
    print(format_table(RATIO_HEADERS, ratios))
    print(f"\n   total {time.perf_counter() - t_all:.1f} s")
    out = {
        "machine": info,
        "settings": {
            "checkpoint": str(path), "dtype": dtype, "concurrency": levels,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "seed": args.seed,
            "quick": args.quick, "repeats": max(1, args.repeats),
        },
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
        "agreement": dict(zip(levels, agree)),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
