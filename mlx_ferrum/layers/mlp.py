"""Dense feed-forward blocks shared by the model families.

- :class:`GatedMLP`: ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (SwiGLU, Llama,
  Qwen) or tanh-approximated GELU (GeGLU, Gemma 3); Shazeer, "GLU Variants Improve
  Transformer" (2020).

Phi-3's fused ``gate_up_proj`` (gate first) is split into ``gate_proj``/``up_proj`` at
load (:mod:`mlx_ferrum.models.phi3`), so it runs through :class:`GatedMLP` too.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedArchitectureError
from ..kernels.reference import exp2, is_fusing as exp2_fusing_now
from .linear import Linear

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
