"""The float window of int4 KV (kernels/float_window.py) and its slots in the block manager.

The ring's bookkeeping is checked against a brute-force simulation (numpy: a list of
per-entry positions written token by token), the manager's slot accounting against the
sequences' lives (create, prefix hit, fork, truncate, release, exhaustion). The
attention itself is checked against an independent oracle in test_quantized_backends.py
and on SmolLM2 in test_kv_quantization_smollm.py.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.kernels.float_window import (
    FIRST_TOKENS,
    entry_of,
    entry_positions,
    in_float,
    ring_entries,
)
from mlx_ferrum.kv_cache.block_tables import (
    BatchBlocks,
    LayerGroupKvManager,
    append_row,
)


def simulated_ring(last: int, entries: int) -> list[int]:
    """The position each entry holds after writing positions 0..last one by one (-1: none)."""
    ring = entries - FIRST_TOKENS
    held = [-1] * entries
    for p in range(last + 1):
        held[p if p < FIRST_TOKENS else FIRST_TOKENS + (p - FIRST_TOKENS) % ring] = p
    # a ring entry is only ever read for positions past the first tokens
    return [p if (i < FIRST_TOKENS or p >= FIRST_TOKENS) else -1 for i, p in enumerate(held)]


@pytest.mark.parametrize("window,lookahead", [(4, 0), (8, 3), (64, 4)])
def test_entry_positions_match_writing_token_by_token(window, lookahead):
    entries = ring_entries(window, lookahead)
    lasts = list(range(0, 3 * entries)) + [1000, 4095]
    got = np.array(entry_positions(mx.array(lasts, dtype=mx.int32), entries))
    for row, last in zip(got, lasts):
        assert row.tolist() == simulated_ring(last, entries), f"last position {last}"
    positions = mx.arange(0, 3 * entries, dtype=mx.int32)
    for p, e in zip(positions.tolist(), np.array(entry_of(positions, entries)).tolist()):
        assert simulated_ring(p, entries)[e] == p


def test_every_key_is_read_once_from_floats_or_codes():
    """For a query at t, the keys in float are exactly its last `window` positions and the
    first tokens, from the window start on, and only those the entries still hold."""
    window, entries = 6, ring_entries(6, 2)
    rng = random.Random(0)
    for _ in range(200):
        t = rng.randrange(0, 60)
        start = rng.choice([0, 0, rng.randrange(0, t + 1)])
        last = t + rng.randrange(0, 3)
        oldest = last - (entries - FIRST_TOKENS) + 1
        keys = mx.arange(0, t + 1, dtype=mx.int32)
        got = np.array(in_float(keys, mx.array(t), mx.array(start), window, mx.array(oldest))).tolist()
        held = set(simulated_ring(last, entries))
        want = [p >= start and (p < FIRST_TOKENS or (p > t - window and p in held)) for p in range(t + 1)]
        assert got == want, (t, start, last)


def test_the_manager_gives_each_sequence_a_window_slot_and_takes_it_back():
    manager = LayerGroupKvManager(num_blocks=64, block_size=4, max_blocks_per_seq=16, prefix_cache=True,
                                  window_slots=2)
    batch = BatchBlocks()
    a = append_row(manager, batch, "a", 9, key_ids=list(range(9)))
    b = append_row(manager, batch, "b", 3, key_ids=[7, 8, 9])
    assert {a.window_slot, b.window_slot} == {0, 1} and a.window_start == b.window_start == 0
    # a third sequence finds no slot: it runs on codes alone
    c = append_row(manager, BatchBlocks(), "c", 2, key_ids=[5, 5])
    assert c.window_slot == -1
    manager.release("c")
    # a prefix hit: the reused tokens come as codes, so the window starts after them
    manager.release("b")
    manager.create("d")
    hit = manager.match_prefix("d", list(range(9)) + [42])
    assert hit == 8 and manager.window_of("d") == (manager.window_of("d")[0], 8)
    assert manager.window_of("d")[0] in (0, 1) and manager.window_of("d")[0] != a.window_slot
    manager.truncate("d", 4)  # positions from 4 on are written anew
    assert manager.window_of("d")[1] == 4
    manager.release("a")
    manager.fork("d", "e")
    assert manager.window_of("e") == (a.window_slot, 4)
    manager.release("d")
    manager.release("e")
    assert sorted(manager._free_window_slots) == [0, 1] and not manager.windows


@pytest.mark.parametrize("tile", [1, 3, 7])
@pytest.mark.parametrize("start,window_start,sliding_window", [(0, 0, None), (9, 0, None), (9, 8, None),
                                                                (2, 0, None), (13, 0, 6)])
def test_prefill_in_tiles_equals_one_call_over_every_key(tile, start, window_start, sliding_window):
    """The tiles read fewer codes and copies, never one a query needs: the same output
    as one call over every key (the tiles' slicing is all that differs)."""
    from mlx_ferrum.kernels.float_window import prefill_attention, prefill_attention_in_tiles

    rng = np.random.default_rng(start * 7 + tile)
    window, entries, length = 4, ring_entries(4, 1), 11
    heads, kv_heads, dim = 4, 2, 8
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q = arr(1, heads, length, dim)
    keys, values = arr(1, kv_heads, start + length, dim), arr(1, kv_heads, start + length, dim)
    ring_keys, ring_values = arr(1, kv_heads, entries, dim), arr(1, kv_heads, entries, dim)
    ring_positions = entry_positions(mx.array([start - 1], dtype=mx.int32), entries)[0]
    new_keys, new_values = arr(1, kv_heads, length, dim), arr(1, kv_heads, length, dim)
    oldest = start - (entries - FIRST_TOKENS)
    tiled = prefill_attention_in_tiles(q, keys, values, ring_keys, ring_values, ring_positions, new_keys, new_values,
                                       start, window_start, window, oldest, 0.3, sliding_window=sliding_window,
                                       tile=tile)
    whole = prefill_attention(q, keys, values, mx.concatenate([ring_keys, new_keys], axis=2),
                              mx.concatenate([ring_values, new_values], axis=2),
                              mx.concatenate([ring_positions, mx.arange(start, start + length, dtype=mx.int32)]),
                              mx.arange(start, start + length, dtype=mx.int32), window_start, window, oldest, 0.3,
                              sliding_window=sliding_window)
    np.testing.assert_allclose(np.array(tiled), np.array(whole), atol=1e-5, rtol=1e-5)
