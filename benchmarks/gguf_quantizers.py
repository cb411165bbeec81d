"""Benchmark-side Q4_K and Q6_K quantizers (the ``gguf`` package dequantizes these types
but cannot quantize them), to write a SmolLM2-sized ``Q4_K_M``-like file.

Simple round-to-nearest versions of llama.cpp's block formats (``block_q4_K``,
``block_q6_K`` in ``ggml-common.h``): not llama.cpp's error-minimizing search, so the
files are a little less accurate than llama.cpp's, but they have the same layout and
size, which is what the memory, load-time and speed figures need. Each function checks
its output with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` float32 (cols % 256 == 0) -> ``uint8`` ``[rows, cols / 256 * 144]``."""
    rows, cols = weights.shape
    w = weights.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    low = np.minimum(w.min(-1), 0.0)
    step = (w.max(-1) - low) / 15.0
    d = step.max(-1) / 63.0
    dmin = (-low).max(-1) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d16 > 0, d16, 1)[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.where(dmin16 > 0, dmin16, 1)[..., None]), 0, 63).astype(np.uint8)
    scale = d16[..., None] * sc
    q = np.clip(np.rint((w + (dmin16[..., None] * mn)[..., None]) / np.where(scale > 0, scale, 1)[..., None]),
                0, 15).astype(np.uint8)
    packed_scales = np.empty((rows, cols // 256, 12), np.uint8)
    packed_scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed_scales[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed_scales[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = q.reshape(rows, cols // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, cols // 256, 128)
    out = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), packed_scales, qs], axis=-1)
    return _checked(out.reshape(rows, -1), weights, "Q4_K")


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` float32 (cols % 256 == 0) -> ``uint8`` ``[rows, cols / 256 * 210]``."""
    rows, cols = weights.shape
    nb = cols // 256
    w = weights.reshape(rows, nb, 16, 16).astype(np.float32)
    scale = np.abs(w).max(-1) / 31.0
    d = np.abs(scale).max(-1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d16 > 0, d16, 1)[..., None]), -127, 127).astype(np.int8)
    eff = d16[..., None] * sc
    q = (np.clip(np.rint(w / np.where(eff != 0, eff, 1)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, nb, 2, 4, 32)  # halves of 128, then the four 32-runs each half interleaves
    ql = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                         (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=-1)  # [rows, nb, 2, 64]
    qh = ((q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4)
          | ((q[:, :, :, 3] >> 4) << 6))  # [rows, nb, 2, 32]
    out = np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), sc.view(np.uint8),
                          _f16_bytes(d16)], axis=-1)
    return _checked(out.reshape(rows, -1), weights, "Q6_K")


def _checked(raw: np.ndarray, weights: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    back = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(weights.shape)
    spread = float(np.abs(weights).max()) or 1.0
    error = float(np.abs(back - weights).max())
    if error > spread * (0.15 if type_name == "Q4_K" else 0.05):
        raise AssertionError(f"{type_name} quantizer is broken: max error {error} for weights up to {spread}")
    return raw
