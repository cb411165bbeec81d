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

#: positions at the start of every sequence kept in float (attention sinks)
FIRST_TOKENS = 4

_NEG_INF = float("-inf")


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
    float entries, in one softmax (``mx.fast.scaled_dot_product_attention`` with an
    additive mask over the two key sets side by side).

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
    mask = mx.where(allowed, mx.array(0.0, q.dtype), mx.array(_NEG_INF, q.dtype))
    all_keys = mx.concatenate([keys.astype(q.dtype), float_keys.astype(q.dtype)], axis=2)
    all_values = mx.concatenate([values.astype(q.dtype), float_values.astype(q.dtype)], axis=2)
    extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
    return mx.fast.scaled_dot_product_attention(q, all_keys, all_values, scale=scale, mask=mask, **extra)


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
    """

    keys: mx.array
    values: mx.array
    last: mx.array
    window_start: mx.array
    window: int
    entries: int

    def masks(self, query_pos: mx.array, key_pos: mx.array,
              sliding_window: Optional[int] = None) -> tuple[mx.array, mx.array]:
        """``(from_float [S, T], entries_valid [S, F])``: which of the keys at ``key_pos``
        (``[S, T]`` or ``[1, T]``) each row's query at ``query_pos`` ``[S]`` reads from
        the float entries, and which entries it attends to (within the model's
        ``sliding_window`` when the layer has one)."""
        t = query_pos.astype(mx.int32)[:, None]
        start = self.window_start.astype(mx.int32)[:, None]
        last = self.last.astype(mx.int32)[:, None]
        oldest = last - (self.entries - FIRST_TOKENS) + 1
        from_float = in_float(key_pos, t, start, self.window, oldest)
        positions = entry_positions(self.last, self.entries)
        valid = float_entries_valid(positions, t, start, self.window, oldest)
        if sliding_window is not None:
            valid = valid & (positions > t - sliding_window)
        return from_float, valid
