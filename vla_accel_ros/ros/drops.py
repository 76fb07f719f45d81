"""What a node refuses, counted and logged: :class:`DropCounter` (per reason, throttled) and
:func:`capped` (a text from the outside world, cut to a length a log line can hold)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from rclpy.node import Node

MAX_LOGGED_CHARS = 200  # a text from the outside world is logged at most this long


def capped(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` for a log line: at most ``limit`` characters, saying how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class DropCounter:
    """Counts dropped inputs by reason and logs each reason at most once per throttle period
    (throttled per reason, so a flood of one kind cannot hide another). Callbacks on any thread
    drop; diagnostics read :meth:`snapshot` (a copy taken under the lock, never the live counter)."""

    def __init__(self, node: Node, what: str, throttle_s: float) -> None:
        self.node, self.what, self.throttle_s = node, what, throttle_s
        self.counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def drop(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            n = self.counts[reason]
            last = self._logged.get(reason)
            log = last is None or now - last >= self.throttle_s
            if log:
                self._logged[reason] = now
        if log:
            self.node.get_logger().warning(f"dropped {self.what} ({reason}, {n} so far): {capped(detail, 3 * MAX_LOGGED_CHARS)}")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def clear(self) -> None:
        with self._lock:
            self.counts.clear()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())
