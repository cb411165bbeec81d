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

With int4's float window (:mod:`mlx_ferrum.kernels.float_window`) each query also reads
its last ``window`` positions and its sequence's first tokens from float16 copies, in the
same softmax as the codes of the others; the pass's own tokens are taken as those copies
hold them, so a prompt read in one pass, in chunks or token by token gives the same, and
so does a batch. A prefix-cache hit brings codes without copies: its shared positions
are read from the codes (the sequence's ``window_start``). Decode rows run the backend's
decode kernel (on Metal the kernel skips the codes the window covers and its partitions
are merged with the window's entries, :func:`~mlx_ferrum.kernels.metal.paged_attention_decode_with_float`);
prefill rows with a window run the pure-MLX path.

:class:`QuantizedPagedAttentionBackend` runs the Metal decode and prefill kernels over the
quantized blocks where the Metal path is on (codes dequantized in registers, queries rotated
before the launch), else the quantized reference: the choice of
:func:`mlx_ferrum.kernels.attention_kernels`, made once when the backend is built.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .. import kernels
from ..errors import ConfigurationError
from ..kernels.float_window import (
    FIRST_TOKENS,
    FloatRows,
    entry_positions,
    prefill_attention_in_tiles,
)
from ..kernels.quantized_reference import (
    attention_over_codes,
    check_kv_cache_dtype,
    dequantize_kv,
    quantize_kv,
    quantized_paged_prefill_with_float,
    rotate,
)
from .attention import (
    ContiguousAttentionBackend,
    PagedAttentionBackend,
    PagedGroupTables,
)

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

    def write(self, layer: int, k: mx.array, v: mx.array, meta, keys_rotated: bool = False) -> None:
        """Quantize and store packed ``k``, ``v`` ``[T, KVH, D]`` at the slots of the layer's
        group (``pool.write`` quantizes and rotates keys, unless ``keys_rotated``), and
        their float copies where the pass's float window keeps them."""
        tables = meta.groups[meta.layer_groups[layer]]
        window_index = meta.float_window.write_index if meta.float_window is not None else None
        meta.pool.write(layer, tables.slot_mapping, k, v, indices=tables.slot_index, window_index=window_index,
                        keys_rotated=keys_rotated)

    def packed_attention(self, q, k, v, meta, layer, scale, window=None, sinks=None) -> mx.array:
        """Write, then attend; with a float window (:mod:`~mlx_ferrum.kernels.float_window`)
        every row attends to its float entries and its codes in one softmax.

        Prefill rows read their sequence's entries as they were before this pass's write
        (gathered first: MLX's in-place update leaves arrays built earlier as they were)
        together with the pass's own K/V, so a chunk longer than the ring loses none of
        the positions its queries need. Decode rows read the entries after the write,
        which also holds the earlier rows of a draft laid out as decode rows.
        """
        fw = meta.float_window
        if fw is None:
            return super().packed_attention(q, k, v, meta, layer, scale, window, sinks)
        pool = meta.pool
        nd = meta.num_decode_seqs
        num_rows = len(meta.host_context_lens) if meta.host_context_lens else meta.context_lens.shape[0]
        before = None
        if nd < num_rows:
            before = (pool.k_window[layer][fw.prefill_slots], pool.v_window[layer][fw.prefill_slots])
        # rotated once: the pool stores these keys and the prefill rows read them back
        keys = rotate(k, k.shape[-1]) if self.rotate_keys else k
        self.write(layer, keys, v, meta, keys_rotated=True)
        tables = meta.groups[meta.layer_groups[layer]]
        parts = []
        if nd:
            rows = FloatRows(pool.k_window[layer][fw.decode_slots].swapaxes(1, 2),
                             pool.v_window[layer][fw.decode_slots].swapaxes(1, 2),
                             fw.decode_last, fw.decode_starts, fw.window, fw.entries, memo=fw.masks)
            parts.append(self.kernels.decode(
                q[:nd], *pool.layer_arrays(layer), tables.block_tables[:nd], meta.context_lens[:nd], scale,
                keys_rotated=self.rotate_keys, host_context_lens=meta.host_context_lens[:nd] or None,
                window=window, sinks=sinks, index=tables.decode_index, float_rows=rows,
            ))
        if before is not None:
            starts = meta.host_query_start_loc
            r0 = starts[nd]
            # the pass's own tokens as their entries hold them (float16), so that a prompt
            # gives the same whether it is read in one pass, in chunks or token by token
            keys = keys.astype(mx.float16)
            values = v.astype(mx.float16)
            float_rows = [
                (before[0][i], before[1][i], keys[starts[nd + i] : starts[nd + i + 1]],
                 values[starts[nd + i] : starts[nd + i + 1]], fw.prefill_starts[i])
                for i in range(num_rows - nd)
            ]
            parts.append(quantized_paged_prefill_with_float(
                q[r0:], *pool.layer_arrays(layer), tables.block_tables[nd:], meta.host_context_lens[nd:],
                [x - r0 for x in starts[nd:]], scale, float_rows, fw.window, fw.entries,
                keys_rotated=self.rotate_keys, window=window, sinks=sinks,
            ))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

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

    def attention(self, q, k, v, meta, layer, scale, window=None, sinks=None) -> mx.array:
        """Write, then attend; a prefill pass over caches with a float window attends row
        by row to the codes and the float entries in one softmax, the entries read as they
        were before this pass's write together with the pass's own K/V (as the paged
        layout does)."""
        caches = [meta.caches[i][layer] for i in range(q.shape[0])]
        if q.shape[2] == 1 or not caches[0].float_window:
            return super().attention(q, k, v, meta, layer, scale, window, sinks)
        before = [c.window_snapshot() for c in caches]
        starts = [c.len for c in caches]
        self.write(layer, k, v, meta)
        head_dim = q.shape[-1]
        queries = rotate(q, head_dim) if self.rotate_keys else q
        # the pass's own tokens as the entries hold them (float16), as in the paged layout
        keys_basis = (rotate(k, head_dim) if self.rotate_keys else k).astype(mx.float16)
        values_basis = v.astype(mx.float16)
        outs = []
        for i, cache in enumerate(caches):
            start = starts[i]
            keys, values = cache.fetch()
            new_keys, new_values = keys_basis[i : i + 1], values_basis[i : i + 1]
            if before[i] is None:  # the first write: no entries yet
                ring_keys, ring_values = new_keys[:, :, :0], new_values[:, :, :0]
                ring_positions = mx.zeros((0,), dtype=mx.int32)
            else:
                ring_keys, ring_values = before[i]
                ring_positions = entry_positions(mx.array([start - 1], dtype=mx.int32), cache.entries)[0]
            outs.append(prefill_attention_in_tiles(
                queries[i : i + 1], keys, values, ring_keys, ring_values, ring_positions, new_keys, new_values,
                start, cache.window_start, cache.float_window, start - (cache.entries - FIRST_TOKENS), scale,
                sliding_window=window, sinks=sinks,
            ))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

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
        floats = None
        if caches[0].float_window:
            # the float window, read after this step's write: [B, KVH, entries, D] and each
            # row's last position and window start
            floats = [mx.concatenate([c.k_window for c in caches], axis=0) if len(caches) > 1 else caches[0].k_window,
                      mx.concatenate([c.v_window for c in caches], axis=0) if len(caches) > 1 else caches[0].v_window,
                      mx.array([n - 1 for n in lens], dtype=mx.int32),
                      mx.array([c.window_start for c in caches], dtype=mx.int32),
                      mx.array(first, dtype=mx.int32)]
        attend = self._compiled_attention(scale, window, q.shape, heads, sinks, caches[0])
        return attend(q[:, :, 0, :], heads, context, sinks, floats)[:, :, None, :]

    def _compiled_attention(self, scale: float, window, shape: tuple, heads: list, sinks, cache):
        """``mx.compile`` of the queries' rotation (when the keys are rotated) and
        :func:`attention_over_codes` with its mask for this scale and window (fused
        elementwise chains instead of op-by-op dispatch in an uncompiled contiguous
        step), over ``heads``: lists of stored arrays, each for a consecutive
        part of the KV heads (the query heads split alike). Its traces are dropped once
        :data:`MAX_DECODE_TRACES` input shapes were seen, so a long run holds a bounded number."""
        float_window, entries = cache.float_window, cache.entries
        key = (scale, window, sinks is None, float_window, entries)
        rotate_keys = self.rotate_keys
        entry = self._compiled.get(key)
        shapes = (tuple(shape), len(heads), tuple(heads[0][0].shape))
        if entry is None or (shapes not in entry[1] and len(entry[1]) >= MAX_DECODE_TRACES):

            def attend(q, heads, context, sinks, floats):
                if rotate_keys:
                    q = rotate(q, q.shape[-1])
                positions = mx.arange(heads[0][0].shape[2])[None, :]
                valid = positions < context
                if window is not None:
                    valid = valid & (positions >= context - window)
                float_parts = [{}] * len(heads)
                if floats is not None:
                    float_keys, float_values, last, starts, first = floats
                    rows = FloatRows(float_keys, float_values, last, starts, float_window, entries)
                    from_float, entries_valid = rows.masks(last, positions + first, window)
                    valid = valid & ~from_float
                    kv_per = float_keys.shape[1] // len(heads)  # KV heads per part
                    float_parts = [{"float_keys": float_keys[:, i * kv_per : (i + 1) * kv_per],
                                    "float_values": float_values[:, i * kv_per : (i + 1) * kv_per],
                                    "float_valid": entries_valid} for i in range(len(heads))]
                per = q.shape[1] // len(heads)  # query heads per part
                outs = [attention_over_codes(q[:, i * per : (i + 1) * per], *arrays, valid, scale,
                                             None if sinks is None else sinks[i * per : (i + 1) * per],
                                             **float_parts[i])
                        for i, arrays in enumerate(heads)]
                return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

            entry = self._compiled[key] = (mx.compile(attend), set())
        entry[1].add(shapes)
        return entry[0]

