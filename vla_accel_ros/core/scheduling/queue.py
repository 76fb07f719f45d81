"""Time-indexed actions on the controller's tick grid.

Slot k is the control tick at ``origin + k*dt``. Action i of a chunk is meant for
``stamp + i*chunk.dt`` (:meth:`ActionChunk.action_time_ns`); it lands on the grid by linear
interpolation, which is an exact copy when the stamp sits on a tick and the chunk runs at the
control rate (the usual case). One array holds both what was executed (rows before
``cursor``, kept for RTC guidance) and the plan (rows from ``cursor`` on).
"""

from __future__ import annotations

import math

import numpy as np

from vla_accel_ros.core.errors import SchedulerError

_SNAP = 1e-6  # grid positions this close to an integer are that integer (float ns arithmetic)


def _snap(pos: np.ndarray) -> np.ndarray:
    r = np.round(pos)
    return np.where(np.abs(pos - r) < _SNAP, r, pos)


def interp_rows(values: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows of ``values`` [N, D] at fractional row positions ``pos`` [M], clamped to the ends.
    Integer positions copy rows bit for bit (RTC's frozen prefix relies on it).  # [M, D]"""
    n = values.shape[0]
    pos = np.clip(_snap(np.asarray(pos, np.float64)), 0.0, n - 1.0)
    lo = np.floor(pos).astype(np.int64)
    frac = pos - lo
    out = values[lo].copy()
    mix = frac > 0.0
    if mix.any():
        hi = np.minimum(lo[mix] + 1, n - 1)
        f = frac[mix, None]
        out[mix] = (values[lo[mix]] * (1.0 - f) + values[hi] * f).astype(values.dtype)
    return out


class ActionTimeline:
    """The executed history and the plan, one row per control slot from ``first``."""

    def __init__(self, dt: float) -> None:
        self.dt_ns = dt * 1e9
        self.origin_ns: int | None = None
        self.first = 0  # slot of row 0
        self.cursor = 0  # next slot to execute; earlier rows are history
        self.values = np.zeros((0, 0), np.float32)  # [N, D]
        self.label = np.zeros(0, np.int64)  # [N] which merge produced the row (metrics)
        self.count = np.zeros(0, np.int64)  # [N] predictions merged into the row (aggregation)

    # -- the grid ----------------------------------------------------------------------------
    def anchor(self, t_ns: int) -> None:
        if self.origin_ns is None:
            self.origin_ns = int(t_ns)

    def position(self, t_ns: int) -> float:
        """Fractional slot of time ``t_ns``."""
        assert self.origin_ns is not None, "anchor() the grid first"
        p = (t_ns - self.origin_ns) / self.dt_ns
        r = round(p)
        return float(r) if abs(p - r) < _SNAP else p

    def slot(self, t_ns: int) -> int:
        """The tick nearest to ``t_ns``: a timer jittering by under dt/2 still hits its slot."""
        return math.floor(self.position(t_ns) + 0.5)

    def place(self, actions: np.ndarray, stamp_ns: int, dt: float) -> tuple[int, np.ndarray]:
        """Resample a chunk's actions [H, D] onto the slots its time span covers.
        Returns (first slot, rows [M, D])."""
        p0 = self.position(stamp_ns)
        ratio = dt * 1e9 / self.dt_ns  # control slots per chunk step
        start = math.ceil(p0 - _SNAP)
        stop = math.floor(p0 + (actions.shape[0] - 1) * ratio + _SNAP) + 1
        slots = np.arange(start, stop)
        return start, interp_rows(actions, (slots - p0) / ratio)

    # -- the rows ----------------------------------------------------------------------------
    @property
    def end(self) -> int:
        return self.first + self.label.shape[0]

    @property
    def pending(self) -> int:
        return max(0, self.end - self.cursor)

    def index(self, slot: int) -> int:
        return slot - self.first

    def write(self, start: int, values: np.ndarray, label: np.ndarray, count: np.ndarray) -> None:
        """Set rows from slot ``start`` on, growing the array; a gap after the current end is
        filled with the last row (a hold: nothing else is planned there)."""
        n = values.shape[0]
        if self.label.shape[0] == 0:
            self.first = start
            self.values = np.array(values, np.float32)
            self.label = np.array(label, np.int64)
            self.count = np.array(count, np.int64)
            return
        if start < self.first:
            raise SchedulerError(f"write at slot {start} before the first kept slot {self.first}")
        grow = max(0, start + n - self.end)
        if grow:
            self.values = np.concatenate([self.values, np.repeat(self.values[-1:], grow, axis=0)])
            self.label = np.concatenate([self.label, np.repeat(self.label[-1:], grow)])
            self.count = np.concatenate([self.count, np.ones(grow, np.int64)])
        i = self.index(start)
        self.values[i : i + n] = values
        self.label[i : i + n] = label
        self.count[i : i + n] = count

    def skip_to(self, slot: int) -> int:
        """Move the cursor to ``slot``; returns the planned rows passed without being executed."""
        skipped = int(np.clip(min(slot, self.end) - self.cursor, 0, None))
        self.cursor = max(self.cursor, slot)
        return skipped

    def truncate(self) -> int:
        """Forget the plan (rows from the cursor on); returns how many rows were dropped."""
        dropped = self.pending
        if dropped:
            keep = self.index(self.cursor)
            self.values, self.label, self.count = self.values[:keep], self.label[:keep], self.count[:keep]
        return dropped

    def trim(self, keep_history: int) -> None:
        """Drop history older than ``keep_history`` slots before the cursor (bounded memory)."""
        cut = self.index(self.cursor - keep_history)
        if cut > 0:
            cut = min(cut, self.label.shape[0])
            self.values, self.label, self.count = self.values[cut:], self.label[cut:], self.count[cut:]
            self.first += cut

    def sample(self, pos0: float, n: int) -> tuple[np.ndarray, int] | None:
        """Rows at slots ``pos0 + j`` for j < n, history and plan alike; past the end they repeat
        the last row, which is what a hold would execute. Returns (rows [n, D], how many rows
        fall inside the array), or None when nothing is kept."""
        if self.label.shape[0] == 0:
            return None
        pos = pos0 - self.first + np.arange(n, dtype=np.float64)
        inside = int(np.clip(math.floor(self.label.shape[0] - 1 - (pos0 - self.first) + _SNAP) + 1, 0, n))
        return interp_rows(self.values, pos), inside
