"""Single-stream generation speed: mlx_ferrum vs mlx-lm on the same checkpoint, same process.

Usage::

    python benchmarks/bench_generate.py                 # Qwen2.5-0.5B-shaped random bf16 checkpoint
    python benchmarks/bench_generate.py --quick         # a 2-layer variant, finishes in < 60 s
    python benchmarks/bench_generate.py --model ../shared/models/stories260K --dtype float32
    python benchmarks/bench_generate.py --layout both --prompt-len 256 --gen 64

Method (identical on both sides):

- the same prompt token ids (seeded random ids in the vocabulary; a new prompt for each
  repeat, the same on both sides, so a prefix cache never serves a repeat), the same dtype
  (``--dtype`` casts both models after loading), greedy decoding, no EOS stop;
- mlx-lm runs through ``mlx_lm.generate.generate_step`` (its timing-free generator),
  mlx_ferrum through ``mf.stream_generate`` with token ids and ``ignore_eos=True``
  (or, for a folder without ``tokenizer.json``, the executor's prefill/decode loop
  with an argmax, which is what ``stream_generate`` runs minus detokenizing);
- the clock starts before the call; "prompt" is the time until the first generated
  token is a Python int (prefill + first sample), "decode" the time from there to the
  last token; prompt tok/s = prompt_len / prompt time, decode tok/s = (gen - 1) /
  decode time;
- one short warm-up run per side, then ``--repeats`` runs alternating the sides
  (ferrum, mlx-lm, ferrum, ...) so load from other processes hits both; medians.

The two sides' greedy tokens are compared as a sanity check (bf16 may diverge at
near-ties; float32 on the same weights should agree).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from common import (  # noqa: E402
    QWEN25_05B_CONFIG,
    cached_random_checkpoint,
    parse_dtype,
    print_header,
    print_table,
    scaled_config,
)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a random Qwen2.5-0.5B-shaped one, built once in $TMPDIR)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=32, help="tokens to generate (default 32)")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    ap.add_argument("--layout", choices=["contiguous", "paged", "both"], default="contiguous", help="mlx_ferrum KV layout")
    ap.add_argument("--block-size", type=int, default=16, help="paged block size")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    ap.add_argument("--driver", choices=["api", "executor"], default="api", help="mlx_ferrum entry point")
    ap.add_argument("--quick", action="store_true", help="2-layer model, short prompt, 1 repeat (CI smoke test)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the random checkpoint")
    ap.add_argument("--json", help="also write the results to this json file")
    ap.add_argument("--load-first", choices=["ferrum", "mlx-lm"], default="ferrum",
                    help="which side's model is loaded first (default: %(default)s): in one process the model "
                         "loaded second has decoded a few per cent faster on this machine's CPU backend, an "
                         "effect of where its weights were allocated, not of either runtime; run both orders")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len = min(args.prompt_len, 32)
        args.gen = min(args.gen, 8)
        args.repeats = 1
    return args


def checkpoint_path(args) -> Path:
    """The folder to benchmark: ``--model`` or the (cached) random Qwen2.5-0.5B-shaped checkpoint."""
    if args.model:
        return Path(args.model)
    if args.quick:
        cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=2, vocab_size=32000)
        return cached_random_checkpoint("qwen2.5-0.5b-2layer-v32k", cfg, "bfloat16", args.rebuild)
    return cached_random_checkpoint("qwen2.5-0.5b", QWEN25_05B_CONFIG, "bfloat16", args.rebuild)


def load_both(path: Path, dtype, load_first: str = "ferrum"):
    """``(ferrum_model, ferrum_tokenizer_or_None, mlx_lm_model)`` for ``path``, both cast to
    ``dtype``, the side named by ``load_first`` ("ferrum" or "mlx-lm") loaded first."""
    from mlx_lm.utils import load_model as lm_load_model

    import mlx_ferrum as mf
    from mlx_ferrum.models.loader import load_model

    def load_ferrum():
        if (path / "tokenizer.json").is_file():
            return mf.load(str(path), dtype=dtype)
        return load_model(str(path), dtype=dtype)[0], None

    def load_mlx_lm():
        lm, _ = lm_load_model(path)
        if dtype is not None:
            lm.set_dtype(dtype)
        mx.eval(lm.parameters())
        return lm

    if load_first == "mlx-lm":
        lm = load_mlx_lm()
        model, tok = load_ferrum()
    else:
        model, tok = load_ferrum()
        lm = load_mlx_lm()
    mx.eval(model.parameters(), lm.parameters())
    return model, tok, lm


def run_mlx_lm(lm, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    """Greedy ``generate_step``: (prompt seconds, decode seconds, tokens)."""
    from mlx_lm.generate import generate_step

    toks: list[int] = []
    t0 = time.perf_counter()
    t1 = t0
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.int32), lm, max_tokens=n):
        toks.append(int(tok))
        if len(toks) == 1:
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, toks


def run_ferrum_api(model, tok, prompt: list[int], n: int, config) -> tuple[float, float, list[int]]:
    """Greedy ``mf.stream_generate`` from token ids: (prompt seconds, decode seconds, tokens)."""
    import mlx_ferrum as mf

    toks: list[int] = []
    t0 = time.perf_counter()
    t1 = t0
    for chunk in mf.stream_generate(model, tok, prompt, config=config, max_tokens=n, temperature=0.0, ignore_eos=True):
        if chunk.token is None:
            continue
        toks.append(chunk.token)
        if len(toks) == 1:
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, toks


def run_ferrum_executor(model, prompt: list[int], n: int, config) -> tuple[float, float, list[int]]:
    """Greedy prefill/decode loop on the model's executor: (prompt seconds, decode seconds, tokens)."""
    from mlx_ferrum.api import executor_for
    from mlx_ferrum.executor import DecodeInput, PrefillInput

    ex = executor_for(model, config)
    toks: list[int] = []
    t0 = time.perf_counter()
    out = ex.prefill(PrefillInput(input_ids=mx.array([prompt], dtype=mx.int32)))
    handle = out.kv_cache
    toks.append(int(mx.argmax(out.logits[0, -1])))
    t1 = time.perf_counter()
    try:
        while len(toks) < n:
            step = ex.decode(DecodeInput(input_ids=mx.array([[toks[-1]]], dtype=mx.int32), kv_cache=handle))
            handle = step.kv_cache
            toks.append(int(mx.argmax(step.logits[0])))
    finally:
        ex.release_cache(handle.cache_id)
    return t1 - t0, time.perf_counter() - t1, toks


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token, or -1 when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    """Run the benchmark, print the table, and return the results."""
    args = parse_args(argv)
    import mlx_ferrum as mf

    path = checkpoint_path(args)
    cfg = json.loads((path / "config.json").read_text())
    dtype = parse_dtype(args.dtype) if args.dtype else None
    layouts = ["contiguous", "paged"] if args.layout == "both" else [args.layout]
    info = print_header(
        "bench_generate: single-stream greedy generation, mlx_ferrum vs mlx-lm",
        {
            "checkpoint": str(path),
            "model": f"{cfg.get('model_type')} hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
            f"heads={cfg['num_attention_heads']}/{cfg['num_key_value_heads']} vocab={cfg['vocab_size']}",
            "dtype": args.dtype or f"checkpoint ({cfg.get('torch_dtype', '?')})",
            "prompt / gen": f"{args.prompt_len} / {args.gen} tokens, greedy, repeats={args.repeats}",
            "loaded first": args.load_first,
        },
    )
    model, tok, lm = load_both(path, dtype, args.load_first)
    driver = args.driver if tok is not None else "executor"
    print(f"   ferrum driver       {driver}{'' if driver == args.driver else ' (no tokenizer.json)'}")
    rng = random.Random(0)
    vocab = cfg["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.repeats)]
    max_pos = cfg.get("max_position_embeddings", 1 << 30)
    if args.prompt_len + args.gen > max_pos:
        raise SystemExit(f"prompt-len + gen = {args.prompt_len + args.gen} exceeds max_position_embeddings {max_pos}")

    def ferrum(layout: str, p: list[int], n: int):
        config = mf.RuntimeConfig(kv_layout=layout, block_size=args.block_size)
        if driver == "api":
            return run_ferrum_api(model, tok, p, n, config)
        return run_ferrum_executor(model, p, n, config)

    sides = {f"mlx_ferrum {lay}": (lambda p, n, lay=lay: ferrum(lay, p, n)) for lay in layouts}
    sides["mlx-lm"] = lambda p, n: run_mlx_lm(lm, p, n)
    warm = [rng.randrange(3, vocab) for _ in range(min(8, args.prompt_len))]
    for fn in sides.values():
        fn(warm, 4)
    results: dict[str, list[tuple[float, float, list[int]]]] = {k: [] for k in sides}
    for repeat in range(args.repeats):
        # the sides alternate (A B, B A, ...), so neither always runs first
        order = list(sides.items()) if repeat % 2 == 0 else list(reversed(sides.items()))
        for name, fn in order:
            results[name].append(fn(prompts[repeat], args.gen))

    rows, summary = [], {}
    ref = statistics.median(r[0] for r in results["mlx-lm"]), statistics.median(r[1] for r in results["mlx-lm"])
    for name, runs in results.items():
        ps = statistics.median(r[0] for r in runs)
        ds = statistics.median(r[1] for r in runs)
        ptps, dtps = args.prompt_len / ps, (args.gen - 1) / ds if ds > 0 else float("nan")
        summary[name] = {"prompt_tps": ptps, "decode_tps": dtps, "prompt_ratio": ref[0] / ps, "decode_ratio": ref[1] / ds}
        # per-repeat ratios (each repeat runs the sides back to back on the same prompt)
        spread = [
            (lm[0] / ours[0], lm[1] / ours[1]) for ours, lm in zip(runs, results["mlx-lm"]) if ours[0] > 0 and ours[1] > 0
        ]

        def span(i: int) -> str:
            return f" ({min(x[i] for x in spread):.2f}-{max(x[i] for x in spread):.2f})" if len(spread) > 1 else ""

        rows.append(
            [name, f"{ptps:.2f}", f"{dtps:.2f}", f"{ref[0] / ps:.2f}x{span(0)}", f"{ref[1] / ds:.2f}x{span(1)}"]
        )
    print()
    print_table(["engine", "prompt tok/s", "decode tok/s", "prompt vs mlx-lm", "decode vs mlx-lm"], rows)
    lm_toks = results["mlx-lm"][-1][2]
    for name in sides:
        if name == "mlx-lm":
            continue
        d = first_divergence(results[name][-1][2], lm_toks)
        print(f"   greedy tokens {name} vs mlx-lm: " + ("identical" if d < 0 else f"first divergence at token {d}"))
    out = {"machine": info, "args": vars(args), "results": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
