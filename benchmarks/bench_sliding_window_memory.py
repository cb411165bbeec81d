"""KV bytes held for one long sequence on a Gemma-3-shaped model: sliding-window block
freeing (per layer group) vs full attention, and mlx-lm's rotating cache, in one run.

Usage::

    python benchmarks/bench_sliding_window_memory.py            # 4096 tokens, window 1024
    python benchmarks/bench_sliding_window_memory.py --tokens 1024 --window 256   # quicker

Model: Gemma 3's layer pattern (5 sliding layers with ``--window`` per global layer,
6 layers), with narrow widths (hidden 256, 4/1 heads of head_dim 64, vocab 1024) since
KV bytes depend only on layers, KV heads, head_dim and dtype. Random weights, float32.

Measured: the sequence is prefilled in chunks of 512 tokens through ``LlmExecutor``
(paged, block_size 16); then the bytes of KV its blocks hold are read from the
executor (``status().memory_usage.used_bytes``: blocks in use per layer group x bytes
per block of that group's layers). The same with every layer made global gives the
full-attention figure; the ratio is the target (<= 0.40 for 4096 tokens and window
1024). mlx-lm's figure is the ``nbytes`` of its per-layer caches after the same
prefill (``RotatingKVCache`` for the sliding layers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import fmt_bytes, print_header, print_table  # noqa: E402


def gemma3_config(window: int, all_global: bool = False) -> dict:
    types = ["full_attention" if (i + 1) % 6 == 0 or all_global else "sliding_attention" for i in range(6)]
    return {
        "model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1024,
        "sliding_window": window, "layer_types": types, "query_pre_attn_scalar": 64,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }


def ferrum_bytes(cfg: dict, tokens: list[int], chunk: int = 512) -> int:
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.executor import LlmExecutor, PrefillInput
    from mlx_ferrum.models import build_model

    mx.random.seed(0)
    model = build_model(cfg)
    mx.eval(model.parameters())
    n_blocks = len(tokens) // 16 + 8
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=n_blocks,
                                          kv_capacity=len(tokens) + 16))
    handle = None
    for i in range(0, len(tokens), chunk):
        out = ex.prefill(PrefillInput(input_ids=mx.array([tokens[i : i + chunk]]), kv_cache=handle))
        handle = out.kv_cache
    return ex.status().memory_usage.used_bytes


def mlx_lm_bytes(cfg: dict, tokens: list[int], chunk: int = 512) -> int:
    from mlx_lm.models import gemma3_text

    args = dict(cfg)
    args["sliding_window_pattern"] = 6
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    cache = model.make_cache()
    for i in range(0, len(tokens), chunk):
        mx.eval(model(mx.array([tokens[i : i + chunk]]), cache=cache))
    return sum(c.nbytes for c in cache)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="1024 tokens, window 256 (same 4:1 ratio of length to window)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.window = 1024, 256
    print_header("bench_sliding_window_memory: KV bytes held, Gemma-3 layer pattern (5 sliding : 1 global)",
                 {"sequence": f"{args.tokens} tokens, prefill chunks of 512, window {args.window}, fp32, block 16"})
    tokens = [int(t) for t in mx.random.randint(0, 1024, (args.tokens,), key=mx.random.key(0)).tolist()]
    windowed = ferrum_bytes(gemma3_config(args.window), tokens)
    full = ferrum_bytes(gemma3_config(args.window, all_global=True), tokens)
    ref = mlx_lm_bytes(gemma3_config(args.window), tokens)
    print_table(
        ["cache", "KV bytes held", "bytes", "ratio to full attention"],
        [
            ["mlx_ferrum paged, sliding groups freed", fmt_bytes(windowed), windowed, f"{windowed / full:.3f}"],
            ["mlx_ferrum paged, all layers global", fmt_bytes(full), full, "1.000"],
            ["mlx-lm (RotatingKVCache for sliding layers)", fmt_bytes(ref), ref, f"{ref / full:.3f}"],
        ],
    )
    print(f"\n   ratio windowed / full attention: {windowed / full:.3f} (target <= 0.40); "
          f"mlx_ferrum / mlx-lm: {windowed / ref:.3f}")
    return {"windowed": windowed, "full": full, "mlx_lm": ref, "ratio": windowed / full}


if __name__ == "__main__":
    main()
