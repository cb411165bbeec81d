"""Attention for every model layer: the one call a layer makes, the typed metadata of a
forward pass, the attention backends that read it, and the dense scaled dot-product
attention they end in.

The call. The runner builds one typed metadata object per forward pass, before
the model runs (:class:`NoCacheMetadata`, :class:`ContiguousMetadata`,
:class:`PagedMetadata`), and hands it to the model; each attention layer hands its
projected q/k/v to :func:`rope_attention` with it. The metadata carries the attention
backend the store was built with, and :func:`rope_attention` calls it: no layer asks
which layout is in use. Nothing is global.

The backends. A backend is chosen ONCE, when the KV store is built
(:func:`mlx_ferrum.kv_cache.factory.build_kv_store`), and every pass's metadata carries
it. This is the split vLLM makes between an ``AttentionBackend`` (the attention
implementation), its ``AttentionMetadata`` (built once per step by the runner, before the
model runs) and the KV storage it reads. One per layout (a quantized KV cache is another
backend over another storage, :mod:`mlx_ferrum.layers.quantized_backends`):

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
  ``slot_mapping``; decode rows run the decode kernel, prefill rows the varlen prefill
  kernel, both from the :class:`~mlx_ferrum.kernels.AttentionKernels` the backend chose
  when it was built (:func:`~mlx_ferrum.kernels.attention_kernels`: Metal or the pure-MLX
  reference). No padding anywhere.

Every backend offers the same calls:

- ``forward(q, k, v, rope, meta, layer, scale, window, sinks)``: from the projections'
  layout, RoPE, store this step's K/V, attend (what :func:`rope_attention` runs);
- ``attention(q, k, v, meta, layer, scale, window, sinks)``: the same after RoPE, in
  ``[B, heads, L, head_dim]``;
- ``rotate(rope, x, meta)``: RoPE at the positions the metadata gives;
- ``write(layer, k, v, meta)`` and ``attend(layer, q, k, v, meta, scale, window, sinks)``:
  the two halves, which a quantized backend replaces (quantize on write, dequantize
  the gathered blocks inside attention).

Dense attention. :func:`sdpa` is what every backend ends in for dense K/V: the fused
``mx.fast.scaled_dot_product_attention`` on GPUs, :func:`sdpa_base2` on MLX's CPU
backend (where the fused call is itself an unfused composition computing ``exp``);
:func:`window_mask` and :func:`contiguous_pad_mask` are its masks.

Why this module is one file of over 500 lines: the typed metadata of a pass, the
backends that read it, the call the layers make and the dense attention the backends end
in change together; one file keeps each backend next to the metadata it consumes and the
attention it runs, and a layer's attention passes through one module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import mlx.core as mx
import numpy as np

from .. import kernels
from ..kernels.reference import (
    PREFILL_GROUP_SCORES,
    SharedPrefix,
    causal_attention_base2,
    exp2,
    exp2_eager,
    is_fusing,
    plan_shared_prefix,
    weighted_values,
)

_NEG_INF = float("-inf")

_LOG2_E = 1.4426950408889634  # exp(x) == 2 ** (x * log2(e))


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
            lengths (:func:`contiguous_pad_mask`), or None.
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
        decode_index: the index arrays of the first ``num_decode_seqs`` rows that the
            backend's decode kernel takes (its kernels' ``decode_index``:
            :func:`~mlx_ferrum.kernels.reference.decode_index` on the reference path,
            :func:`~mlx_ferrum.kernels.metal_decode_index` on the Metal path), or None
            without decode rows.
    """

    slot_mapping: mx.array
    block_tables: mx.array
    slot_index: tuple
    decode_index: Any = None


@dataclass
class FloatWindowMetadata:
    """Where a pass over a quantized pool with a float window writes and reads the float
    entries (:mod:`~mlx_ferrum.kernels.float_window`).

    Attributes:
        write_index: ``(window slots [T], entries [T])`` int32 per packed token: where its
            float copy goes (the pool's scratch slot for tokens no window keeps).
        decode_slots, decode_last, decode_starts: ``[num_decode_seqs]`` int32 per decode
            row: its sequence's window slot, the last position the pass writes for that
            sequence, and the sequence's first position with a float entry
            (:data:`NO_FLOAT_WINDOW` for a sequence without a slot).
        prefill_slots: ``[num_prefill_rows]`` int32, each prefill row's window slot (read
            by every layer of the pass, so built once).
        prefill_starts: each prefill row's first position with a float entry (Python ints).
        window: the float window in tokens; entries: ring entries per sequence.
        masks: the decode rows' masks, built by the pass's first layer of each group and
            read by the others (:class:`~mlx_ferrum.kernels.float_window.FloatRows` ``memo``).
    """

    write_index: tuple
    decode_slots: mx.array
    decode_last: mx.array
    decode_starts: mx.array
    prefill_slots: mx.array
    prefill_starts: list
    window: int
    entries: int
    masks: dict = field(default_factory=dict)


