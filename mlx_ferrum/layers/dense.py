"""Dense layers of the model families: the linear projection and the gated feed-forward
block built from three of them.

- :class:`Linear`: ``nn.Linear`` reading its weight through a transposed view made once.
  ``mlx.nn.Linear`` computes ``x @ weight.T``: every call adds a ``Transpose`` node to
  the graph, a view that copies nothing but still costs the scheduler a task. In a
  compiled decode step of a small model those nodes are a tenth of the graph (36 of 367
  for stories260K), and MLX's CPU backend pays a few microseconds per node whatever it
  computes. :func:`cache_transposed_weights` evaluates ``weight.T`` once, before any
  step is traced, so the step's graph reads the view as a constant. The view shares the
  weight's buffer: no memory is added, and the product is the same BLAS call.
- :class:`GatedMLP`: ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (SwiGLU, Llama,
  Qwen; :func:`swiglu`) or tanh-approximated GELU (GeGLU, Gemma 3); Shazeer, "GLU
  Variants Improve Transformer" (2020). Phi-3's fused ``gate_up_proj`` (gate first) is
  split into ``gate_proj``/``up_proj`` at load (:mod:`mlx_ferrum.models.phi3`), so it
  runs through :class:`GatedMLP` too.

Both are per-token dense compute, no positions and no cache, and both shape their MLX
graph for the CPU backend (a constant transposed weight; a base-2 SiLU in one kernel).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedArchitectureError
from ..kernels.reference import exp2, is_fusing as exp2_fusing_now


# ---------------------------------------------------------------------------- projection
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


# ---------------------------------------------------------------------------- gated MLP
_LOG2_E = 1.4426950408889634  # exp(x) == 2 ** (x * log2(e))


@partial(mx.compile, shapeless=True)
def _swiglu_base2(gate: mx.array, up: mx.array) -> mx.array:
    return gate / (1.0 + mx.power(2.0, gate * -_LOG2_E)) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (SwiGLU; SiLU from Elfwing et al. 2018), any shape and float dtype.

    On MLX's CPU backend it is one fused kernel computing ``gate / (1 + 2**(-gate *
    log2(e))) * up``: there ``sigmoid`` and ``exp`` cost several times ``2**x``, and
    ``nn.silu(gate) * up`` was a fifth of a Qwen2.5-0.5B-shaped prefill. In a compiled
    decode step's trace ``2**x`` is :func:`~mlx_ferrum.kernels.reference.exp2`'s arithmetic.
    Elsewhere it is ``nn.silu(gate) * up``.
    """
    if mx.default_device().type == mx.DeviceType.cpu:
        if exp2_fusing_now():  # a compiled step's trace: its 2**x as fusable arithmetic
            return gate / (1.0 + exp2(gate.astype(mx.float32) * -_LOG2_E).astype(gate.dtype)) * up
        return _swiglu_base2(gate, up)
    return nn.silu(gate) * up


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016), ``gelu_pytorch_tanh``."""
    return nn.gelu_approx(x)


_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": nn.silu,
    "swish": nn.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": nn.gelu,
}


def activation(name: str) -> Callable[[mx.array], mx.array]:
    """The activation function a config names (``hidden_act`` / ``hidden_activation``).

    Raises:
        UnsupportedArchitectureError: an unknown name (the message lists the known ones).
    """
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: ``[..., hidden] -> [..., hidden]``.

    Args:
        hidden_size, intermediate_size: widths.
        act: the activation name (see :func:`activation`).
        bias: whether the three projections carry a bias.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self._act = activation(act)

    def __call__(self, x: mx.array) -> mx.array:
        if self._act is nn.silu:
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
