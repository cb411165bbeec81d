"""Parity with mlx-lm: full-sequence logits (float32, 1e-4) and 32 greedy tokens.

Each checkpoint is loaded twice, by our loader and by ``mlx_lm.utils.load_model``
(an independent implementation of the same architectures). mlx-lm generates 32
greedy tokens with its own KV cache (``generate_step``); we must produce the same
tokens three ways: re-running ``model(ids)`` over the whole sequence at every step,
and through ``LlmExecutor`` prefill + decode in both KV layouts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from support.checkpoints import FAMILIES, cached_checkpoint
from mlx_ferrum.models import load_model

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
mlx_lm_generate = pytest.importorskip("mlx_lm.generate")

NEW_TOKENS = 32
ATOL = 1e-4


def _prompt(vocab: int, n: int = 16, seed: int = 0) -> list[int]:
    return [int(t) for t in mx.random.randint(3, vocab, (n,), key=mx.random.key(seed)).tolist()]


def _reference_greedy(ref_model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """mlx-lm's own generation loop (prefill, then KV-cached decode; argmax sampler)."""
    steps = mlx_lm_generate.generate_step(mx.array(prompt), ref_model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def _greedy_full_recompute(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(mx.array([ids]))
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids[len(prompt):]


def _greedy_executor(model, prompt: list[int], layout: str, n: int = NEW_TOKENS) -> list[int]:
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput

    cfg = RuntimeConfig(kv_layout=layout, kv_capacity=256, max_num_blocks=64 if layout == "paged" else None)
    ex = LlmExecutor(model, config=cfg)
    out = ex.prefill(PrefillInput(input_ids=mx.array([prompt])))
    tok = int(mx.argmax(out.logits[0, -1]).item())
    toks, handle = [tok], out.kv_cache
    for _ in range(n - 1):
        step = ex.decode(DecodeInput(input_ids=mx.array([[tok]]), kv_cache=handle))
        handle = step.kv_cache
        tok = int(mx.argmax(step.logits.reshape(-1)).item())
        toks.append(tok)
    ex.release_cache(handle.cache_id)
    return toks


def _min_margin(logits: mx.array) -> float:
    """Smallest gap between the top two logits over the rows of ``[N, vocab]``."""
    top2 = mx.sort(logits.astype(mx.float32), axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).min().item()


def _clear_prompt(ref_model, vocab: int) -> tuple[list[int], list[int]]:
    """A prompt whose 32 greedy steps (by mlx-lm) have no near-tie in the top two logits.

    With random weights a top-2 gap below float rounding happens by chance; at such a
    step two correct implementations may legitimately pick different tokens. The
    choice uses only the reference's logits, so it cannot hide an error of ours.
    """
    for seed in range(8):
        prompt = _prompt(vocab, seed=seed)
        expected = _reference_greedy(ref_model, prompt)
        logits = ref_model(mx.array([prompt + expected]))[0, len(prompt) - 1 : -1]
        if _min_margin(logits) > 10 * ATOL:
            return prompt, expected
    raise AssertionError("no prompt without near-ties found: rescale the test checkpoint's weights")


def _max_abs(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def _check_parity(folder: Path, prompt_ids=None, executor: bool = True):
    ours, config, _ = load_model(folder)
    ref, _ = mlx_lm_utils.load_model(Path(folder))
    if prompt_ids is None:
        prompt, expected = _clear_prompt(ref, config["vocab_size"])
    else:
        prompt, expected = list(prompt_ids), _reference_greedy(ref, list(prompt_ids))
    assert len(expected) == NEW_TOKENS
    seq = mx.array([prompt + expected])

    a, b = ours(seq), ref(seq)
    assert a.dtype == mx.float32 and a.shape == b.shape == (1, seq.shape[1], config["vocab_size"])
    err = _max_abs(a, b)
    assert err <= ATOL, f"max |logits - mlx-lm| = {err:.3g}"

    assert _greedy_full_recompute(ours, prompt) == expected
    if executor:
        for layout in ("contiguous", "paged"):
            assert _greedy_executor(ours, prompt, layout) == expected, layout
    return ours, ref, prompt, expected


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_mlx_lm(family):
    _check_parity(cached_checkpoint(family))


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_mlx_4bit_checkpoint_matches_mlx_lm(family):
    ours, _, _, _ = _check_parity(cached_checkpoint(family, quantized=True))
    import mlx.nn as nn

    assert isinstance(ours.model.embed_tokens, nn.QuantizedEmbedding)


def test_sharded_checkpoint_matches_mlx_lm():
    _check_parity(cached_checkpoint("mistral", sharded=True), executor=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_written_config_loads_the_same(family):
    """transformers >= 5 writes ``rope_parameters`` and ``dtype``; mlx-lm 0.32's llama
    reads only ``rope_theta``/``rope_scaling``, so the reference here is our own load
    of the hub-style json with identical weights (itself checked against mlx-lm above)."""
    a, ca, _ = load_model(cached_checkpoint(family, style="transformers"))
    b, cb, _ = load_model(cached_checkpoint(family))
    assert "rope_parameters" in ca and "rope_theta" not in ca
    assert a.args.rope_theta == b.args.rope_theta
    seq = mx.array([_prompt(cb["vocab_size"], 24)])
    assert mx.array_equal(a(seq), b(seq))


@pytest.mark.parametrize("family", ["llama3", "llama_linear"])
def test_rope_scaling_is_exercised(family, tmp_path):
    """The parity tests would catch a loader or model that ignored ``rope_scaling``."""
    folder = tmp_path / family
    shutil.copytree(cached_checkpoint(family), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(cfg))
    unscaled, _, _ = load_model(folder)
    ref, _ = mlx_lm_utils.load_model(cached_checkpoint(family))
    seq = mx.array([_prompt(cfg["vocab_size"], 16 + NEW_TOKENS)])
    assert _max_abs(unscaled(seq), ref(seq)) > 10 * ATOL


def test_stories260k_matches_mlx_lm_and_the_recording(stories_path, stories_expected):
    once = stories_expected["once"]
    _, _, _, expected = _check_parity(stories_path, prompt_ids=list(once["prompt_ids"]))
    assert expected == once["generated_ids"][:NEW_TOKENS]
