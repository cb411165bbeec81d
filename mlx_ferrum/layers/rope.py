"""Rotary position embeddings and their scaling variants.

RoPE: Su et al., "RoFormer" (2021), in the rotate-half convention of Hugging Face
``transformers`` (``mx.fast.rope`` with ``traditional=False``). Scaling variants, each
computed as in transformers' ``modeling_rope_utils`` (the reference the parity tests
run against):

- ``linear``: positions divided by ``factor``.
- ``llama3``: Meta's per-frequency scaling of Llama 3.1 (``apply_scaling``).
- ``dynamic``: NTK-aware base growth, applied statically for a
  ``max_position_embeddings`` context.
- ``yarn``: Peng et al., "YaRN: Efficient Context Window Extension" (2023): a ramp
  between interpolated and extrapolated frequencies, and an attention factor that
  scales cos/sin (gpt-oss).
- ``longrope`` (alias ``su``): Ding et al., "LongRoPE" (2024), Phi-3's per-frequency
  ``short_factor`` / ``long_factor`` and attention factor. As in transformers, the
  long factors are used for a forward pass whose last position reaches past
  ``original_max_position_embeddings``.

``partial_rotary_factor`` rotates only the first ``head_dim * factor`` features.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from ..errors import UnsupportedArchitectureError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope", "su")


def rope_parameters(config: dict[str, Any], layer_type: Optional[str] = None) -> dict[str, Any]:
    """The rope settings of a HF config as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads both spellings: transformers 5's ``rope_parameters`` (flat, or keyed by layer
    type as Gemma 3 writes it) and the older ``rope_theta`` + ``rope_scaling`` (+
    Gemma 3's ``rope_local_base_freq`` for sliding layers, whose rope is unscaled).

    Args:
        config: the ``config.json`` dict (text part).
        layer_type: ``"sliding_attention"`` / ``"full_attention"`` for models whose
            layer kinds have their own rope, else None.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    out: dict[str, Any] = {}
    if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()):
        out.update(params)
    scaling = config.get("rope_scaling")
    local = layer_type == "sliding_attention" and "rope_local_base_freq" in config
    if isinstance(scaling, dict) and not local and "rope_type" not in out:
        out.update(scaling)
    if "rope_theta" not in out:
        out["rope_theta"] = config["rope_local_base_freq"] if local else config.get("rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    if "partial_rotary_factor" not in out and "partial_rotary_factor" in config:
        out["partial_rotary_factor"] = config["partial_rotary_factor"]
    if out["rope_type"] in ("longrope", "su") and "original_max_position_embeddings" not in out:
        out["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", config.get("max_position_embeddings", 4096)
        )
    return out


#: Largest input (elements) whose rotate_half :meth:`Rope.apply_table` takes as a product
#: with a constant matrix: one graph node where slicing and concatenating take three, which
#: pays in a decode step (a few rows, dispatch-bound), while for a prefill chunk the
#: product's ``dims`` multiply-adds per element cost more than the copies' one move.
#: Both give the same bits.
MAX_PRODUCT_ROTATION_SIZE = 1 << 16


class Rope(nn.Module):
    """Rotary embedding with explicit positions.

    Args:
        head_dim: features per head.
        params: the dict of :func:`rope_parameters` (``rope_type``, ``rope_theta``, ...).
        max_position_embeddings: the model's context length (``dynamic``, ``longrope``).

    Call ``rope(x, offset)``: ``x`` ``[B, H, L, D]``; row ``b`` token ``l`` sits at
    position ``offset[b] + l`` (``offset`` an int or ``[B]`` int32). Returns ``x``'s
    shape and dtype.

    Raises:
        UnsupportedArchitectureError: an unknown ``rope_type``.
    """

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int = 4096):
        super().__init__()
        kind = params.get("rope_type", "default")
        base = float(params.get("rope_theta", 10000.0))
        self.dims = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
        self.scale = 1.0
        self.attention_factor = 1.0
        self.base: Optional[float] = base
        self._freqs: Optional[mx.array] = None
        self._long_freqs: Optional[mx.array] = None
        self._switch_at = 0
        d = self.dims
        if kind == "default":
            pass
        elif kind == "linear":
            self.scale = 1.0 / float(params["factor"])
        elif kind == "llama3":
            self._freqs = _llama3_freqs(d, base, params)
        elif kind == "dynamic":
            factor = float(params["factor"])
            orig = int(params.get("original_max_position_embeddings", max_position_embeddings))
            seq = max(max_position_embeddings, orig)
            if seq > orig:
                self.base = base * ((factor * seq / orig) - (factor - 1)) ** (d / (d - 2))
        elif kind == "yarn":
            self._freqs, self.attention_factor = _yarn(d, base, params, max_position_embeddings)
        elif kind in ("longrope", "su"):
            orig = int(params["original_max_position_embeddings"])
            factor = params.get("factor") or max_position_embeddings / orig
            af = params.get("attention_factor")
            if af is None:
                af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            self.attention_factor = float(af)
            exponents = [i / d for i in range(0, d, 2)]
            self._freqs = mx.array([float(f) * base**e for f, e in zip(params["short_factor"], exponents)])
            if max_position_embeddings > orig:
                self._long_freqs = mx.array([float(f) * base**e for f, e in zip(params["long_factor"], exponents)])
                self._switch_at = orig
        else:
            raise UnsupportedArchitectureError(
                f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self._freqs is not None:
            self.base = None
        # angle of feature pair i at position p: p * scale * inv_freq[i] (what mx.fast.rope computes)
        half = mx.arange(0, d, 2, dtype=mx.float32) / d
        self._inv_freq = 1.0 / self._freqs if self._freqs is not None else 1.0 / (self.base ** half)
        # rotate_half (transformers' convention) as a constant matrix: x @ R = [-x2, x1];
        # each output is one input times +-1, so the product is exact (see apply_table)
        rows = np.arange(d // 2)
        rotate_half = np.zeros((d, d), dtype=np.float32)
        rotate_half[rows + d // 2, rows] = -1.0
        rotate_half[rows, rows + d // 2] = 1.0
        self._rotate_half = mx.array(rotate_half)
        # evaluated here: a lazy array keeps the stream of the thread that built it, and the
        # engine's steps may run on another thread
        mx.eval(self._inv_freq, self._rotate_half)
        # layers with equal settings share one table per pass (each layer has its own Rope)
        self.table_key = (self.dims, self.scale, tuple(self._inv_freq.tolist()))

    @property
    def has_table(self) -> bool:
        """True when :meth:`table` / :meth:`apply_table` reproduce this rope (every kind but
        a ``longrope`` whose long factors switch in on the pass's last position)."""
        return self._long_freqs is None

    def table(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """``(cos, sin)`` float32 ``[T, 1, dims]`` for ``positions`` ``[T]`` int32, each
        half-width table repeated twice (both halves of a feature pair turn by one angle).

        Computed once per forward pass and shared by every layer using this rope (the
        same angles ``mx.fast.rope`` computes in each call; on MLX's CPU backend that call
        is an unfused composition that rebuilds them per layer, for q and for k).
        """
        angles = (positions.astype(mx.float32) * self.scale)[:, None] * self._inv_freq[None, :]
        cos, sin = mx.cos(angles), mx.sin(angles)
        return mx.concatenate([cos, cos], axis=-1)[:, None, :], mx.concatenate([sin, sin], axis=-1)[:, None, :]

    def apply_table(self, x: mx.array, table: tuple[mx.array, mx.array]) -> mx.array:
        """Rotate packed tokens ``x`` ``[T, H, D]`` by :meth:`table` ``(cos, sin)``, in the
        rotate-half convention (transformers' ``rotate_half``: ``x * cos + rotate_half(x) *
        sin``); returns ``x``'s shape and dtype."""
        cos, sin = table
        rotated = x if self.dims == x.shape[-1] else x[..., : self.dims]
        if rotated.size <= MAX_PRODUCT_ROTATION_SIZE:
            # as a 2-D product: a 3-D one adds a Flatten and an Unflatten node around it
            flat = rotated.astype(mx.float32).reshape(-1, self.dims)
            turned = (flat @ self._rotate_half).reshape(rotated.shape)
        else:
            half = self.dims // 2
            turned = mx.concatenate([-rotated[..., half:], rotated[..., :half]], axis=-1)
        y = rotated * cos + turned * sin
        if self.dims < x.shape[-1]:
            y = mx.concatenate([y, x[..., self.dims :].astype(y.dtype)], axis=-1)
        if self.attention_factor != 1.0:
            y = y * self.attention_factor
        return y.astype(x.dtype)

    def _rotate(self, x: mx.array, offset, freqs) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offset, freqs=freqs)

    def __call__(self, x: mx.array, offset) -> mx.array:
        y = self._rotate(x, offset, self._freqs)
        if self._long_freqs is not None:
            last = (mx.max(offset) if isinstance(offset, mx.array) else offset) + x.shape[2]
            y = mx.where(last > self._switch_at, self._rotate(x, offset, self._long_freqs), y)
        if self.attention_factor != 1.0:
            y = y * self.attention_factor
        return y


def _llama3_freqs(dims: int, base: float, rs: dict) -> mx.array:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, smooth in between."""
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    orig = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen = orig / low
    high_wavelen = orig / high
    out = []
    for i in range(0, dims, 2):
        inv = 1.0 / (base ** (i / dims))
        wavelen = 2 * math.pi / inv
        if wavelen < high_wavelen:
            new = inv
        elif wavelen > low_wavelen:
            new = inv / factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            new = (1 - smooth) * inv / factor + smooth * inv
        out.append(1.0 / new)  # mx.fast.rope takes wavelength-like "freqs": angle = pos / freqs
    return mx.array(out, dtype=mx.float32)


def _yarn(dims: int, base: float, rs: dict, max_position_embeddings: int) -> tuple[mx.array, float]:
    """YaRN frequencies (as wavelengths for ``mx.fast.rope``) and the attention factor."""
    orig = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor") or max_position_embeddings / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = rs.get("attention_factor")
    if af is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        af = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    out = []
    for j, i in enumerate(range(0, dims, 2)):
        pos_freq = base ** (i / dims)
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        extrapolation = 1.0 - ramp
        inv = (1.0 / (factor * pos_freq)) * (1 - extrapolation) + (1.0 / pos_freq) * extrapolation
        out.append(1.0 / inv)
    return mx.array(out, dtype=mx.float32), float(af)
