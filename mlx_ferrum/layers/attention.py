"""The one attention call every model layer makes, and the metadata it takes.

The runner builds one typed metadata object per forward pass, before the
model runs (:mod:`mlx_ferrum.layers.backends`: :class:`NoCacheMetadata`,
:class:`ContiguousMetadata`, :class:`PagedMetadata`), and hands it to the model; each
attention layer hands its projected q/k/v to :func:`rope_attention` with it. The
metadata carries the attention backend the store was built with (chosen once, per
layout and KV dtype), and :func:`rope_attention` calls it: no layer asks which layout
is in use. Nothing is global. This mirrors vLLM's ``AttentionBackend`` /
``AttentionMetadata`` split.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

from .backends import (
    NO_CACHE_BACKEND,
    AttentionBackend,
    ContiguousAttentionBackend,
    ContiguousMetadata,
    NoCacheAttentionBackend,
    NoCacheMetadata,
    PagedAttentionBackend,
    PagedGroupTables,
    PagedMetadata,
    paged_metadata,
    prefill_runs,
)
from .sdpa import contiguous_pad_mask, sdpa, sdpa_base2

#: What a model's ``meta`` argument may be (``None``: no cache, positions from 0).
AttentionMetadata = Union[NoCacheMetadata, ContiguousMetadata, PagedMetadata]


def _backend(meta) -> AttentionBackend:
    return NO_CACHE_BACKEND if meta is None else meta.backend


def apply_rope(rope, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
    """Rotate ``x`` ``[B, H, L, D]`` by the positions ``meta`` assigns its tokens (the
    backend's ``rotate``)."""
    return _backend(meta).rotate(rope, x, meta)


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    meta: Optional[AttentionMetadata],
    layer: int,
    scale: float,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Store this step's K/V in the cache ``meta`` names and attend (after RoPE).

    Args:
        q: ``[B, num_heads, L, head_dim]``; k, v: ``[B, num_kv_heads, L, head_dim]``.
        meta: the pass's metadata (``None``: causal, no cache).
        layer, scale, window, sinks: see :meth:`~mlx_ferrum.layers.backends.AttentionBackend.attention`.

    Returns:
        ``[B, num_heads, L, head_dim]`` in q's dtype.
    """
    return _backend(meta).attention(q, k, v, meta, layer, scale, window, sinks)


def rope_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    rope,
    meta: Optional[AttentionMetadata],
    layer: int,
    scale: float,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """RoPE on q and k, then attention, from and to the projections' layout (the backend's
    :meth:`~mlx_ferrum.layers.backends.AttentionBackend.forward`).

    Args:
        q: ``[B, L, num_heads, head_dim]``; k, v: ``[B, L, num_kv_heads, head_dim]``
            (the q/k/v projections reshaped, before RoPE); in a paged pass also the
            packed ``[T, heads, head_dim]``.
        rope: the layer's :class:`~mlx_ferrum.layers.rope.Rope`.
        meta, layer, scale, window, sinks: as for :func:`attention`.

    Returns:
        ``[B, L, num_heads * head_dim]`` (``[T, num_heads * head_dim]`` for packed
        input) in q's dtype, ready for ``o_proj``.

    Raises:
        ValueError: packed input without a paged pass's metadata.
    """
    return _backend(meta).forward(q, k, v, rope, meta, layer, scale, window, sinks)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ContiguousAttentionBackend",
    "ContiguousMetadata",
    "NO_CACHE_BACKEND",
    "NoCacheAttentionBackend",
    "NoCacheMetadata",
    "PagedAttentionBackend",
    "PagedGroupTables",
    "PagedMetadata",
    "apply_rope",
    "attention",
    "contiguous_pad_mask",
    "paged_metadata",
    "prefill_runs",
    "rope_attention",
    "sdpa",
    "sdpa_base2",
]
