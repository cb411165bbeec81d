"""Weight-layout helpers shared by the loader's family ``sanitize`` methods: stacking
per-expert tensors, splitting fused projections."""

from __future__ import annotations

import mlx.core as mx

from ..errors import MissingWeightError

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_SUFFIXES = ("weight", "bias", "scales", "biases")


def stack_experts(weights: dict[str, mx.array], source: str, target: str, num_experts: int) -> None:
    """Replace ``{source}.{e}.{proj}.{suffix}`` (one tensor per expert) by one stacked
    ``{target}.{proj}.{suffix}`` ``[num_experts, ...]``, in place.

    Does nothing for a projection whose expert 0 is absent (already stacked, as in
    mlx-lm's converted checkpoints).

    Raises:
        MissingWeightError: expert 0 has the tensor but another expert does not.
    """
    for proj in _PROJECTIONS:
        for suffix in _SUFFIXES:
            first = f"{source}.0.{proj}.{suffix}"
            if first not in weights:
                continue
            names = [f"{source}.{e}.{proj}.{suffix}" for e in range(num_experts)]
            missing = [n for n in names if n not in weights]
            if missing:
                raise MissingWeightError(
                    f"{len(missing)} expert tensors are missing (first: {missing[0]}); the checkpoint has fewer "
                    f"experts than config.json's {num_experts}: re-download it or fix num_experts"
                )
            weights[f"{target}.{proj}.{suffix}"] = mx.stack([weights.pop(n) for n in names])


def split_fused(weights: dict[str, mx.array], name: str, parts: dict[str, int], axis: int = 0) -> None:
    """Split tensor ``name`` along ``axis`` into consecutive pieces, in place.

    ``parts`` maps each new name to its size, in order; the sizes must sum to the
    tensor's length on ``axis``. Does nothing when ``name`` is absent.
    """
    if name not in weights:
        return
    t = weights.pop(name)
    start = 0
    for new_name, size in parts.items():
        weights[new_name] = mx.take(t, mx.arange(start, start + size), axis=axis)
        start += size
