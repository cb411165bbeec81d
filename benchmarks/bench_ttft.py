"""Time to first token of one long prompt: mlx_ferrum against mlx-lm, same process.

Usage::

    python benchmarks/bench_ttft.py                       # 2,048-token prompt, both shapes, 3 repeats
    python benchmarks/bench_ttft.py --shapes moe --prompt-len 2048 --repeats 5
    python benchmarks/bench_ttft.py --quick               # 2-layer shapes, 256 tokens (smoke test)

Shapes (random weights, Hugging Face layout; speed depends on shapes and dtypes only):

- ``qwen``: Qwen2.5-0.5B (``common.QWEN25_05B_CONFIG``), stored and run in float32
  (README's Linux setting: float32 is the fast dtype with OpenBLAS);
- ``moe``: the Qwen3-MoE shape of ``bench_moe.py`` (128 experts, 8 per token, hidden
  1024, 6 layers), stored in bfloat16 and cast to float32 by both sides at load
  (MLX's CPU ``gather_mm`` takes float32 only).

Method: one request, greedy, one generated token. mlx_ferrum runs through its
defaults (``mf.stream_generate``, which queues the request on an engine with the
default ``RuntimeConfig``: contiguous layout, chunked prefill of
``prefill_chunk_size`` tokens); mlx-lm through ``mlx_lm.generate.generate_step``
with its defaults (``prefill_step_size`` 2048). TTFT is the wall time from the call
to the first token as a Python int. One untimed warm-up per side, then ``--repeats``
rounds with the sides alternating (ferrum first in even rounds); the table gives
the median and [min, max] of each side and of the per-round ratio ferrum / mlx-lm
(below 1 is better for mlx_ferrum).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_moe import QWEN3_MOE_SHAPED, build_checkpoint as build_moe_checkpoint  # noqa: E402
from common import QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, print_table, scaled_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen,moe", help="comma-separated: qwen, moe (default both)")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--quick", action="store_true", help="2-layer shapes, 256-token prompt, 1 round")
    ap.add_argument("--json", help="also write the results to this json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len, args.repeats = min(args.prompt_len, 256), 1
    return args


def checkpoint(shape: str, quick: bool) -> Path:
    """The cached random checkpoint of ``shape``."""
    if shape == "qwen":
        cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=2) if quick else QWEN25_05B_CONFIG
        return cached_random_checkpoint("qwen2.5-0.5b-2layer" if quick else "qwen2.5-0.5b-shape", cfg, "float32")
    if shape == "moe":
        cfg = dict(QWEN3_MOE_SHAPED, num_hidden_layers=2) if quick else dict(QWEN3_MOE_SHAPED)
        name = "qwen3-moe-shaped-2layer" if quick else "qwen3-moe-shaped"
        return build_moe_checkpoint(Path(tempfile.gettempdir()) / "mlx_ferrum_bench" / name, cfg, "bfloat16")
    raise SystemExit(f"unknown shape {shape!r}: use qwen or moe")


def ferrum_ttft(model, tokenizer, prompt: list[int]) -> float:
    import mlx_ferrum as mf

    t0 = time.perf_counter()
    for chunk in mf.stream_generate(model, tokenizer, prompt, max_tokens=1, temperature=0.0, ignore_eos=True):
        if chunk.token is not None:
            return time.perf_counter() - t0
    raise RuntimeError("mlx_ferrum produced no token")


def mlx_lm_ttft(model, prompt: list[int]) -> float:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=1):
        int(token)
        return time.perf_counter() - t0
    raise RuntimeError("mlx-lm produced no token")


def main(argv=None) -> dict:
    """Run the benchmark, print the table, and return the results."""
    args = parse_args(argv)
    import mlx_ferrum as mf
    from mlx_lm.utils import load_model as lm_load

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    info = print_header(
        "bench_ttft: time to first token of one long prompt, mlx_ferrum (defaults) vs mlx-lm (defaults)",
        {"shapes": ", ".join(shapes), "prompt": f"{args.prompt_len} tokens, 1 generated, greedy",
         "repeats": args.repeats},
    )
    rows, results = [], {"machine": info, "shapes": {}}
    for shape in shapes:
        path = checkpoint(shape, args.quick)
        model, tokenizer = mf.load(str(path), dtype=mx.float32)
        lm, _ = lm_load(path)
        lm.set_dtype(mx.float32)
        mx.eval(model.parameters(), lm.parameters())
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        ferrum_ttft(model, tokenizer, prompt)  # warm-up: the shapes of this prompt on both sides
        mlx_lm_ttft(lm, prompt)
        ours, theirs = [], []
        for round_index in range(args.repeats):
            sides = [("ferrum", lambda: ferrum_ttft(model, tokenizer, prompt)), ("mlx-lm", lambda: mlx_lm_ttft(lm, prompt))]
            if round_index % 2:
                sides.reverse()
            for side, fn in sides:
                (ours if side == "ferrum" else theirs).append(fn())
        ratios = [a / b for a, b in zip(ours, theirs)]
        rows.append([
            shape, "float32", str(args.prompt_len),
            f"{statistics.median(ours):.3f} [{min(ours):.3f}, {max(ours):.3f}]",
            f"{statistics.median(theirs):.3f} [{min(theirs):.3f}, {max(theirs):.3f}]",
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
        ])
        results["shapes"][shape] = {"ferrum_s": ours, "mlx_lm_s": theirs, "ratio": ratios}
        del model, lm
    print_table(["shape", "dtype", "prompt tokens", "mlx_ferrum TTFT s", "mlx-lm TTFT s",
                 "ratio ferrum / mlx-lm"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
