"""The whole model on the Metal-kernel code path, with the CPU harness standing in for
``mx.fast.metal_kernel``.

With ``FERRUM_METAL_PAGED_KV=1`` and the launcher forced, every attention call of
stories260K (5 layers, GQA 8/4, head_dim 8) runs the decode or prefill kernel in the
harness; the greedy continuation of "Once upon a time" must equal the recorded 200
tokens (produced independently by numpy llama2.c, transformers and mlx-lm).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

import mlx_ferrum as mf
from mlx_ferrum.kernels import metal
from support import metal_harness as mh

pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(
        not mh.clang_available(),
        reason="clang++-19 not installed (apt-get install -y clang-19): the Metal harness compiles kernels with it",
    ),
]


def _greedy(executor, prompt_ids: list[int], n: int) -> list[int]:
    out = executor.prefill(mf.PrefillInput(input_ids=mx.array([prompt_ids])))
    ids = [int(mx.argmax(out.logits[0, -1]).item())]
    cache = out.kv_cache
    while len(ids) < n:
        step = executor.decode(mf.DecodeInput(input_ids=mx.array([[ids[-1]]]), kv_cache=cache))
        cache = step.kv_cache
        ids.append(int(mx.argmax(step.logits.reshape(-1)).item()))
    executor.release_cache(cache.cache_id)
    return ids


def test_paged_model_on_kernels_reproduces_recorded_greedy_output(
    stories_path, stories_expected, monkeypatch, caplog
):
    monkeypatch.setenv("FERRUM_METAL_PAGED_KV", "1")
    monkeypatch.setenv("FERRUM_KV_MAX_BLOCKS", "64")  # the harness copies the pools at every launch
    monkeypatch.delenv("FERRUM_METAL_KERNELS", raising=False)
    rec = stories_expected["once"]
    model, _ = mf.load(str(stories_path))
    before = mh.LAUNCHES.copy()
    caplog.set_level(logging.INFO, logger="mlx_ferrum.kernels")
    # One random schedule per launch keeps 1000 launches fast; the kernel tests run all three.
    with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("random",)):
        ids = _greedy(mf.LlmExecutor(model, config=None), rec["prompt_ids"], rec["max_new_tokens"])
    decode = mh.LAUNCHES["paged_attention_decode"] - before["paged_attention_decode"]
    prefill = mh.LAUNCHES["paged_prefill_attention"] - before["paged_prefill_attention"]
    layers = len(model.layers)
    assert prefill == layers, "the prompt did not go through the prefill kernel in every layer"
    assert decode == layers * (rec["max_new_tokens"] - 1), "some decode steps did not use the kernel"
    assert not [r for r in caplog.records if "reference" in r.getMessage()], "a call fell back to the reference"
    assert ids == rec["generated_ids"]
