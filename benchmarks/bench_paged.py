"""Batched decode of many sequences of mixed lengths: paged vs contiguous vs mlx-lm's BatchGenerator.

Usage::

    python benchmarks/bench_paged.py                  # 8 and 32 sequences, small random Qwen2-shaped model
    python benchmarks/bench_paged.py --quick          # 4 and 8 sequences, short prompts (< 60 s)
    python benchmarks/bench_paged.py --model PATH --dtype float32 --seqs 8,32

For each batch size N, N prompts with lengths drawn uniformly from
``[--min-prompt, --max-prompt]`` (seeded, the same for every engine) are prefilled
(not timed), then every engine decodes ``--gen`` greedy steps with all N sequences in
each step. Reported:

- aggregate decode tok/s = N * steps / wall time of the steps (host argmax and token
  feedback included on every side);
- KV held / ideal, right after the last step. Ideal = tokens stored x bytes per token
  (all layers, K and V, the model dtype). Held:
  - mlx_ferrum paged: blocks in use x block bytes (``manager.num_in_use``;
    the rest of the pool is free for other sequences, so it is not counted),
  - mlx_ferrum contiguous: the sum of every sequence's buffer capacities,
  - mlx-lm: the ``nbytes`` of its batch cache arrays (``BatchGenerator.prompt_cache_nbytes``).

Engines:

- ``ferrum paged``: ``LlmExecutor.batch_decode`` with ``RuntimeConfig(kv_layout="paged")``,
  one forward pass for all sequences, ragged contexts, no padding;
- ``ferrum contiguous``: ``batch_decode`` with the contiguous layout (rows padded to
  the longest cache and masked);
- ``mlx-lm``: ``mlx_lm.generate.BatchGenerator`` (left-padded ``BatchKVCache``), its
  ``next()`` called once per step; ``completion_batch_size`` and
  ``prefill_batch_size`` are N so that all sequences decode together.

The default model copies Qwen2's structure (q/k/v bias, GQA, tied embeddings, head_dim
64, 2 KV heads as in Qwen2.5-0.5B) at a size a 2-core CPU decodes in seconds: hidden
256, 6 layers, 4 heads, intermediate 768, vocab 8192, bf16.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import QWEN25_05B_CONFIG, cached_random_checkpoint, fmt_bytes, parse_dtype, print_header, print_table, scaled_config  # noqa: E402

SMALL_QWEN2 = scaled_config(
    QWEN25_05B_CONFIG,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    num_hidden_layers=6,
    vocab_size=8192,
    max_position_embeddings=4096,
)
"""The default model: Qwen2 structure, Qwen2.5-0.5B's KV geometry per layer (2 heads x 64)."""


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a small random Qwen2-shaped one)")
    ap.add_argument("--seqs", default="8,32", help="batch sizes, comma separated (default 8,32)")
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=320)
    ap.add_argument("--gen", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warm", type=int, default=2, help="untimed decode steps before timing")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--engines", default="paged,contiguous,mlx-lm", help="subset of paged,contiguous,mlx-lm")
    ap.add_argument("--quick", action="store_true", help="4 and 8 sequences, short prompts (CI smoke test)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the random checkpoint")
    ap.add_argument("--json", help="also write the results to this json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.min_prompt, args.max_prompt, args.gen, args.warm = "4,8", 16, 64, 8, 1
    return args


def bytes_per_token(cfg: dict, dtype) -> int:
    """KV bytes one token costs over all layers, K and V."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * dtype.size


def run_ferrum(model, layout: str, prompts: list[list[int]], args, per_tok: int) -> dict:
    """Prefill (untimed), ``warm`` + ``gen`` batched greedy decode steps; tok/s and KV held."""
    import mlx_ferrum as mf
    from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput

    total = sum(len(p) for p in prompts) + len(prompts) * (args.gen + args.warm + 1)
    blocks = 2 * (-(-total // args.block_size) + len(prompts))  # room to spare: held != pool size
    cfg = mf.RuntimeConfig(kv_layout=layout, block_size=args.block_size, max_num_blocks=blocks)
    ex = LlmExecutor(model, cfg)
    t0 = time.perf_counter()
    outs = ex.batch_prefill([PrefillInput(input_ids=mx.array([p], dtype=mx.int32)) for p in prompts])
    prefill_s = time.perf_counter() - t0
    handles = [o.kv_cache for o in outs]
    tokens = mx.argmax(mx.concatenate([o.logits[:, -1, :] for o in outs], axis=0), axis=-1).tolist()
    t0 = 0.0
    for step in range(args.warm + args.gen):
        if step == args.warm:
            t0 = time.perf_counter()
        outs = ex.batch_decode(
            [DecodeInput(input_ids=mx.array([[t]], dtype=mx.int32), kv_cache=h) for t, h in zip(tokens, handles)]
        )
        handles = [o.kv_cache for o in outs]
        tokens = mx.argmax(mx.concatenate([o.logits for o in outs], axis=0), axis=-1).tolist()
    decode_s = time.perf_counter() - t0
    stored = sum(h.num_tokens for h in handles)
    if layout == "paged":
        held = ex.manager.num_in_use * args.block_size * per_tok
    else:
        held = ex.cache_metrics_snapshot()["allocated_bytes"]
    res = {
        "prefill_s": prefill_s,
        "decode_tps": len(prompts) * args.gen / decode_s,
        "held": held,
        "ideal": stored * per_tok,
        "pool_bytes": ex.kv_allocated_bytes(),
    }
    ex.shutdown()
    return res


def run_mlx_lm(lm, prompts: list[list[int]], args, per_tok: int) -> dict:
    """The same workload through ``BatchGenerator``: prefill until every sequence has its
    first token, ``warm`` untimed then ``gen`` timed ``next()`` steps."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(
        lm, max_tokens=args.gen + args.warm + 8, completion_batch_size=n, prefill_batch_size=n
    )
    try:
        t0 = time.perf_counter()
        gen.insert(prompts)
        first = set()
        while len(first) < n:
            _, responses = gen.next()
            first.update(r.uid for r in responses)
        prefill_s = time.perf_counter() - t0
        produced = 0
        for step in range(args.warm + args.gen):
            if step == args.warm:
                t0 = time.perf_counter()
                produced = 0
            _, responses = gen.next()
            produced += len(responses)
        decode_s = time.perf_counter() - t0
        if produced != n * args.gen:
            raise RuntimeError(f"mlx-lm produced {produced} tokens in {args.gen} steps, expected {n * args.gen}")
        caches = gen._generation_batch.prompt_cache  # the per-layer BatchKVCache objects
        mx.eval([c.state[:2] for c in caches])
        # offset = real tokens per row (its left padding excluded)
        stored = sum(int(x) for x in caches[0].offset.tolist())
        held = gen.prompt_cache_nbytes
    finally:
        gen.close()
    return {
        "prefill_s": prefill_s,
        "decode_tps": n * args.gen / decode_s,
        "held": held,
        "ideal": stored * per_tok,
        "pool_bytes": held,
    }


