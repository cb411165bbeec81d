"""A forward pass's inputs, built by the runner from what the block manager's owner handed
over: how the pass lays out its rows and the typed attention metadata the model gets, and
the device arrays (bucketed shapes, padded metadata arrays, token ids, per-token LoRA slots).

The paged layout reads the step's rows as the block manager's owner handed them over
(the scheduler's ``SchedulerOutput.kv``, or :class:`~mlx_ferrum.executor.LlmExecutor`'s):
per row its first position, its slots and its block tables per layer group
(:class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`). From them
:class:`PagedPassBuilder` packs every row into ONE pass (one row of varlen sequences,
decode tokens first; vLLM's varlen layout and ferrum's ``unified_decode``) and builds its
arrays: positions, slot mapping, block tables, context lengths, query start offsets and
the decode rows' shared prefix. The per-layer index arrays derived from those (pool
indices, decode indices, Metal launch arrays, RoPE tables) come from the backend's
:func:`~mlx_ferrum.layers.attention.paged_metadata`, which the compiled decode step also
calls inside its trace.

The contiguous layout runs one pass per distinct new-token count (rows of equal length;
caches of different lengths are padded and masked inside attention), so no pad token is
ever stored (:class:`ContiguousPassBuilder`).

The KV store only holds the storage (pools, contiguous buffers) and reads and writes it;
:func:`pass_builder` picks the builder once, when the runner is built.

The device arrays below the builders are the inputs of one pass, eager or compiled
(:mod:`.compiled_decode`); all of it is host-side numpy work over the given slots and
block tables (the runner never allocates).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..errors import ExecutorError
from ..kernels.float_window import FIRST_TOKENS
from ..kernels.reference import SHARED_PREFIX_MIN_SEQS
from ..kv_cache.block_tables import BatchBlocks
from ..kv_cache.store import ContiguousKvStore, PagedKvStore
from ..layers.attention import (
    NO_FLOAT_WINDOW,
    ContiguousMetadata,
    FloatWindowMetadata,
    PagedMetadata,
    contiguous_pad_mask,
    paged_metadata,
)
from .protocol import SeqWork


@dataclass
class PagedPassInputs:
    """A paged pass's host-side arrays (numpy), from :meth:`PagedPassBuilder.passes`.

    Attributes:
        positions: ``[T]`` int32 position of each packed token.
        context_lens: ``[num_rows]`` int32, tokens stored after the pass's writes.
        query_start_loc: ``[num_rows + 1]`` int32 prefix sums of query tokens per row.
        num_decode_seqs: leading rows that bring exactly one token.
        host_context_lens, host_query_start_loc: the same as lists of ints.
        slot_mappings: per layer group, ``[T]`` int32 (``block_id * block_size + offset``).
        block_tables: per layer group, ``[num_rows, max_blocks]`` int32.
        shared_prefixes: per layer group, the decode rows'
            :class:`~mlx_ferrum.kernels.reference.SharedPrefix` (numpy) or None
            (the backend's ``shared_prefix``); an empty list when no group has one.
        float_window: a pool with a float window: ``write_slots``, ``write_entries``
            (``[T]``), ``decode_slots``, ``decode_last``, ``decode_starts``
            (``[num_decode_seqs]``) and ``prefill_slots`` (``[num_prefill_rows]``) int32
            numpy, and ``prefill_starts`` (a list); see
            :class:`~mlx_ferrum.layers.attention.FloatWindowMetadata`. None otherwise.
    """

    positions: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    num_decode_seqs: int
    host_context_lens: list
    host_query_start_loc: list
    slot_mappings: list
    block_tables: list
    shared_prefixes: list = field(default_factory=list)
    float_window: Optional[dict] = None


@dataclass
class ContiguousPassInputs:
    """A contiguous pass's host-side inputs, from :meth:`ContiguousPassBuilder.passes`.

    Attributes:
        offsets: ``[B]`` int32 cache length of each row before the pass.
        caches: per row, its per-layer caches.
        cache_lens_after: per row, tokens stored after the pass.
    """

    offsets: np.ndarray
    caches: list
    cache_lens_after: list


@dataclass
class KvPass:
    """One forward pass over some items of a batch.

    Attributes:
        items: indices into the batch's items, in the pass's order.
        rows, cols: the pass's token array is ``[rows, cols]``.
        starts: flat index (into the ``rows * cols`` tokens) of each item's first token.
        inputs: the pass's host-side inputs (:class:`PagedPassInputs` or
            :class:`ContiguousPassInputs`), turned into metadata by the builder's ``metadata``.
        packed: True when the tokens are packed into one row of varlen sequences (the
            paged layout), so the model may take them as ``[T]``.
        decode_rows: attention rows that bring one token each (every row of a pure decode
            pass; 0 when the layout has no decode rows).
    """

    items: list[int]
    rows: int
    cols: int
    starts: list[int]
    inputs: Any = None
    packed: bool = False
    decode_rows: int = 0


def block_table_array(tables: list) -> np.ndarray:
    """``[num_seqs, max_blocks]`` int32 from per-row block id lists, zero-padded; blocks
    freed outside a sliding window (-1) point at block 0, which attention never reads for them."""
    widths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    table_arr = np.zeros((len(tables), int(widths.max())), dtype=np.int32)
    if len(tables) <= 8:
        for r, t in enumerate(tables):
            table_arr[r, : len(t)] = t
    else:
        # one flat copy (row r's blocks fill its first widths[r] columns): a row at
        # a time costs about 2 us per row
        table_arr[np.arange(table_arr.shape[1])[None, :] < widths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(widths.sum()))
    return np.maximum(table_arr, 0, out=table_arr)


class PagedPassBuilder:
    """The paged layout's passes and :class:`~mlx_ferrum.layers.attention.PagedMetadata`.

    Args:
        store: the runner's :class:`~mlx_ferrum.kv_cache.store.PagedKvStore` (its pool,
            backend, block size, layer groups and their windows are read).
        ropes: the model's table ropes (``table_key``, ``table(positions)``); one per
            distinct ``table_key`` is kept, and the metadata carries its ``(cos, sin)`` tables.
    """

    def __init__(self, store: PagedKvStore, ropes: Sequence = ()):
        self.store = store
        seen: dict = {}
        for rope in ropes:
            seen.setdefault(rope.table_key, rope)
        self.ropes = list(seen.values())

    def passes(self, items: Sequence[tuple[Hashable, Sequence[int]]], as_decode: Sequence[bool] = (),
               blocks: Optional[BatchBlocks] = None) -> list[KvPass]:
        """Pack every item into one pass, decode tokens first, at the slots ``blocks`` gives.

        Args:
            items: ``(cache_id, token ids)`` per sequence (only the counts are read).
            as_decode: per item, True to lay its ``n`` tokens out as ``n`` decode rows of
                one query each (the same block table, context lengths ``start + 1`` ..
                ``start + n``) instead of one prefill segment. Each token then attends to
                the cache up to itself, exactly as causal prefill attention would (every
                row's K/V is written before any row attends), so a speculative draft
                runs through the decode attention, and through the compiled decode step
                when the whole pass is decode rows, as vLLM runs drafts as multi-query decode.
            blocks: the step's rows, one per item's cache id, each with as many slots as
                the item has tokens.

        Returns:
            One :class:`KvPass` whose ``inputs`` are :class:`PagedPassInputs`.

        Raises:
            ExecutorError: ``blocks`` missing, or a row absent or of another token count.
        """
        if blocks is None:
            raise ExecutorError("the paged store allocates no blocks: pass the step's BatchBlocks "
                                "(the scheduler's SchedulerOutput.kv, or use LlmExecutor)")
        store = self.store
        expand = [bool(as_decode[i]) if i < len(as_decode) else False for i in range(len(items))]
        # decode rows (one token, or expanded drafts) first, stable
        order = sorted(range(len(items)), key=lambda i: not (len(items[i][1]) == 1 or expand[i]))
        starts: list[int] = []
        group_slots: list[list[int]] = [[] for _ in store.group_windows]
        rows = []
        for i in order:
            cid, tokens = items[i]
            row = blocks.rows.get(cid)
            if row is None or row.num_tokens != len(tokens):
                raise ExecutorError(
                    f"cache {cid!r} brings {len(tokens)} tokens but the step's blocks hold "
                    f"{'no row' if row is None else f'{row.num_tokens} slots'} for it: allocate its slots first")
            for g, slots in enumerate(row.slots):
                group_slots[g].extend(slots)
            starts.append(row.start)
            rows.append(row)
        lens = np.fromiter((len(items[i][1]) for i in order), dtype=np.int64, count=len(order))
        item_qsl = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=item_qsl[1:])
        starts_np = np.asarray(starts, dtype=np.int64)
        # position of packed token j: its sequence's start + (j - that sequence's first row)
        positions = np.arange(int(item_qsl[-1]), dtype=np.int64) - np.repeat(item_qsl[:-1] - starts_np, lens)
        # attention rows: one per item, or one per token of an expanded item
        if any(expand):
            expanded = np.fromiter((expand[i] for i in order), dtype=bool, count=len(order))
            row_item = np.repeat(np.arange(len(order), dtype=np.int64), np.where(expanded, lens, 1))
            row_lens = np.where(expanded[row_item], 1, lens[row_item])
        else:
            row_item, row_lens = np.arange(len(order), dtype=np.int64), lens
        qsl = np.zeros(len(row_lens) + 1, dtype=np.int64)
        np.cumsum(row_lens, out=qsl[1:])
        ctx_np = positions[qsl[1:] - 1] + 1  # each row attends up to its last token
        ctx = ctx_np.tolist()
        tables = [block_table_array([row.block_tables[g] for row in rows]) for g in range(len(store.group_windows))]
        if len(row_item) != len(order):
            tables = [t[row_item] for t in tables]
        num_decode = int(np.sum(row_lens == 1))
        shared = [None] * len(tables)
        # decode rows come first, in item order: the last one's item counts the sequences
        if num_decode and int(row_item[num_decode - 1]) + 1 >= SHARED_PREFIX_MIN_SEQS:
            row_seqs = row_item[:num_decode] if len(row_item) != len(order) else None
            shared = [store.backend.shared_prefix(t[:num_decode], ctx_np[:num_decode], store.block_size,
                                                  row_seqs=row_seqs)
                      if window is None else None for t, window in zip(tables, store.group_windows)]
        inputs = PagedPassInputs(
            positions=positions.astype(np.int32),
            context_lens=np.asarray(ctx, dtype=np.int32),
            query_start_loc=qsl.astype(np.int32),
            num_decode_seqs=num_decode,
            host_context_lens=ctx,
            host_query_start_loc=qsl.tolist(),
            slot_mappings=[np.asarray(gs, dtype=np.int32) for gs in group_slots],
            block_tables=tables,
            shared_prefixes=shared if any(x is not None for x in shared) else [],
        )
        if getattr(store.pool, "float_window", 0):
            inputs.float_window = float_window_inputs(store.pool, rows, positions, lens, row_item, num_decode)
        decode_rows = num_decode if num_decode == int(item_qsl[-1]) else 0
        return [KvPass(order, 1, int(item_qsl[-1]), item_qsl[:-1].tolist(), inputs, packed=True,
                       decode_rows=decode_rows)]

    def metadata(self, kv_pass: KvPass, dtype: mx.Dtype) -> PagedMetadata:
        """The pass's complete :class:`~mlx_ferrum.layers.attention.PagedMetadata`: its
        numpy arrays moved to the device, and the per-layer arrays derived from them
        (:func:`~mlx_ferrum.layers.attention.paged_metadata`). ``dtype`` (the activation
        dtype) is unused by this layout."""
        f: PagedPassInputs = kv_pass.inputs
        store = self.store
        return paged_metadata(
            store.backend, store.pool, mx.array(f.positions), mx.array(f.context_lens), f.num_decode_seqs,
            store.layer_groups, [mx.array(x) for x in f.slot_mappings], [mx.array(x) for x in f.block_tables],
            ropes=self.ropes, query_start_loc=mx.array(f.query_start_loc), host_context_lens=f.host_context_lens,
            host_query_start_loc=f.host_query_start_loc,
            shared_prefixes=[None if x is None else x.to_device() for x in f.shared_prefixes],
            float_window=None if f.float_window is None else float_window_metadata(f.float_window, store.pool),
        )


def float_window_inputs(pool, rows: list, positions: np.ndarray, lens: np.ndarray, row_item: np.ndarray,
                        num_decode: int) -> dict:
    """A pass's float-window arrays (see :attr:`PagedPassInputs.float_window`) from its
    items' rows (``rows``, pass order), the packed tokens' ``positions``, the items'
    token counts ``lens`` and each attention row's item ``row_item``.

    A token's float copy is kept when it is one of its sequence's first tokens or one of
    the last ``entries - FIRST_TOKENS`` positions this pass writes for it (older ones
    would be overwritten in the same scatter); the others, and every token of a
    sequence without a slot, go to the pool's scratch slot.
    """
    scratch = pool.window_slots
    ring = pool.entries - FIRST_TOKENS
    slot = np.fromiter((r.window_slot for r in rows), dtype=np.int64, count=len(rows))
    start = np.fromiter((r.window_start for r in rows), dtype=np.int64, count=len(rows))
    start = np.where(slot >= 0, start, NO_FLOAT_WINDOW)
    slot = np.where(slot >= 0, slot, scratch)
    last = np.fromiter((r.start for r in rows), dtype=np.int64, count=len(rows)) + lens - 1
    token_item = np.repeat(np.arange(len(rows)), lens)
    keep = (start[token_item] < NO_FLOAT_WINDOW) & (
        (positions < FIRST_TOKENS) | (positions > last[token_item] - ring))
    entries = np.where(positions < FIRST_TOKENS, positions, FIRST_TOKENS + (positions - FIRST_TOKENS) % ring)
    decode_items = row_item[:num_decode]
    prefill_items = row_item[num_decode:]
    return {
        "write_slots": np.where(keep, slot[token_item], scratch).astype(np.int32),
        "write_entries": np.where(keep, entries, 0).astype(np.int32),
        "decode_slots": slot[decode_items].astype(np.int32),
        "decode_last": last[decode_items].astype(np.int32),
        "decode_starts": start[decode_items].astype(np.int32),
        "prefill_slots": slot[prefill_items].astype(np.int32),
        "prefill_starts": start[prefill_items].tolist(),
    }


def float_window_metadata(arrays: dict, pool) -> FloatWindowMetadata:
    """:class:`~mlx_ferrum.layers.attention.FloatWindowMetadata` from
    :func:`float_window_inputs`' arrays (numpy, or device arrays in a compiled step)."""
    device = lambda x: x if isinstance(x, mx.array) else mx.array(x)  # noqa: E731
    return FloatWindowMetadata(
        write_index=(device(arrays["write_slots"]), device(arrays["write_entries"])),
        decode_slots=device(arrays["decode_slots"]), decode_last=device(arrays["decode_last"]),
        decode_starts=device(arrays["decode_starts"]),
        # a compiled decode step has no prefill rows
        prefill_slots=device(arrays.get("prefill_slots", np.zeros(0, np.int32))),
        prefill_starts=list(arrays.get("prefill_starts", [])),
        window=pool.float_window, entries=pool.entries,
    )


class ContiguousPassBuilder:
    """The contiguous layout's passes and :class:`~mlx_ferrum.layers.attention.ContiguousMetadata`.

    Args:
        store: the runner's :class:`~mlx_ferrum.kv_cache.store.ContiguousKvStore`; every
            item's caches exist (``store.prepare`` created them).
    """

    def __init__(self, store: ContiguousKvStore):
        self.store = store
        self.ropes: list = []  # contiguous passes rotate by each row's offset (mx.fast.rope): no tables

    def passes(self, items: Sequence[tuple[Hashable, Sequence[int]]], as_decode: Sequence[bool] = (),
               blocks: Optional[BatchBlocks] = None) -> list[KvPass]:
        """One pass per distinct new-token count, rows in item order (``as_decode`` and
        ``blocks`` are unused by this layout).

        Raises:
            KeyError: an item whose caches do not exist (``store.prepare`` makes them).
        """
        groups: dict[int, list[int]] = {}
        for i, (_, tokens) in enumerate(items):
            groups.setdefault(len(tokens), []).append(i)
        passes = []
        for n, idxs in groups.items():
            caches = [self.store.caches[items[i][0]] for i in idxs]
            prev = [c[0].len for c in caches]
            inputs = ContiguousPassInputs(np.asarray(prev, dtype=np.int32), caches, [p + n for p in prev])
            passes.append(KvPass(idxs, len(idxs), n, [j * n for j in range(len(idxs))], inputs))
        return passes

    def metadata(self, kv_pass: KvPass, dtype: mx.Dtype) -> ContiguousMetadata:
        """The pass's :class:`~mlx_ferrum.layers.attention.ContiguousMetadata`: offsets on the
        device, the rows' caches, and the pad mask (in ``dtype``) for rows of different lengths."""
        f: ContiguousPassInputs = kv_pass.inputs
        return ContiguousMetadata(self.store.backend, mx.array(f.offsets), f.caches,
                                  contiguous_pad_mask(f.cache_lens_after, kv_pass.cols, dtype))


def pass_builder(store: Union[PagedKvStore, ContiguousKvStore],
                 ropes: Sequence = ()) -> Union[PagedPassBuilder, ContiguousPassBuilder]:
    """The builder for ``store``'s layout, picked once when the runner is built: a store
    with a block geometry (paged) gets a :class:`PagedPassBuilder` over ``ropes``, one
    without a :class:`ContiguousPassBuilder`."""
    if store.geometry is not None:
        return PagedPassBuilder(store, ropes)
    return ContiguousPassBuilder(store)


def shape_bucket(n: int) -> int:
    """``n`` rounded up to a size a compiled decode step is traced for.

    Sizes up to 8 are kept; above, ``n`` is rounded up to a multiple of a quarter of
    its power of two (10, 12, 14, 16, 20, 24, 28, 32, 40, ...): four sizes per
    octave, so less than a quarter of the padded work is waste, and a batch that
    changes by a row or a context that crosses a block boundary mostly reuses a
    trace. The idea of vLLM's CUDA-graph capture sizes.
    """
    if n <= 8:
        return max(n, 1)
    granule = 1 << (n.bit_length() - 3)
    return -(-n // granule) * granule


def _pad_rows(values: np.ndarray, rows: int, fill: int) -> np.ndarray:
    """``values`` ``[n]`` int32 padded to ``[rows]`` with ``fill``."""
    if values.shape[0] == rows:
        return values
    return np.concatenate([values, np.full(rows - values.shape[0], fill, dtype=values.dtype)])


def _pad_table(table: np.ndarray, rows: int, cols: int, scratch_block: int) -> np.ndarray:
    """A ``[n, m]`` block table padded to ``[rows, cols]``: extra columns point at block 0
    (masked by ``context_lens``), extra rows at the scratch block."""
    out = np.zeros((rows, cols), dtype=np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    out[table.shape[0] :, 0] = scratch_block
    return out


def device_input_ids(flat: np.ndarray, patch_at: list[int], patch_rows: list[int], prev: Optional[mx.array]) -> mx.array:
    """The step's token ids ``flat`` (``[T]`` int32) as a device array; the placeholders at
    ``patch_at`` are filled from ``prev[patch_rows]`` (``prev``: the previous step's sampled
    tokens, on the device), so a previous step's tokens never travel through the host
    (the overlap of mlx-lm's ``generate_step``)."""
    ids = mx.array(flat)
    if patch_at:
        ids[mx.array(patch_at, dtype=mx.int32)] = prev[mx.array(patch_rows, dtype=mx.int32)].astype(mx.int32)
    return ids


def lora_token_slots(none_slot: int, work: Sequence[SeqWork], items: Sequence[int], starts: Sequence[int],
                     size: int) -> Optional[mx.array]:
    """``[size]`` int32 LoRA slot of each flattened token of a pass (``none_slot`` for tokens
    without an adapter and for padding), or None when no item of the pass has one.

    Args:
        none_slot: the registry's slot of the base model (zero adapters).
        work: the batch; ``items`` the pass's indices into it, ``starts`` each item's first
            flat token.
        size: tokens in the pass (``rows * cols``).
    """
    if all(work[i].lora_slot < 0 for i in items):
        return None
    slots = np.full(size, none_slot, dtype=np.int32)
    for i, start in zip(items, starts):
        if work[i].lora_slot >= 0:
            slots[start : start + len(work[i].tokens)] = work[i].lora_slot
    return mx.array(slots)
