"""AttentionMetadata and the one attention call every model layer makes.

The executor builds one :class:`AttentionMetadata` per forward pass and hands it to
the model; each attention layer hands its projected q/k/v to :func:`rope_attention`
(RoPE, then :func:`attention`) with it. Nothing is global: the metadata carries the positions, the cache of whichever
layout is in use, and (paged) the ``slot_mapping``, ``block_tables`` and
``context_lens`` the kernels need. This mirrors nano-vllm's context object and vLLM's
``AttentionMetadata``.

Layouts:

- ``"none"``: no cache; causal attention over the given tokens (tests, scoring).
- ``"contiguous"``: batch row ``b`` has its own list of per-layer
  :class:`~mlx_ferrum.kv_cache.ContiguousKvCache`; every row brings ``L`` new tokens
  at positions ``offsets[b] .. offsets[b]+L-1``. Rows of different cache lengths are
  batched by right-padding the gathered K/V to the longest and masking the pad
  (``-inf``), so one forward pass serves them all; the pad costs a copy of
  ``B * max_len`` K/V entries per layer.
- ``"paged"``: tokens of all sequences are packed into one row (``input_ids [1, T]``),
  decode tokens first (one per decoding sequence), then each prefilling sequence's
  chunk. K/V go to the shared pool through ``slot_mapping``; decode rows run
  :func:`~mlx_ferrum.kernels.paged_attention_decode`, prefill rows
  :func:`~mlx_ferrum.kernels.paged_prefill_attention`. No padding anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from .. import kernels

_NEG_INF = float("-inf")


@dataclass
class AttentionMetadata:
    """Everything an attention layer needs besides q, k and v.

    Attributes:
        layout: ``"none"``, ``"contiguous"`` or ``"paged"``.
        offsets: ``[B]`` int32 (none/contiguous): position of row ``b``'s first new token.
        caches: contiguous: ``caches[b][layer]`` is row ``b``'s cache of that layer.
        pad_mask: contiguous: ``[B, 1, L, max_len]`` additive mask for padded rows, or None.
        positions: paged: ``[T]`` int32 position of each packed token.
        pool: paged: the :class:`~mlx_ferrum.kv_cache.PagedKvPool`.
        slot_mapping: paged: ``[T]`` int32 pool slot of each packed token.
        block_tables: paged: ``[num_seqs, max_blocks]`` int32, decode sequences first.
        context_lens: paged: ``[num_seqs]`` int32, tokens stored after this step's writes.
        query_start_loc: paged: ``[num_seqs + 1]`` int32 prefix sums of tokens per sequence.
        num_decode_seqs: paged: the leading sequences that bring exactly one token.
        host_context_lens, host_query_start_loc: the same as Python lists (no read-back).
        logits_indices: ``[N]`` int32 rows of the flattened ``B*L`` tokens whose logits
            are wanted, or None for all.
        slot_index: paged: the pool index arrays of ``slot_mapping``, built once per pass
            and shared by every layer's write.
        layer_groups: paged, models mixing full and sliding-window layers
            (:class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`): group index of each layer,
            else None. Each group has its own block ids, so its layers use
            ``group_slot_mappings[g]`` (``[T]`` int32) and ``group_block_tables[g]``
            (``[num_seqs, max_blocks]`` int32) instead of ``slot_mapping`` /
            ``block_tables``; ``group_slot_indices`` caches their pool index arrays.
        decode_indices: paged: the reference decode attention's index arrays
            (:func:`~mlx_ferrum.kernels.reference.decode_index`) by layer group (None
            without groups), built on first use and shared by every layer of the pass.
        metal_kernels: the executor's ``RuntimeConfig.metal_kernels``, decided once per
            executor (None: the kernels read ``FERRUM_METAL_KERNELS``).
        rope_tables: paged: the pass's RoPE ``(cos, sin)`` tables by ``Rope.table_key``,
            filled by :meth:`rope_table` on first use.
        lora_slots: ``[N]`` int32 LoRA slot of each of the pass's flattened tokens (``B*L``,
            or the packed ``T``), or None when no token has an adapter. Attention does not
            read it: the executor binds it to the model's LoRA projections
            (:class:`~mlx_ferrum.layers.lora.LoraContext`) while it builds the pass.
    """

    layout: str = "none"
    offsets: Optional[mx.array] = None
    caches: Optional[list] = None
    pad_mask: Optional[mx.array] = None
    positions: Optional[mx.array] = None
    pool: Any = None
    slot_mapping: Optional[mx.array] = None
    block_tables: Optional[mx.array] = None
    context_lens: Optional[mx.array] = None
    query_start_loc: Optional[mx.array] = None
    num_decode_seqs: int = 0
    host_context_lens: list = field(default_factory=list)
    host_query_start_loc: list = field(default_factory=list)
    logits_indices: Optional[mx.array] = None
    slot_index: Any = None
    # paged, layer groups (models mixing full and sliding layers): layer_groups[layer]
    # is the layer's group; each group has its own slot_mapping and block_tables
    layer_groups: Optional[list] = None
    group_slot_mappings: Optional[list] = None
    group_block_tables: Optional[list] = None
    group_slot_indices: Optional[dict] = None
    decode_indices: Optional[dict] = None
    metal_kernels: Optional[bool] = None
    rope_tables: Optional[dict] = None
    lora_slots: Optional[mx.array] = None

    def rope_table(self, rope) -> tuple[mx.array, mx.array]:
        """Paged: ``rope.table(positions)``, computed on the first call of a pass for each
        distinct rope setting (``rope.table_key``) and shared by every layer after it."""
        if self.rope_tables is None:
            self.rope_tables = {}
        if rope.table_key not in self.rope_tables:
            self.rope_tables[rope.table_key] = rope.table(self.positions)
        return self.rope_tables[rope.table_key]


def apply_rope(rope, x: mx.array, meta: Optional[AttentionMetadata]) -> mx.array:
    """Rotate ``x`` ``[B, H, L, D]`` by the positions ``meta`` assigns its tokens.

    Paged (packed) tokens each have their own position, so they are rotated as
    ``T`` rows of length 1 with per-row offsets.
    """
    if meta is None or meta.layout == "none" and meta.offsets is None:
        return rope(x, 0)
    if meta.layout == "paged":
        # [1, H, T, D] -> [T, H, 1, D] in one transpose (the batch axis has size 1), so
        # each packed token is a row with its own offset; fewer graph ops per layer
        y = rope(x.transpose(2, 1, 0, 3), meta.positions)
        return y.transpose(2, 1, 0, 3)
    return rope(x, meta.offsets)


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
    """Store this step's K/V in the cache ``meta`` names and attend.

    Args:
        q: ``[B, num_heads, L, head_dim]`` (RoPE applied).
        k, v: ``[B, num_kv_heads, L, head_dim]`` (RoPE applied to k).
        meta: the step's metadata (``None``: causal, no cache).
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
    if meta is None or meta.layout == "none":
        l = q.shape[2]
        mask = "causal" if l > 1 else None
        if window is not None and l > window:
            pos = mx.arange(l)
            mask = _window_mask(pos[:, None], pos[None, :], window, q.dtype)
        return _sdpa(q, k, v, scale, mask, sinks)
    if meta.layout == "contiguous":
        return _contiguous(q, k, v, meta, layer, scale, window, sinks)
    if meta.layout == "paged":
        # packed: [1, H, T, D] -> [T, H, D] and back
        out = _paged(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                     meta, layer, scale, window, sinks)
        return out.transpose(1, 0, 2)[None]
    raise ValueError(f"unknown KV layout {meta.layout!r}")


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
    """RoPE on q and k, then :func:`attention`, from and to the projections' layout.

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

    The paged layout packs every token into one row, so it works on ``[T, H, D]``
    directly: RoPE from one cos/sin table per pass (:meth:`AttentionMetadata.rope_table`)
    and no transposes. The other layouts rotate ``[B, H, L, D]`` with ``mx.fast.rope``.
    """
    lead = q.shape[:-2]
    if q.ndim == 3:  # [T, H, D]: a paged pass's packed tokens
        if meta is None or meta.layout != "paged":
            raise ValueError("packed [T, heads, head_dim] projections need a paged pass's metadata")
        if not rope.has_table:
            q, k, v = q[None], k[None], v[None]
    if meta is not None and meta.layout == "paged" and rope.has_table:
        table = meta.rope_table(rope)
        if q.ndim == 4:
            q, k, v = q[0], k[0], v[0]
        out = _paged(rope.apply_table(q, table), rope.apply_table(k, table), v, meta, layer, scale, window, sinks)
        return out.reshape(*lead, -1)
    q = apply_rope(rope, q.transpose(0, 2, 1, 3), meta)
    k = apply_rope(rope, k.transpose(0, 2, 1, 3), meta)
    out = attention(q, k, v.transpose(0, 2, 1, 3), meta, layer, scale, window=window, sinks=sinks)
    return out.transpose(0, 2, 1, 3).reshape(*lead, -1)


_LOG2_E = 1.4426950408889634  # exp(x) == 2 ** (x * log2(e))


def _sdpa(q, k, v, scale: float, mask, sinks: Optional[mx.array]) -> mx.array:
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
    group = num_heads // num_kv_heads
    qg = (q * (scale * _LOG2_E)).reshape(b, num_kv_heads, group * lq, head_dim)
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
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = (sinks.astype(mx.float32) * _LOG2_E).reshape(1, num_kv_heads, group, 1, 1)
        top = mx.maximum(top, sink)
    weights = mx.power(2.0, scores - top)
    denom = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + mx.power(2.0, sink - top)
    weights = (weights / denom).astype(v.dtype).reshape(b, num_kv_heads, group * lq, lk)
    return (weights @ v).reshape(b, num_heads, lq, head_dim).astype(q.dtype)


def _window_mask(qpos: mx.array, kpos: mx.array, window: Optional[int], dtype) -> mx.array:
    """Additive mask: 0 where ``qpos - window < kpos <= qpos``, else ``-inf``."""
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    return mx.where(allowed, 0.0, _NEG_INF).astype(dtype)


def _contiguous(q, k, v, meta: AttentionMetadata, layer: int, scale: float, window=None, sinks=None) -> mx.array:
    b, _, l, _ = q.shape
    if b == 1:
        keys, values = meta.caches[0][layer].append(k, v)
        n = keys.shape[2]
        mask = "causal" if l > 1 else None
        if window is not None and n > window:
            if l == 1:
                # a decode step reads only its window: a slice, no mask
                keys, values = keys[:, :, n - window :], values[:, :, n - window :]
            else:
                qpos = mx.arange(n - l, n)[:, None]
                mask = _window_mask(qpos, mx.arange(n)[None, :], window, q.dtype)
        return _sdpa(q, keys, values, scale, mask, sinks)
    ks, vs = [], []
    for i in range(b):
        ki, vi = meta.caches[i][layer].append(k[i : i + 1], v[i : i + 1])
        ks.append(ki)
        vs.append(vi)
    max_len = max(x.shape[2] for x in ks)
    pad = lambda x: x if x.shape[2] == max_len else mx.pad(x, [(0, 0), (0, 0), (0, max_len - x.shape[2]), (0, 0)])  # noqa: E731
    keys = mx.concatenate([pad(x) for x in ks], axis=0)
    values = mx.concatenate([pad(x) for x in vs], axis=0)
    mask = meta.pad_mask
    if window is not None and max_len > window:
        # rows differ in length: the window is cut per row, from each row's own positions
        lens = mx.array([x.shape[2] for x in ks], dtype=mx.int32)[:, None, None, None]
        qpos = lens - l + mx.arange(l)[None, None, :, None]
        mask = _window_mask(qpos, mx.arange(max_len)[None, None, None, :], window, q.dtype)
    return _sdpa(q, keys, values, scale, mask, sinks)


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


def _paged(qt, kt, vt, meta: AttentionMetadata, layer: int, scale: float, window=None, sinks=None) -> mx.array:
    """Packed tokens ``qt`` ``[T, H, D]``, ``kt``/``vt`` ``[T, KVH, D]`` -> ``[T, H, D]``."""
    pool = meta.pool
    if meta.layer_groups is not None:
        # this layer's group has its own block ids (sliding groups free old blocks)
        g = meta.layer_groups[layer]
        slot_mapping, block_tables = meta.group_slot_mappings[g], meta.group_block_tables[g]
        if meta.group_slot_indices is None:
            meta.group_slot_indices = {}
        if g not in meta.group_slot_indices:
            meta.group_slot_indices[g] = tuple(mx.broadcast_arrays(*pool.slot_indices(slot_mapping)))
        slot_index = meta.group_slot_indices[g]
    else:
        if meta.slot_index is None:
            # broadcast once per pass, so no layer's K or V write broadcasts them again
            meta.slot_index = tuple(mx.broadcast_arrays(*pool.slot_indices(meta.slot_mapping)))
        slot_mapping, block_tables, slot_index = meta.slot_mapping, meta.block_tables, meta.slot_index
    pool.write(layer, slot_mapping, kt, vt, indices=slot_index)
    kp, vp = pool.k[layer], pool.v[layer]
    nd = meta.num_decode_seqs
    # a compiled decode step has no host lengths (nothing may be read back while tracing)
    n_seqs = meta.context_lens.shape[0]
    parts = []
    if nd:
        # the reference path's index arrays, once per pass (and layer group)
        group = meta.layer_groups[layer] if meta.layer_groups is not None else None
        if meta.decode_indices is None:
            meta.decode_indices = {}
        if group not in meta.decode_indices:
            meta.decode_indices[group] = kernels.reference.decode_index(
                block_tables[:nd], meta.context_lens[:nd], kp.shape[1], kp.shape[2])
        parts.append(
            kernels.paged_attention_decode(
                qt[:nd], kp, vp, block_tables[:nd], meta.context_lens[:nd], scale,
                host_context_lens=meta.host_context_lens[:nd] or None,
                window=window, sinks=sinks,
                metal_kernels=meta.metal_kernels,
                reference_index=meta.decode_indices[group],
            )
        )
    if nd < n_seqs:
        for first, last, fresh in _prefill_runs(meta, nd, window):
            parts.append(_prefill_run(qt, kt, vt, kp, vp, block_tables, meta, first, last, fresh, scale, window, sinks))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _prefill_runs(meta: AttentionMetadata, first_prefill: int, window: Optional[int]) -> list[tuple[int, int, bool]]:
    """Split the prefill sequences ``first_prefill ..`` into runs ``(first, last, fresh)``
    of consecutive sequences (``last`` exclusive).

    A fresh run holds sequences with no cached tokens before this pass and the same
    number of new tokens (more than one, and within the window): they attend only to
    their own new K/V, so one batched causal SDPA serves the run without reading the
    pool (the usual case of a burst of new prompts). Every other run goes to
    :func:`~mlx_ferrum.kernels.paged_prefill_attention`, and so does everything when the
    Metal kernels are in use (their prefill kernel takes a whole varlen batch in one launch).
    """
    context_lens, starts = meta.host_context_lens, meta.host_query_start_loc
    batch_fresh = not kernels.metal_path_enabled(meta.metal_kernels)
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


def _prefill_run(qt, kt, vt, kp, vp, block_tables, meta: AttentionMetadata, first: int, last: int, fresh: bool,
                 scale: float, window, sinks) -> mx.array:
    """Attention of the packed rows of prefill sequences ``first .. last - 1`` -> ``[rows, H, D]``."""
    starts = meta.host_query_start_loc
    row0, row1 = starts[first], starts[last]
    if fresh:
        seqs, new = last - first, (row1 - row0) // (last - first)
        as_batch = lambda x: x[row0:row1].reshape(seqs, new, x.shape[1], x.shape[2]).transpose(0, 2, 1, 3)  # noqa: E731
        out = _sdpa(as_batch(qt), as_batch(kt), as_batch(vt), scale, "causal", sinks)  # [S, H, L, D]
        return out.transpose(0, 2, 1, 3).reshape(row1 - row0, qt.shape[1], qt.shape[2])
    rel = [x - row0 for x in starts[first : last + 1]]
    return kernels.paged_prefill_attention(
        qt[row0:row1], kp, vp, block_tables[first:last], meta.context_lens[first:last],
        mx.array(rel, dtype=mx.int32), scale,
        host_context_lens=meta.host_context_lens[first:last], host_query_start_loc=rel,
        window=window, sinks=sinks, metal_kernels=meta.metal_kernels,
    )
