"""Attention backends over a quantized KV cache (``kv_cache_dtype`` "int8" / "int4").

The same layouts as the backends of :mod:`mlx_ferrum.layers.attention`, over the storage of
:mod:`mlx_ferrum.kv_cache.quantized` (group-wise codes with float16 scales along
``head_dim``; keys rotated by a Walsh-Hadamard transform before quantization, the
format of :mod:`mlx_ferrum.kernels.quantized_reference`):

- the write quantizes the new tokens in the same pass that writes their slots (the
  storage's ``write`` / ``append``);
- attention reads only the blocks (or the one sequence's cache) it needs: decode attends
  from the codes themselves (:func:`~mlx_ferrum.kernels.quantized_reference.attention_over_codes`,
  group scales folded into the scores and probabilities), prefill dequantizes the blocks
  it gathered; with rotated keys it rotates the queries by the same orthonormal matrix, so
  ``q_rot . k_rot = q . k`` (QuaRot / QuIP#-style incoherence processing; llama.cpp's
  Hadamard-rotated K cache). Values are never rotated, so outputs need no rotating back.

Every query attends to what the cache stores, its own pass's tokens included: a run
of fresh prompts (no cached tokens) attends to its K/V after a quantize-dequantize
round trip, which equals what the pool holds. So a prompt's output is the same whether
its prefix came from the prefix cache, an earlier chunk or this pass, and a batch
gives what its requests give one at a time.

:class:`QuantizedPagedAttentionBackend` runs the Metal decode and prefill kernels over the
quantized blocks where the Metal path is on (codes dequantized in registers, queries rotated
before the launch), else the quantized reference: the choice of
:func:`mlx_ferrum.kernels.attention_kernels`, made once when the backend is built.
"""

from __future__ import annotations

import mlx.core as mx

from typing import Optional

from .. import kernels
from ..errors import ConfigurationError
from ..kernels.quantized_reference import attention_over_codes, check_kv_cache_dtype, dequantize_kv, quantize_kv, rotate
from .attention import ContiguousAttentionBackend, PagedAttentionBackend, PagedGroupTables


#: A contiguous decode step reads each row's slots in spans of this many tokens (the
#: slots past a row's length are masked): the compiled attention keeps one shape for
#: this many steps, at the cost of reading at most this many masked slots per row.
DECODE_READ_GRANULE = 128

