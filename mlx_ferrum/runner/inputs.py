"""Input building for a forward pass: bucketed shapes, padded metadata arrays, the pass's
token ids on the device and its per-token LoRA slots.

Host-side numpy work on what the block manager's owner handed over (the runner reads
slots and block tables; it never allocates); the device arrays built here are the
inputs of one pass, eager or compiled (:mod:`.compiled_decode`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .protocol import SeqWork


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
