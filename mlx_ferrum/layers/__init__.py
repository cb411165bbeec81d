"""Layers shared by every model family: the attention call and its backends (no cache |
contiguous | paged), rope variants, norms, MLP.

Models import from here; the runner builds the metadata (:data:`AttentionMetadata`:
one of the typed metadata classes of :mod:`.attention`, carrying its backend) these layers read.
"""

from .attention import (
    AttentionBackend,
    AttentionMetadata,
    ContiguousAttentionBackend,
    ContiguousMetadata,
    NoCacheAttentionBackend,
    NoCacheMetadata,
    PagedAttentionBackend,
    PagedMetadata,
    apply_rope,
    attention,
    contiguous_pad_mask,
    rope_attention,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ContiguousAttentionBackend",
    "ContiguousMetadata",
    "NoCacheAttentionBackend",
    "NoCacheMetadata",
    "PagedAttentionBackend",
    "PagedMetadata",
    "apply_rope",
    "attention",
    "contiguous_pad_mask",
    "rope_attention",
]
