"""GGUF tensor types -> MLX arrays, keeping quantized weights quantized.

MLX's affine quantization stores a weight ``[out, in]`` as codes ``q`` (``bits`` each,
packed little-endian into ``uint32`` words, ``[out, in * bits / 32]``) and one
``scale`` and ``bias`` per group of ``group_size`` inputs; it computes
``w = scale * q + bias`` (MLX, ``mx.quantize`` docs). Most GGUF block types are the
same thing with another byte layout, so they are repacked, never dequantized:

| GGUF type | block | becomes | exact |
|---|---|---|---|
| F32 / F16 / BF16 | - | the same dtype | yes |
| Q8_0 | ``w = d * q``, q int8, d f16 | 8-bit g32, ``q + 128``, scale d, bias ``-128 d`` | yes |
| Q4_0 | ``w = d * (q - 8)`` | 4-bit g32, scale d, bias ``-8 d`` | yes |
| Q4_1 | ``w = d * q + m`` | 4-bit g32, scale d, bias m | yes |
| Q5_0 | ``w = d * (q - 16)`` | 5-bit g32, scale d, bias ``-16 d`` | yes |
| Q5_1 | ``w = d * q + m`` | 5-bit g32, scale d, bias m | yes |
| Q4_K / Q5_K | 8 groups of 32 per 256, ``w = d*sc_j*q - dmin*m_j`` | 4/5-bit g32, scale ``d*sc_j``, bias ``-dmin*m_j`` | yes |
| Q6_K / Q3_K / Q2_K | 16 groups of 16 per 256 | 6/3/2-bit codes, one scale and bias per 16 weights, as two MLX g32 sets (:mod:`.tensors16`, :mod:`mlx_ferrum.layers.quantized16`) | yes |

Scales and biases are float16 when every one of them is exact in float16 (the legacy
types: d, m and ``-2^k d`` are), else float32 (the K-quants' ``d * sc`` products have
up to 17 significant bits). The layouts are those of llama.cpp's ``ggml-common.h``
block structs (``block_q4_0`` ... ``block_q6_K``); the K-quants' 6-bit scale packing
is ``get_scale_min_k4`` in ``ggml-quants.c``. The code here is written from those
layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ...errors import UnsupportedTensorTypeError

GROUP_SIZE = 32

#: GGUF type name -> (bits, exact); "float" types have bits None
SUPPORTED_TYPES: dict[str, tuple[Optional[int], bool]] = {
    "F32": (None, True),
    "F16": (None, True),
    "BF16": (None, True),
    "Q8_0": (8, True),
    "Q4_0": (4, True),
    "Q4_1": (4, True),
    "Q5_0": (5, True),
    "Q5_1": (5, True),
    "Q4_K": (4, True),
    "Q5_K": (5, True),
    "Q6_K": (6, True),
    "Q3_K": (3, True),
    "Q2_K": (2, True),
}


@dataclass
class ConvertedTensor:
    """One GGUF tensor in MLX form.

    Attributes:
        weight: the float array (float types), or the packed ``uint32`` codes
            ``[rows, cols * bits / 32]``.
        scales, biases: ``[rows, cols / 32]`` float16 or float32 (quantized only).
        bits: code width (None for float types).
        exact: whether dequantizing gives the GGUF values bit for bit.
        bfloat16: ``weight`` holds bfloat16 bits as uint16 (numpy has no bfloat16).
        group_size: inputs per scale: 32, or 16 for Q6_K / Q3_K / Q2_K (whose
            ``scales`` / ``biases`` are then ``[rows, cols / 16]``).

    :func:`convert_numpy` fills it with numpy arrays (safe in worker threads: it makes no
    MLX array, whose lazy operations belong to the creating thread's stream);
    :func:`convert_tensor` returns it with MLX arrays.
    """

    weight: Any
    scales: Any = None
    biases: Any = None
    bits: Optional[int] = None
    exact: bool = True
    bfloat16: bool = False
    group_size: int = GROUP_SIZE


def check_types_supported(types_by_tensor: dict[str, str]) -> None:
    """Refuse a file holding a tensor type this module cannot convert.

    Args:
        types_by_tensor: ``{gguf tensor name: GGUF type name}``.

    Raises:
        UnsupportedTensorTypeError: lists each unsupported type with (up to 4 of) the
            tensors using it, every type found in the file and the supported types.
    """
    bad: dict[str, list[str]] = {}
    for name, type_name in types_by_tensor.items():
        if type_name not in SUPPORTED_TYPES:
            bad.setdefault(type_name, []).append(name)
    if bad:
        found = sorted(set(types_by_tensor.values()))
        detail = "; ".join(
            f"{t}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}" for t, names in sorted(bad.items())
        )
        raise UnsupportedTensorTypeError(
            f"GGUF tensor types not supported: {detail}. Types in this file: {', '.join(found)}; supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Use a file quantized to one of those (e.g. Q4_K_M, Q8_0)"
        )


def _pack_5bit(q: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Pack 5-bit codes ``[rows, n]`` (uint8, contiguous) into bytes: 8 codes fill 5 bytes.

    Each output byte is built from the code planes (every 8th code) straight into its
    slot of the result, with two scratch planes, so no ``[rows, n]`` temporary beyond the
    result exists (uint8 shifts drop the bits that move out of a byte). ``out``: the
    result's ``uint8`` ``[rows, n * 5 / 8]`` buffer (C-contiguous), or None to allocate it."""
    rows, n = q.shape
    codes = np.ascontiguousarray(q).reshape(-1, 8)
    c = [codes[:, i] for i in range(8)]
    out = np.empty((codes.shape[0], 5), dtype=np.uint8) if out is None else out.reshape(-1, 5)
    scratch, other = np.empty(codes.shape[0], dtype=np.uint8), np.empty(codes.shape[0], dtype=np.uint8)
    np.left_shift(c[1], 5, out=scratch)
    np.bitwise_or(c[0], scratch, out=out[:, 0])
    np.right_shift(c[1], 3, out=scratch)
    scratch |= np.left_shift(c[2], 2, out=other)
    scratch |= np.left_shift(c[3], 7, out=other)
    out[:, 1] = scratch
    np.right_shift(c[3], 1, out=scratch)
    np.bitwise_or(scratch, np.left_shift(c[4], 4, out=other), out=out[:, 2])
    np.right_shift(c[4], 4, out=scratch)
    scratch |= np.left_shift(c[5], 1, out=other)
    scratch |= np.left_shift(c[6], 6, out=other)
    out[:, 3] = scratch
    np.right_shift(c[6], 2, out=scratch)
    np.bitwise_or(scratch, np.left_shift(c[7], 3, out=other), out=out[:, 4])
    return out.reshape(rows, n * 5 // 8)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes ``[rows, n]`` (uint8, each < 2**bits) into MLX's layout.

    MLX reads a row as one little-endian bit stream: code ``i`` occupies bits
    ``[i*bits, (i+1)*bits)``, 32 bits per ``uint32`` word (checked against
    ``mx.dequantize`` for 2-8 bits in the tests).

    Returns:
        ``uint32`` ``[rows, n * bits / 32]``.
    """
    rows, n = q.shape
    if bits == 8:
        packed = np.ascontiguousarray(q, dtype=np.uint8)
    elif bits == 4:
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    elif bits == 5:
        packed = _pack_5bit(q)
    else:  # 2, 3, 6 bits: 8 codes fill ``bits`` bytes exactly; build them in a uint64
        codes = q.reshape(rows, n // 8, 8).astype(np.uint64)
        word = np.zeros((rows, n // 8), dtype=np.uint64)
        for i in range(8):
            word |= codes[..., i] << np.uint64(bits * i)
        packed = word[..., None].view(np.uint8)[..., :bits].reshape(rows, n * bits // 8)
    return np.ascontiguousarray(packed).view(np.uint32).reshape(rows, n * bits // 32)


def _nibble_pair_table() -> np.ndarray:
    """``table[b0 | b1 << 8]`` for two bytes of ggml nibbles: low byte ``lo(b0) | lo(b1) << 4``,
    high byte ``hi(b0) | hi(b1) << 4`` (uint16, 65,536 entries)."""
    pair = np.arange(1 << 16, dtype=np.uint32)
    first, second = pair & 0xFF, pair >> 8
    low = (first & 0x0F) | ((second & 0x0F) << 4)
    high = (first >> 4) | (second & 0xF0)
    return (low | (high << 8)).astype(np.uint16)


def _fifth_bit_table() -> np.ndarray:
    """``table[byte]``: a uint64 whose byte ``j`` is ``0x10`` when bit ``j`` of ``byte`` is set
    (one byte of ggml's ``qh`` spread onto 8 codes' fifth bits)."""
    values = np.arange(256, dtype=np.uint64)
    spread = np.zeros(256, dtype=np.uint64)
    for j in range(8):
        spread |= ((values >> np.uint64(j)) & np.uint64(1)) << np.uint64(8 * j + 4)
    return spread


_NIBBLE_PAIRS = _nibble_pair_table()
_FIFTH_BITS = _fifth_bit_table()


def _repack_nibbles(pairs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml's nibble layout -> MLX's 4-bit layout, for runs of 32 codes.

    ggml stores 32 codes in 16 bytes: byte ``i`` holds code ``i`` (low nibble) and code
    ``i + 16`` (high nibble); MLX's byte ``k`` holds codes ``2k`` (low) and ``2k + 1``.
    So MLX's byte ``k < 8`` is the low nibbles of ggml bytes ``2k, 2k+1`` and byte
    ``8 + k`` their high nibbles: one lookup per byte pair in a 65,536-entry table gives
    both, with no per-code array.

    Args:
        pairs: ``uint16`` ``[..., 8]``, each the little-endian pair of ggml bytes
            ``2k, 2k+1`` of one 16-byte run (a strided view of the blocks is fine).
        out: ``uint8`` ``[..., 16]``, written in MLX's order.

    Returns:
        ``out``.
    """
    looked_up = np.take(_NIBBLE_PAIRS, pairs)  # [..., 8] uint16: (low byte, high byte) per pair
    as_bytes = looked_up.view(np.uint8).reshape(looked_up.shape + (2,))
    np.copyto(out.reshape(pairs.shape[:-1] + (2, 8)), np.swapaxes(as_bytes, -1, -2))
    return out


def _nibble_codes(qs: np.ndarray) -> np.ndarray:
    """``uint8`` ``[..., 16]`` ggml nibbles -> ``[..., 32]`` codes (low nibbles first)."""
    codes = np.empty(qs.shape[:-1] + (2 * qs.shape[-1],), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=codes[..., :qs.shape[-1]])
    np.right_shift(qs, 4, out=codes[..., qs.shape[-1]:])
    return codes


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` (even) of every block ``[..., block_bytes]`` (a view)."""
    return blocks.view(np.uint16)[..., start // 2].view(np.float16)


def _legacy_scales(d: np.ndarray, minimum: Optional[np.ndarray], offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases of a legacy block type: ``d`` and the bias ``m`` (a stored
    float16) or ``offset * d`` (``offset`` a power of two: -8, -16, -128).

    Args:
        d, minimum: float16 views ``[rows, blocks]`` (``minimum`` None for ``offset * d``).

    Returns:
        Contiguous float16 arrays: a power-of-two multiple of a float16 is exact in
        float16 unless it overflows; then both are float32 (as :func:`_scale_dtype` decides).
    """
    scales = np.array(d, dtype=np.float16)
    if minimum is not None:
        return scales, np.array(minimum, dtype=np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        biases = scales * np.float16(offset)
    if np.isfinite(biases).all() or not np.isfinite(scales).all():
        return scales, biases
    wide = scales.astype(np.float32)
    return wide, np.float32(offset) * wide


def _k_scale_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> two ``[..., 8]`` uint8 arrays."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _scale_dtype(*arrays: np.ndarray) -> np.dtype:
    """float16 when every value survives a float16 round trip, else float32."""
    with np.errstate(over="ignore"):
        if all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays):
            return np.float16
    return np.float32


def _common_dtype(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``scales`` and ``biases`` (float32, exact) in :func:`_scale_dtype`'s dtype."""
    dtype = _scale_dtype(scales, biases)
    return scales.astype(dtype), biases.astype(dtype)


def _quantized_packed(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                      rows: int) -> ConvertedTensor:
    scales, biases = _common_dtype(scales.reshape(rows, -1), biases.reshape(rows, -1))
    return ConvertedTensor(weight=weight, scales=scales, biases=biases, bits=bits)


def _quantized(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, rows: int) -> ConvertedTensor:
    q = q.reshape(rows, -1)
    dtype = _scale_dtype(scales, biases)
    return ConvertedTensor(
        weight=pack_codes(q, bits),
        scales=scales.reshape(rows, -1).astype(dtype),
        biases=biases.reshape(rows, -1).astype(dtype),
        bits=bits,
    )


#: GGUF type -> bits of the types whose packed codes :func:`convert_numpy` can write
#: straight into a caller's buffer (``out``), so they are written once, in place
DIRECT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}


def packed_shape(type_name: str, shape: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """The ``uint32`` ``[rows, cols * bits / 32]`` shape of a :data:`DIRECT_TYPES`
    tensor's packed codes (rows: every axis but the last), or None for another type."""
    bits = DIRECT_TYPES.get(type_name)
    if bits is None:
        return None
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows, shape[-1] * bits // 32


def to_mlx(converted: ConvertedTensor, weight: Optional[mx.array] = None) -> ConvertedTensor:
    """The same tensor with MLX arrays (call it on the thread that uses them).

    Args:
        converted: numpy arrays (:func:`convert_numpy`).
        weight: the MLX array ``converted.weight`` was written into (``out``), used as
            it is; None copies ``converted.weight``.
    """
    if weight is not None:
        return ConvertedTensor(weight, None if converted.scales is None else mx.array(converted.scales),
                               None if converted.biases is None else mx.array(converted.biases),
                               converted.bits, converted.exact, group_size=converted.group_size)
    weight = mx.array(converted.weight)
    if converted.bfloat16:
        weight = weight.view(mx.bfloat16)
    scales = None if converted.scales is None else mx.array(converted.scales)
    biases = None if converted.biases is None else mx.array(converted.biases)
    return ConvertedTensor(weight, scales, biases, converted.bits, converted.exact, group_size=converted.group_size)


def convert_tensor(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> ConvertedTensor:
    """Convert one GGUF tensor's bytes to MLX: :func:`to_mlx` of :func:`convert_numpy`."""
    return to_mlx(convert_numpy(type_name, data, shape))


def convert_numpy(type_name: str, data: np.ndarray, shape: tuple[int, ...],
                  out: Optional[np.ndarray] = None) -> ConvertedTensor:
    """Convert one GGUF tensor's bytes to MLX's layout, as numpy arrays.

    Args:
        type_name: the GGUF type (``"Q4_K"``...), one of :data:`SUPPORTED_TYPES`.
        data: the tensor as the ``gguf`` reader maps it: the values (float types) or
            ``uint8`` blocks ``[rows, bytes_per_row]``.
        shape: the logical shape in numpy order (``[rows, cols]`` for a matrix).
        out: for a :data:`DIRECT_TYPES` tensor, a writable C-contiguous ``uint32``
            array of :func:`packed_shape` (a numpy view of an MLX array) that receives
            the packed codes and is returned as ``weight``; None allocates it. Other
            types ignore it.

    Returns:
        A :class:`ConvertedTensor`. Quantized types need ``cols % 32 == 0`` (the GGUF
        block sizes guarantee it).

    Raises:
        UnsupportedTensorTypeError: ``type_name`` is not supported.
    """
    if type_name in ("F32", "F16"):
        return ConvertedTensor(weight=np.asarray(data).reshape(shape))
    if type_name == "BF16":
        raw = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
        return ConvertedTensor(weight=raw, bfloat16=True)
    if type_name not in SUPPORTED_TYPES:
        check_types_supported({"<tensor>": type_name})
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    cols = shape[-1]
    blocks32 = cols // 32
    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(rows, -1)
    # every path below reads the blocks through views of the (memory-mapped) bytes and
    # writes the packed codes once, into ``weight``: no per-block Python, no float64
    weight = None
    if type_name in DIRECT_TYPES:
        weight = np.empty(packed_shape(type_name, shape), dtype=np.uint32) if out is None else out
        codes = weight.view(np.uint8)  # [rows, cols * bits / 8]
    if type_name == "Q8_0":
        b = raw.reshape(rows, blocks32, 34)
        # int8 q + 128 as uint8: flipping the sign bit of two's complement
        np.bitwise_xor(b[..., 2:], np.uint8(0x80), out=codes.reshape(rows, blocks32, 32))
        scales, biases = _legacy_scales(_f16_field(b, 0), None, -128.0)
        return ConvertedTensor(weight=weight, scales=scales, biases=biases, bits=8)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(rows, blocks32, size)
        scales, biases = _legacy_scales(_f16_field(b, 0), _f16_field(b, 2) if type_name == "Q4_1" else None, -8.0)
        _repack_nibbles(b.view(np.uint16)[..., (size - 16) // 2:], codes.reshape(rows, blocks32, 16))
        return ConvertedTensor(weight=weight, scales=scales, biases=biases, bits=4)
    if type_name in ("Q5_0", "Q5_1"):
        size = 22 if type_name == "Q5_0" else 24
        b = raw.reshape(rows, blocks32, size)
        qh_at = 2 if type_name == "Q5_0" else 4
        q = _nibble_codes(b[..., size - 16:])
        # qh: bit i of a little-endian uint32 is code i's fifth bit; spread byte j onto codes 8j..8j+7
        q.reshape(rows, blocks32, 4, 8).view(np.uint64)[..., 0] |= _FIFTH_BITS[b[..., qh_at:qh_at + 4]]
        scales, biases = _legacy_scales(_f16_field(b, 0), _f16_field(b, 2) if type_name == "Q5_1" else None, -16.0)
        _pack_5bit(q.reshape(rows, cols), codes)
        return ConvertedTensor(weight=weight, scales=scales, biases=biases, bits=5)
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        b = raw.reshape(rows, cols // 256, size)
        d, dmin = _f16_field(b, 0).astype(np.float32), _f16_field(b, 2).astype(np.float32)
        sc, mn = _k_scale_mins(b[..., 4:16])
        scales = d[..., None] * sc.astype(np.float32)
        biases = -(dmin[..., None] * mn.astype(np.float32))
        if type_name == "Q4_K":
            # 4 chunks of 32 bytes: group 2c in the low nibbles of chunk c, group 2c+1 in the
            # high nibbles, code l of each in byte l: the legacy layout's pairs, per chunk
            pairs = b.view(np.uint16)[..., (size - 128) // 2:].reshape(rows, cols // 256, 4, 16)
            looked_up = np.take(_NIBBLE_PAIRS, pairs)  # [.., chunk, pair]
            as_bytes = looked_up.view(np.uint8).reshape(looked_up.shape + (2,))  # [.., chunk, pair, lo/hi]
            # group 2c: the low bytes of chunk c's 16 pairs; group 2c+1: the high bytes
            np.copyto(codes.reshape(rows, cols // 256, 4, 2, 16), as_bytes.transpose(0, 1, 2, 4, 3))
            return _quantized_packed(weight, scales, biases, 4, rows)
        qs = b[..., size - 128:].reshape(rows, cols // 256, 4, 32)  # 4 chunks of 64 weights
        q = np.empty((rows, cols // 256, 4, 2, 32), dtype=np.uint8)
        np.bitwise_and(qs, 0x0F, out=q[..., 0, :])
        np.right_shift(qs, 4, out=q[..., 1, :])
        # bit 2c / 2c+1 of qh byte l: the fifth bit of weight l in group 2c / 2c+1
        fifth = _FIFTH_BITS[b[..., 16:48]].view(np.uint8).reshape(rows, cols // 256, 32, 4, 2)
        q |= fifth.transpose(0, 1, 3, 4, 2)
        _pack_5bit(q.reshape(rows, cols), codes)
        return _quantized_packed(weight, scales, biases, 5, rows)
    return _convert16(type_name, raw, rows, cols)


def _convert16(type_name: str, raw: np.ndarray, rows: int, cols: int) -> ConvertedTensor:
    """Q6_K / Q3_K / Q2_K: codes packed as MLX does, scales and biases per 16 weights."""
    from .tensors16 import unpack16

    q, scales, biases, bits = unpack16(type_name, raw, rows, cols)
    converted = _quantized(q, scales, biases, bits, rows)
    converted.group_size = 16
    return converted


__all__ = [
    "DIRECT_TYPES", "GROUP_SIZE", "SUPPORTED_TYPES", "ConvertedTensor", "check_types_supported", "convert_numpy",
    "convert_tensor", "pack_codes", "packed_shape", "to_mlx",
]
