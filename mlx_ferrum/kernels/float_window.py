"""The float window of a quantized KV cache: each query's most recent keys and values, and
its sequence's first tokens, attended in float beside the codes of all the others.

Why: with int4 codes on a real model (SmolLM2-135M, head_dim 64) almost all of the loss
against float KV comes from the tokens nearest the query. Keeping each query's last 64
keys and values and its sequence's first 4 in float, with the stored format unchanged,
takes the mean KL per token from about 0.1 to about 0.005 (``docs/benchmarks.md``). This is
KIVI's full-precision residual of recent tokens (Liu et al., "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache", 2024) together with the attention sinks of
Xiao et al. ("Efficient Streaming Language Models with Attention Sinks", 2023), here
per query: the query at position ``t`` reads positions ``t - window + 1 .. t`` and
``0 .. FIRST_TOKENS - 1`` from the float copy and every other position from the codes,
in ONE softmax over both.

Storage: per sequence a ring of ``FIRST_TOKENS + ring`` float entries per layer and KV
head. Position ``p < FIRST_TOKENS`` lives at entry ``p``; a later position at entry
``FIRST_TOKENS + (p - FIRST_TOKENS) % ring``. ``ring`` is ``window`` plus the most tokens
one sequence writes in a pass whose rows then read the ring after the write (a
speculative draft laid out as decode rows), so that no write overwrites a position a
row of the same pass still reads. A sequence's float entries are trusted only from its
``window_start`` on: the positions it computed itself (a prefix-cache hit or a fork
brings codes without floats, and those positions are read from the codes).

All functions are pure MLX on arrays and trace under ``mx.compile``; this module imports
nothing above the kernels layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .reference import _masked_attention

#: positions at the start of every sequence kept in float (attention sinks)
FIRST_TOKENS = 4


def ring_entries(window: int, lookahead: int = 0) -> int:
    """Entries of one sequence's float ring: ``FIRST_TOKENS + window + lookahead``.

    Args:
        window: the float window in tokens (> 0).
        lookahead: the most tokens one sequence writes in a pass whose rows read the
            ring after the write (a draft laid out as decode rows, minus one), else 0.
    """
    return FIRST_TOKENS + window + lookahead


def entry_of(positions: mx.array, entries: int) -> mx.array:
    """The ring entry of each position ``positions`` (int32, any shape) in a ring of
    ``entries`` (:func:`ring_entries`) entries."""
    ring = entries - FIRST_TOKENS
    return mx.where(positions < FIRST_TOKENS, positions, FIRST_TOKENS + (positions - FIRST_TOKENS) % ring)


def entry_positions(last: mx.array, entries: int) -> mx.array:
    """The position each ring entry holds once positions up to ``last`` were written.

    Args:
        last: ``[S]`` int32, the last position written per sequence.
        entries: ring entries (:func:`ring_entries`).

    Returns:
        ``[S, entries]`` int32; entries never written (a position below 0, or a ring
        entry whose newest position is one of the first tokens) hold -1.
    """
    ring = entries - FIRST_TOKENS
    last = last.astype(mx.int32)[:, None]
    first = mx.broadcast_to(mx.arange(FIRST_TOKENS, dtype=mx.int32)[None], (last.shape[0], FIRST_TOKENS))
    first = mx.where(first <= last, first, -1)
    j = mx.arange(ring, dtype=mx.int32)[None]
    newest = last - (last - FIRST_TOKENS - j) % ring
    newest = mx.where(newest >= FIRST_TOKENS, newest, -1)
    return mx.concatenate([first, newest], axis=1)


def in_float(key_pos: mx.array, query_pos: mx.array, window_start, window: int, oldest) -> mx.array:
    """True where the query at ``query_pos`` reads the key at ``key_pos`` from the float
    entries rather than the codes: the key is at or after ``window_start``, and it is one
    of the first :data:`FIRST_TOKENS` positions, or one of the query's last ``window`` that
    the entries still hold (at or after ``oldest``, the oldest ring position the reader
    has). Every caller decides both sides with this one predicate, so each key is read
    exactly once. Arguments broadcast against each other (int32)."""
    recent = (key_pos > query_pos - window) & (key_pos >= oldest)
    return (key_pos >= window_start) & ((key_pos < FIRST_TOKENS) | recent)


def float_entries_valid(positions: mx.array, query_pos: mx.array, window_start, window: int, oldest) -> mx.array:
    """The float entries (their ``positions``, -1 for none) that the query at
    ``query_pos`` attends to; the arguments broadcast (e.g. ``[S, F]`` against ``[S, 1]``)."""
    return (positions >= 0) & (positions <= query_pos) & in_float(positions, query_pos, window_start, window, oldest)


def prefill_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    float_keys: mx.array,
    float_values: mx.array,
    float_positions: mx.array,
    query_positions: mx.array,
    window_start: int,
    window: int,
    oldest: int,
    scale: float,
    *,
    key_start: int = 0,
    sliding_window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Causal attention of one sequence's queries over its dequantized codes and its
    float entries, in one softmax (the masked attention of the prefill references over
    the two key sets side by side).

    Args:
        q: ``[1, num_heads, L, head_dim]`` queries in the keys' basis.
        keys, values: ``[1, num_kv_heads, n, head_dim]`` the dequantized codes of positions
            ``key_start .. key_start + n - 1``.
        float_keys, float_values: ``[1, num_kv_heads, F, head_dim]`` float entries (keys in
            the same basis), at ``float_positions`` ``[F]`` int32 (-1: none).
        query_positions: ``[L]`` int32.
        window_start: the sequence's first position with a float entry.
        window: the float window in tokens.
        oldest: the oldest position the float entries hold past the first tokens.
        scale: softmax scale.
        key_start: position of ``keys``' first row.
        sliding_window: the model's sliding window for this layer (None: full attention).
        sinks: ``[num_heads]`` attention-sink logits of the model (gpt-oss), or None.

    Returns:
        ``[1, num_heads, L, head_dim]`` in q's dtype.
    """
    qpos = query_positions.astype(mx.int32)[:, None]
    kpos = mx.arange(key_start, key_start + keys.shape[2], dtype=mx.int32)[None]
    fpos = float_positions.astype(mx.int32)[None]
    code_ok = (kpos <= qpos) & ~in_float(kpos, qpos, window_start, window, oldest)
    float_ok = float_entries_valid(fpos, qpos, window_start, window, oldest)
    if sliding_window is not None:
        code_ok = code_ok & (kpos > qpos - sliding_window)
        float_ok = float_ok & (fpos > qpos - sliding_window)
    allowed = mx.concatenate([code_ok, float_ok], axis=1)
    all_keys = mx.concatenate([keys.astype(q.dtype), float_keys.astype(q.dtype)], axis=2)
    all_values = mx.concatenate([values.astype(q.dtype), float_values.astype(q.dtype)], axis=2)
    # the prefill references' masked attention: a base-2 softmax on MLX's CPU backend
    # (where the fused call is an unfused composition computing exp), the fused kernel elsewhere
    return _masked_attention(q, all_keys, all_values, allowed[None, None], scale, sinks)


