"""Layers shared by every model family: the attention call (contiguous | paged), rope variants, norms, MLP.

Models import from here; the executor builds the :class:`AttentionMetadata` these layers read.
"""

from .attention import AttentionMetadata, apply_rope, attention, contiguous_pad_mask, rope_attention

__all__ = ["AttentionMetadata", "apply_rope", "attention", "contiguous_pad_mask", "rope_attention"]
