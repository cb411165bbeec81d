"""Attention backends and the typed metadata of a forward pass.

A backend is chosen ONCE, when the KV store is built
(:func:`mlx_ferrum.kv_cache.factory.build_kv_store`), and every pass's metadata carries
it; the layers call ``meta.backend`` and never ask which layout is in use. This is the
split vLLM makes between an ``AttentionBackend`` (the attention implementation), its
``AttentionMetadata`` (built once per step by the runner, before the model runs) and
the KV storage it reads.

Backends (one per layout; a quantized KV cache is another backend over another storage):

- :class:`NoCacheAttentionBackend` with :class:`NoCacheMetadata`: no cache; causal
  attention over the given tokens (tests, scoring).
- :class:`ContiguousAttentionBackend` with :class:`ContiguousMetadata`: batch row ``b``
  has its own list of per-layer :class:`~mlx_ferrum.kv_cache.ContiguousKvCache`; every
  row brings ``L`` new tokens at positions ``offsets[b] .. offsets[b]+L-1``. Rows of
  different cache lengths are batched by right-padding the gathered K/V to the longest
  and masking the pad (``-inf``); the pad costs a copy of ``B * max_len`` K/V entries
  per layer.
- :class:`PagedAttentionBackend` with :class:`PagedMetadata`: tokens of all sequences
  are packed into one row, decode tokens first (one per decoding sequence), then each
  prefilling sequence's chunk. K/V go to the shared pool through each layer group's
  ``slot_mapping``; decode rows run :func:`~mlx_ferrum.kernels.paged_attention_decode`,
  prefill rows :func:`~mlx_ferrum.kernels.paged_prefill_attention`. No padding anywhere.

Every backend offers the same calls:

- ``forward(q, k, v, rope, meta, layer, scale, window, sinks)``: from the projections'
  layout, RoPE, store this step's K/V, attend (what :func:`~mlx_ferrum.layers.attention.rope_attention`
  runs);
- ``attention(q, k, v, meta, layer, scale, window, sinks)``: the same after RoPE, in
  ``[B, heads, L, head_dim]``;
- ``rotate(rope, x, meta)``: RoPE at the positions the metadata gives;
- ``write(layer, k, v, meta)`` and ``attend(layer, q, k, v, meta, scale, window, sinks)``:
  the two halves, which a quantized backend replaces (quantize on write, dequantize
  the gathered blocks inside attention).

Why this module is one file of over 500 lines: the typed metadata of a pass and the
backends that read it change together; one file keeps each backend next to the metadata
it consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .. import kernels
from ..kernels import metal, reference
from ..kernels.reference import DecodeIndex
from .sdpa import sdpa, window_mask


# ---------------------------------------------------------------------------- metadata
@dataclass
class NoCacheMetadata:
    """A pass without a KV cache.

    Attributes:
        offsets: ``[B]`` int32 position of each row's first token, or None (position 0).
        logits_indices: ``[N]`` int32 rows of the flattened ``B*L`` tokens whose logits are
            wanted, or None for all.
        lora_slots: ``[B*L]`` int32 LoRA slot per token, or None (read by the runner's
            LoRA context, not by attention).
        backend: :data:`NO_CACHE_BACKEND`.
    """

    offsets: Optional[mx.array] = None
    logits_indices: Optional[mx.array] = None
    lora_slots: Optional[mx.array] = None
    backend: "AttentionBackend" = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        if self.backend is None:
            self.backend = NO_CACHE_BACKEND


@dataclass
class ContiguousMetadata:
    """A pass over per-sequence contiguous caches (:class:`ContiguousAttentionBackend`).

    Attributes:
        backend: the store's backend.
        offsets: ``[B]`` int32 position of row ``b``'s first new token (its cache length
            before the pass).
        caches: ``caches[b][layer]`` is row ``b``'s cache of that layer.
        pad_mask: ``[B, 1, L, max_len]`` additive mask for rows of different cache
            lengths (:func:`~mlx_ferrum.layers.sdpa.contiguous_pad_mask`), or None.
        logits_indices, lora_slots: as :class:`NoCacheMetadata`.
    """

    backend: "AttentionBackend"
    offsets: mx.array
    caches: list
    pad_mask: Optional[mx.array] = None
    logits_indices: Optional[mx.array] = None
    lora_slots: Optional[mx.array] = None


@dataclass
class PagedGroupTables:
    """One layer group's addressing of the paged pool for one pass (each group of a
    model mixing full and sliding-window layers has its own block ids; a model without
    windows has one group).

    Attributes:
        slot_mapping: ``[T]`` int32 pool slot (``block * block_size + offset``) of each
            packed token.
        block_tables: ``[num_rows, max_blocks]`` int32, decode rows first.
        slot_index: the pool index arrays of ``slot_mapping`` (``PagedKvPool.slot_indices``,
            broadcast), shared by every layer's K and V write.
        decode_index: the reference decode attention's index arrays over the first
            ``num_decode_seqs`` rows (:func:`~mlx_ferrum.kernels.reference.decode_index`),
            or None without decode rows.
        decode_launch: the Metal decode kernel's launch arrays
            (:func:`~mlx_ferrum.kernels.metal.decode_metadata`) when the Metal path is
            enabled and there are decode rows, else None.
    """

    slot_mapping: mx.array
    block_tables: mx.array
    slot_index: tuple
    decode_index: Optional[DecodeIndex] = None
    decode_launch: Optional[metal.DecodeMetadata] = None


@dataclass
class PagedMetadata:
    """A packed pass over the paged pool (:class:`PagedAttentionBackend`), complete before
    the model runs (:func:`paged_metadata`): no layer adds to it.

    Attributes:
        backend: the store's backend.
        pool: the K/V storage (:class:`~mlx_ferrum.kv_cache.PagedKvPool`, or its view in a
            compiled decode step).
        positions: ``[T]`` int32 position of each packed token.
        context_lens: ``[num_rows]`` int32, tokens stored after this pass's writes.
        query_start_loc: ``[num_rows + 1]`` int32 prefix sums of query tokens per row, or
            None (a compiled decode step: one token per row).
        num_decode_seqs: the leading rows that bring exactly one token.
        host_context_lens, host_query_start_loc: the same as Python lists (empty in a
            compiled decode step, where nothing may be read back).
        layer_groups: ``layer_groups[layer]`` is the layer's group index.
        groups: one :class:`PagedGroupTables` per layer group.
        rope_tables: ``(cos, sin)`` per ``Rope.table_key`` of the model's ropes, over
            ``positions``, shared by every layer.
        metal_kernels: the runner's ``RuntimeConfig.metal_kernels``.
        logits_indices, lora_slots: as :class:`NoCacheMetadata`.
    """

    backend: "AttentionBackend"
    pool: Any
    positions: mx.array
    context_lens: mx.array
    num_decode_seqs: int
    layer_groups: list
    groups: list
    query_start_loc: Optional[mx.array] = None
    host_context_lens: list = field(default_factory=list)
    host_query_start_loc: list = field(default_factory=list)
    rope_tables: dict = field(default_factory=dict)
    metal_kernels: Optional[bool] = None
    logits_indices: Optional[mx.array] = None
    lora_slots: Optional[mx.array] = None

    @property
    def slot_mapping(self) -> mx.array:
        """Group 0's ``slot_mapping`` (the full-attention group when there is one)."""
        return self.groups[0].slot_mapping

    @property
    def block_tables(self) -> mx.array:
        """Group 0's ``block_tables``."""
        return self.groups[0].block_tables