#: queries per call of :func:`prefill_attention_in_tiles`: each tile reads only the codes
#: and the float copies its queries need, so a chunk's scores grow as the causal
#: triangle, not as the chunk against itself twice
PREFILL_QUERY_TILE = 128


def prefill_attention_in_tiles(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ring_keys: mx.array,
    ring_values: mx.array,
    ring_positions: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    start: int,
    window_start: int,
    window: int,
    oldest: int,
    scale: float,
    *,
    sliding_window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    tile: Optional[int] = None,
) -> mx.array:
    """:func:`prefill_attention` of one sequence's ``L`` new queries (positions ``start ..
    start + L - 1``), in tiles of ``tile`` queries (default :data:`PREFILL_QUERY_TILE`).

    Args:
        q: ``[1, num_heads, L, head_dim]`` queries in the keys' basis.
        keys, values: ``[1, num_kv_heads, start + L, head_dim]`` the dequantized codes of
            positions ``0 .. start + L - 1``.
        ring_keys, ring_values: ``[1, num_kv_heads, entries, head_dim]`` the sequence's
            float entries as they were before this pass, at ``ring_positions`` ``[entries]``
            int32 (-1: none).
        new_keys, new_values: ``[1, num_kv_heads, L, head_dim]`` this pass's own float copies.
        start, window_start, window, oldest, scale, sliding_window, sinks: as in
            :func:`prefill_attention`.

    Returns:
        ``[1, num_heads, L, head_dim]`` in q's dtype: the same as one call over every key.

    Per tile of queries ``first .. last``, the codes read are those of positions up to
    the last one any of its queries reads from the codes (``last - window``, or below
    ``window_start`` / ``oldest``), and the float copies of this pass those of the tile's
    windows and the first tokens; the ring's entries are always read (a few dozen).
    """
    length = q.shape[2]
    tile = tile or PREFILL_QUERY_TILE
    outs = []
    for i0 in range(0, length, tile):
        i1 = min(length, i0 + tile)
        first, last = start + i0, start + i1 - 1
        code_end = min(last + 1, max(last - window + 1, min(max(window_start, oldest), last + 1)))
        code_begin = 0 if sliding_window is None else max(0, min(code_end, first - sliding_window + 1))
        head = max(0, min(FIRST_TOKENS - start, i1))  # this pass's own first tokens
        lo = max(head, first - window + 1 - start)
        picked = list(range(head)) + list(range(lo, i1))
        index = mx.array(picked, dtype=mx.int32)
        float_keys = mx.concatenate([ring_keys, new_keys[:, :, index]], axis=2)
        float_values = mx.concatenate([ring_values, new_values[:, :, index]], axis=2)
        positions = mx.concatenate([ring_positions.astype(mx.int32), index + start])
        outs.append(prefill_attention(
            q[:, :, i0:i1], keys[:, :, code_begin:code_end], values[:, :, code_begin:code_end], float_keys,
            float_values, positions, mx.arange(first, last + 1, dtype=mx.int32), window_start, window, oldest,
            scale, key_start=code_begin, sliding_window=sliding_window, sinks=sinks,
        ))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


