"""Observation-to-chunk latency over a sliding window."""

from __future__ import annotations

from collections import deque

import numpy as np


class LatencyTracker:
    """Keeps the latest ``window`` latencies; ``estimate()`` is their ``percentile``.

    The scheduler feeds it ``arrival - observation stamp`` for every chunk, which is what
    decides how many actions are stale or committed: camera, transport and inference together.
    """

    def __init__(self, *, window: int, percentile: float, initial_ms: float) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.percentile = percentile
        self.initial_ms = initial_ms

    def record(self, ms: float) -> None:
        if not np.isfinite(ms) or ms < 0:
            raise ValueError(f"latency must be a finite, non-negative number of ms, got {ms!r}")
        self._samples.append(float(ms))

    def estimate(self, percentile: float | None = None) -> float:
        """The percentile latency in ms, or ``initial_ms`` before any sample."""
        if not self._samples:
            return self.initial_ms
        q = self.percentile if percentile is None else percentile
        return float(np.percentile(np.fromiter(self._samples, float), q))

    def __len__(self) -> int:
        return len(self._samples)

    def clear(self) -> None:
        self._samples.clear()