def main(argv=None) -> dict:
    """Run every engine at every batch size; print the table and return the results."""
    args = parse_args(argv)
    from mlx_ferrum.models.loader import load_model
    from mlx_lm.utils import load_model as lm_load_model

    if args.model:
        path = Path(args.model)
    else:
        path = cached_random_checkpoint("qwen2-small", SMALL_QWEN2, "bfloat16", args.rebuild)
    cfg = json.loads((path / "config.json").read_text())
    dtype = parse_dtype(args.dtype) if args.dtype else None
    sizes = [int(s) for s in args.seqs.split(",")]
    engines = args.engines.split(",")
    info = print_header(
        "bench_paged: batched greedy decode of mixed-length sequences",
        {
            "checkpoint": str(path),
            "model": f"{cfg.get('model_type')} hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
            f"heads={cfg['num_attention_heads']}/{cfg['num_key_value_heads']} vocab={cfg['vocab_size']}",
            "dtype": args.dtype or f"checkpoint ({cfg.get('torch_dtype', '?')})",
            "workload": f"prompts U[{args.min_prompt},{args.max_prompt}] tokens, {args.warm} warm + {args.gen} timed "
            f"steps, block_size={args.block_size}",
        },
    )
    model, _, _ = load_model(str(path), dtype=dtype)
    lm, _ = lm_load_model(path)
    if dtype is not None:
        lm.set_dtype(dtype)
    mx.eval(model.parameters(), lm.parameters())
    from mlx_ferrum.executor.llm_executor import model_dtype

    per_tok = bytes_per_token(cfg, model_dtype(model))
    rng = random.Random(0)
    vocab = cfg["vocab_size"]
    results: dict[int, dict[str, dict]] = {}
    # warm up every engine's code paths once on a tiny batch
    warm_prompts = [[rng.randrange(3, vocab) for _ in range(8 + i)] for i in range(2)]
    small = argparse.Namespace(**{**vars(args), "gen": 2, "warm": 1})
    for eng in engines:
        (run_mlx_lm(lm, warm_prompts, small, per_tok) if eng == "mlx-lm" else run_ferrum(model, eng, warm_prompts, small, per_tok))
    for n in sizes:
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))] for _ in range(n)]
        results[n] = {}
        for eng in engines:
            if eng == "mlx-lm":
                r = run_mlx_lm(lm, prompts, args, per_tok)
            else:
                r = run_ferrum(model, eng, prompts, args, per_tok)
            results[n][eng] = r
            gc.collect()
            mx.clear_cache()
            print(f"   N={n:<3} {eng:<11} prefill {r['prefill_s']:.1f} s, decode {r['decode_tps']:.1f} tok/s")
    print()
    rows = []
    for n, by in results.items():
        ref = by.get("mlx-lm", {}).get("decode_tps")
        for eng, r in by.items():
            rows.append(
                [
                    n,
                    {"paged": "mlx_ferrum paged", "contiguous": "mlx_ferrum contiguous"}.get(eng, eng),
                    f"{r['decode_tps']:.1f}",
                    f"{r['decode_tps'] / ref:.2f}x" if ref else "-",
                    fmt_bytes(r["held"]),
                    fmt_bytes(r["ideal"]),
                    f"{r['held'] / r['ideal']:.3f}",
                ]
            )
    print_table(["seqs", "engine", "decode tok/s (aggregate)", "vs mlx-lm", "KV held", "KV ideal", "held / ideal"], rows)
    out = {"machine": info, "args": vars(args), "results": {str(k): v for k, v in results.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
