"""Tiny sliding-window models on the Metal-kernel path, with the CPU harness standing in
for ``mx.fast.metal_kernel``.

Mistral (every layer windowed) and gpt-oss (a sliding layer with sinks and a full layer
with sinks) checkpoints written by transformers (tests/support/hf_reference.py), a prompt three
windows long prefilled in two chunks of at most 16 rows (so both go through the prefill
kernel) and 12 decode steps through the decode kernel: the greedy tokens must equal
transformers' eager forward, the logits within 1e-3, and no call may fall back to the
reference.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.kernels import metal
from mlx_ferrum.models import load_model
from support import metal_harness as mh

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(
        not mh.clang_available(),
        reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
    ),
]

WINDOW = 10
PROMPT_LEN = 3 * WINDOW
NEW_TOKENS = 12
ATOL = 1e-3


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_window_model_on_kernels_matches_transformers(family, tmp_path, caplog, monkeypatch):
    from support.hf_reference import VOCAB, executor_greedy, make_checkpoint, reference_greedy

    monkeypatch.delenv("FERRUM_METAL_KERNELS", raising=False)
    ref = make_checkpoint(family, tmp_path, window=WINDOW)
    for seed in range(8):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, PROMPT_LEN)]
        expected, ref_logits = reference_greedy(ref, prompt, NEW_TOKENS)
        top2 = np.sort(ref_logits[PROMPT_LEN - 1 : -1], axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min() > 10 * ATOL:
            break
    else:
        raise AssertionError("no prompt without near-ties in the reference: rescale the test weights")
    model, _, _ = load_model(tmp_path)
    cfg = RuntimeConfig(kv_layout="paged", kv_capacity=128, block_size=8, max_num_blocks=32)
    before = mh.LAUNCHES.copy()
    caplog.set_level(logging.INFO, logger="mlx_ferrum.kernels")
    with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("random",)):
        ex = LlmExecutor(model, config=cfg)
        tokens, ours = executor_greedy(ex, prompt, PROMPT_LEN // 2 + 1, NEW_TOKENS)
    layers = len(model.layers)
    assert mh.LAUNCHES["paged_prefill_attention"] - before.get("paged_prefill_attention", 0) == 2 * layers
    assert mh.LAUNCHES["paged_attention_decode"] - before.get("paged_attention_decode", 0) == \
        layers * (NEW_TOKENS - 1)
    assert not [r for r in caplog.records if "reference" in r.getMessage()], "a call fell back to the reference"
    assert tokens == expected, family
    assert float(np.abs(ours - ref_logits[: ours.shape[0]]).max()) <= ATOL, family
