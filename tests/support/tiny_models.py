"""In-memory random-weight models of the supported families, for executor and engine tests."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_ferrum.models.llama import Model, ModelArgs

CONFIGS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama3": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
}


def tiny_model(name: str = "llama", seed: int = 0, vocab_size: int = 97, max_position_embeddings: int = 256,
               scale: float = 0.2) -> Model:
    """A 2-layer, hidden-32 model with N(0, scale) weights (large enough that greedy
    choices are rarely near-ties, so batched and solo runs pick the same tokens)."""
    cfg = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, vocab_size=vocab_size,
               max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg.update(CONFIGS[name])
    model = Model(ModelArgs.from_dict(cfg))
    mx.random.seed(seed)
    params = [(k, mx.random.normal(v.shape) * scale) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def finish_all(eng):
    """Step ``eng`` until no request is left; the final output of each request, by id."""
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final