def paged_metadata(
    backend: "AttentionBackend",
    pool,
    positions: mx.array,
    context_lens: mx.array,
    num_decode_seqs: int,
    layer_groups: list,
    slot_mappings: list,
    block_tables: list,
    ropes: list = (),
    query_start_loc: Optional[mx.array] = None,
    host_context_lens: Optional[list] = None,
    host_query_start_loc: Optional[list] = None,
    metal_kernels: Optional[bool] = None,
    shared_prefixes: Optional[list] = None,
) -> PagedMetadata:
    """A complete :class:`PagedMetadata`: the per-pass arrays every layer shares (pool
    index arrays, decode indices, Metal launch arrays, RoPE tables) are derived here,
    once, from the step's arrays.

    Called by the runner's pass builder for an eager pass and inside the compiled decode step's trace
    (where the step's arrays are the traced inputs, so the derived ones are part of the
    compiled graph rather than constants of one trace).

    Args:
        backend: the attention backend the pass runs.
        pool: the K/V storage.
        positions: ``[T]`` int32.
        context_lens: ``[num_rows]`` int32.
        num_decode_seqs: leading one-token rows.
        layer_groups: group index of each layer.
        slot_mappings: per group, ``[T]`` int32.
        block_tables: per group, ``[num_rows, max_blocks]`` int32.
        ropes: the model's distinct table ropes (objects with ``table_key`` and
            ``table(positions)``; :class:`~mlx_ferrum.layers.rope.Rope`).
        query_start_loc, host_context_lens, host_query_start_loc, metal_kernels: see
            :class:`PagedMetadata`.
        shared_prefixes: per group, the decode rows'
            :class:`~mlx_ferrum.kernels.reference.SharedPrefix` (MLX arrays) or None
            (:meth:`PagedAttentionBackend.shared_prefix`); None: none anywhere.
    """
    nd = num_decode_seqs
    num_kv_heads, block_size = pool.shape[1], pool.shape[2]
    launch = nd and backend.uses_metal_kernels and kernels.metal_path_enabled(metal_kernels)
    groups = []
    shared_prefixes = shared_prefixes or [None] * len(block_tables)
    for slots, tables, shared in zip(slot_mappings, block_tables, shared_prefixes):
        groups.append(PagedGroupTables(
            slot_mapping=slots,
            block_tables=tables,
            # broadcast once per pass, so no layer's K or V write broadcasts them again
            slot_index=tuple(mx.broadcast_arrays(*pool.slot_indices(slots))),
            decode_index=reference.decode_index(tables[:nd], context_lens[:nd], num_kv_heads, block_size, shared)
            if nd else None,
            decode_launch=metal.decode_metadata(tables[:nd], context_lens[:nd], num_kv_heads, block_size)
            if launch else None,
        ))
    rope_tables = {}
    for rope in ropes:
        if rope.table_key not in rope_tables:
            rope_tables[rope.table_key] = rope.table(positions)
    return PagedMetadata(
        backend=backend, pool=pool, positions=positions, context_lens=context_lens, num_decode_seqs=nd,
        layer_groups=list(layer_groups), groups=groups, query_start_loc=query_start_loc,
        host_context_lens=list(host_context_lens or []), host_query_start_loc=list(host_query_start_loc or []),
        rope_tables=rope_tables, metal_kernels=metal_kernels,
    )


