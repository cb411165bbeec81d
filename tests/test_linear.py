"""``layers.dense.Linear``: the same products as ``mlx.nn.Linear`` (and numpy), without a
Transpose node once its transposed weight is cached, and never from a stale weight."""

from __future__ import annotations

import os
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_ferrum.layers.dense import Linear, cache_transposed_weights


def _graph_text(*arrays: mx.array) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return f.read()


@pytest.mark.parametrize("bias", [False, True])
def test_cached_products_equal_numpy_and_drop_the_transpose_node(bias):
    mx.random.seed(0)
    layer = Linear(12, 7, bias=bias)
    x = mx.random.normal((3, 5, 12))
    expected = np.asarray(x) @ np.asarray(layer.weight).T + (np.asarray(layer.bias) if bias else 0.0)
    plain = layer(x)
    assert "Transpose" in _graph_text(plain)
    cache_transposed_weights(layer)
    cached = layer(x)
    assert "Transpose" not in _graph_text(cached)
    np.testing.assert_allclose(np.asarray(cached), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(plain), rtol=1e-6, atol=1e-6)


def test_new_weights_are_used_and_the_old_view_is_dropped():
    mx.random.seed(1)
    layer = Linear(8, 4, bias=False)
    cache_transposed_weights(layer)
    x = mx.random.normal((2, 8))
    new = mx.random.normal((4, 8))
    layer.update({"weight": new})
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(x) @ np.asarray(new).T, rtol=1e-5, atol=1e-5)
    assert layer.__dict__.get("_transposed") is None
    # the cache is not a parameter: checkpoints and parameter counts are unchanged
    assert set(dict(layer.parameters())) == {"weight"}


def test_every_linear_of_a_model_is_cached_and_it_still_quantizes():
    from support.tiny_models import tiny_model

    model = tiny_model("llama")
    count = cache_transposed_weights(model)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert count == len(linears) > 0
    x = mx.array([[1, 2, 3]])
    before = model(x)
    nn.quantize(model, group_size=32, bits=8)
    assert not any(isinstance(m, nn.Linear) for _, m in model.named_modules())
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(before), atol=0.05)