#: the window start of a sequence without a float-window slot: no position is read from floats
NO_FLOAT_WINDOW = 1 << 30


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
        logits_indices, lora_slots: as :class:`NoCacheMetadata`.
        float_window: a quantized pool's :class:`FloatWindowMetadata`, or None.
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
    logits_indices: Optional[mx.array] = None
    lora_slots: Optional[mx.array] = None
    float_window: Optional[FloatWindowMetadata] = None

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
    shared_prefixes: Optional[list] = None,
    float_window: Optional[FloatWindowMetadata] = None,
) -> PagedMetadata:
    """A complete :class:`PagedMetadata`: the per-pass arrays every layer shares (pool
    index arrays, the decode index of the backend's kernels, RoPE tables) are derived
    here, once, from the step's arrays.

    Called by the runner's pass builder for an eager pass and inside the compiled decode step's trace
    (where the step's arrays are the traced inputs, so the derived ones are part of the
    compiled graph rather than constants of one trace).

    Args:
        backend: the paged attention backend the pass runs (its ``kernels`` build the
            decode index).
        pool: the K/V storage.
        positions: ``[T]`` int32.
        context_lens: ``[num_rows]`` int32.
        num_decode_seqs: leading one-token rows.
        layer_groups: group index of each layer.
        slot_mappings: per group, ``[T]`` int32.
        block_tables: per group, ``[num_rows, max_blocks]`` int32.
        ropes: the model's distinct table ropes (objects with ``table_key`` and
            ``table(positions)``; :class:`~mlx_ferrum.layers.rope.Rope`).
        query_start_loc, host_context_lens, host_query_start_loc: see
            :class:`PagedMetadata`.
        shared_prefixes: per group, the decode rows'
            :class:`~mlx_ferrum.kernels.reference.SharedPrefix` (MLX arrays) or None
            (:meth:`PagedAttentionBackend.shared_prefix`); None: none anywhere.
        float_window: a quantized pool's :class:`FloatWindowMetadata`, or None.
    """
    nd = num_decode_seqs
    num_kv_heads, block_size = pool.shape[1], pool.shape[2]
    groups = []
    shared_prefixes = shared_prefixes or [None] * len(block_tables)
    for slots, tables, shared in zip(slot_mappings, block_tables, shared_prefixes):
        groups.append(PagedGroupTables(
            slot_mapping=slots,
            block_tables=tables,
            # broadcast once per pass, so no layer's K or V write broadcasts them again
            slot_index=tuple(mx.broadcast_arrays(*pool.slot_indices(slots))),
            decode_index=backend.kernels.decode_index(tables[:nd], context_lens[:nd], num_kv_heads, block_size, shared)
            if nd else None,
        ))
    rope_tables = {}
    for rope in ropes:
        if rope.table_key not in rope_tables:
            rope_tables[rope.table_key] = rope.table(positions)
    return PagedMetadata(
        backend=backend, pool=pool, positions=positions, context_lens=context_lens, num_decode_seqs=nd,
        layer_groups=list(layer_groups), groups=groups, query_start_loc=query_start_loc,
        host_context_lens=list(host_context_lens or []), host_query_start_loc=list(host_query_start_loc or []),
        rope_tables=rope_tables, float_window=float_window,
    )


