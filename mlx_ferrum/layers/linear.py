"""A linear projection that reads its weight through a transposed view made once.

``mlx.nn.Linear`` computes ``x @ weight.T``: every call adds a ``Transpose`` node to the
graph, a view that copies nothing but still costs the scheduler a task. In a compiled
decode step of a small model those nodes are a tenth of the graph (36 of 367 for
stories260K), and MLX's CPU backend pays a few microseconds per node whatever it
computes. :func:`cache_transposed_weights` evaluates ``weight.T`` once, before any step
is traced, so the step's graph reads the view as a constant. The view shares the
weight's buffer: no memory is added, and the product is the same BLAS call.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


class _TransposedWeight:
    """The weight a view was made from and the view; a plain object, so ``nn.Module``
    does not list it among the parameters."""

    __slots__ = ("source", "view")

    def __init__(self, source: mx.array, view: mx.array):
        self.source, self.view = source, view


class Linear(nn.Linear):
    """``nn.Linear`` (``y = x @ W^T + b``; ``W`` ``[output_dims, input_dims]``, any float
    dtype) that multiplies by the view :meth:`cache_transposed_weight` made, while that
    view belongs to the current weight; otherwise exactly ``nn.Linear``.

    Checkpoint names, quantization (``to_quantized``) and LoRA adapters see an
    ``nn.Linear``.
    """

    def cache_transposed_weight(self) -> None:
        """Evaluate ``W.T`` as a view of ``W`` (no copy). Call outside ``mx.compile``
        traces: inside one the view would be a node of the trace again."""
        weight = self["weight"]
        view = weight.T
        mx.eval(view)
        object.__setattr__(self, "_transposed", _TransposedWeight(weight, view))

    def _weight_t(self) -> Optional[mx.array]:
        cached = self.__dict__.get("_transposed")
        if cached is None:
            return None
        if cached.source is not self["weight"]:
            # the weight was replaced (new weights loaded): drop the view, which would
            # keep the old buffer alive
            object.__setattr__(self, "_transposed", None)
            return None
        return cached.view

    def __call__(self, x: mx.array) -> mx.array:
        weight_t = self._weight_t()
        if weight_t is None:
            return super().__call__(x)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight_t)
        return x @ weight_t


def cache_transposed_weights(model: nn.Module) -> int:
    """Give every :class:`Linear` of ``model`` its transposed view; returns how many.
    Call after the weights are loaded and outside any ``mx.compile`` trace."""
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, Linear):
            module.cache_transposed_weight()
            count += 1
    return count
