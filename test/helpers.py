"""Helpers the ROS tests share (importable because pytest puts test/ on sys.path)."""

from __future__ import annotations

import time


def wait_for(cond, timeout: float, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
