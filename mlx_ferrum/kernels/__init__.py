"""Attention kernels over the paged KV layout: Metal path or pure-MLX reference path.

``paged_attention_decode`` and ``paged_prefill_attention`` take the arguments of the
functions of the same names in :mod:`mlx_ferrum.kernels.reference`, and dispatch to
the Metal kernels (:mod:`mlx_ferrum.kernels.metal`) when Metal is available (or a
test launcher is installed with :func:`mlx_ferrum.kernels.metal.use_launcher`) and
``FERRUM_METAL_KERNELS`` / ``RuntimeConfig.metal_kernels`` is not ``0``; else to
the reference. A shape the kernels do not take goes to the reference, and the
reason is logged once (logger ``mlx_ferrum.kernels``, level INFO).

Sliding-window (``window``) and attention-sink (``sinks``) attention follow the same
rules: every kernel (decode, prefill and the opt-in matrix prefill) takes both.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional, Sequence

import mlx.core as mx

from ..config import RuntimeConfig
from . import metal, quantized_reference, reference
from .reference import write_kv_slots

__all__ = ["paged_attention_decode", "paged_prefill_attention", "quantized_paged_attention_decode",
           "quantized_paged_prefill_attention", "write_kv_slots", "metal_path_enabled"]

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def _fallback(kernel: str, reason: str) -> None:
    msg = f"{kernel}: using the pure-MLX reference: {reason}"
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)


def _routed_to_reference(longest: int) -> None:
    logger.debug(
        "paged_prefill_attention: %d query rows > %d: reference (matrix-unit SDPA)",
        longest, metal.PREFILL_KERNEL_MAX_QUERY_LEN,
    )


def metal_path_enabled(metal_kernels: Optional[bool] = None) -> bool:
    """True when attention runs on the Metal kernels: Metal (or a test launcher) is
    present and the kernels are not switched off.

    Args:
        metal_kernels: the caller's ``RuntimeConfig.metal_kernels`` (the model runner passes
            its own, so an explicit ``RuntimeConfig(metal_kernels=False)`` wins); ``None``
            reads ``FERRUM_METAL_KERNELS``.

    Raises:
        ConfigurationError: a ``FERRUM_*`` variable is malformed.
    """
    if metal_kernels is None:
        metal_kernels = _metal_kernels_flag(os.environ.get("FERRUM_METAL_KERNELS"))
    if not metal_kernels:
        return False
    return metal.launcher_forced() or mx.metal.is_available()


@functools.lru_cache(maxsize=8)
def _metal_kernels_flag(raw: Optional[str]) -> bool:
    # keyed on the raw variable so a changed environment is seen, but the decode hot
    # path does not rebuild a RuntimeConfig for every layer
    return RuntimeConfig().metal_kernels


def paged_attention_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    metal_kernels: Optional[bool] = None,
    metadata: Optional[metal.DecodeMetadata] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    reference_index: Optional[reference.DecodeIndex] = None,
) -> mx.array:
    """Decode attention over paged K/V; see :func:`mlx_ferrum.kernels.reference.paged_attention_decode`.

    Shapes: q ``[num_seqs, num_heads, head_dim]``, pools ``[num_blocks, num_kv_heads,
    block_size, head_dim]``, block_tables ``[num_seqs, max_blocks]`` int32,
    context_lens ``[num_seqs]`` int32; returns ``[num_seqs, num_heads, head_dim]`` in q's dtype.
    ``host_context_lens`` (the same lengths as Python ints) lets the reference skip masking.
    ``metal_kernels``: the caller's ``RuntimeConfig.metal_kernels`` (None: the environment).
    ``metadata`` (:func:`mlx_ferrum.kernels.metal.decode_metadata`, built once per step)
    spares the kernel path rebuilding its launch arrays per layer; the reference ignores it.
    ``reference_index`` (:func:`mlx_ferrum.kernels.reference.decode_index`, built once per
    pass) does the same for the reference path; the kernel path ignores it.
    Runs the Metal kernel (vLLM paged attention v1/v2, GQA-packed) when enabled and the
    shape is supported, else the reference; both take ``window`` (sliding window in
    tokens) and ``sinks`` (``[num_heads]`` attention-sink logits).
    """
    if metal_path_enabled(metal_kernels):
        reason = metal.decode_unsupported_reason(q, k_pool, v_pool, block_tables, context_lens)
        if reason is None:
            return metal.paged_attention_decode(
                q, k_pool, v_pool, block_tables, context_lens, scale, metadata=metadata,
                window=window, sinks=sinks,
            )
        _fallback("paged_attention_decode", reason)
    return reference.paged_attention_decode(
        q, k_pool, v_pool, block_tables, context_lens, scale, host_context_lens=host_context_lens,
        window=window, sinks=sinks, index=reference_index,
    )


def paged_prefill_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    metal_kernels: Optional[bool] = None,
) -> mx.array:
    """Causal varlen prefill attention over paged K/V; see
    :func:`mlx_ferrum.kernels.reference.paged_prefill_attention`.

    Shapes: q ``[num_tokens, num_heads, head_dim]``, query_start_loc ``[num_seqs + 1]``
    int32, the rest as for decode; returns ``[num_tokens, num_heads, head_dim]``.
    ``metal_kernels``: the caller's ``RuntimeConfig.metal_kernels`` (None: the environment).
    Runs the Metal kernel (FlashAttention-style tiles over the paged layout) when
    enabled, the shape is supported and no sequence has more than
    :data:`mlx_ferrum.kernels.metal.PREFILL_KERNEL_MAX_QUERY_LEN` new rows (speculative
    verify, short extends); longer chunks are compute bound and go to the reference,
    whose gather + ``mx.fast.scaled_dot_product_attention`` uses the matrix units (or,
    with ``metal.PREFILL_MATRIX_KERNEL`` set, to the ``simdgroup_matrix`` kernel).
    All three paths take ``window`` (sliding window in tokens) and ``sinks``
    (``[num_heads]`` attention-sink logits).
    """
    if metal_path_enabled(metal_kernels):
        ctx = list(host_context_lens) if host_context_lens is not None else context_lens.tolist()
        qsl = list(host_query_start_loc) if host_query_start_loc is not None else query_start_loc.tolist()
        reason = metal.prefill_unsupported_reason(q, k_pool, v_pool, block_tables, ctx, qsl)
        longest = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
        if reason is None and longest <= metal.PREFILL_KERNEL_MAX_QUERY_LEN:
            return metal.paged_prefill_attention(
                q, k_pool, v_pool, block_tables, context_lens, query_start_loc, scale,
                host_context_lens=ctx, host_query_start_loc=qsl, window=window, sinks=sinks,
            )
        if reason is None and metal.PREFILL_MATRIX_KERNEL:
            return metal.paged_prefill_attention_mma(
                q, k_pool, v_pool, block_tables, context_lens, query_start_loc, scale,
                host_context_lens=ctx, host_query_start_loc=qsl, window=window, sinks=sinks,
            )
        if reason is None:
            # A dispatch rule, not a fallback: long chunks are compute bound and MLX's
            # matrix-unit SDPA beats the scalar kernel there.
            _routed_to_reference(longest)
        else:
            _fallback("paged_prefill_attention", reason)
        host_context_lens, host_query_start_loc = ctx, qsl
    return reference.paged_prefill_attention(
        q, k_pool, v_pool, block_tables, context_lens, query_start_loc, scale,
        host_context_lens=host_context_lens, host_query_start_loc=host_query_start_loc,
        window=window, sinks=sinks,
    )


def _quantized_args(kv_cache_dtype: str, k_scales, v_scales, k_biases, v_biases) -> dict:
    # the keyword arguments the metal functions (and their shape checks) take for code pools
    return dict(kv_cache_dtype=kv_cache_dtype, k_scales=k_scales, v_scales=v_scales,
                k_biases=k_biases, v_biases=v_biases)


def _rotated_query(q: mx.array, keys_rotated: bool) -> mx.array:
    # the kernels take queries in the keys' basis: the pool stores keys rotated
    return quantized_reference.rotate(q, q.shape[-1]) if keys_rotated else q


def quantized_paged_attention_decode(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    kv_cache_dtype: str,
    keys_rotated: bool = False,
    host_context_lens: Optional[Sequence[int]] = None,
    metal_kernels: Optional[bool] = None,
    metadata: Optional[metal.DecodeMetadata] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    reference_index: Optional[reference.DecodeIndex] = None,
) -> mx.array:
    """Decode attention over a quantized paged pool: the Metal decode kernel reading the
    codes (dequantized in registers) when enabled and the shape is supported, else
    :func:`~mlx_ferrum.kernels.quantized_reference.quantized_paged_attention_decode`.

    Shapes: q ``[num_seqs, num_heads, head_dim]`` un-rotated (post-RoPE) queries; codes
    ``[num_blocks, num_kv_heads, block_size, head_dim]`` int8 (``"int8"``) or
    ``[.., head_dim // 2]`` uint8 (``"int4"``); scales (and int4 biases) float16
    ``[num_blocks, num_kv_heads, block_size, head_dim // group_size]``; the rest and the
    result as for :func:`paged_attention_decode`. ``keys_rotated``: the pool stores keys
    rotated by the Walsh-Hadamard matrix, so the queries are rotated to match (both paths).

    Raises:
        KernelError: malformed quantized arrays on the kernel path.
    """
    if metal_path_enabled(metal_kernels):
        quantized = _quantized_args(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)
        reason = metal.decode_unsupported_reason(q, k_codes, v_codes, block_tables, context_lens, **quantized)
        if reason is None:
            return metal.paged_attention_decode(
                _rotated_query(q, keys_rotated), k_codes, v_codes, block_tables, context_lens, scale,
                metadata=metadata, window=window, sinks=sinks, **quantized,
            )
        _fallback("quantized_paged_attention_decode", reason)
    return quantized_reference.quantized_paged_attention_decode(
        q, k_codes, v_codes, k_scales, v_scales, k_biases, v_biases, block_tables, context_lens, scale,
        keys_rotated=keys_rotated, host_context_lens=host_context_lens, window=window, sinks=sinks,
        index=reference_index,
    )


def quantized_paged_prefill_attention(
    q: mx.array,
    k_codes: mx.array,
    v_codes: mx.array,
    k_scales: mx.array,
    v_scales: mx.array,
    k_biases: Optional[mx.array],
    v_biases: Optional[mx.array],
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    kv_cache_dtype: str,
    keys_rotated: bool = False,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    metal_kernels: Optional[bool] = None,
) -> mx.array:
    """Causal varlen prefill attention over a quantized paged pool: the Metal prefill
    kernel (tiles dequantized while staged) for chunks of at most
    :data:`~mlx_ferrum.kernels.metal.PREFILL_KERNEL_MAX_QUERY_LEN` rows when enabled and
    supported, else :func:`~mlx_ferrum.kernels.quantized_reference.quantized_paged_prefill_attention`
    (the matrix kernel reads float pools only). Shapes as for
    :func:`quantized_paged_attention_decode` and :func:`paged_prefill_attention`.

    Raises:
        KernelError: malformed quantized arrays on the kernel path.
    """
    if metal_path_enabled(metal_kernels):
        quantized = _quantized_args(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)
        ctx = list(host_context_lens) if host_context_lens is not None else context_lens.tolist()
        qsl = list(host_query_start_loc) if host_query_start_loc is not None else query_start_loc.tolist()
        reason = metal.prefill_unsupported_reason(q, k_codes, v_codes, block_tables, ctx, qsl, **quantized)
        longest = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
        if reason is None and longest <= metal.PREFILL_KERNEL_MAX_QUERY_LEN:
            return metal.paged_prefill_attention(
                _rotated_query(q, keys_rotated), k_codes, v_codes, block_tables, context_lens, query_start_loc,
                scale, host_context_lens=ctx, host_query_start_loc=qsl, window=window, sinks=sinks, **quantized,
            )
        if reason is None:
            _routed_to_reference(longest)
        else:
            _fallback("quantized_paged_prefill_attention", reason)
        host_context_lens, host_query_start_loc = ctx, qsl
    return quantized_reference.quantized_paged_prefill_attention(
        q, k_codes, v_codes, k_scales, v_scales, k_biases, v_biases, block_tables, context_lens, query_start_loc,
        scale, keys_rotated=keys_rotated, host_context_lens=host_context_lens,
        host_query_start_loc=host_query_start_loc, window=window, sinks=sinks,
    )
