"""Load time and single-stream decode speed of MLX quantization modes: mxfp4 (and
optionally mxfp8 / nvfp4) against the affine 4-bit conversion of the same checkpoint,
mlx_ferrum and mlx-lm side by side.

Usage::

    python benchmarks/bench_quant_modes.py                      # Qwen2.5-0.5B-shaped, affine vs mxfp4
    python benchmarks/bench_quant_modes.py --modes affine,mxfp4,mxfp8,nvfp4 --repeats 5
    python benchmarks/bench_quant_modes.py --quick              # 2 layers, smoke test

Method:

- one random-weight bf16 checkpoint (``common.cached_random_checkpoint``), converted
  once per mode by mlx-lm's own ``mlx_lm.convert(quantize=True, q_mode=MODE)`` with
  the mode's default group size and bits (affine: 4 bits, group 64), cached in
  ``$TMPDIR/mlx_ferrum_bench``;
- **load**: wall seconds from the folder to evaluated parameters, mlx_ferrum's
  ``load_model`` and mlx-lm's ``load_model`` (both read the same safetensors; the
  file cache is warm after the first, untimed, load of each side);
- **decode**: greedy generation of ``--gen`` tokens after a ``--prompt-len``-token
  prompt, timed as in ``bench_generate.py`` (mlx_ferrum through ``mf.stream_generate``,
  mlx-lm through ``generate_step``), decode tok/s = (gen - 1) / decode seconds;
- every measurement alternates the sides and the modes (ferrum, mlx-lm; mode by mode,
  in turn) for ``--repeats`` rounds; the table gives medians and the [min, max] spread
  of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench_generate import run_ferrum_api, run_mlx_lm  # noqa: E402
from common import QWEN25_05B_CONFIG, cached_random_checkpoint, fmt_bytes, print_header, print_table, scaled_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="affine,mxfp4", help="comma-separated MLX modes (default affine,mxfp4)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--quick", action="store_true", help="2-layer model, short run (smoke test)")
    ap.add_argument("--json", help="also write the results to this json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len, args.gen, args.repeats = min(args.prompt_len, 16), min(args.gen, 8), 1
    return args


def converted(source: Path, mode: str) -> Path:
    """``source`` converted by ``mlx_lm.convert`` in ``mode``, cached beside it."""
    from mlx_lm.convert import convert

    folder = source.parent / f"{source.name}-{mode}"
    marker = folder / ".complete"
    if marker.is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    convert(str(source), str(folder), quantize=True, q_mode=mode)
    marker.write_text(mode)
    print(f"   converted {source.name} to {mode} in {time.perf_counter() - t0:.1f} s")
    return folder


def load_ferrum(folder: Path):
    import mlx_ferrum as mf

    t0 = time.perf_counter()
    model, tokenizer = mf.load(str(folder))
    mx.eval(model.parameters())
    return time.perf_counter() - t0, model, tokenizer


def load_mlx_lm(folder: Path):
    from mlx_lm.utils import load_model

    t0 = time.perf_counter()
    model, _ = load_model(folder)
    mx.eval(model.parameters())
    return time.perf_counter() - t0, model


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main(argv=None) -> dict:
    """Run the benchmark, print the table, and return the results."""
    args = parse_args(argv)
    import mlx_ferrum as mf

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.quick:
        cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=2, vocab_size=32000)
        source = cached_random_checkpoint("qwen2.5-0.5b-2layer-v32k", cfg, "bfloat16")
    else:
        cfg = QWEN25_05B_CONFIG
        source = cached_random_checkpoint("qwen2.5-0.5b", QWEN25_05B_CONFIG, "bfloat16")
    info = print_header(
        "bench_quant_modes: load time and decode speed per MLX quantization mode, mlx_ferrum vs mlx-lm",
        {
            "checkpoint": f"{source} converted by mlx_lm.convert per mode",
            "model": f"qwen2 hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} vocab={cfg['vocab_size']}",
            "modes": ", ".join(modes),
            "prompt / gen": f"{args.prompt_len} / {args.gen} tokens, greedy, repeats={args.repeats}",
        },
    )
    folders = {mode: converted(source, mode) for mode in modes}
    models = {}
    for mode, folder in folders.items():  # untimed first loads warm the file cache for both sides
        _, ours, tokenizer = load_ferrum(folder)
        _, theirs = load_mlx_lm(folder)
        models[mode] = (ours, tokenizer, theirs)
    rng = random.Random(0)
    prompt = [rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt_len)]
    config = mf.RuntimeConfig(kv_layout="contiguous")
    for ours, tokenizer, theirs in models.values():  # warm-up: compile paths, first allocations
        run_ferrum_api(ours, tokenizer, prompt[:8], 4, config)
        run_mlx_lm(theirs, prompt[:8], 4)

    load = {m: {"ferrum": [], "mlx-lm": []} for m in modes}
    decode = {m: {"ferrum": [], "mlx-lm": []} for m in modes}
    for round_index in range(args.repeats):
        order = modes if round_index % 2 == 0 else list(reversed(modes))
        for mode in order:
            ours, tokenizer, theirs = models[mode]
            sides = [("ferrum", True), ("mlx-lm", False)]
            if round_index % 2:
                sides.reverse()
            for side, is_ours in sides:
                if is_ours:
                    seconds, _, _ = load_ferrum(folders[mode])
                    _, decode_seconds, tokens = run_ferrum_api(ours, tokenizer, prompt, args.gen, config)
                else:
                    seconds, _ = load_mlx_lm(folders[mode])
                    _, decode_seconds, tokens = run_mlx_lm(theirs, prompt, args.gen)
                load[mode][side].append(seconds)
                decode[mode][side].append((len(tokens) - 1) / decode_seconds)

    def spread(values):
        return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    rows, results = [], {"machine": info, "modes": {}}
    base = modes[0]
    for mode in modes:
        ours_tps, theirs_tps = decode[mode]["ferrum"], decode[mode]["mlx-lm"]
        ratio = [a / b for a, b in zip(ours_tps, theirs_tps)]
        vs_base = [a / b for a, b in zip(ours_tps, decode[base]["ferrum"])]
        rows.append([
            mode, fmt_bytes(weight_bytes(models[mode][0])),
            f"{statistics.median(load[mode]['ferrum']):.2f}", f"{statistics.median(load[mode]['mlx-lm']):.2f}",
            f"{statistics.median(ours_tps):.1f}", f"{statistics.median(theirs_tps):.1f}",
            spread(ratio), spread(vs_base),
        ])
        results["modes"][mode] = {
            "weight_bytes": weight_bytes(models[mode][0]), "load_s": load[mode], "decode_tok_s": decode[mode],
        }
    print_table(
        ["mode", "weights", "ferrum load s", "mlx-lm load s", "ferrum decode tok/s", "mlx-lm decode tok/s",
         "ferrum / mlx-lm [min, max]", f"ferrum vs {base} [min, max]"],
        rows,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
