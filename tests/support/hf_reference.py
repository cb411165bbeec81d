"""Tiny random checkpoints written by transformers' own ``save_pretrained`` (Hub
layout), and transformers' eager forward as the reference.

Needs torch and transformers (the ``ref`` extra); tests importing this module skip
with a reason when they are missing. Nothing is downloaded: each checkpoint is built
from a config class with random weights, in a temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is missing: install the test extra with pip install -e '.[ref]'")
transformers = pytest.importorskip(
    "transformers", reason="transformers is missing: install the test extra with pip install -e '.[ref]'"
)

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.08)


def _mistral(window: int) -> Any:
    return transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=512, **_COMMON,
    )


def _qwen3_moe(window: int) -> Any:
    return transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512, **_COMMON,
    )


def _gemma3(window: int) -> Any:
    return transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=window, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        max_position_embeddings=512, **_COMMON,
    )


def _gpt_oss(window: int) -> Any:
    return transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        },
        **_COMMON,
    )


def _phi3(window: int) -> Any:
    half = 8  # head_dim 16 -> 8 frequencies
    return transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=256,
        sliding_window=window,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 256,
        },
        **_COMMON,
    )


CONFIGS: dict[str, Callable[[int], Any]] = {
    "mistral": _mistral,
    "qwen3_moe": _qwen3_moe,
    "gemma3_text": _gemma3,
    "gpt_oss": _gpt_oss,
    "phi3": _phi3,
}


def make_checkpoint(family: str, folder: Path, window: int = 8, seed: int = 0) -> Any:
    """Save a random tiny ``family`` model with ``save_pretrained`` into ``folder``;
    return the torch model (float32, eval, eager attention)."""
    torch.manual_seed(seed)
    config = CONFIGS[family](window)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    if family == "gpt_oss":
        # transformers initializes sinks and router bias to zero; random values exercise them
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
                layer.mlp.router.bias.normal_(0.0, 0.5)
    if family == "gemma3_text":
        with torch.no_grad():  # Gemma's (1+w) norms start at w = 0; random w exercises them
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' eager forward: ``[len(ids), vocab]`` float32 logits."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.float().numpy()


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """``n`` greedy tokens from transformers' ``generate`` (its own KV cache, sliding
    layers included); also the eager full-sequence logits of prompt + tokens, which the
    caller uses for the per-position check and the top-2 margins."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
    ids = [int(t) for t in out[0]]
    return ids[len(prompt):], reference_logits(model, ids)


def executor_greedy(executor, prompt: list[int], split: int, n: int) -> tuple[list[int], np.ndarray]:
    """The code under test's side of the parity checks: prefill ``prompt[:split]`` then
    ``prompt[split:]`` (when ``split < len(prompt)``) with every position's logits, then
    greedy decodes until ``n`` tokens. Returns the tokens and the float32 logits
    ``[len(prompt) + n - 1, vocab]`` (every prompt position, then each decode step);
    the cache is released."""
    import mlx.core as mx

    from mlx_ferrum.executor import DecodeInput, PrefillInput

    out = executor.prefill(PrefillInput(input_ids=mx.array([prompt[:split]]), return_all_logits=True))
    rows = [out.logits[0]]
    if split < len(prompt):
        out = executor.prefill(PrefillInput(input_ids=mx.array([prompt[split:]]), kv_cache=out.kv_cache,
                                            return_all_logits=True))
        rows.append(out.logits[0])
    handle = out.kv_cache
    tokens = [int(mx.argmax(rows[-1][-1]).item())]
    for _ in range(n - 1):
        step = executor.decode(DecodeInput(input_ids=mx.array([[tokens[-1]]]), kv_cache=handle))
        handle = step.kv_cache
        rows.append(step.logits.reshape(1, -1))
        tokens.append(int(mx.argmax(step.logits.reshape(-1)).item()))
    executor.release_cache(handle.cache_id)
    return tokens, np.array(mx.concatenate(rows, axis=0).astype(mx.float32))
