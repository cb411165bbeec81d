"""Contiguous KV layout: one growing ``[1, num_kv_heads, capacity, head_dim]`` buffer per layer.

This is ferrum's original layout (and mlx-lm's ``KVCache``): simple, and each new
token is one slice update. Memory is held in steps of ``step`` tokens (or
preallocated up to ``max_capacity``), so up to ``step - 1`` token slots sit unused.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..errors import KvCacheExhaustedError, KvCacheError


class ContiguousKvCache:
    """K and V of one layer of one sequence.

    Args:
        num_kv_heads, head_dim: per-token shape of K and V.
        dtype: the model's dtype (bf16/fp16/fp32).
        max_capacity: most tokens this cache may hold (``FERRUM_KV_CAPACITY`` or the
            model's ``max_position_embeddings``).
        step: growth step in tokens; buffers grow to the next multiple of it.
        preallocate: allocate ``max_capacity`` tokens at once (gpt-fast's static cache).

    Attributes:
        k, v: ``[1, num_kv_heads, capacity, head_dim]`` buffers (``None`` until first write).
        len: tokens stored.
        capacity: tokens the current buffers can hold without growing.

    Raises:
        KvCacheExhaustedError: an append would exceed ``max_capacity``.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        max_capacity: int,
        step: int = 256,
        preallocate: bool = False,
    ):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.max_capacity = max_capacity
        self.step = step
        self.len = 0
        self.capacity = 0
        self.k: Optional[mx.array] = None
        self.v: Optional[mx.array] = None
        if preallocate:
            self._grow_to(max_capacity)

    def _grow_to(self, capacity: int) -> None:
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        k = mx.zeros(shape, self.dtype)
        v = mx.zeros(shape, self.dtype)
        if self.len:
            k[..., : self.len, :] = self.k[..., : self.len, :]
            v[..., : self.len, :] = self.v[..., : self.len, :]
        self.k, self.v, self.capacity = k, v, capacity

    def append(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store ``L`` new tokens and return views of all stored K and V.

        Args:
            k, v: ``[1, num_kv_heads, L, head_dim]``.

        Returns:
            ``(keys, values)``, each ``[1, num_kv_heads, len, head_dim]`` (``len`` after the append).

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
            new_cap = min(self.max_capacity, -(-end // self.step) * self.step)
            self._grow_to(new_cap)
        self.k[..., self.len : end, :] = k.astype(self.dtype)
        self.v[..., self.len : end, :] = v.astype(self.dtype)
        self.len = end
        return self.k[..., :end, :], self.v[..., :end, :]

    def arrays(self) -> list[mx.array]:
        """The K and V buffers (empty before the first write)."""
        return [] if self.k is None else [self.k, self.v]

    def copy_from(self, other: "ContiguousKvCache") -> None:
        """Hold ``other``'s stored tokens (a fork): this cache's own are replaced.

        Raises:
            KvCacheExhaustedError: ``other`` holds more than this cache's ``max_capacity``.
        """
        self.len = 0
        if other.len:
            self.append(other.k[..., : other.len, :], other.v[..., : other.len, :])

    def truncate(self, new_len: int) -> None:
        """Forget tokens from ``new_len`` on (their slots are overwritten by later appends).

        Raises:
            KvCacheError: ``new_len`` is negative or larger than ``len``.
        """
        if not 0 <= new_len <= self.len:
            raise KvCacheError(f"cannot truncate a KV cache of {self.len} tokens to {new_len}")
        self.len = new_len

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers (capacity, not just ``len``)."""
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes
