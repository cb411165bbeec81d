"""KV cache memory per token with ``kv_cache_dtype`` auto / int8 / int4, and what it buys:
concurrent 1,024-token sequences the engine admits at a fixed KV memory budget.

1. **Bytes per KV token** on the Qwen2.5-0.5B shape (24 layers, 2 KV heads, head_dim 64),
   measured from allocated pool arrays (``nbytes`` of every array, scales and biases
   included, divided by the pool's token slots): ``PagedKvPool`` in float16 / bfloat16 /
   float32 for ``auto``, ``QuantizedPagedKvPool`` for int8 and int4. Also the ratio to
   float16.

2. **Admission at a fixed budget**: the pool gets ``budget // bytes_per_block`` blocks of
   each format (bytes per block measured as above), and ``--requests`` requests of
   ``--prompt-tokens`` prompt tokens + ``--max-tokens`` generated (1,024 in all by default)
   are submitted at once to an :class:`~mlx_ferrum.engine.Engine` (paged layout, prefix
   caching off so that nothing is shared). Reported: the most sequences running at once
   (``stats()["num_running"]`` after every step), the preemptions, and the pool's
   allocated bytes. The model has the Qwen2.5-0.5B attention shape (14 heads, 2 KV heads,
   head_dim 64, so the same bytes per token and layer) but ``--layers`` layers (default
   2), hidden 64 and a 512-token vocabulary, in bfloat16 so that ``auto`` stores 2-byte
   K/V as the real checkpoint does; admission depends only on the KV bytes per block, and
   the small model keeps the CPU run to minutes.

   Where the runner does not build quantized storage from ``RuntimeConfig.kv_cache_dtype``
   yet, the int8 / int4 rows run the engine with the auto pool sized to the quantized
   block count (the block count decides admission) and say so (``storage`` column).

Run (from the repository root):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python benchmarks/bench_kv_memory.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import QWEN25_05B_CONFIG, print_header, print_table  # noqa: E402

from mlx_ferrum.config import RuntimeConfig  # noqa: E402
from mlx_ferrum.kv_cache.store import PagedKvPool  # noqa: E402
from mlx_ferrum.kv_cache.quantized import QuantizedPagedKvPool  # noqa: E402

BLOCK_SIZE = 16


def measured_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kind: str,
                             dtype: mx.Dtype = mx.float16, num_blocks: int = 64) -> float:
    """Bytes per token slot of an allocated pool: every array's ``nbytes`` over ``num_blocks * BLOCK_SIZE``."""
    if kind == "auto":
        pool = PagedKvPool(num_layers, num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, dtype)
    else:
        pool = QuantizedPagedKvPool(num_layers, num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, kind)
    return pool.nbytes / (num_blocks * BLOCK_SIZE)


def small_model(num_layers: int, seed: int = 0):
    """A bfloat16 Qwen2 model with Qwen2.5-0.5B's attention shape and a small hidden size."""
    from mlx_ferrum.models.llama import Model, ModelArgs

    cfg = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=num_layers, intermediate_size=128,
               num_attention_heads=QWEN25_05B_CONFIG["num_attention_heads"],
               num_key_value_heads=QWEN25_05B_CONFIG["num_key_value_heads"], head_dim=64, vocab_size=512,
               max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    model = Model(ModelArgs.from_dict(cfg))
    mx.random.seed(seed)
    params = [(k, (mx.random.normal(v.shape) * 0.1).astype(mx.bfloat16)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def quantized_storage(runner) -> bool:
    """True when the runner's store holds a quantized pool."""
    return any(isinstance(o, QuantizedPagedKvPool) for o in [runner.store, *vars(runner.store).values()])


def admission(model, kind: str, budget: int, bytes_per_block: int, requests: int, prompt_tokens: int,
              max_tokens: int) -> dict:
    """Run ``requests`` requests at once on a pool of ``budget // bytes_per_block`` blocks."""
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.engine.sampling import SamplingParams

    blocks = budget // bytes_per_block
    config = RuntimeConfig(kv_layout="paged", kv_cache_dtype=kind, max_num_blocks=blocks, max_num_seqs=requests,
                           prefix_cache=False, block_size=BLOCK_SIZE)
    engine = Engine(model, None, config)
    if kind == "auto":
        storage = "bfloat16 pool"
    else:
        storage = "quantized pool" if quantized_storage(engine.runner) else "bfloat16 pool, quantized block count"
    allocated = engine.runner.store.allocated_bytes()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        engine.add_request([1 + (i * 7 + j) % 500 for j in range(prompt_tokens)], params)
    most = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.stats()["num_running"])
    stats = engine.stats()
    return {"kv_cache_dtype": kind, "blocks": blocks, "allocated_bytes": allocated, "storage": storage,
            "max_running": most, "preemptions": stats["num_preemptions"],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-seqs", type=int, default=8,
                   help="the KV budget, in 1,024-token sequences of auto (bfloat16) KV")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1008)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="layers of the admission model")
    p.add_argument("--skip-admission", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="a smoke run: 6 requests of 112 + 16 tokens, budget 2")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.max_tokens, args.budget_seqs = 6, 112, 16, 2

    info = print_header("KV cache memory: bytes per token and admission at a fixed budget")
    q = QWEN25_05B_CONFIG
    layers, kvh, hd = q["num_hidden_layers"], q["num_key_value_heads"], q["hidden_size"] // q["num_attention_heads"]
    per_token = {}
    for label, kind, dtype in (("auto (float32)", "auto", mx.float32), ("auto (bfloat16/float16)", "auto", mx.float16),
                               ("int8", "int8", None), ("int4", "int4", None)):
        per_token[label] = measured_bytes_per_token(layers, kvh, hd, kind, dtype or mx.float16)
    fp16 = per_token["auto (bfloat16/float16)"]
    print(f"\nBytes per KV token, Qwen2.5-0.5B shape ({layers} layers, {kvh} KV heads, head_dim {hd}), "
          "from allocated pool arrays (scales and biases included)")
    print_table(["kv_cache_dtype", "bytes / token", "per layer", "vs float16"],
                [[k, f"{v:.0f}", f"{v / layers:.1f}", f"{v / fp16:.4f}x"] for k, v in per_token.items()])
    results = {"machine": info, "bytes_per_token": per_token}

    if not args.skip_admission:
        total = args.prompt_tokens + args.max_tokens
        model = small_model(args.layers)
        per_block = {k: int(round(measured_bytes_per_token(args.layers, kvh, hd, k, mx.bfloat16) * BLOCK_SIZE))
                     for k in ("auto", "int8", "int4")}
        budget = args.budget_seqs * -(-total // BLOCK_SIZE) * per_block["auto"]
        print(f"\nAdmission: budget {budget} bytes ({args.budget_seqs} sequences of {total} tokens in bfloat16 KV), "
              f"{args.requests} requests of {args.prompt_tokens} + {args.max_tokens} tokens, {args.layers}-layer model "
              f"with Qwen2.5-0.5B's attention shape")
        rows, adm = [], []
        for kind in ("auto", "int8", "int4"):
            r = admission(model, kind, budget, per_block[kind], args.requests, args.prompt_tokens, args.max_tokens)
            adm.append(r)
        base = adm[0]["max_running"]
        for r in adm:
            rows.append([r["kv_cache_dtype"], per_block[r["kv_cache_dtype"]], r["blocks"], r["allocated_bytes"],
                         r["max_running"], f"{r['max_running'] / base:.2f}x", r["preemptions"], r["storage"],
                         r["seconds"]])
        print_table(["kv_cache_dtype", "bytes / block", "blocks", "allocated bytes", "max running", "vs auto",
                     "preemptions", "storage", "s"], rows)
        results["admission"] = {"budget_bytes": budget, "runs": adm}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
