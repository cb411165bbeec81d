"""Normalization layers shared by the model families.

- :class:`RMSNorm`: ``x / rms(x) * w`` (Zhang & Sennrich, "Root Mean Square Layer
  Normalization", 2019); MLX's ``nn.RMSNorm``, used by Llama, Qwen, Phi-3 and gpt-oss.
- :class:`GemmaRMSNorm`: the same with the weight stored as an offset from one,
  ``x / rms(x) * (1 + w)``, as Gemma checkpoints store it (Google's ``gemma``
  reference code and transformers' ``Gemma3RMSNorm``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

RMSNorm = nn.RMSNorm


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * (1 + weight)``.

    Args:
        dims: size of the last axis.
        eps: added to the mean square before the square root.

    Input ``[..., dims]`` in any float dtype; output the same shape and dtype. The
    reduction runs in float32 inside ``mx.fast.rms_norm``.
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)