# ---------------------------------------------------------------------------- backends
class AttentionBackend:
    """The attention of one KV layout (and KV dtype). Subclasses implement :meth:`rotate`,
    :meth:`write` and :meth:`attend`; :meth:`forward` and :meth:`attention` are built on them.

    Attributes:
        kv_cache_dtype: the KV storage format the backend reads (``"auto"``: the model dtype).
        uses_metal_kernels: the backend runs the Metal kernels where they are enabled
            (``RuntimeConfig.metal_kernels`` and a Metal device), so the metadata carries
            their launch arrays and prefill runs go to the varlen kernel.
    """

    kv_cache_dtype = "auto"
    uses_metal_kernels = False

    def rotate(self, rope, x: mx.array, meta) -> mx.array:
        """RoPE ``x`` ``[B, heads, L, head_dim]`` at the positions ``meta`` gives its tokens."""
        raise NotImplementedError

    def write(self, layer: int, k: mx.array, v: mx.array, meta) -> None:
        """Store this pass's K/V of ``layer`` (layout as the backend's :meth:`attention` takes them)."""
        raise NotImplementedError

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, meta, scale: float,
               window: Optional[int] = None, sinks: Optional[mx.array] = None) -> mx.array:
        """Attention of ``q`` over what the cache holds for ``layer`` (after :meth:`write`);
        ``k``/``v`` are this pass's own K/V, for paths that need not read them back."""
        raise NotImplementedError

    def attention(self, q: mx.array, k: mx.array, v: mx.array, meta, layer: int, scale: float,
                  window: Optional[int] = None, sinks: Optional[mx.array] = None) -> mx.array:
        """Store this step's K/V and attend.

        Args:
            q: ``[B, num_heads, L, head_dim]`` (RoPE applied).
            k, v: ``[B, num_kv_heads, L, head_dim]`` (RoPE applied to k).
            meta: the pass's metadata.
            layer: index of the calling layer, to pick its cache.
            scale: softmax scale.
            window: sliding-window size in tokens, or None for full attention. The query at
                position ``p`` sees keys at positions ``p - window + 1 .. p`` (Mistral,
                Beltagy et al. "Longformer" 2020; transformers' ``sliding_window_overlay``).
            sinks: ``[num_heads]`` attention-sink logits (gpt-oss), or None. Each head's
                softmax gets one extra logit that takes probability mass and no value
                (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023).

        Returns:
            ``[B, num_heads, L, head_dim]`` in q's dtype.
        """
        self.write(layer, k, v, meta)
        return self.attend(layer, q, k, v, meta, scale, window, sinks)

    def forward(self, q: mx.array, k: mx.array, v: mx.array, rope, meta, layer: int, scale: float,
                window: Optional[int] = None, sinks: Optional[mx.array] = None) -> mx.array:
        """RoPE on q and k, then :meth:`attention`, from and to the projections' layout.

        Args:
            q: ``[B, L, num_heads, head_dim]``; k, v: ``[B, L, num_kv_heads, head_dim]``
                (the projections reshaped, before RoPE).
            rope: the layer's :class:`~mlx_ferrum.layers.rope.Rope`.
            meta, layer, scale, window, sinks: as for :meth:`attention`.

        Returns:
            ``[B, L, num_heads * head_dim]`` in q's dtype, ready for ``o_proj``.

        Raises:
            ValueError: packed ``[T, heads, head_dim]`` input (only a paged pass packs tokens).
        """
        if q.ndim == 3:
            raise ValueError("packed [T, heads, head_dim] projections need a paged pass's metadata")
        lead = q.shape[:-2]
        q = self.rotate(rope, q.transpose(0, 2, 1, 3), meta)
        k = self.rotate(rope, k.transpose(0, 2, 1, 3), meta)
        out = self.attention(q, k, v.transpose(0, 2, 1, 3), meta, layer, scale, window, sinks)
        return out.transpose(0, 2, 1, 3).reshape(*lead, -1)


