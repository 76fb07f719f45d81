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


def record_sim_bag(out, episodes: int, steps: int):
    """Scripted transfer_cube episodes through `vla-accel sim record`, top camera at 240x320."""
    from vla_accel_ros.cli import main

    argv = ["sim", "record", "--task", "transfer_cube", "--episodes", str(episodes), "--steps", str(steps),
            "--cameras", "top", "--height", "240", "--width", "320", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out
