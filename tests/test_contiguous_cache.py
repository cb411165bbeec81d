"""ContiguousKvCache: growth in steps, preallocation, truncate, capacity errors."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.errors import KvCacheError, KvCacheExhaustedError
from mlx_ferrum.kv_cache import ContiguousKvCache


def test_grows_in_steps_and_keeps_contents():
    c = ContiguousKvCache(2, 4, mx.float16, max_capacity=40, step=16)
    data = mx.random.normal((1, 2, 20, 4)).astype(mx.float16)
    for i in range(20):
        k, v = c.append(data[:, :, i : i + 1], -data[:, :, i : i + 1])
    assert c.len == 20 and c.capacity == 32 and c.k.shape == (1, 2, 32, 4) and c.k.dtype == mx.float16
    np.testing.assert_array_equal(np.array(k), np.array(data))
    np.testing.assert_array_equal(np.array(v), -np.array(data))
    c.append(mx.zeros((1, 2, 15, 4)), mx.zeros((1, 2, 15, 4)))
    assert c.capacity == 40  # capped at max_capacity
    with pytest.raises(KvCacheExhaustedError, match="FERRUM_KV_CAPACITY"):
        c.append(mx.zeros((1, 2, 6, 4)), mx.zeros((1, 2, 6, 4)))
    assert c.len == 35


def test_preallocate_and_truncate():
    c = ContiguousKvCache(1, 2, mx.float32, max_capacity=10, preallocate=True)
    assert c.capacity == 10 and c.nbytes == 2 * 10 * 2 * 4
    c.append(mx.ones((1, 1, 6, 2)), mx.ones((1, 1, 6, 2)))
    c.truncate(2)
    k, _ = c.append(mx.full((1, 1, 1, 2), 7.0), mx.zeros((1, 1, 1, 2)))
    assert k.shape == (1, 1, 3, 2) and float(k[0, 0, 2, 0]) == 7.0
    with pytest.raises(KvCacheError):
        c.truncate(4)
