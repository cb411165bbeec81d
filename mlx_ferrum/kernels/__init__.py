"""Attention kernels over the paged KV layout: Metal path or pure-MLX reference path,
chosen once per attention backend.

:func:`attention_kernels` makes the choice when a paged attention backend is built
(:class:`~mlx_ferrum.layers.attention.PagedAttentionBackend` and
:class:`~mlx_ferrum.layers.quantized_backends.QuantizedPagedAttentionBackend` call it in
their constructors): the Metal kernels (:mod:`mlx_ferrum.kernels.metal`) when Metal is
available (or a test launcher is installed with
:func:`mlx_ferrum.kernels.metal.use_launcher`) and ``FERRUM_METAL_KERNELS`` /
``RuntimeConfig.metal_kernels`` is not ``0``; else the reference
(:mod:`mlx_ferrum.kernels.reference`, :mod:`mlx_ferrum.kernels.quantized_reference`).
The backend keeps the :class:`AttentionKernels` it got and calls its functions, so a
request's attention calls go straight to the reference functions, or to this module's
Metal-path functions, with no per-call check of the flag. On the Metal path, a shape
the kernels do not take goes to the reference, and the reason is logged once (logger
``mlx_ferrum.kernels``, level INFO).

:func:`paged_attention_decode` and :func:`paged_prefill_attention` make the same
choice for one call (tests and one-off callers).

Sliding-window (``window``) and attention-sink (``sinks``) attention follow the same
rules: every kernel (decode, prefill and the opt-in matrix prefill) takes both.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..config import RuntimeConfig
from . import metal, quantized_reference, reference
from .float_window import FloatRows
from .reference import write_kv_slots

__all__ = ["AttentionKernels", "MetalDecodeIndex", "attention_kernels", "metal_path_enabled",
           "paged_attention_decode", "paged_prefill_attention", "write_kv_slots"]

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
    # keyed on the raw variable so a changed environment is seen, while callers that
    # ask often (the matmul16 dispatch) do not rebuild a RuntimeConfig each time
    return RuntimeConfig().metal_kernels


# ------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class AttentionKernels:
    """The paged-attention functions one attention backend calls, chosen once
    (:func:`attention_kernels`).

    Attributes:
        metal: True for the Metal path. Prefill then sends every row through the varlen
            kernel (it takes a whole batch in one launch) and the decode rows read their
            blocks in place (no shared-prefix plan).
        decode_index: ``(block_tables [nd, max_blocks] int32, context_lens [nd] int32,
            num_kv_heads, block_size, shared=None) -> index``: the per-pass index arrays
            that every layer's ``decode`` shares (built once per pass by
            :func:`~mlx_ferrum.layers.attention.paged_metadata`).
        decode: decode attention with the arguments of
            :func:`mlx_ferrum.kernels.reference.paged_attention_decode` (``index`` from
            ``decode_index``); over a quantized pool, those of
            :func:`mlx_ferrum.kernels.quantized_reference.quantized_paged_attention_decode`.
        prefill: causal varlen prefill attention with the arguments of
            :func:`mlx_ferrum.kernels.reference.paged_prefill_attention` (quantized:
            :func:`mlx_ferrum.kernels.quantized_reference.quantized_paged_prefill_attention`).
    """

    metal: bool
    decode_index: Callable
    decode: Callable
    prefill: Callable


def attention_kernels(metal_kernels: Optional[bool] = None, kv_cache_dtype: str = "auto") -> AttentionKernels:
    """The paged-attention functions for a backend over a pool of ``kv_cache_dtype``,
    chosen now: the Metal path when :func:`metal_path_enabled` (``metal_kernels``), else
    the reference. Called when the backend is built, so a test that sets
    ``FERRUM_METAL_KERNELS`` or installs a launcher builds its backend (its executor or
    engine) afterwards.

    Args:
        metal_kernels: the runner's ``RuntimeConfig.metal_kernels``; None reads
            ``FERRUM_METAL_KERNELS``.
        kv_cache_dtype: ``"auto"`` (a pool in the model dtype), ``"int8"`` or ``"int4"``
            (code pools: the quantized reference, or the Metal kernels reading codes).

    Raises:
        ConfigurationError: a ``FERRUM_*`` variable is malformed.
    """
    quantized = kv_cache_dtype != "auto"
    if not metal_path_enabled(metal_kernels):
        if quantized:
            return AttentionKernels(False, reference.decode_index, quantized_reference.quantized_paged_attention_decode,
                                    quantized_reference.quantized_paged_prefill_attention)
        return AttentionKernels(False, reference.decode_index, reference.paged_attention_decode,
                                reference.paged_prefill_attention)
    if quantized:
        return AttentionKernels(True, metal_decode_index,
                                functools.partial(metal_quantized_paged_attention_decode, kv_cache_dtype=kv_cache_dtype),
                                functools.partial(metal_quantized_paged_prefill_attention,
                                                  kv_cache_dtype=kv_cache_dtype))
    return AttentionKernels(True, metal_decode_index, metal_paged_attention_decode, metal_paged_prefill_attention)


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
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """One decode attention call on the path :func:`attention_kernels` chooses now
    (``metal_kernels``: the caller's ``RuntimeConfig.metal_kernels``; None: the
    environment): :func:`metal_paged_attention_decode` or
    :func:`mlx_ferrum.kernels.reference.paged_attention_decode`, whose arguments,
    shapes and result it has.
    """
    return attention_kernels(metal_kernels).decode(
        q, k_pool, v_pool, block_tables, context_lens, scale, host_context_lens=host_context_lens,
        window=window, sinks=sinks,
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
    """One causal varlen prefill attention call on the path :func:`attention_kernels`
    chooses now: :func:`metal_paged_prefill_attention` or
    :func:`mlx_ferrum.kernels.reference.paged_prefill_attention`, whose arguments,
    shapes and result it has (``metal_kernels`` as for :func:`paged_attention_decode`).
    """
    return attention_kernels(metal_kernels).prefill(
        q, k_pool, v_pool, block_tables, context_lens, query_start_loc, scale,
        host_context_lens=host_context_lens, host_query_start_loc=host_query_start_loc, window=window, sinks=sinks,
    )


# ------------------------------------------------------------------ the Metal path


@dataclass(frozen=True)
class MetalDecodeIndex:
    """The Metal path's per-pass decode index: the kernel's launch arrays, and the
    reference's index arrays for the calls whose shape the kernel does not take.

    Attributes:
        launch: :func:`mlx_ferrum.kernels.metal.decode_metadata` of the decode rows.
        reference: :func:`mlx_ferrum.kernels.reference.decode_index` of the same rows.
    """

    launch: metal.DecodeMetadata
    reference: reference.DecodeIndex


def metal_decode_index(block_tables: mx.array, context_lens: mx.array, num_kv_heads: int, block_size: int,
                       shared: Optional[reference.SharedPrefix] = None) -> MetalDecodeIndex:
    """The :class:`MetalDecodeIndex` of a pass's decode rows (``block_tables``
    ``[nd, max_blocks]`` int32, ``context_lens`` ``[nd]`` int32); arguments as
    :func:`mlx_ferrum.kernels.reference.decode_index`."""
    return MetalDecodeIndex(metal.decode_metadata(block_tables, context_lens, num_kv_heads, block_size),
                            reference.decode_index(block_tables, context_lens, num_kv_heads, block_size, shared))


def _launch_and_reference(index) -> tuple:
    # a MetalDecodeIndex, or None (each side then builds its own)
    return (None, None) if index is None else (index.launch, index.reference)


def metal_paged_attention_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    index: Optional[MetalDecodeIndex] = None,
) -> mx.array:
    """Decode attention over paged K/V on the Metal kernel (vLLM paged attention v1/v2,
    GQA-packed), or on :func:`mlx_ferrum.kernels.reference.paged_attention_decode` for a
    shape the kernel does not take (:func:`mlx_ferrum.kernels.metal.decode_unsupported_reason`).

    Shapes: q ``[num_seqs, num_heads, head_dim]``, pools ``[num_blocks, num_kv_heads,
    block_size, head_dim]``, block_tables ``[num_seqs, max_blocks]`` int32,
    context_lens ``[num_seqs]`` int32; returns ``[num_seqs, num_heads, head_dim]`` in q's
    dtype. ``host_context_lens`` (the same lengths as Python ints) lets the reference
    skip masking. ``index`` (:func:`metal_decode_index`, built once per pass) spares both
    paths rebuilding their index arrays per layer. ``window``: sliding window in tokens;
    ``sinks``: ``[num_heads]`` attention-sink logits.
    """
    launch, reference_index = _launch_and_reference(index)
    reason = metal.decode_unsupported_reason(q, k_pool, v_pool, block_tables, context_lens)
    if reason is None:
        return metal.paged_attention_decode(
            q, k_pool, v_pool, block_tables, context_lens, scale, metadata=launch, window=window, sinks=sinks,
        )
    _fallback("paged_attention_decode", reason)
    return reference.paged_attention_decode(
        q, k_pool, v_pool, block_tables, context_lens, scale, host_context_lens=host_context_lens,
        window=window, sinks=sinks, index=reference_index,
    )


def metal_paged_prefill_attention(
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
) -> mx.array:
    """Causal varlen prefill attention over paged K/V on the Metal path; arguments, shapes
    and result of :func:`mlx_ferrum.kernels.reference.paged_prefill_attention` (q
    ``[num_tokens, num_heads, head_dim]``, query_start_loc ``[num_seqs + 1]`` int32;
    returns ``[num_tokens, num_heads, head_dim]``).

    Runs the Metal kernel (FlashAttention-style tiles over the paged layout) when the
    shape is supported and no sequence has more than
    :data:`mlx_ferrum.kernels.metal.PREFILL_KERNEL_MAX_QUERY_LEN` new rows (speculative
    verify, short extends); longer chunks are compute bound and go to the reference,
    whose gather + ``mx.fast.scaled_dot_product_attention`` uses the matrix units (or,
    with ``metal.PREFILL_MATRIX_KERNEL`` set, to the ``simdgroup_matrix`` kernel).
    All three paths take ``window`` (sliding window in tokens) and ``sinks``
    (``[num_heads]`` attention-sink logits).
    """
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
    return reference.paged_prefill_attention(
        q, k_pool, v_pool, block_tables, context_lens, query_start_loc, scale,
        host_context_lens=ctx, host_query_start_loc=qsl, window=window, sinks=sinks,
    )


def _quantized_args(kv_cache_dtype: str, k_scales, v_scales, k_biases, v_biases) -> dict:
    # the keyword arguments the metal functions (and their shape checks) take for code pools
    return dict(kv_cache_dtype=kv_cache_dtype, k_scales=k_scales, v_scales=v_scales,
                k_biases=k_biases, v_biases=v_biases)


def _rotated_query(q: mx.array, keys_rotated: bool) -> mx.array:
    # the kernels take queries in the keys' basis: the pool stores keys rotated
    return quantized_reference.rotate(q, q.shape[-1]) if keys_rotated else q


def metal_quantized_paged_attention_decode(
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
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    index: Optional[MetalDecodeIndex] = None,
    float_rows: Optional[FloatRows] = None,
) -> mx.array:
    """Decode attention over a quantized paged pool: the Metal decode kernel reading the
    codes (dequantized in registers) when the shape is supported, else
    :func:`~mlx_ferrum.kernels.quantized_reference.quantized_paged_attention_decode`.
    With ``float_rows`` (an int4 pool's float window,
    :class:`~mlx_ferrum.kernels.float_window.FloatRows`) the kernel skips the codes the
    window covers and :func:`~mlx_ferrum.kernels.metal.paged_attention_decode_with_float`
    merges its partitions with the window's entries in one softmax.

    Shapes: q ``[num_seqs, num_heads, head_dim]`` un-rotated (post-RoPE) queries; codes
    ``[num_blocks, num_kv_heads, block_size, head_dim]`` int8 (``"int8"``) or
    ``[.., head_dim // 2]`` uint8 (``"int4"``); scales (and int4 biases) float16
    ``[num_blocks, num_kv_heads, block_size, head_dim // group_size]``; the rest and the
    result as for :func:`metal_paged_attention_decode`. ``kv_cache_dtype`` (bound once by
    :func:`attention_kernels`): ``"int8"`` or ``"int4"``. ``keys_rotated``: the pool stores
    keys rotated by the Walsh-Hadamard matrix, so the queries are rotated to match (both paths).

    Raises:
        KernelError: malformed quantized arrays on the kernel path.
    """
    launch, reference_index = _launch_and_reference(index)
    quantized = _quantized_args(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)
    reason = metal.decode_unsupported_reason(q, k_codes, v_codes, block_tables, context_lens, **quantized)
    if reason is None and float_rows is not None:
        entries_valid, code_bounds = float_rows.kernel_inputs(context_lens - 1, window)
        return metal.paged_attention_decode_with_float(
            _rotated_query(q, keys_rotated), k_codes, v_codes, block_tables, context_lens, scale,
            float_keys=float_rows.keys, float_values=float_rows.values, float_valid=entries_valid,
            code_bounds=code_bounds, metadata=launch, window=window, sinks=sinks, **quantized,
        )
    if reason is None:
        return metal.paged_attention_decode(
            _rotated_query(q, keys_rotated), k_codes, v_codes, block_tables, context_lens, scale,
            metadata=launch, window=window, sinks=sinks, **quantized,
        )
    _fallback("quantized_paged_attention_decode", reason)
    return quantized_reference.quantized_paged_attention_decode(
        q, k_codes, v_codes, k_scales, v_scales, k_biases, v_biases, block_tables, context_lens, scale,
        keys_rotated=keys_rotated, host_context_lens=host_context_lens, window=window, sinks=sinks,
        index=reference_index, float_rows=float_rows,
    )


def metal_quantized_paged_prefill_attention(
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
) -> mx.array:
    """Causal varlen prefill attention over a quantized paged pool: the Metal prefill
    kernel (tiles dequantized while staged) for chunks of at most
    :data:`~mlx_ferrum.kernels.metal.PREFILL_KERNEL_MAX_QUERY_LEN` rows when supported,
    else :func:`~mlx_ferrum.kernels.quantized_reference.quantized_paged_prefill_attention`
    (the matrix kernel reads float pools only). Shapes as for
    :func:`metal_quantized_paged_attention_decode` and :func:`metal_paged_prefill_attention`.

    Raises:
        KernelError: malformed quantized arrays on the kernel path.
    """
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
    return quantized_reference.quantized_paged_prefill_attention(
        q, k_codes, v_codes, k_scales, v_scales, k_biases, v_biases, block_tables, context_lens, query_start_loc,
        scale, keys_rotated=keys_rotated, host_context_lens=ctx, host_query_start_loc=qsl, window=window, sinks=sinks,
    )
