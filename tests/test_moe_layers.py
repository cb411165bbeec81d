"""MoE building blocks against plain per-expert loops in numpy/MLX."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_ferrum.layers.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, softmax_topk, topk_softmax


def _loop_reference(mlp: SwitchGLU, x: np.ndarray, idx: np.ndarray, dequant=None) -> np.ndarray:
    """Each (token, chosen expert) pair through that expert's own matrices."""
    def w(lin):
        if dequant is not None:
            return np.array(dequant(lin))
        return np.array(lin.weight)

    g, u, d = w(mlp.gate_proj), w(mlp.up_proj), w(mlp.down_proj)
    out = np.zeros(idx.shape + (x.shape[-1],), np.float32)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            gate = g[e] @ x[t]
            up = u[e] @ x[t]
            h = gate / (1 + np.exp(-gate)) * up
            out[t, j] = d[e] @ h
    return out


@pytest.mark.parametrize("tokens", [3, 40])  # below and above the sort threshold (64 pairs)
def test_switch_glu_matches_a_per_expert_loop(tokens):
    mx.random.seed(0)
    mlp = SwitchGLU(32, 16, 8)
    x = mx.random.normal((tokens, 32))
    idx = mx.random.randint(0, 8, (tokens, 2)).astype(mx.uint32)
    ours = np.array(mlp(x, idx))
    assert np.abs(ours - _loop_reference(mlp, np.array(x), np.array(idx))).max() < 1e-4


def test_quantized_switch_linear_equals_its_dequantized_weights():
    mx.random.seed(1)
    layer = SwitchLinear(64, 32, 4, bias=True)
    layer.bias = mx.random.normal((4, 32))
    q = layer.to_quantized(group_size=32, bits=4)
    assert isinstance(q, QuantizedSwitchLinear)
    deq = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    x = mx.random.normal((5, 1, 1, 64))
    idx = mx.random.randint(0, 4, (5, 2)).astype(mx.uint32)
    plain = SwitchLinear(64, 32, 4, bias=True)
    plain.weight, plain.bias = deq, layer.bias
    assert mx.abs(q(x, idx) - plain(x, idx)).max().item() < 1e-4
    # nn.quantize finds it (the loader's path for mlx_lm-converted checkpoints)
    holder = nn.Module()
    holder.proj = SwitchLinear(64, 32, 4)
    nn.quantize(holder, group_size=32, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized"))
    assert isinstance(holder.proj, QuantizedSwitchLinear)


def test_routers_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 8)).astype(np.float32)
    idx, w = softmax_topk(mx.array(logits), 3, normalize=True)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :3]
    assert (np.sort(np.array(idx), -1) == np.sort(top, -1)).all()
    kept = np.take_along_axis(p, np.array(idx).astype(np.int64), -1)
    assert np.allclose(np.array(w), kept / kept.sum(-1, keepdims=True), atol=1e-6)
    idx, w = topk_softmax(mx.array(logits), 3)
    vals = np.take_along_axis(logits, np.array(idx).astype(np.int64), -1)
    e = np.exp(vals - vals.max(-1, keepdims=True))
    assert np.allclose(np.array(w), e / e.sum(-1, keepdims=True), atol=1e-6)
    assert (np.sort(np.array(idx), -1) == np.sort(np.argsort(-logits, -1)[:, :3], -1)).all()
