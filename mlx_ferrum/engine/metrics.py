"""Bounded latency statistics for the engine: a count, a sum and a fixed-size sample.

A long-running server finishes millions of requests, so the engine keeps no list that
grows with them. :class:`LatencyReservoir` keeps the exact count and mean plus a uniform
random sample of at most ``capacity`` values (reservoir sampling, Vitter's Algorithm R,
ACM TOMS 1985), from which percentiles are read.
"""

from __future__ import annotations

import random
from typing import Iterable


class LatencyReservoir:
    """Count, mean and percentiles of a stream of latencies in seconds, in O(capacity) memory.

    Args:
        capacity: most values kept for percentiles (>= 1).
        seed: seed of the replacement choices, so runs are reproducible.

    Percentiles are exact while fewer than ``capacity`` values were added, and estimates
    from a uniform sample afterwards.
    """

    def __init__(self, capacity: int = 4096, seed: int = 0):
        if capacity < 1:
            raise ValueError("a reservoir needs capacity >= 1")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.samples: list[float] = []
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        """Record one latency (seconds)."""
        self.count += 1
        self.total += value
        if len(self.samples) < self.capacity:
            self.samples.append(value)
            return
        j = self._random.randrange(self.count)
        if j < self.capacity:
            self.samples[j] = value

    def extend(self, values: Iterable[float]) -> None:
        """Record several latencies."""
        for v in values:
            self.add(v)

    @property
    def mean(self) -> float:
        """Mean of every value added (0.0 when none)."""
        return self.total / self.count if self.count else 0.0

    def percentile(self, q: float) -> float:
        """The ``q``-quantile (``q`` in [0, 1], nearest rank) of the kept sample; 0.0 when empty."""
        if not self.samples:
            return 0.0
        ys = sorted(self.samples)
        return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]
