"""What the runner reads off a loaded model once, when it is built: activation dtype, the
rope modules whose tables a paged pass carries, and each layer's sliding window.

Plain functions over an ``mlx.nn.Module`` (a model of :mod:`mlx_ferrum.models`); nothing
here runs the model.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..layers.rope import Rope


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The activation dtype of ``model``: ``model.dtype`` if set, else its embedding's float dtype
    (the scales' dtype if affine-quantized), else the final norm's (the microscaling modes
    store uint8 scales, which say nothing about the activations)."""
    if isinstance(getattr(model, "dtype", None), mx.Dtype):
        return model.dtype
    emb = model.model.embed_tokens
    for candidate in (getattr(emb, "scales", None), emb.weight, getattr(getattr(model.model, "norm", None), "weight", None)):
        if candidate is not None and mx.issubdtype(candidate.dtype, mx.floating):
            return candidate.dtype
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def table_ropes(model: nn.Module) -> list[Rope]:
    """The model's :class:`~mlx_ferrum.layers.rope.Rope` modules that take per-pass tables
    (``has_table``), one per distinct ``table_key``: a paged pass's metadata carries one
    ``(cos, sin)`` table for each, shared by every layer using it."""
    ropes: dict = {}
    for module in model.modules():
        if isinstance(module, Rope) and module.has_table:
            ropes.setdefault(module.table_key, module)
    return list(ropes.values())


def layer_windows(model: nn.Module) -> list[Optional[int]]:
    """The sliding window of each layer (None: full attention), from ``model.args.window``.

    One shared window (Mistral, Phi-3) lets the paged manager free blocks outside it;
    mixed layers (Gemma 3, gpt-oss) get one block table per layer group in the
    :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`.
    """
    args = model.args
    if not hasattr(args, "window"):
        return [None] * args.num_hidden_layers
    return [args.window(i) for i in range(args.num_hidden_layers)]