class NoCacheAttentionBackend(AttentionBackend):
    """Causal attention over the given tokens, nothing stored (tests, scoring)."""

    def rotate(self, rope, x: mx.array, meta) -> mx.array:
        """RoPE from ``meta.offsets`` (position 0 when there is no metadata or no offsets)."""
        offsets = None if meta is None else meta.offsets
        return rope(x, 0 if offsets is None else offsets)

    def write(self, layer: int, k: mx.array, v: mx.array, meta) -> None:
        """Nothing is stored."""

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None) -> mx.array:
        """Causal attention of ``q`` over ``k``/``v`` (``[B, heads, L, head_dim]``)."""
        length = q.shape[2]
        mask = "causal" if length > 1 else None
        if window is not None and length > window:
            pos = mx.arange(length)
            mask = window_mask(pos[:, None], pos[None, :], window, q.dtype)
        return sdpa(q, k, v, scale, mask, sinks)


class ContiguousAttentionBackend(AttentionBackend):
    """Per-sequence contiguous caches (:class:`ContiguousMetadata`): each batch row appends
    its ``L`` new tokens to its own per-layer cache and attends over all of them."""

    def rotate(self, rope, x: mx.array, meta) -> mx.array:
        """RoPE from each row's ``meta.offsets``."""
        return rope(x, meta.offsets)

    def write(self, layer: int, k: mx.array, v: mx.array, meta) -> None:
        """Append row ``b``'s ``k[b]``, ``v[b]`` (``[1, num_kv_heads, L, head_dim]``) to ``meta.caches[b][layer]``."""
        if k.shape[0] == 1:
            meta.caches[0][layer].append(k, v)
            return
        for i in range(k.shape[0]):
            meta.caches[i][layer].append(k[i : i + 1], v[i : i + 1])

    def read(self, layer: int, meta, row: int) -> tuple[mx.array, mx.array]:
        """Every stored K and V of ``layer`` for batch row ``row``: ``[1, num_kv_heads, len, head_dim]`` each."""
        cache = meta.caches[row][layer]
        return cache.k[..., : cache.len, :], cache.v[..., : cache.len, :]

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None) -> mx.array:
        """Attention of each row's ``L`` queries over its cache; rows of different lengths
        are right-padded to the longest and masked (``meta.pad_mask``)."""
        b, _, length, _ = q.shape
        if b == 1:
            keys, values = self.read(layer, meta, 0)
            n = keys.shape[2]
            mask = "causal" if length > 1 else None
            if window is not None and n > window:
                if length == 1:
                    # a decode step reads only its window: a slice, no mask
                    keys, values = keys[:, :, n - window :], values[:, :, n - window :]
                else:
                    qpos = mx.arange(n - length, n)[:, None]
                    mask = window_mask(qpos, mx.arange(n)[None, :], window, q.dtype)
            return sdpa(q, keys, values, scale, mask, sinks)
        rows = [self.read(layer, meta, i) for i in range(b)]
        max_len = max(x.shape[2] for x, _ in rows)

        def pad(x):
            return x if x.shape[2] == max_len else mx.pad(x, [(0, 0), (0, 0), (0, max_len - x.shape[2]), (0, 0)])

        keys = mx.concatenate([pad(x) for x, _ in rows], axis=0)
        values = mx.concatenate([pad(x) for _, x in rows], axis=0)
        mask = meta.pad_mask
        if window is not None and max_len > window:
            # rows differ in length: the window is cut per row, from each row's own positions
            lens = mx.array([x.shape[2] for x, _ in rows], dtype=mx.int32)[:, None, None, None]
            qpos = lens - length + mx.arange(length)[None, None, :, None]
            mask = window_mask(qpos, mx.arange(max_len)[None, None, None, :], window, q.dtype)
        return sdpa(q, keys, values, scale, mask, sinks)