@dataclass
class FloatRows:
    """The float entries of a batch of decode rows, read after the pass's writes.

    Attributes:
        keys, values: ``[S, num_kv_heads, F, head_dim]`` each row's sequence's entries
            (keys in the codes' basis), ``F`` = ``entries``.
        last: ``[S]`` int32, the last position written to each row's entries (a draft
            laid out as decode rows writes past its earlier rows' positions).
        window_start: ``[S]`` int32, each sequence's first position with a float entry.
        window: the float window in tokens.
        entries: ring entries per sequence (:func:`ring_entries`).
        memo: a dict shared by the layers of one pass, where :meth:`masks` keeps what it
            built under the caller's key (every layer of a group reads the same keys), or None.
    """

    keys: mx.array
    values: mx.array
    last: mx.array
    window_start: mx.array
    window: int
    entries: int
    memo: Optional[dict] = None

    def masks(self, query_pos: mx.array, key_pos: mx.array, sliding_window: Optional[int] = None,
              memo_key=None) -> tuple[mx.array, mx.array]:
        """``(from_float [S, T], entries_valid [S, F])``: which of the keys at ``key_pos``
        (``[S, T]`` or ``[1, T]``) each row's query at ``query_pos`` ``[S]`` reads from
        the float entries, and which entries it attends to (within the model's
        ``sliding_window`` when the layer has one). With ``memo_key`` (naming the query and
        key positions) the masks are built once per pass and reused."""
        if memo_key is not None and self.memo is not None:
            key = (memo_key, sliding_window)
            if key not in self.memo:
                self.memo[key] = self.masks(query_pos, key_pos, sliding_window)
            return self.memo[key]
        t = query_pos.astype(mx.int32)[:, None]
        start = self.window_start.astype(mx.int32)[:, None]
        from_float = in_float(key_pos, t, start, self.window, self._oldest()[:, None])
        return from_float, self.entries_valid(query_pos, sliding_window)

    def _oldest(self) -> mx.array:
        # [S] the oldest position each row's ring still holds past the first tokens
        return self.last.astype(mx.int32) - (self.entries - FIRST_TOKENS) + 1

    def entries_valid(self, query_pos: mx.array, sliding_window: Optional[int] = None) -> mx.array:
        """``[S, F]`` bool: the entries each row's query at ``query_pos`` ``[S]`` attends to
        (within the model's ``sliding_window`` when the layer has one)."""
        t = query_pos.astype(mx.int32)[:, None]
        positions = entry_positions(self.last, self.entries)
        valid = float_entries_valid(positions, t, self.window_start.astype(mx.int32)[:, None], self.window,
                                    self._oldest()[:, None])
        if sliding_window is not None:
            valid = valid & (positions > t - sliding_window)
        return valid

    def kernel_inputs(self, query_pos: mx.array, sliding_window: Optional[int] = None) -> tuple[mx.array, mx.array]:
        """``(entries_valid [S, F], code_bounds [S, 2])`` for a decode kernel that walks the
        codes itself (:meth:`entries_valid`, :meth:`code_bounds`), built once per pass
        and sliding window when the rows carry a ``memo``."""
        if self.memo is None:
            return self.entries_valid(query_pos, sliding_window), self.code_bounds(query_pos)
        key = ("kernel", sliding_window)
        if key not in self.memo:
            self.memo[key] = (self.entries_valid(query_pos, sliding_window), self.code_bounds(query_pos))
        return self.memo[key]

    def code_bounds(self, query_pos: mx.array) -> mx.array:
        """``[S, 2]`` int32 per row ``(code_end, float_from)``: :func:`in_float` for a row's
        query at ``query_pos`` ``[S]``, as two bounds a kernel can apply while it walks the
        codes. A key at or after ``code_end`` is read from the entries, and so is a key
        below :data:`FIRST_TOKENS` at or after ``float_from`` (the window start); every other
        key is read from the codes. (``code_end`` is ``max(window_start, max(t - window + 1,
        oldest))``: past the first tokens, :func:`in_float` is exactly ``key >= code_end``.)"""
        t = query_pos.astype(mx.int32)
        start = self.window_start.astype(mx.int32)
        recent_from = mx.maximum(t - self.window + 1, self._oldest())
        return mx.stack([mx.maximum(start, recent_from), start], axis=1)
