"""GGUF's 16-weight-group K-quants (Q6_K, Q3_K, Q2_K) -> codes + per-16-group scales, exactly.

Each of these types holds 256 weights per super-block in 16 groups of 16 consecutive
weights, ``w = scale_j * q + bias_j`` with an unsigned code ``q``:

| type | bytes | code | scale_j | bias_j |
|---|---|---|---|---|
| Q6_K | 210: ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d`` f16 | 6 bits | ``d * sc_j`` | ``-32 * scale_j`` |
| Q3_K | 110: ``hmask[32]``, ``qs[64]``, ``scales[12]`` (16 x 6 bits), ``d`` f16 | 3 bits | ``d * (sc_j - 32)`` | ``-4 * scale_j`` |
| Q2_K | 84: ``scales[16]`` (4-bit scale, 4-bit min), ``qs[64]``, ``d``, ``dmin`` f16 | 2 bits | ``d * (sc_j & 15)`` | ``-dmin * (sc_j >> 4)`` |

Weight ``i`` of a super-block (``i = 128 n + 32 k + l``, ``n`` its half, ``k`` its
32-weight quarter, ``l < 32``) has scale index ``i // 16`` and its code in:

- Q6_K: low 4 bits in ``ql[64 n + l + 32 (k % 2)]`` (low nibble for ``k < 2``, high
  nibble else), high 2 bits at bit ``2 k`` of ``qh[32 n + l]``;
- Q3_K: low 2 bits at bit ``2 k`` of ``qs[32 n + l]``, third bit at bit ``4 n + k`` of
  ``hmask[l]`` (ggml subtracts 4 when it is clear: ``q - 4`` below is that);
- Q2_K: 2 bits at bit ``2 k`` of ``qs[32 n + l]``.

These are the layouts of llama.cpp's ``block_q6_K``, ``block_q3_K``, ``block_q2_K``
(``ggml-common.h``) and of its ``dequantize_row_q6_K`` / ``_q3_K`` / ``_q2_K``
(``ggml-quants.c``), written here from that description; the tests check every type
against the ``gguf`` package's ``quants.dequantize``.

Every ``scale * q + bias`` is exact in float32 (at most 24 significant bits: an
11-bit float16 factor, an 8-bit scale, a code of 6 bits at most), so the float32 values
MLX's dequantization computes are those of the file, bit for bit.
"""

from __future__ import annotations

import numpy as np

#: GGUF type -> (code bits, bytes per 256-weight super-block)
TYPES16 = {"Q6_K": (6, 210), "Q3_K": (3, 110), "Q2_K": (2, 84)}

_SHIFT_BY_QUARTER = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[rows, nblocks]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 2, 32)  # [half, k % 2, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # k = 0, 1 (low nibbles), 2, 3 (high)
    qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
    high = (qh >> _SHIFT_BY_QUARTER) & 3
    codes = low | (high << 4)
    scales = _f16(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    return codes, scales, -32.0 * scales


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, nb = b.shape[:2]
    qs = b[..., 32:96].reshape(rows, nb, 2, 1, 32)
    low = (qs >> _SHIFT_BY_QUARTER) & 3
    hmask = b[..., 0:32].reshape(rows, nb, 1, 1, 32)
    bit_at = np.arange(8, dtype=np.uint8).reshape(2, 4, 1)  # 4 n + k
    codes = low | (((hmask >> bit_at) & 1) << 2)
    packed = b[..., 96:108]
    low4 = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # scale j < 8, j >= 8
    # the high 2 bits of scale j: bits 2 (j // 4) of byte 8 + j % 4
    high2 = ((packed[..., None, 8:12] >> _SHIFT_BY_QUARTER) & 3).reshape(rows, nb, 16)
    sc = (low4 | (high2 << 4)).astype(np.float32) - 32.0
    scales = _f16(b, 108)[..., None] * sc
    return codes, scales, -4.0 * scales


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, nb = b.shape[:2]
    qs = b[..., 16:80].reshape(rows, nb, 2, 1, 32)
    codes = (qs >> _SHIFT_BY_QUARTER) & 3
    packed = b[..., 0:16]
    scales = _f16(b, 80)[..., None] * (packed & 0x0F).astype(np.float32)
    biases = -(_f16(b, 82)[..., None] * (packed >> 4).astype(np.float32))
    return codes, scales, biases


def unpack16(type_name: str, raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Codes, scales and biases of a Q6_K / Q3_K / Q2_K tensor.

    Args:
        type_name: ``"Q6_K"``, ``"Q3_K"`` or ``"Q2_K"``.
        raw: ``uint8`` ``[rows, cols / 256 * block bytes]``.
        rows, cols: the matrix shape (``cols`` a multiple of 256).

    Returns:
        ``(codes, scales, biases, bits)``: ``codes`` ``uint8`` ``[rows, cols]`` (each
        ``< 2**bits``), ``scales`` / ``biases`` float32 ``[rows, cols / 16]``, with
        ``w[r, i] = scales[r, i // 16] * codes[r, i] + biases[r, i // 16]`` exactly.

    Raises:
        KeyError: ``type_name`` is not one of the three.
    """
    bits, size = TYPES16[type_name]
    blocks = raw.reshape(rows, cols // 256, size)
    codes, scales, biases = {"Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k}[type_name](blocks)
    return (codes.astype(np.uint8).reshape(rows, cols), scales.reshape(rows, -1), biases.reshape(rows, -1), bits)


__all__ = ["TYPES16", "unpack16"]