class PagedAttentionBackend(AttentionBackend):
    """The paged pool (:class:`PagedMetadata`): packed tokens ``[T, heads, head_dim]``, K/V
    written through each layer group's ``slot_mapping``, decode rows on
    :func:`~mlx_ferrum.kernels.paged_attention_decode`, prefill rows on
    :func:`~mlx_ferrum.kernels.paged_prefill_attention` or, for a run of fresh prompts of
    equal length, one batched causal SDPA over their own K/V.

    A quantized backend subclasses this and replaces :meth:`write`,
    :meth:`decode_attention`, :meth:`prefill_attention` and :meth:`fresh_attention`.
    """

    uses_metal_kernels = True

    def shared_prefix(self, block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                      metal_kernels: Optional[bool] = None,
                      row_seqs: Optional[np.ndarray] = None) -> Optional[reference.SharedPrefix]:
        """The host plan by which the reference decode attention reads the blocks that
        head many decode rows' tables once for all of them
        (:func:`~mlx_ferrum.kernels.reference.plan_shared_prefix`), or None: too little
        shared, or the Metal kernel runs (it reads each row's blocks in place).

        Args:
            block_tables: ``[num_decode_seqs, max_blocks]`` int32 of a full-attention group.
            context_lens: ``[num_decode_seqs]`` int32.
            block_size: tokens per block.
            metal_kernels: the runner's ``RuntimeConfig.metal_kernels``.
            row_seqs: ``[num_decode_seqs]`` the sequence of each row (a verified draft
                is several rows of one sequence), or None: one row per sequence.
        """
        if kernels.metal_path_enabled(metal_kernels):
            return None
        return reference.plan_shared_prefix(block_tables, context_lens, block_size, row_seqs=row_seqs)

    def rotate(self, rope, x: mx.array, meta) -> mx.array:
        """RoPE of packed tokens ``x`` ``[1, H, T, D]``: each token is rotated as a row of
        length 1 with its own position."""
        # [1, H, T, D] -> [T, H, 1, D] in one transpose (the batch axis has size 1)
        y = rope(x.transpose(2, 1, 0, 3), meta.positions)
        return y.transpose(2, 1, 0, 3)

    def forward(self, q, k, v, rope, meta, layer, scale, window=None, sinks=None) -> mx.array:
        """As :meth:`AttentionBackend.forward`, for a paged pass's packed tokens: ``[T, heads,
        head_dim]`` (or ``[1, T, heads, head_dim]``) in, ``[T, heads * head_dim]`` (or
        ``[1, T, ...]``) out. A rope with a table (``rope.has_table``) is applied from the
        pass's ``rope_tables`` on ``[T, H, D]`` directly, with no transposes.

        Raises:
            ValueError: the pass's metadata has no table for ``rope`` (the runner builds
                tables for the ropes it found in the model).
        """
        lead = q.shape[:-2]
        if rope.has_table:
            table = meta.rope_tables.get(rope.table_key)
            if table is None:
                raise ValueError("this paged pass has no RoPE table for the layer's rope: build the metadata "
                                 "with the model's ropes (paged_metadata(ropes=...))")
            if q.ndim == 4:
                q, k, v = q[0], k[0], v[0]
            out = self.packed_attention(rope.apply_table(q, table), rope.apply_table(k, table), v, meta, layer,
                                        scale, window, sinks)
            return out.reshape(*lead, -1)
        if q.ndim == 3:
            q, k, v = q[None], k[None], v[None]
        q = self.rotate(rope, q.transpose(0, 2, 1, 3), meta)
        k = self.rotate(rope, k.transpose(0, 2, 1, 3), meta)
        out = self.attention(q, k, v.transpose(0, 2, 1, 3), meta, layer, scale, window, sinks)
        return out.transpose(0, 2, 1, 3).reshape(*lead, -1)

    def attention(self, q, k, v, meta, layer, scale, window=None, sinks=None) -> mx.array:
        """As :meth:`AttentionBackend.attention` on ``[1, heads, T, head_dim]``."""
        out = self.packed_attention(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                                    meta, layer, scale, window, sinks)
        return out.transpose(1, 0, 2)[None]

    def packed_attention(self, q, k, v, meta, layer, scale, window=None, sinks=None) -> mx.array:
        """Packed ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, KVH, D]`` -> ``[T, H, D]``: write, then attend."""
        self.write(layer, k, v, meta)
        return self.attend(layer, q, k, v, meta, scale, window, sinks)

    def write(self, layer: int, k: mx.array, v: mx.array, meta) -> None:
        """Store packed ``k``, ``v`` ``[T, KVH, D]`` at the slots of the layer's group."""
        tables = meta.groups[meta.layer_groups[layer]]
        meta.pool.write(layer, tables.slot_mapping, k, v, indices=tables.slot_index)

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None) -> mx.array:
        """Decode rows, then prefill runs (:func:`prefill_runs`), concatenated in row order."""
        tables = meta.groups[meta.layer_groups[layer]]
        nd = meta.num_decode_seqs
        # a compiled decode step has no host lengths (nothing may be read back while tracing)
        num_rows = meta.context_lens.shape[0]
        parts = []
        if nd:
            parts.append(self.decode_attention(layer, q[:nd], tables, meta, scale, window, sinks))
        if nd < num_rows:
            starts = meta.host_query_start_loc
            for first, last, fresh in prefill_runs(meta, nd, window):
                row0, row1 = starts[first], starts[last]
                if fresh:
                    parts.append(self.fresh_attention(q[row0:row1], k[row0:row1], v[row0:row1], last - first,
                                                      scale, sinks))
                else:
                    parts.append(self.prefill_attention(layer, q[row0:row1], tables, meta, first, last, scale,
                                                        window, sinks))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def decode_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, scale: float,
                         window=None, sinks=None) -> mx.array:
        """The ``num_decode_seqs`` decode rows ``q`` ``[nd, H, D]`` over the pool -> ``[nd, H, D]``."""
        nd = q.shape[0]
        return kernels.paged_attention_decode(
            q, meta.pool.k[layer], meta.pool.v[layer], tables.block_tables[:nd], meta.context_lens[:nd], scale,
            host_context_lens=meta.host_context_lens[:nd] or None,
            window=window, sinks=sinks, metal_kernels=meta.metal_kernels,
            metadata=tables.decode_launch, reference_index=tables.decode_index,
        )

    def prefill_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, first: int, last: int,
                          scale: float, window=None, sinks=None) -> mx.array:
        """Rows ``first .. last - 1`` (their packed queries ``q``) over the pool -> ``q``'s shape."""
        starts = meta.host_query_start_loc
        rel = [x - starts[first] for x in starts[first : last + 1]]
        return kernels.paged_prefill_attention(
            q, meta.pool.k[layer], meta.pool.v[layer], tables.block_tables[first:last],
            meta.context_lens[first:last], mx.array(rel, dtype=mx.int32), scale,
            host_context_lens=meta.host_context_lens[first:last], host_query_start_loc=rel,
            window=window, sinks=sinks, metal_kernels=meta.metal_kernels,
        )

    def fresh_attention(self, q: mx.array, k: mx.array, v: mx.array, num_seqs: int, scale: float,
                        sinks=None) -> mx.array:
        """A run of ``num_seqs`` fresh prompts of equal length: one batched causal SDPA over
        their own K/V (``q`` ``[rows, H, D]``, ``k``/``v`` ``[rows, KVH, D]``), no pool read."""
        rows = q.shape[0]
        new = rows // num_seqs

        def as_batch(x):
            return x.reshape(num_seqs, new, x.shape[1], x.shape[2]).transpose(0, 2, 1, 3)

        out = sdpa(as_batch(q), as_batch(k), as_batch(v), scale, "causal", sinks)  # [S, H, L, D]
        return out.transpose(0, 2, 1, 3).reshape(rows, q.shape[1], q.shape[2])


