"""Qwen3-MoE decode: mlx_ferrum's Engine vs mlx-lm's BatchGenerator at 1 and 32 requests.

Usage::

    python benchmarks/bench_moe.py            # Qwen3-MoE-shaped random checkpoint (6 layers), 1 and 32 requests
    python benchmarks/bench_moe.py --quick    # 2 layers, 1 and 8 requests, short runs (smoke test)

The checkpoint keeps Qwen3-30B-A3B's routing shape (128 experts, 8 per token,
``norm_topk_prob``, q/k RMSNorm, GQA 32/4 heads of head_dim 128 scaled to 16/2) with
the widths cut to fit a CPU run: hidden 1024, moe_intermediate 256, 6 layers, vocab
32000, random ``N(0, 0.02)`` weights in the Hub layout (one tensor per expert). The
config carries both key spellings (``num_experts`` and ``num_local_experts``,
``rope_theta`` and ``rope_parameters``) so mlx-lm 0.32 loads it too. Everything else
(timing, alternation of the sides, medians, ratios) is ``bench_engine.py``'s; its
options pass through (``--repeats``, ``--max-tokens``, ``--openblas`` ...).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import _write_wordlevel_tokenizer, parse_dtype  # noqa: E402

QWEN3_MOE_SHAPED = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_experts": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": 1,
    "initializer_range": 0.02,
}


def build_checkpoint(folder: Path, cfg: dict, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random Qwen3-MoE checkpoint in the Hub layout (per-expert tensors) to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / ".complete"
    stamp = json.dumps([cfg, dtype], sort_keys=True)
    if marker.is_file() and marker.read_text() == stamp:
        return folder
    t0 = time.perf_counter()
    (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=dtype), indent=2))
    mx.random.seed(seed)
    dt = parse_dtype(dtype)
    h, e, mi = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    nh, nkv, hd, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]

    def rnd(*shape):
        return (0.02 * mx.random.normal(shape)).astype(dt)

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": mx.ones((h,), dt), "lm_head.weight": rnd(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": mx.ones((h,), dt),
            p + "post_attention_layernorm.weight": mx.ones((h,), dt),
            p + "self_attn.q_proj.weight": rnd(nh * hd, h),
            p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
            p + "self_attn.v_proj.weight": rnd(nkv * hd, h),
            p + "self_attn.o_proj.weight": rnd(h, nh * hd),
            p + "self_attn.q_norm.weight": mx.ones((hd,), dt),
            p + "self_attn.k_norm.weight": mx.ones((hd,), dt),
            p + "mlp.gate.weight": rnd(e, h),
        })
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            w[q + "gate_proj.weight"] = rnd(mi, h)
            w[q + "up_proj.weight"] = rnd(mi, h)
            w[q + "down_proj.weight"] = rnd(h, mi)
        mx.eval(w)
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "pt"})
    _write_wordlevel_tokenizer(folder, v)
    marker.write_text(stamp)
    print(f"   built random Qwen3-MoE checkpoint {folder} in {time.perf_counter() - t0:.1f} s")
    return folder


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    cfg = dict(QWEN3_MOE_SHAPED)
    name = "qwen3-moe-shaped"
    if quick:
        cfg["num_hidden_layers"] = 2
        name += "-2layer"
    import bench_engine

    if "--openblas" not in argv:
        bench_engine.ensure_blas("auto")
    folder = build_checkpoint(Path(tempfile.gettempdir()) / "mlx_ferrum_bench" / name, cfg)
    args = ["--model", str(folder)]
    if not any(a.startswith("--concurrency") for a in argv):
        args += ["--concurrency", "1,8" if quick else "1,32"]
    return bench_engine.main(args + argv)


if __name__ == "__main__":
    main()
