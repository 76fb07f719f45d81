"""Rolling statistics for diagnostics: loop rate and jitter, latency percentiles, counters."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoopSummary:
    rate_hz: float  # ticks per second over the window
    period_mean_ms: float
    jitter_std_ms: float  # std of the period
    jitter_max_ms: float  # max |period - nominal|
    ticks: int  # ticks since start
    jitter_p50_ms: float = 0.0  # percentiles of |period - nominal| over the window
    jitter_p99_ms: float = 0.0


class LoopStats:
    """Feed :meth:`tick` with the wall (steady) time of every loop iteration."""

    def __init__(self, nominal_period_s: float, window: int = 500) -> None:
        self.nominal_ms = nominal_period_s * 1e3
        self._periods: deque[float] = deque(maxlen=window)
        self._last: int | None = None
        self.ticks = 0

    def tick(self, now_ns: int) -> None:
        if self._last is not None and now_ns > self._last:
            self._periods.append((now_ns - self._last) / 1e6)
        self._last = now_ns
        self.ticks += 1

    def summary(self) -> LoopSummary:
        if not self._periods:
            return LoopSummary(0.0, 0.0, 0.0, 0.0, self.ticks)
        p = np.fromiter(self._periods, float)
        mean = float(p.mean())
        jitter = np.abs(p - self.nominal_ms)
        p50, p99 = np.percentile(jitter, [50, 99])
        return LoopSummary(
            rate_hz=1e3 / mean if mean > 0 else 0.0,
            period_mean_ms=mean,
            jitter_std_ms=float(p.std()),
            jitter_max_ms=float(jitter.max()),
            ticks=self.ticks,
            jitter_p50_ms=float(p50),
            jitter_p99_ms=float(p99),
        )


class Percentiles:
    """The latest ``window`` samples of one quantity (e.g. a latency in ms)."""

    def __init__(self, window: int = 200) -> None:
        self._x: deque[float] = deque(maxlen=window)
        self.count = 0
        self.max = float("nan")  # of every sample, not only the window's

    def add(self, value: float) -> None:
        if np.isfinite(value):
            self._x.append(float(value))
            self.count += 1
            if not value <= self.max:  # (nan before the first sample)
                self.max = float(value)

    def get(self, q: float) -> float:
        if not self._x:
            return float("nan")
        return float(np.percentile(np.fromiter(self._x, float), q))

    def last(self) -> float:
        return self._x[-1] if self._x else float("nan")
