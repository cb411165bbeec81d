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
    elif bits == 5:  # 8 codes c0..c7 fill 5 bytes; uint8 shifts drop the bits that move out
        c = [q[:, i::8] for i in range(8)]
        packed = np.stack([
            c[0] | (c[1] << 5),
            (c[1] >> 3) | (c[2] << 2) | (c[3] << 7),
            (c[3] >> 1) | (c[4] << 4),
            (c[4] >> 4) | (c[5] << 1) | (c[6] << 6),
            (c[6] >> 2) | (c[7] << 3),
        ], axis=-1).reshape(rows, n * 5 // 8)
    else:  # 2, 3, 6 bits: 8 codes fill ``bits`` bytes exactly; build them in a uint64
        codes = q.reshape(rows, n // 8, 8).astype(np.uint64)
        word = np.zeros((rows, n // 8), dtype=np.uint64)
        for i in range(8):
            word |= codes[..., i] << np.uint64(bits * i)
        packed = word[..., None].view(np.uint8)[..., :bits].reshape(rows, n * bits // 8)
    return np.ascontiguousarray(packed).view(np.uint32).reshape(rows, n * bits // 32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[rows, nblocks]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are elements 0-15, high nibbles 16-31 (ggml's
    legacy blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh_bytes: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's ``qh``: bit ``i`` of a little-endian uint32 is element ``i``'s fifth bit."""
    bits = np.unpackbits(qh_bytes, axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


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


def _quantized(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, rows: int) -> ConvertedTensor:
    q = q.reshape(rows, -1)
    dtype = _scale_dtype(scales, biases)
    return ConvertedTensor(
        weight=pack_codes(q, bits),
        scales=scales.reshape(rows, -1).astype(dtype),
        biases=biases.reshape(rows, -1).astype(dtype),
        bits=bits,
    )


def to_mlx(converted: ConvertedTensor) -> ConvertedTensor:
    """The same tensor with MLX arrays (call it on the thread that uses them)."""
    weight = mx.array(converted.weight)
    if converted.bfloat16:
        weight = weight.view(mx.bfloat16)
    scales = None if converted.scales is None else mx.array(converted.scales)
    biases = None if converted.biases is None else mx.array(converted.biases)
    return ConvertedTensor(weight, scales, biases, converted.bits, converted.exact, group_size=converted.group_size)


def convert_tensor(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> ConvertedTensor:
    """Convert one GGUF tensor's bytes to MLX: :func:`to_mlx` of :func:`convert_numpy`."""
    return to_mlx(convert_numpy(type_name, data, shape))


def convert_numpy(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> ConvertedTensor:
    """Convert one GGUF tensor's bytes to MLX's layout, as numpy arrays.

    Args:
        type_name: the GGUF type (``"Q4_K"``...), one of :data:`SUPPORTED_TYPES`.
        data: the tensor as the ``gguf`` reader maps it: the values (float types) or
            ``uint8`` blocks ``[rows, bytes_per_row]``.
        shape: the logical shape in numpy order (``[rows, cols]`` for a matrix).

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
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if type_name == "Q8_0":
        b = raw.reshape(rows, blocks32, 34)
        d = _f16(b, 0)
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _quantized(q, d, -128.0 * d, 8, rows)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(rows, blocks32, size)
        d = _f16(b, 0)
        bias = -8.0 * d if type_name == "Q4_0" else _f16(b, 2)
        # MLX's byte k holds codes 2k (low nibble) and 2k+1; ggml's byte i holds codes i
        # and i+16: repack the bytes directly, never widening to one code per byte
        qs = b[..., size - 16:]
        even, odd = qs[..., 0::2], qs[..., 1::2]
        packed = np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)
        dtype = _scale_dtype(d, bias)
        return ConvertedTensor(
            weight=np.ascontiguousarray(packed).view(np.uint32).reshape(rows, cols // 8),
            scales=d.astype(dtype), biases=bias.astype(dtype), bits=4)
    if type_name in ("Q5_0", "Q5_1"):
        size = 22 if type_name == "Q5_0" else 24
        b = raw.reshape(rows, blocks32, size)
        d = _f16(b, 0)
        qh_at = 2 if type_name == "Q5_0" else 4
        q = _nibbles_32(b[..., size - 16:]) | _high_bits_32(b[..., qh_at:qh_at + 4])
        bias = -16.0 * d if type_name == "Q5_0" else _f16(b, 2)
        return _quantized(q, d, bias, 5, rows)
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        b = raw.reshape(rows, cols // 256, size)
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scale_mins(b[..., 4:16])
        qs = b[..., size - 128:].reshape(rows, cols // 256, 4, 32)  # 4 chunks of 64 weights
        # each 32-byte chunk holds two groups: low nibbles then high nibbles
        q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, nb, 4, 2, 32]
        if type_name == "Q5_K":
            qh = b[..., 16:48]  # bit 2j / 2j+1 of byte l: the fifth bit of weight l in group 2j / 2j+1
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            q = q | (((qh[:, :, None, None, :] >> shifts) & 1) << 4)
        scales = d[..., None] * sc.astype(np.float32)
        biases = -(dmin[..., None] * mn.astype(np.float32))
        return _quantized(q.astype(np.uint8), scales, biases, 5 if type_name == "Q5_K" else 4, rows)
    return _convert16(type_name, raw, rows, cols)


def _convert16(type_name: str, raw: np.ndarray, rows: int, cols: int) -> ConvertedTensor:
    """Q6_K / Q3_K / Q2_K: codes packed as MLX does, scales and biases per 16 weights."""
    from .tensors16 import unpack16

    q, scales, biases, bits = unpack16(type_name, raw, rows, cols)
    converted = _quantized(q, scales, biases, bits, rows)
    converted.group_size = 16
    return converted


__all__ = [
    "GROUP_SIZE", "SUPPORTED_TYPES", "ConvertedTensor", "check_types_supported", "convert_numpy", "convert_tensor",
    "pack_codes", "to_mlx",
]
