"""Attention backends over a quantized KV cache (``kv_cache_dtype`` "int8" / "int4").

The same layouts as :mod:`mlx_ferrum.layers.backends`, over the storage of
:mod:`mlx_ferrum.kv_cache.quantized` (group-wise codes with float16 scales along
``head_dim``; keys rotated by a Walsh-Hadamard transform before quantization, the
format of :mod:`mlx_ferrum.kernels.quantized_reference`):

- the write quantizes the new tokens in the same pass that writes their slots (the
  storage's ``write`` / ``append``);
- attention dequantizes only the blocks (or the one sequence's cache) it reads, and
  with rotated keys it rotates the queries by the same orthonormal matrix, so
  ``q_rot . k_rot = q . k`` (QuaRot / QuIP#-style incoherence processing; llama.cpp's
  Hadamard-rotated K cache). Values are never rotated, so outputs need no rotating back.

Every query attends to what the cache stores, its own pass's tokens included: a run
of fresh prompts (no cached tokens) attends to its K/V after a quantize-dequantize
round trip, which equals what the pool holds. So a prompt's output is the same whether
its prefix came from the prefix cache, an earlier chunk or this pass, and a batch
gives what its requests give one at a time.

:class:`QuantizedPagedAttentionBackend` runs the Metal decode and prefill kernels over the
quantized blocks where the Metal path is on (codes dequantized in registers, queries rotated
before the launch), else the quantized reference (:mod:`mlx_ferrum.kernels`' dispatch).
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..kernels.quantized_reference import check_kv_cache_dtype, dequantize_kv, quantize_kv, rotate
from ..errors import ConfigurationError
from .backends import ContiguousAttentionBackend, PagedAttentionBackend, PagedGroupTables


def _check_quantized(kv_cache_dtype: str) -> None:
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        raise ConfigurationError("a quantized attention backend needs kv_cache_dtype 'int8' or 'int4' "
                                 "('auto' uses the model-dtype backends)")


def _round_trip(x: mx.array, kv_cache_dtype: str, rotated: bool, dtype: mx.Dtype) -> mx.array:
    """What the cache stores for ``x`` ``[..., head_dim]``: rotated (when ``rotated``),
    quantized and dequantized to ``dtype``."""
    head_dim = x.shape[-1]
    if rotated:
        x = rotate(x, head_dim)
    codes, scales, biases = quantize_kv(x, kv_cache_dtype)
    return dequantize_kv(codes, scales, biases, kv_cache_dtype, head_dim, dtype)


class QuantizedPagedAttentionBackend(PagedAttentionBackend):
    """The paged layout over a :class:`~mlx_ferrum.kv_cache.quantized.QuantizedPagedKvPool`.

    Args:
        kv_cache_dtype: "int8" or "int4".
        rotate_keys: the pool rotates keys before quantizing them (the pool's
            ``rotate_keys``; queries are rotated to match).

    Raises:
        ConfigurationError: ``kv_cache_dtype`` is not "int8" or "int4".
    """

    uses_metal_kernels = True

    def __init__(self, kv_cache_dtype: str, rotate_keys: bool):
        _check_quantized(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.rotate_keys = bool(rotate_keys)

    # write: the inherited one calls pool.write, which quantizes (and rotates keys)

    def decode_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, scale: float,
                         window=None, sinks=None) -> mx.array:
        """Decode rows ``q`` ``[nd, H, D]`` -> ``[nd, H, D]`` over the quantized blocks
        (:func:`~mlx_ferrum.kernels.quantized_paged_attention_decode`: the Metal kernel
        dequantizing in registers, or the reference over the gathered blocks)."""
        nd = q.shape[0]
        return kernels.quantized_paged_attention_decode(
            q, *meta.pool.layer_arrays(layer), tables.block_tables[:nd], meta.context_lens[:nd], scale,
            kv_cache_dtype=self.kv_cache_dtype, keys_rotated=self.rotate_keys,
            host_context_lens=meta.host_context_lens[:nd] or None, metal_kernels=meta.metal_kernels,
            metadata=tables.decode_launch, window=window, sinks=sinks, reference_index=tables.decode_index,
        )

    def prefill_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, first: int, last: int,
                          scale: float, window=None, sinks=None) -> mx.array:
        """Prefill rows ``first .. last - 1`` over their quantized blocks
        (:func:`~mlx_ferrum.kernels.quantized_paged_prefill_attention`)."""
        starts = meta.host_query_start_loc
        rel = [x - starts[first] for x in starts[first : last + 1]]
        return kernels.quantized_paged_prefill_attention(
            q, *meta.pool.layer_arrays(layer), tables.block_tables[first:last], meta.context_lens[first:last],
            mx.array(rel, dtype=mx.int32), scale, kv_cache_dtype=self.kv_cache_dtype, keys_rotated=self.rotate_keys,
            host_context_lens=meta.host_context_lens[first:last], host_query_start_loc=rel,
            window=window, sinks=sinks, metal_kernels=meta.metal_kernels,
        )

    def fresh_attention(self, q: mx.array, k: mx.array, v: mx.array, num_seqs: int, scale: float,
                        sinks=None) -> mx.array:
        """Fresh prompts of equal length: one batched causal SDPA over their own K/V as the
        pool stores them (quantize-dequantize round trip, keys rotated with the queries)."""
        keys = _round_trip(k, self.kv_cache_dtype, self.rotate_keys, q.dtype)
        values = _round_trip(v, self.kv_cache_dtype, False, q.dtype)
        if self.rotate_keys:
            q = rotate(q, q.shape[-1])
        return super().fresh_attention(q, keys, values, num_seqs, scale, sinks)


class QuantizedContiguousAttentionBackend(ContiguousAttentionBackend):
    """The contiguous layout over :class:`~mlx_ferrum.kv_cache.quantized.QuantizedContiguousKvCache`
    lists: ``append`` quantizes, :meth:`read` dequantizes one row's cache, and queries are
    rotated when the keys are.

    Args:
        kv_cache_dtype: "int8" or "int4".
        rotate_keys: the caches rotate keys before quantizing them.

    Raises:
        ConfigurationError: ``kv_cache_dtype`` is not "int8" or "int4".
    """

    def __init__(self, kv_cache_dtype: str, rotate_keys: bool):
        _check_quantized(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.rotate_keys = bool(rotate_keys)

    def read(self, layer: int, meta, row: int) -> tuple[mx.array, mx.array]:
        """Row ``row``'s stored K and V of ``layer``, dequantized to the model dtype (keys
        in the rotated basis when the cache rotates them)."""
        return meta.caches[row][layer].fetch()

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None) -> mx.array:
        """:meth:`ContiguousAttentionBackend.attend` with the queries rotated to the keys' basis."""
        if self.rotate_keys:
            q = rotate(q, q.shape[-1])
        return super().attend(layer, q, k, v, meta, scale, window, sinks)

