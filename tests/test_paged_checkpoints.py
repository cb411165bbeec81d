"""Paged equals contiguous on every test checkpoint (HF layout, incl. MLX 4-bit).

fp32 logits agree within 1e-5 and greedy tokens are identical, for block sizes 8, 16
and 32, with a prompt length that is not a multiple of any of them.
"""

import mlx.core as mx
import numpy as np
import pytest

from support.checkpoints import FAMILIES, cached_checkpoint
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
from mlx_ferrum.models import load_model

CASES = [(f, False) for f in FAMILIES] + [("llama3", True), ("qwen2", True)]


def greedy_trace(ex, prompt, steps):
    out = ex.prefill(PrefillInput(input_ids=mx.array([prompt]), return_all_logits=True))
    rows = [np.array(out.logits[0])]
    h = out.kv_cache
    tok = int(np.argmax(rows[0][-1]))
    toks = []
    for _ in range(steps):
        toks.append(tok)
        o = ex.decode(DecodeInput(input_ids=mx.array([[tok]]), kv_cache=h))
        h = o.kv_cache
        rows.append(np.array(o.logits))
        tok = int(np.argmax(rows[-1][-1]))
    return np.concatenate(rows), toks


@pytest.mark.parametrize("family,quantized", CASES, ids=[f + ("-4bit" if q else "") for f, q in CASES])
def test_paged_equals_contiguous(family, quantized):
    path = cached_checkpoint(family, quantized=quantized)
    model, cfg, _ = load_model(path, dtype=None if quantized else mx.float32)
    prompt = [(7 * i + 3) % 200 + 3 for i in range(13)]
    ref_logits, ref_toks = greedy_trace(LlmExecutor(model, RuntimeConfig(kv_layout="contiguous")), prompt, 24)
    for bs in (8, 16, 32):
        ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=bs, max_num_blocks=32))
        logits, toks = greedy_trace(ex, prompt, 24)
        assert toks == ref_toks, f"block_size={bs}"
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, err_msg=f"block_size={bs}")