def prefill_runs(meta: PagedMetadata, first_prefill: int, window: Optional[int]) -> list[tuple[int, int, bool]]:
    """Split the prefill rows ``first_prefill ..`` into runs ``(first, last, fresh)`` of
    consecutive rows (``last`` exclusive).

    A fresh run holds sequences with no cached tokens before this pass and the same
    number of new tokens (more than one, and within the window): they attend only to
    their own new K/V, so one batched causal SDPA serves the run without reading the
    pool (the usual case of a burst of new prompts). Every other run goes to
    :func:`~mlx_ferrum.kernels.paged_prefill_attention`, and so does everything when the
    Metal kernels are in use (their prefill kernel takes a whole varlen batch in one launch).

    Reads ``meta.host_context_lens``, ``meta.host_query_start_loc``, ``meta.metal_kernels``
    and ``meta.backend.uses_metal_kernels``.
    """
    context_lens, starts = meta.host_context_lens, meta.host_query_start_loc
    batch_fresh = not (meta.backend.uses_metal_kernels and kernels.metal_path_enabled(meta.metal_kernels))
    runs: list[tuple[int, int, bool]] = []
    for i in range(first_prefill, len(context_lens)):
        new = starts[i + 1] - starts[i]
        fresh = batch_fresh and new > 1 and context_lens[i] == new and (window is None or new <= window)
        if runs and runs[-1][1] == i and runs[-1][2] == fresh and (
            not fresh or starts[i] - starts[i - 1] == new
        ):
            runs[-1] = (runs[-1][0], i + 1, fresh)
        else:
            runs.append((i, i + 1, fresh))
    return runs


#: the one no-cache backend (it holds no state)
NO_CACHE_BACKEND = NoCacheAttentionBackend()
