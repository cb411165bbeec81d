"""Multi-LoRA serving: 32 requests over 8 adapters in one batch, against the same requests
with no adapter, and against serving the 8 adapter groups one after another.

Usage::

    python benchmarks/bench_lora.py --model ../shared/models/stories260K
    python benchmarks/bench_lora.py --qwen-shape            # random fp32 checkpoint, Qwen2.5-0.5B shapes
    python benchmarks/bench_lora.py --model M --quick       # 8 requests, 2 adapters, short (smoke test)

Sides (each its own ``Engine``, paged KV, ``enable_lora``, ``max_loras`` = number of
adapters, ``max_lora_rank`` = rank, prefix caching off, the same random prompts):

- ``base``: every request without an adapter (LoRA on in the engine, but no pass binds a
  slot, so the projections run exactly their base matmul).
- ``mixed``: request ``i`` uses adapter ``i % adapters``, all submitted at once: one batch
  mixes every adapter (per-token slots, ``mx.gather_mm``).
- ``sequential``: the same requests, one adapter group at a time (the group's requests
  batched together, the next group after it finishes): what a server that holds one
  adapter at a time can at best do (no reload between groups).
- ``base_sequential``: the base model, the same groups one after another: the ceiling of
  the ``mixed / sequential`` ratio on this machine (what batching alone buys here).

Adapters: random PEFT LoRAs (``N(0, 0.02)`` factors) of rank ``--rank`` on every attention
and MLP projection (q, k, v, o, gate, up, down) of every layer, written once to a temporary
folder. Throughput = generated tokens / wall time of the whole side (prefill included;
``ignore_eos``, so every request generates ``--max-tokens``). One untimed warm-up per side,
then ``--repeats`` rounds with the sides alternating; medians (min-max) are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from common import QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, print_table  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model, folder: Path, count: int, rank: int, seed: int = 0) -> list[str]:
    """``count`` random PEFT adapters of ``rank`` on every projection of ``model``; their folders."""
    from mlx_ferrum.lora.registry import adaptable_modules, module_dims

    rng = np.random.default_rng(seed)
    targets = {p: m for p, m in adaptable_modules(model).items() if p.rsplit(".", 1)[-1] in PROJECTIONS}
    paths = []
    for k in range(count):
        out = folder / f"adapter-{k}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for path, module in targets.items():
            fan_in, fan_out = module_dims(module)
            tensors[f"base_model.model.{path}.lora_A.weight"] = mx.array(
                rng.normal(0, 0.02, (rank, fan_in)).astype(np.float32))
            tensors[f"base_model.model.{path}.lora_B.weight"] = mx.array(
                rng.normal(0, 0.02, (fan_out, rank)).astype(np.float32))
        mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors)
        (out / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}))
        paths.append(str(out))
    return paths


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder")
    ap.add_argument("--qwen-shape", action="store_true", help="a random fp32 checkpoint with Qwen2.5-0.5B's shapes")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 requests, 2 adapters, 8 tokens, 1 repeat")
    ap.add_argument("--sides", default="base,mixed,sequential,base_sequential",
                    help="comma-separated sides to run (default: all four)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.adapters, args.max_tokens, args.repeats, args.prompt_tokens = 8, 2, 8, 1, 16
    return args


def main(argv=None) -> int:
    """Run the benchmark; print the machine, a Markdown table and the ratios."""
    args = parse_args(argv)
    import mlx_ferrum as mf
    from mlx_ferrum.cli import bench
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.engine import Engine, SamplingParams

    if args.qwen_shape:
        path = cached_random_checkpoint("qwen2.5-0.5b-shape", QWEN25_05B_CONFIG, "float32")
    elif args.model:
        path = Path(args.model)
    else:
        raise SystemExit("give --model PATH or --qwen-shape")
    print_header("multi-LoRA serving: mixed batch vs no adapter vs one adapter group at a time",
                 {"model": str(path), "requests": args.requests, "adapters": args.adapters, "rank": args.rank,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats})
    model, _ = mf.load(str(path))
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    adapters = write_adapters(model, tmp, args.adapters, args.rank, args.seed)
    names = [f"lora-{k}" for k in range(args.adapters)]
    prompts = bench.make_prompts(model.args.vocab_size, args.requests, args.prompt_tokens, args.seed)
    warm = bench.make_prompts(model.args.vocab_size, args.requests, 8, args.seed + 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    loras = [names[i % args.adapters] for i in range(args.requests)]

    def new_engine() -> Engine:
        cfg = RuntimeConfig(kv_layout="paged", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                            max_num_seqs=max(32, args.requests), prefix_cache=False)
        eng = Engine(model, None, cfg)
        for name, folder in zip(names, adapters):
            eng.add_lora(name, folder)
        return eng

    def base(eng, ps, sp):
        return eng.generate(ps, sp, lora=None)

    def mixed(eng, ps, sp):
        return eng.generate(ps, sp, lora=loras)

    def sequential(eng, ps, sp):
        outs = []
        for name in names:
            group = [p for p, n in zip(ps, loras) if n == name]
            outs.extend(eng.generate(group, sp, lora=name))
        return outs

    def base_sequential(eng, ps, sp):
        outs = []
        for name in names:
            outs.extend(eng.generate([p for p, n in zip(ps, loras) if n == name], sp, lora=None))
        return outs

    sides = {"base": base, "mixed": mixed, "sequential": sequential, "base_sequential": base_sequential}
    unknown = set(args.sides.split(",")) - set(sides)
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; use {', '.join(sides)}")
    sides = {name: fn for name, fn in sides.items() if name in args.sides.split(",")}
    engines = {side: new_engine() for side in sides}
    for side, fn in sides.items():
        fn(engines[side], warm, warm_params)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, fn in sides.items():
            t0 = time.perf_counter()
            outs = fn(engines[side], prompts, params)
            times[side].append(time.perf_counter() - t0)
            assert sum(len(o.token_ids) for o in outs) == args.requests * args.max_tokens
    tokens = args.requests * args.max_tokens
    tps = {side: [tokens / t for t in ts] for side, ts in times.items()}
    med = {side: statistics.median(v) for side, v in tps.items()}
    rows = [[side, f"{med[side]:.1f} ({min(v):.1f}-{max(v):.1f})", f"{statistics.median(times[side]):.2f}"]
            for side, v in tps.items()]
    print_table(["side", "generated tok/s, median (min-max)", "wall s"], rows)
    ratios = {}
    for name, (a, b) in {"mixed_vs_base": ("mixed", "base"), "mixed_vs_sequential": ("mixed", "sequential"),
                         "base_vs_base_sequential": ("base", "base_sequential")}.items():
        if a in med and b in med:
            # per round too: the sides of one round ran back to back, so their ratio is the steadier figure
            paired = sorted(x / y for x, y in zip(tps[a], tps[b]))
            ratios[name] = med[a] / med[b]
            print(f"{a} / {b} = {ratios[name]:.2f}x (per round {paired[0]:.2f}-{paired[-1]:.2f})")
    if "mixed" in engines:
        m = engines["mixed"].lora_metrics_snapshot()
        print(f"mixed engine LoRA metrics: resident {len(m['resident'])}, slot loads {m['slot_loads']}, "
              f"evictions {m['slot_evictions']}, stack bytes {m['stack_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tok_s": tps, "times": times, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
