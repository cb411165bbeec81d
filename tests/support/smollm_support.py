"""The real chat model SmolLM2-135M-Instruct in ../shared/models, and its recorded replies.

``greedy_chat.json`` holds greedy replies (temperature 0, float32, up to 48 tokens, ending
with ``<|im_end|>``, id 2) recorded with transformers' GGUF loader and cross-checked with
mlx-lm: the independent reference every SmolLM2 test compares against.

The 4-bit folder runs at about 10 tokens/s on these CPUs (MLX's CPU quantized matmul
multiplies one row at a time, so a batch costs as many single steps); tests that batch
many requests use :func:`dequantized_float32`, the same weights as plain float32 matrices,
whose matmuls go through BLAS and batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED_MODELS = Path(os.environ.get("FERRUM_SHARED_MODELS", Path(__file__).resolve().parents[3] / "shared" / "models"))
SMOLLM = SHARED_MODELS / "SmolLM2-135M-Instruct"


def smollm_path() -> Path:
    """The SmolLM2 folder; skips the test when ../shared is absent."""
    if not (SMOLLM / "config.json").exists() or not (SMOLLM / "greedy_chat.json").exists():
        pytest.skip(f"SmolLM2-135M-Instruct not found at {SMOLLM} (set FERRUM_SHARED_MODELS)")
    return SMOLLM


def recorded_cases() -> list[dict]:
    """The recorded conversations: ``messages``, ``prompt_ids``, ``greedy_transformers``
    (reply ids, ``<|im_end|>`` included when the model stopped) and ``text_transformers``."""
    return json.loads((smollm_path() / "greedy_chat.json").read_text())["cases"]


def load_float32():
    """``mlx_ferrum.load`` of the 4-bit folder computing in float32 (scales and biases cast)."""
    import mlx.core as mx

    import mlx_ferrum as mf

    return mf.load(str(smollm_path()), dtype=mx.float32)


def dequantized_float32():
    """The 4-bit folder's weights dequantized to float32 matrices in memory (mlx-lm's
    ``dequantize_model``), so batched steps cost about one step; skips without mlx-lm."""
    import mlx.core as mx

    utils = pytest.importorskip("mlx_lm.utils")
    model, tokenizer = load_float32()
    model = utils.dequantize_model(model)
    mx.eval(model.parameters())
    return model, tokenizer
