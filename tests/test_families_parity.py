"""Every family against transformers' eager forward, on prompts longer than the window.

For each family a tiny random checkpoint is written by transformers' own
``save_pretrained`` (Hub layout) and loaded by our loader. Targets:
float32 logits within 1e-3 of transformers at every position, and 32 greedy tokens
identical, with no cache and through ``LlmExecutor`` in both KV layouts (the paged
prefill in two chunks, so the second reads the first from the pool).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from support.hf_reference import CONFIGS, VOCAB, executor_greedy, make_checkpoint, reference_greedy
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.models import load_model

ATOL = 1e-3
NEW_TOKENS = 32
WINDOW = 10
PROMPT_LEN = 3 * WINDOW


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    ref = make_checkpoint(family, folder, window=WINDOW)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(3, VOCAB, PROMPT_LEN)]
        expected, logits = reference_greedy(ref, prompt, NEW_TOKENS)
        top2 = np.sort(logits[PROMPT_LEN - 1 : -1], axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min() > 10 * ATOL:
            break
    else:
        raise AssertionError("no prompt without near-ties in the reference: rescale the test weights")
    model, config, _ = load_model(folder)
    return family, model, ref, prompt, expected, logits


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float32) - np.asarray(b, dtype=np.float32)).max())


def test_logits_match_transformers_without_cache(case):
    family, model, _, prompt, expected, ref_logits = case
    ours = np.array(model(mx.array([prompt + expected]))[0].astype(mx.float32))
    assert ours.shape == ref_logits.shape
    assert _err(ours, ref_logits) <= ATOL, family


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_executor_logits_and_greedy_tokens_match_transformers(case, layout):
    family, model, _, prompt, expected, ref_logits = case
    cfg = RuntimeConfig(kv_layout=layout, kv_capacity=256, block_size=8, max_num_blocks=128 if layout == "paged" else None)
    ex = LlmExecutor(model, config=cfg)
    split = PROMPT_LEN // 2 + 1 if layout == "paged" else PROMPT_LEN
    tokens, ours = executor_greedy(ex, prompt, split, NEW_TOKENS)
    assert tokens == expected, family
    assert _err(ours, ref_logits[: ours.shape[0]]) <= ATOL, family