#: input shapes of the contiguous decode's compiled attention kept before its traces are dropped
MAX_DECODE_TRACES = 64


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
        metal_kernels: the runner's ``RuntimeConfig.metal_kernels`` (None reads
            ``FERRUM_METAL_KERNELS``).

    Attributes:
        kernels: the quantized :class:`~mlx_ferrum.kernels.AttentionKernels` chosen here,
            once (:func:`~mlx_ferrum.kernels.attention_kernels` with ``kv_cache_dtype``).

    Raises:
        ConfigurationError: ``kv_cache_dtype`` is not "int8" or "int4", or
            ``FERRUM_METAL_KERNELS`` is malformed.
    """

    def __init__(self, kv_cache_dtype: str, rotate_keys: bool, metal_kernels: Optional[bool] = None):
        _check_quantized(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.rotate_keys = bool(rotate_keys)
        self.kernels = kernels.attention_kernels(metal_kernels, kv_cache_dtype)

    # write: the inherited one calls pool.write, which quantizes (and rotates keys)

    def shared_prefix(self, block_tables, context_lens, block_size: int, row_seqs=None) -> None:
        """None: the quantized reference reads each row's codes (no shared-prefix read)."""
        return None

    def decode_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, scale: float,
                         window=None, sinks=None) -> mx.array:
        """Decode rows ``q`` ``[nd, H, D]`` -> ``[nd, H, D]`` over the quantized blocks
        (the backend's quantized decode kernel: the Metal kernel dequantizing in registers,
        :func:`~mlx_ferrum.kernels.metal_quantized_paged_attention_decode`, or the reference
        over the gathered blocks)."""
        nd = q.shape[0]
        return self.kernels.decode(
            q, *meta.pool.layer_arrays(layer), tables.block_tables[:nd], meta.context_lens[:nd], scale,
            keys_rotated=self.rotate_keys, host_context_lens=meta.host_context_lens[:nd] or None,
            window=window, sinks=sinks, index=tables.decode_index,
        )

    def prefill_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, first: int, last: int,
                          scale: float, window=None, sinks=None) -> mx.array:
        """Prefill rows ``first .. last - 1`` over their quantized blocks
        (the backend's quantized prefill kernel)."""
        starts = meta.host_query_start_loc
        rel = [x - starts[first] for x in starts[first : last + 1]]
        return self.kernels.prefill(
            q, *meta.pool.layer_arrays(layer), tables.block_tables[first:last], meta.context_lens[first:last],
            mx.array(rel, dtype=mx.int32), scale, keys_rotated=self.rotate_keys,
            host_context_lens=meta.host_context_lens[first:last], host_query_start_loc=rel,
            window=window, sinks=sinks,
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
    lists: :meth:`write` quantizes, decode attends from the rows' codes, prefill reads one
    row's cache dequantized (:meth:`read`), and queries are
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
        self._compiled: dict = {}

    def write(self, layer: int, k: mx.array, v: mx.array, meta) -> None:
        """Quantize and append row ``b``'s ``k[b]``, ``v[b]`` to ``meta.caches[b][layer]``
        (``QuantizedContiguousKvCache.write``: nothing is dequantized here)."""
        for i in range(k.shape[0]):
            meta.caches[i][layer].write(k[i : i + 1], v[i : i + 1])

    def read(self, layer: int, meta, row: int) -> tuple[mx.array, mx.array]:
        """Row ``row``'s stored K and V of ``layer``, dequantized to the model dtype (keys
        in the rotated basis when the cache rotates them); prefill passes read this."""
        return meta.caches[row][layer].fetch()

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None) -> mx.array:
        """:meth:`ContiguousAttentionBackend.attend` with the queries rotated to the keys' basis.

        A decode pass (one new token per row) attends over each row's codes with
        :func:`~mlx_ferrum.kernels.quantized_reference.attention_over_codes`, so no row's
        cache is dequantized; rows of different lengths are batched by reading each
        row's slots up to the longest (codes, not floats) and masking past its length.
        Prefill passes read the dequantized rows (:meth:`read`).
        """
        if q.shape[2] != 1:
            if self.rotate_keys:
                q = rotate(q, q.shape[-1])
            return super().attend(layer, q, k, v, meta, scale, window, sinks)
        return self._decode(layer, q, meta, scale, window, sinks)

    def _decode(self, layer, q, meta, scale, window, sinks) -> mx.array:
        """One query per row ``q`` ``[B, H, 1, D]`` (not rotated: the compiled attention
        rotates it, one fused graph with the rest) over the rows' codes -> ``[B, H, 1, D]``.

        Every row's slots ``first .. first + span - 1`` are read, ``span`` rounded up to a
        multiple of :data:`DECODE_READ_GRANULE` so that consecutive steps share the shape of
        one compiled attention (the slots past a row's length are masked); ``first`` skips
        whole granules before the shortest row's window."""
        caches = [meta.caches[i][layer] for i in range(q.shape[0])]
        lens = [c.len for c in caches]
        granule = DECODE_READ_GRANULE
        first = 0 if window is None else max(0, min(lens) - window) // granule * granule
        span = -(-(max(lens) - first) // granule) * granule

        def padded(a):
            # slots past a row's buffer (shorter than the span) are zeros, masked like the rest
            return a if a.shape[2] == span else mx.pad(a, [(0, 0), (0, 0), (0, span - a.shape[2]), (0, 0)])

        rows = [[None if a is None else padded(a) for a in c.stored_arrays(first, min(first + span, c.capacity))]
                for c in caches]
        arrays = rows[0] if len(rows) == 1 else [
            None if parts[0] is None else mx.concatenate(parts, axis=0) for parts in zip(*rows)]
        if len(rows) == 1:
            # one row's slots are a strided slice of its buffer (heads `capacity` slots
            # apart), which MLX's CPU backend casts element by element; each head's slice
            # is contiguous, so the heads are attended one by one
            heads = [[None if a is None else a[:, h : h + 1] for a in arrays] for h in range(arrays[0].shape[1])]
        else:
            heads = [arrays]  # concatenated rows: contiguous already
        context = mx.array([[n - first] for n in lens], dtype=mx.int32)  # row lengths, from slot `first`
        attend = self._compiled_attention(scale, window, q.shape, heads, sinks)
        return attend(q[:, :, 0, :], heads, context, sinks)[:, :, None, :]

    def _compiled_attention(self, scale: float, window, shape: tuple, heads: list, sinks):
        """``mx.compile`` of the queries' rotation (when the keys are rotated) and
        :func:`attention_over_codes` with its mask for this scale and window (fused
        elementwise chains instead of op-by-op dispatch in an uncompiled contiguous
        step), over ``heads``: lists of stored arrays, each for a consecutive
        part of the KV heads (the query heads split alike). Its traces are dropped once
        :data:`MAX_DECODE_TRACES` input shapes were seen, so a long run holds a bounded number."""
        key = (scale, window, sinks is None)
        rotate_keys = self.rotate_keys
        entry = self._compiled.get(key)
        shapes = (tuple(shape), len(heads), tuple(heads[0][0].shape))
        if entry is None or (shapes not in entry[1] and len(entry[1]) >= MAX_DECODE_TRACES):

            def attend(q, heads, context, sinks):
                if rotate_keys:
                    q = rotate(q, q.shape[-1])
                positions = mx.arange(heads[0][0].shape[2])[None, :]
                valid = positions < context
                if window is not None:
                    valid = valid & (positions >= context - window)
                per = q.shape[1] // len(heads)  # query heads per part
                outs = [attention_over_codes(q[:, i * per : (i + 1) * per], *arrays, valid, scale,
                                             None if sinks is None else sinks[i * per : (i + 1) * per])
                        for i, arrays in enumerate(heads)]
                return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

            entry = self._compiled[key] = (mx.compile(attend), set())
        entry[1].add(shapes)
        return entry[0]