# ---------------------------------------------------------------------------- backends
class AttentionBackend:
    """The attention of one KV layout (and KV dtype). Subclasses implement :meth:`rotate`,
    :meth:`write` and :meth:`attend`; :meth:`forward` and :meth:`attention` are built on them.

    Attributes:
        kv_cache_dtype: the KV storage format the backend reads (``"auto"``: the model dtype).
    """

    kv_cache_dtype = "auto"

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
    written through each layer group's ``slot_mapping``, decode rows on the decode kernel,
    prefill rows on the varlen prefill kernel or, for a run of fresh prompts of equal
    length, one batched causal SDPA over their own K/V.

    A quantized backend subclasses this and replaces :meth:`write`,
    :meth:`decode_attention`, :meth:`prefill_attention` and :meth:`fresh_attention`.

    Args:
        metal_kernels: the runner's ``RuntimeConfig.metal_kernels`` (None reads
            ``FERRUM_METAL_KERNELS``).

    Attributes:
        kernels: the :class:`~mlx_ferrum.kernels.AttentionKernels` chosen here, once
            (:func:`~mlx_ferrum.kernels.attention_kernels`): the Metal path when Metal (or
            a test launcher) is present and ``metal_kernels`` does not switch it off, else
            the pure-MLX reference. Every pass's attention calls them directly.

    Raises:
        ConfigurationError: ``FERRUM_METAL_KERNELS`` is malformed.
    """

    def __init__(self, metal_kernels: Optional[bool] = None):
        self.kernels = kernels.attention_kernels(metal_kernels)

    def shared_prefix(self, block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                      row_seqs: Optional[np.ndarray] = None) -> Optional[SharedPrefix]:
        """The host plan by which the reference decode attention reads the blocks that
        head many decode rows' tables once for all of them
        (:func:`~mlx_ferrum.kernels.reference.plan_shared_prefix`), or None: too little
        shared, or the Metal kernel runs (it reads each row's blocks in place).

        Args:
            block_tables: ``[num_decode_seqs, max_blocks]`` int32 of a full-attention group.
            context_lens: ``[num_decode_seqs]`` int32.
            block_size: tokens per block.
            row_seqs: ``[num_decode_seqs]`` the sequence of each row (a verified draft
                is several rows of one sequence), or None: one row per sequence.
        """
        if self.kernels.metal:
            return None
        return plan_shared_prefix(block_tables, context_lens, block_size, row_seqs=row_seqs)

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
        return self.kernels.decode(
            q, meta.pool.k[layer], meta.pool.v[layer], tables.block_tables[:nd], meta.context_lens[:nd], scale,
            host_context_lens=meta.host_context_lens[:nd] or None,
            window=window, sinks=sinks, index=tables.decode_index,
        )

    def prefill_attention(self, layer: int, q: mx.array, tables: PagedGroupTables, meta, first: int, last: int,
                          scale: float, window=None, sinks=None) -> mx.array:
        """Rows ``first .. last - 1`` (their packed queries ``q``) over the pool -> ``q``'s shape."""
        starts = meta.host_query_start_loc
        rel = [x - starts[first] for x in starts[first : last + 1]]
        return self.kernels.prefill(
            q, meta.pool.k[layer], meta.pool.v[layer], tables.block_tables[first:last],
            meta.context_lens[first:last], mx.array(rel, dtype=mx.int32), scale,
            host_context_lens=meta.host_context_lens[first:last], host_query_start_loc=rel,
            window=window, sinks=sinks,
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
    pool (the usual case of a burst of new prompts). Every other run goes to the
    backend's prefill kernel, and so does everything when its kernels are the Metal path
    (their prefill kernel takes a whole varlen batch in one launch).

    Reads ``meta.host_context_lens``, ``meta.host_query_start_loc`` and
    ``meta.backend.kernels.metal`` (a :class:`PagedAttentionBackend`'s choice).
    """
    context_lens, starts = meta.host_context_lens, meta.host_query_start_loc
    batch_fresh = not meta.backend.kernels.metal
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


# ---------------------------------------------------------------------------- the layers' call
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
        layer, scale, window, sinks: see :meth:`AttentionBackend.attention`.

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
    :meth:`AttentionBackend.forward`).

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


# ---------------------------------------------------------------------------- dense attention
def sdpa(q, k, v, scale: float, mask, sinks: Optional[mx.array]) -> mx.array:
    """Scaled dot-product attention on the current device: :func:`sdpa_base2` on MLX's CPU
    backend, ``mx.fast.scaled_dot_product_attention`` elsewhere (same arguments as
    :func:`sdpa_base2`; returns ``[B, num_heads, L_q, head_dim]`` in q's dtype)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return sdpa_base2(q, k, v, scale, mask, sinks)
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks.astype(q.dtype))


def sdpa_base2(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, sinks: Optional[mx.array] = None) -> mx.array:
    """Scaled dot-product attention with the softmax in base 2 (log2(e) folded into the scale).

    What attention runs on MLX's CPU backend, where ``mx.fast.scaled_dot_product_attention``
    is itself an unfused composition of these ops, computing ``exp``; ``2 ** x`` costs a
    fraction of it there (FlashAttention-2 kernels fold log2(e) the same way). GPUs keep
    the fused kernel.

    Args:
        q: ``[B, num_heads, L_q, head_dim]``; k, v: ``[B, num_kv_heads, L_k, head_dim]``
            (grouped-query attention when ``num_heads > num_kv_heads``).
        scale: softmax scale.
        mask: None, ``"causal"`` (query ``i`` sees keys ``0 .. L_k - L_q + i``), an
            additive float mask or a boolean mask (True: attend), broadcastable to
            ``[B, num_heads, L_q, L_k]``.
        sinks: ``[num_heads]`` attention-sink logits, or None.

    Returns:
        ``[B, num_heads, L_q, head_dim]`` in q's dtype; the softmax is taken in float32.
    """
    b, num_heads, lq, head_dim = q.shape
    num_kv_heads, lk = k.shape[1], k.shape[2]
    if isinstance(mask, str) and not is_fusing() and lq > 1 and b * num_heads * lq * lk > PREFILL_GROUP_SCORES:
        # a long causal pass, op by op: tiles of queries skip the masked half of the scores
        return causal_attention_base2(q, k, v, scale, sinks)
    group = num_heads // num_kv_heads
    rows = group * lq
    qg = (q * (scale * _LOG2_E)).reshape(b, num_kv_heads, rows, head_dim)
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32).reshape(b, num_kv_heads, group, lq, lk)
    if isinstance(mask, str):
        allowed = mx.arange(lk)[None, :] <= (mx.arange(lq) + (lk - lq))[:, None]
        scores = mx.where(allowed, scores, _NEG_INF)
    elif mask is not None:
        if mask.ndim == 4:  # [B or 1, H or 1, L_q or 1, L_k] -> the grouped layout
            mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(
                mask.shape[0], num_kv_heads, group, mask.shape[2], mask.shape[3])
        if mask.dtype == mx.bool_:  # True: attend
            scores = mx.where(mask, scores, _NEG_INF)
        else:
            scores = scores + mask.astype(mx.float32) * _LOG2_E
    # op by op (a prefill, a contiguous step), 2**x as one compiled kernel; inside the
    # runner's traced step, the arithmetic that its trace fuses
    power = exp2 if is_fusing() else exp2_eager
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = (sinks.astype(mx.float32) * _LOG2_E).reshape(1, num_kv_heads, group, 1, 1)
        top = mx.maximum(top, sink)
    weights = power(scores - top).reshape(b, num_kv_heads, rows, lk)
    # normalised on the product, not before it: one pass over the scores fewer
    out, denom = weighted_values([(weights, 0)], v)
    if sinks is not None:
        denom = denom + power(sink - top).reshape(b, num_kv_heads, rows, 1)
    return (out / denom).reshape(b, num_heads, lq, head_dim).astype(q.dtype)


def window_mask(qpos: mx.array, kpos: mx.array, window: Optional[int], dtype) -> mx.array:
    """Additive mask broadcast from ``qpos`` and ``kpos`` (positions, int): 0 where ``qpos - window < kpos <= qpos``, else ``-inf``."""
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    return mx.where(allowed, 0.0, _NEG_INF).astype(dtype)


def contiguous_pad_mask(cache_lens_after: list[int], new_tokens: int, dtype) -> Optional[mx.array]:
    """Additive mask ``[B, 1, L, max_len]`` for right-padded contiguous rows.

    Row ``b`` stores ``cache_lens_after[b]`` tokens after this step; its ``L`` new
    tokens are the last ``L`` of them, and query ``j`` may see keys ``0 .. len-L+j``.
    """
    max_len = max(cache_lens_after)
    if len(cache_lens_after) == 1:
        return None
    lens = mx.array(cache_lens_after, dtype=mx.int32)[:, None, None, None]
    kpos = mx.arange(max_len)[None, None, None, :]
    qpos = lens - new_tokens + mx.arange(new_tokens)[None, None, :, None]
    return mx.where(kpos <= qpos, 0.0, _NEG_INF).astype(dtype)


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
    "window_mask",
]
