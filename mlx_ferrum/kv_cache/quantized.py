"""Quantized KV storage (``kv_cache_dtype`` "int8" / "int4"): a paged pool and a contiguous cache.

The format (group-wise int8 / packed int4 codes with float16 scales and biases along
``head_dim``, Walsh-Hadamard-rotated keys) and its math live in
:mod:`mlx_ferrum.kernels.quantized_reference`, which attention reads; they are
re-exported here beside the storage (``kv_group_size``, ``quantize_kv``,
``dequantize_kv``, ``hadamard_matrix``, ``rotate``).

Every write quantizes the new tokens (rotating keys first) and scatters their
codes, scales and biases into the slots, in the same pass; nothing here ever
builds a float copy of the stored tokens except :meth:`QuantizedContiguousKvCache.append`'s
return value, which is that one sequence's keys and values for the reference path.

Per layer, the paged pool holds (``C`` = ``head_dim`` for int8, ``head_dim // 2`` for int4;
``G`` = :func:`kv_group_size`):

- ``k_codes[layer]``, ``v_codes[layer]``: ``[num_blocks, num_kv_heads, block_size, C]`` int8 / uint8
- ``k_scales[layer]``, ``v_scales[layer]``: ``[num_blocks, num_kv_heads, block_size, head_dim // G]`` float16
- ``k_biases[layer]``, ``v_biases[layer]`` (int4 only, else the lists are empty): like the scales.

The contiguous cache holds the same per layer with ``[1, num_kv_heads, capacity, ...]``.

Why this module is one file of over 500 lines: the quantized pool and the quantized
contiguous cache share one write path (quantize on write, scales beside the codes);
keeping both beside it keeps the storage format in one place.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from .. import config as config_module
from ..config import check_memory
from ..errors import ConfigurationError, KvCacheError, KvCacheExhaustedError
from ..kernels.float_window import FIRST_TOKENS as FLOAT_FIRST_TOKENS
from ..kernels.float_window import ring_entries
from ..kernels.quantized_reference import (
    KV_CACHE_DTYPES,
    KV_GROUP_SIZE,
    check_kv_cache_dtype,
    dequantize_kv,
    hadamard_matrix,
    kv_group_size,
    quantize_kv,
    rotate,
)
from ..kernels.reference import slot_indices
from .block_tables import window_start_after_cut
from .store import HOST_BYTES_PER_BLOCK

__all__ = [
    "KV_CACHE_DTYPES",
    "KV_GROUP_SIZE",
    "QuantizedContiguousKvCache",
    "QuantizedPagedKvPool",
    "bytes_per_token",
    "check_kv_cache_dtype",
    "dequantize_kv",
    "hadamard_matrix",
    "kv_group_size",
    "quantize_kv",
    "quantized_bytes_per_block",
    "rotate",
]


def bytes_per_token(num_kv_heads: int, head_dim: int, kv_cache_dtype: str, dtype: Optional[mx.Dtype] = None) -> int:
    """Bytes one token's K and V take in one layer, scales and biases included.

    ``2 * num_kv_heads * (code bytes + scale bytes (+ bias bytes))``; for "auto" the
    model ``dtype``'s ``2 * num_kv_heads * head_dim * dtype.size``.

    Raises:
        ConfigurationError: an unknown ``kv_cache_dtype``, int4 with an odd head_dim,
            or "auto" without ``dtype``.
    """
    check_kv_cache_dtype(kv_cache_dtype, head_dim)
    if kv_cache_dtype == "auto":
        if dtype is None:
            raise ConfigurationError("bytes_per_token: kv_cache_dtype='auto' needs the model dtype (dtype=...)")
        return 2 * num_kv_heads * head_dim * dtype.size
    groups = head_dim // kv_group_size(head_dim)
    if kv_cache_dtype == "int8":
        per_head = head_dim + 2 * groups
    else:
        per_head = head_dim // 2 + 4 * groups
    return 2 * num_kv_heads * per_head


def quantized_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                              kv_cache_dtype: str) -> int:
    """Bytes one block id costs across all layers, K and V, codes, scales and biases together."""
    return num_layers * block_size * bytes_per_token(num_kv_heads, head_dim, kv_cache_dtype)


def _default_rotate(kv_cache_dtype: str, rotate_keys: Optional[bool]) -> bool:
    return True if rotate_keys is None else bool(rotate_keys)


def _shapes(lead: tuple, head_dim: int, kv_cache_dtype: str) -> tuple[tuple, mx.Dtype, tuple]:
    """(codes shape, codes dtype, scales shape) for a leading shape ``lead``."""
    groups = head_dim // kv_group_size(head_dim)
    if kv_cache_dtype == "int8":
        return (*lead, head_dim), mx.int8, (*lead, groups)
    return (*lead, head_dim // 2), mx.uint8, (*lead, groups)


class QuantizedPagedKvPool:
    """Quantized K/V block pools of all layers (the paged layout with ``kv_cache_dtype`` int8/int4).

    The interface follows :class:`~mlx_ferrum.kv_cache.store.PagedKvPool`: :meth:`write`
    at a ``slot_mapping`` with shared :meth:`slot_indices`, :meth:`copy_blocks`,
    :meth:`with_arrays` for a compiled step that takes the pools as inputs, ``nbytes``.
    Like that pool, this object is the only holder of its arrays, so MLX updates them
    in place.

    Args:
        num_layers, num_blocks, num_kv_heads, block_size, head_dim: the pool shape.
        kv_cache_dtype: "int8" or "int4".
        rotate_keys: rotate keys by the Walsh-Hadamard matrix before quantizing them
            (None: True). Attention must then rotate queries
            (``keys_rotated=self.rotate_keys`` in the quantized reference).
        float_window: tokens of each query's recent K/V read in float beside the codes
            (:mod:`~mlx_ferrum.kernels.float_window`; 0: none).
        window_slots: sequences that can hold a float window at once.
        lookahead: the most tokens past its first that one sequence writes in a pass whose
            decode rows read the window after the write (a speculative draft).

    Attributes:
        k_codes, v_codes, k_scales, v_scales, k_biases, v_biases: lists, one array per
            layer (the bias lists are empty for int8); shapes in the module docstring.
        k_window, v_window: lists, one array per layer (empty without a float window):
            ``[window_slots + 1, entries, num_kv_heads, head_dim]`` float16, keys in the
            codes' basis; the last slot is scratch (tokens no window keeps are written there).
        entries: float entries per sequence (:func:`~mlx_ferrum.kernels.float_window.ring_entries`).

    Raises:
        ConfigurationError: an unknown ``kv_cache_dtype``, "auto", or int4 with an odd head_dim.
        InsufficientMemoryError: the pool does not fit in free memory.
    """

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 kv_cache_dtype: str, rotate_keys: Optional[bool] = None, float_window: int = 0,
                 window_slots: int = 0, lookahead: int = 0):
        check_kv_cache_dtype(kv_cache_dtype, head_dim)
        if kv_cache_dtype == "auto":
            raise ConfigurationError("QuantizedPagedKvPool stores int8 or int4: use PagedKvPool for kv_cache_dtype='auto'")
        self.float_window = float_window if window_slots > 0 else 0
        self.window_slots = window_slots if self.float_window else 0
        self.entries = ring_entries(float_window, lookahead) if self.float_window else 0
        check_quantized_pool_fits(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_cache_dtype)
        self.num_layers = num_layers
        self.shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.kv_cache_dtype = kv_cache_dtype
        self.rotate_keys = _default_rotate(kv_cache_dtype, rotate_keys)
        lead = (num_blocks, num_kv_heads, block_size)
        codes_shape, codes_dtype, scales_shape = _shapes(lead, head_dim, kv_cache_dtype)
        self.k_codes = [mx.zeros(codes_shape, codes_dtype) for _ in range(num_layers)]
        self.v_codes = [mx.zeros(codes_shape, codes_dtype) for _ in range(num_layers)]
        self.k_scales = [mx.zeros(scales_shape, mx.float16) for _ in range(num_layers)]
        self.v_scales = [mx.zeros(scales_shape, mx.float16) for _ in range(num_layers)]
        with_bias = kv_cache_dtype == "int4"
        self.k_biases = [mx.zeros(scales_shape, mx.float16) for _ in range(num_layers)] if with_bias else []
        self.v_biases = [mx.zeros(scales_shape, mx.float16) for _ in range(num_layers)] if with_bias else []
        window_shape = (self.window_slots + 1, self.entries, num_kv_heads, head_dim)
        if self.float_window:
            check_memory(
                2 * num_layers * (self.window_slots + 1) * self.entries * num_kv_heads * head_dim * 2,
                f"the float windows of {self.window_slots} sequences ({self.entries} float16 tokens each)",
                "lower --max-num-seqs / FERRUM_PAGED_MAX_SEQS, or set --kv-float-window 0",
            )
        self.k_window = [mx.zeros(window_shape, mx.float16) for _ in range(num_layers)] if self.float_window else []
        self.v_window = [mx.zeros(window_shape, mx.float16) for _ in range(num_layers)] if self.float_window else []
        mx.eval(self.arrays())

    # -- the arrays, flat, for a compiled step's inputs and outputs --------------------------------

    def _lists(self) -> list[list]:
        return [self.k_codes, self.v_codes, self.k_scales, self.v_scales, self.k_biases, self.v_biases,
                self.k_window, self.v_window]

    def arrays(self) -> list[mx.array]:
        """Every array, flat, in a fixed order: k_codes, v_codes, k_scales, v_scales,
        k_biases, v_biases, k_window, v_window (each all layers; the bias lists are empty
        for int8, the window lists without a float window)."""
        return [a for lst in self._lists() for a in lst]

    def _split(self, arrays: list) -> list[list]:
        n = self.num_layers
        counts = [n, n, n, n, len(self.k_biases), len(self.v_biases), len(self.k_window), len(self.v_window)]
        if len(arrays) != sum(counts):
            raise KvCacheError(f"a quantized pool view needs {sum(counts)} arrays (got {len(arrays)})")
        out, at = [], 0
        for c in counts:
            out.append(list(arrays[at : at + c]))
            at += c
        return out

    def with_arrays(self, arrays: list) -> "QuantizedPagedKvPool":
        """A pool object of the same shape over other arrays (:meth:`arrays`' order).

        A compiled decode step takes ``pool.arrays()`` as inputs and returns the view's
        ``arrays()`` as outputs; :meth:`set_arrays` then rebinds the real pool to them.

        Raises:
            KvCacheError: the number of arrays does not match this pool's.
        """
        view = object.__new__(QuantizedPagedKvPool)
        view.num_layers, view.shape = self.num_layers, self.shape
        view.kv_cache_dtype, view.rotate_keys = self.kv_cache_dtype, self.rotate_keys
        view.float_window, view.window_slots, view.entries = self.float_window, self.window_slots, self.entries
        (view.k_codes, view.v_codes, view.k_scales, view.v_scales,
         view.k_biases, view.v_biases, view.k_window, view.v_window) = self._split(list(arrays))
        return view

    def set_arrays(self, arrays: list) -> None:
        """Rebind this pool to ``arrays`` (:meth:`arrays`' order), e.g. a compiled step's outputs.

        Raises:
            KvCacheError: the number of arrays does not match this pool's.
        """
        (self.k_codes, self.v_codes, self.k_scales, self.v_scales,
         self.k_biases, self.v_biases, self.k_window, self.v_window) = self._split(list(arrays))

    def layer_arrays(self, layer: int) -> tuple:
        """``(k_codes, v_codes, k_scales, v_scales, k_biases, v_biases)`` of one layer, in the
        argument order of the quantized reference attention (biases None for int8)."""
        kb = self.k_biases[layer] if self.k_biases else None
        vb = self.v_biases[layer] if self.v_biases else None
        return self.k_codes[layer], self.v_codes[layer], self.k_scales[layer], self.v_scales[layer], kb, vb

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks per layer pool."""
        return self.shape[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads."""
        return self.shape[1]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.shape[2]

    @property
    def head_dim(self) -> int:
        """Unpacked values per head and token."""
        return self.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated array (codes, scales, biases, float windows; all layers, K and V)."""
        return sum(a.nbytes for a in self.arrays())

    @property
    def float_window_bytes(self) -> int:
        """Bytes of the float windows (all slots and layers, K and V); 0 without."""
        return sum(a.nbytes for a in self.k_window + self.v_window)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot costs across all layers, scales and biases included,
        measured from the allocated arrays (``(nbytes - float_window_bytes) / (num_blocks
        * block_size)``: the float windows are per running sequence, not per token)."""
        return (self.nbytes - self.float_window_bytes) // (self.num_blocks * self.block_size)

    # -- writes -----------------------------------------------------------------------------------

    def slot_indices(self, slot_mapping: mx.array):
        """Index arrays addressing ``slot_mapping`` in this pool (see ``kernels.reference.slot_indices``);
        they address codes, scales and biases alike (the last axis is left whole)."""
        return slot_indices(slot_mapping, self.shape[1], self.shape[2])

    def write(self, layer: int, slot_mapping: mx.array, k: mx.array, v: mx.array, indices=None,
              window_index: Optional[tuple] = None, keys_rotated: bool = False) -> None:
        """Quantize and store ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` (post-RoPE,
        any float dtype) at ``slot_mapping`` ``[num_tokens]`` int32 of layer ``layer``.

        Keys are rotated first when ``rotate_keys``. Non-finite inputs are stored as
        finite values (see :func:`quantize_kv`), so no slot ever holds a NaN scale.

        Args:
            indices: :meth:`slot_indices` of ``slot_mapping``, to reuse across layers.
            window_index: ``(window slots [num_tokens], entries [num_tokens])`` int32, where
                each token's float copy goes (the scratch slot for tokens no window
                keeps); None writes no float copy.
            keys_rotated: ``k`` is rotated already (a caller that also reads the rotated
                keys rotates them once).
        """
        if indices is None:
            indices = self.slot_indices(slot_mapping)
        if self.rotate_keys and not keys_rotated:
            k = rotate(k, self.head_dim)
        if window_index is not None and self.float_window:
            self.k_window[layer][window_index] = k.astype(mx.float16)
            self.v_window[layer][window_index] = v.astype(mx.float16)
        kc, ks, kb = quantize_kv(k, self.kv_cache_dtype)
        vc, vs, vb = quantize_kv(v, self.kv_cache_dtype)
        self.k_codes[layer][indices] = kc
        self.v_codes[layer][indices] = vc
        self.k_scales[layer][indices] = ks
        self.v_scales[layer][indices] = vs
        if kb is not None:
            self.k_biases[layer][indices] = kb
            self.v_biases[layer][indices] = vb

    def copy_blocks(self, copies: list[tuple[int, int]], layers=None) -> None:
        """Copy whole blocks ``src -> dst`` (codes, scales and biases) in every layer, or in
        ``layers`` (a list of layer indices), for copy-on-write of shared blocks."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        chosen = range(self.num_layers) if layers is None else layers
        lists = [lst for lst in self._lists()[:6] if lst]  # blocks: not the float windows
        blocks = [[lst[i][src] for i in chosen] for lst in lists]
        # evaluate the gathers first: a pending read of a pool would make the scatter
        # below copy the whole pool instead of updating it in place
        mx.eval(blocks)
        for lst, got in zip(lists, blocks):
            for i, b in zip(chosen, got):
                lst[i][dst] = b


def _quantize_pair(k: mx.array, v: mx.array, kv_cache_dtype: str, rotate_keys: bool, head_dim: int) -> tuple:
    """``(k_codes, k_scales, k_biases, v_codes, v_scales, v_biases)`` of ``k`` (rotated first
    when ``rotate_keys``) and ``v``; the biases None for int8."""
    if rotate_keys:
        k = rotate(k, head_dim)
    return (*quantize_kv(k, kv_cache_dtype), *quantize_kv(v, kv_cache_dtype))


@functools.lru_cache(maxsize=None)
def _decode_quantizer(kv_cache_dtype: str, rotate_keys: bool, head_dim: int):
    """:func:`_quantize_pair` for one format, ``mx.compile``'d (its inputs, one decode
    token's K and V, keep their shape from step to step, so it is traced once)."""
    compiled = mx.compile(lambda k, v: [a for a in _quantize_pair(k, v, kv_cache_dtype, rotate_keys, head_dim)
                                        if a is not None])

    def run(k: mx.array, v: mx.array) -> tuple:
        out = compiled(k, v)
        if len(out) == 6:
            return tuple(out)
        kc, ks, vc, vs = out
        return kc, ks, None, vc, vs, None

    return run


def check_quantized_pool_fits(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                              kv_cache_dtype: str, extra_blocks: int = 0) -> None:
    """Refuse a quantized pool that free memory cannot hold, before it is allocated.

    Raises:
        InsufficientMemoryError: names the blocks asked for, the bytes per block and the most that fit.
    """
    per = quantized_bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, kv_cache_dtype) + HOST_BYTES_PER_BLOCK
    fits = max(0, config_module.available_memory_bytes() // per - extra_blocks)
    check_memory(
        (num_blocks + extra_blocks) * per,
        f"a {kv_cache_dtype} paged KV pool of {num_blocks} blocks (FERRUM_KV_MAX_BLOCKS / --max-num-blocks / "
        f"RuntimeConfig.max_num_blocks; {per} bytes per block)",
        f"set it to at most {fits} blocks, or leave it unset to size the pool from FERRUM_PAGED_MAX_SEQS",
    )


class QuantizedContiguousKvCache:
    """Quantized K and V of one layer of one sequence (the contiguous layout, int8/int4).

    The interface follows :class:`~mlx_ferrum.kv_cache.contiguous.ContiguousKvCache`
    (``append``, ``truncate``, ``len``, ``capacity``, ``nbytes``), and buffers grow the same way.

    Args:
        num_kv_heads, head_dim: per-token shape of K and V.
        dtype: the model's dtype: :meth:`append` returns K and V in it.
        max_capacity: most tokens this cache may hold.
        kv_cache_dtype: "int8" or "int4".
        step: growth step in tokens.
        preallocate: allocate ``max_capacity`` tokens at once.
        rotate_keys: as in :class:`QuantizedPagedKvPool` (None: True).
        float_window, lookahead: as in :class:`QuantizedPagedKvPool` (0: no float window).

    Attributes:
        k_codes, v_codes: ``[1, num_kv_heads, capacity, C]``; k_scales, v_scales (and for
            int4 k_biases, v_biases; else None): ``[1, num_kv_heads, capacity, head_dim // G]``
            float16; all None until the first write.
        len, capacity: tokens stored, and tokens the buffers hold without growing.
        k_window, v_window: ``[1, num_kv_heads, entries, head_dim]`` float16, the float
            window's ring (:mod:`~mlx_ferrum.kernels.float_window`; keys in the codes'
            basis), None without a float window or before the first write.
        window_start: the first position with a float entry (a fork's copied tokens
            come as codes).

    Raises:
        ConfigurationError: an unknown ``kv_cache_dtype``, "auto", or int4 with an odd head_dim.
        KvCacheExhaustedError: an append would exceed ``max_capacity``.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, max_capacity: int, kv_cache_dtype: str,
                 step: int = 256, preallocate: bool = False, rotate_keys: Optional[bool] = None,
                 float_window: int = 0, lookahead: int = 0):
        check_kv_cache_dtype(kv_cache_dtype, head_dim)
        if kv_cache_dtype == "auto":
            raise ConfigurationError(
                "QuantizedContiguousKvCache stores int8 or int4: use ContiguousKvCache for kv_cache_dtype='auto'")
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.max_capacity, self.step = max_capacity, step
        self.kv_cache_dtype = kv_cache_dtype
        self.rotate_keys = _default_rotate(kv_cache_dtype, rotate_keys)
        self.len = 0
        self.capacity = 0
        self.k_codes = self.v_codes = self.k_scales = self.v_scales = None
        self.k_biases = self.v_biases = None
        self.float_window = float_window
        self.entries = ring_entries(float_window, lookahead) if float_window else 0
        self.k_window = self.v_window = None
        self.window_start = 0
        if preallocate:
            self._grow_to(max_capacity)

    def _names(self) -> list[str]:
        names = ["k_codes", "v_codes", "k_scales", "v_scales"]
        return names + (["k_biases", "v_biases"] if self.kv_cache_dtype == "int4" else [])

    def arrays(self) -> list[mx.array]:
        """The stored arrays (codes, scales, biases for int4), empty before the first write."""
        return [] if self.k_codes is None else [getattr(self, n) for n in self._names()]

    def _grow_to(self, capacity: int) -> None:
        codes_shape, codes_dtype, scales_shape = _shapes((1, self.num_kv_heads, capacity), self.head_dim,
                                                         self.kv_cache_dtype)
        for name in self._names():
            shape, dtype = (codes_shape, codes_dtype) if name.endswith("codes") else (scales_shape, mx.float16)
            new = mx.zeros(shape, dtype)
            if self.len:
                new[:, :, : self.len] = getattr(self, name)[:, :, : self.len]
            setattr(self, name, new)
        self.capacity = capacity

    def append(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize and store ``L`` new tokens; return all stored K and V, dequantized.

        Args:
            k, v: ``[1, num_kv_heads, L, head_dim]`` (post-RoPE keys).

        Returns:
            ``(keys, values)``, each ``[1, num_kv_heads, len, head_dim]`` in the model dtype:
            this sequence's tokens only. Keys are in the rotated basis when
            ``rotate_keys`` (rotate queries to match, e.g. with
            ``quantized_contiguous_attention(..., keys_rotated=cache.rotate_keys)``).

        Raises:
            KvCacheExhaustedError: ``len + L > max_capacity``.
        """
        self.write(k, v)
        return self.fetch()

    def write(self, k: mx.array, v: mx.array) -> None:
        """Quantize and store ``L`` new tokens, as :meth:`append` does, returning nothing
        (for attention that reads the codes themselves).

        Args:
            k, v: ``[1, num_kv_heads, L, head_dim]`` (post-RoPE keys).

        Raises:
            KvCacheExhaustedError: ``len + L > max_capacity``.
        """
        n = k.shape[2]
        end = self.len + n
        if end > self.max_capacity:
            raise KvCacheExhaustedError(
                f"contiguous KV cache holds at most {self.max_capacity} tokens and {end} were asked for: "
                "raise FERRUM_KV_CAPACITY or shorten the prompt/max_tokens"
            )
        if end > self.capacity:
            self._grow_to(min(self.max_capacity, -(-end // self.step) * self.step))
        if n == 1:
            # a decode step: the same few tensors every step, so one compiled graph serves
            # them (op by op, the quantization's ~30 small ops cost more than the attention)
            kc, ks, kb, vc, vs, vb = _decode_quantizer(self.kv_cache_dtype, self.rotate_keys, self.head_dim)(k, v)
        else:
            kc, ks, kb, vc, vs, vb = _quantize_pair(k, v, self.kv_cache_dtype, self.rotate_keys, self.head_dim)
        if self.float_window:
            self._write_window(k, v)
        self.k_codes[:, :, self.len : end] = kc
        self.v_codes[:, :, self.len : end] = vc
        self.k_scales[:, :, self.len : end] = ks
        self.v_scales[:, :, self.len : end] = vs
        if kb is not None:
            self.k_biases[:, :, self.len : end] = kb
            self.v_biases[:, :, self.len : end] = vb
        self.len = end

    def _write_window(self, k: mx.array, v: mx.array) -> None:
        """Keep the float copies of the new tokens the window may read: the first tokens
        and the last ``entries - FIRST_TOKENS`` positions (older ones of a long chunk
        would be overwritten by newer ones in the same scatter)."""
        if self.k_window is None:
            shape = (1, self.num_kv_heads, self.entries, self.head_dim)
            self.k_window, self.v_window = mx.zeros(shape, mx.float16), mx.zeros(shape, mx.float16)
        n, end = k.shape[2], self.len + k.shape[2]
        ring = self.entries - FLOAT_FIRST_TOKENS
        kept = [p for p in range(self.len, end) if p < FLOAT_FIRST_TOKENS or p > end - 1 - ring]
        if not kept:
            return
        entries = mx.array([p if p < FLOAT_FIRST_TOKENS else FLOAT_FIRST_TOKENS + (p - FLOAT_FIRST_TOKENS) % ring
                            for p in kept], dtype=mx.int32)
        rows = kept if len(kept) < n else None
        if self.rotate_keys:
            k = rotate(k, self.head_dim)
        if rows is not None:
            picked = mx.array([p - self.len for p in rows], dtype=mx.int32)
            k, v = k[:, :, picked], v[:, :, picked]
        self.k_window[:, :, entries] = k.astype(mx.float16)
        self.v_window[:, :, entries] = v.astype(mx.float16)

    def window_snapshot(self) -> Optional[tuple[mx.array, mx.array]]:
        """``(k_window, v_window)`` as they are now, unaffected by later writes (a prefill
        pass reads its sequence's entries from before its own write), or None."""
        if self.k_window is None:
            return None
        return self.k_window[:, :, :], self.v_window[:, :, :]

    def fetch(self, start: int = 0) -> tuple[mx.array, mx.array]:
        """Stored tokens ``start .. len - 1``, dequantized to the model dtype:
        ``[1, num_kv_heads, len - start, head_dim]`` each (keys rotated when ``rotate_keys``)."""
        if self.k_codes is None:
            empty = mx.zeros((1, self.num_kv_heads, 0, self.head_dim), self.dtype)
            return empty, empty
        part = lambda a: None if a is None else a[:, :, start : self.len]  # noqa: E731
        keys = dequantize_kv(part(self.k_codes), part(self.k_scales), part(self.k_biases),
                             self.kv_cache_dtype, self.head_dim, self.dtype)
        values = dequantize_kv(part(self.v_codes), part(self.v_scales), part(self.v_biases),
                               self.kv_cache_dtype, self.head_dim, self.dtype)
        return keys, values

    def stored_arrays(self, start: int = 0, stop: Optional[int] = None) -> tuple:
        """Slots ``start .. stop - 1`` as stored, not dequantized: ``(k_codes, v_codes,
        k_scales, v_scales, k_biases, v_biases)``, each ``[1, num_kv_heads, stop - start, ...]``
        (views; biases None for int8), the argument order of
        :func:`~mlx_ferrum.kernels.quantized_reference.attention_over_codes`.

        ``stop`` defaults to ``len`` and may go up to ``capacity``: slots past ``len`` hold
        finite leftovers (zeros or truncated tokens) that a caller must mask.

        Raises:
            KvCacheError: nothing is stored yet, or ``0 <= start <= stop <= capacity`` fails.
        """
        stop = self.len if stop is None else stop
        if self.k_codes is None or not 0 <= start <= stop <= self.capacity:
            raise KvCacheError(f"stored_arrays({start}, {stop}): the cache holds {self.len} tokens in "
                               f"{self.capacity} slots")
        part = lambda a: None if a is None else a[:, :, start:stop]  # noqa: E731
        return (part(self.k_codes), part(self.v_codes), part(self.k_scales), part(self.v_scales),
                part(self.k_biases), part(self.v_biases))

    def copy_from(self, other: "QuantizedContiguousKvCache") -> None:
        """Take ``other``'s stored tokens as they are (codes, not re-quantized), for a fork.

        Raises:
            KvCacheError: the caches differ in format or shape.
        """
        same = (other.kv_cache_dtype, other.rotate_keys, other.num_kv_heads, other.head_dim)
        if same != (self.kv_cache_dtype, self.rotate_keys, self.num_kv_heads, self.head_dim):
            raise KvCacheError("copy_from: the two quantized caches differ in format or shape")
        if other.len > self.max_capacity:
            raise KvCacheExhaustedError(
                f"contiguous KV cache holds at most {self.max_capacity} tokens and {other.len} were asked for: "
                "raise FERRUM_KV_CAPACITY")
        self.len = 0
        if other.len > self.capacity:
            self._grow_to(min(self.max_capacity, -(-other.len // self.step) * self.step))
        for name in self._names():
            getattr(self, name)[:, :, : other.len] = getattr(other, name)[:, :, : other.len]
        self.len = other.len
        self.window_start = other.len  # the copied tokens come as codes

    def truncate(self, new_len: int) -> None:
        """Forget tokens from ``new_len`` on (their slots are overwritten by later appends).

        Raises:
            KvCacheError: ``new_len`` is negative or larger than ``len``.
        """
        if not 0 <= new_len <= self.len:
            raise KvCacheError(f"cannot truncate a KV cache of {self.len} tokens to {new_len}")
        if self.float_window:
            lookahead = self.entries - FLOAT_FIRST_TOKENS - self.float_window
            self.window_start = window_start_after_cut(self.window_start, self.len, new_len, self.float_window,
                                                       lookahead)
        self.len = new_len

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers (capacity, not just ``len``), scales, biases and the
        float window included."""
        window = 0 if self.k_window is None else self.k_window.nbytes + self.v_window.nbytes
        return sum(a.nbytes for a in self.arrays()) + window
