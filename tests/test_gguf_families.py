"""qwen2 (q/k/v bias) and qwen3 (q/k RMSNorm) GGUF files, which llama.cpp stores without
the llama q/k permutation: logits and greedy tokens against transformers' GGUF loader."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.gguf_fixtures import VOCAB, write_llama_gguf  # noqa: E402
from mlx_ferrum.models import load_model  # noqa: E402


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_gguf_logits_match_transformers(tmp_path, architecture):
    # transformers' GGUF config for qwen3 ignores attention.key_length and assumes head_dim 128
    heads = {"qwen2": (4, 2), "qwen3": (2, 1)}[architecture]
    write_llama_gguf(tmp_path / "model.gguf", "Q8_0", architecture=architecture, heads=heads[0], kv_heads=heads[1])
    ours, config, _ = load_model(tmp_path / "model.gguf", dtype="float32")
    assert config["model_type"] == architecture
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 24)]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].numpy()
    got = np.array(ours(mx.array([prompt]))[0])
    assert np.abs(got - expected).max() <= 1e-3
