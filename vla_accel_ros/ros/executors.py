"""Executors built and shut down safely: :func:`make_executor` with the stop signals held back
while rclpy builds it, :func:`drain_executor` that lets the callbacks already running finish
before the nodes are destroyed."""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor


def drain_executor(executor: MultiThreadedExecutor, timeout_s: float | None = None) -> list[str]:
    """Shut ``executor`` down after it stopped spinning, so nodes can then be destroyed with no
    callback running. Callbacks already handed to its thread pool finish first: each one
    triggers the executor's guard condition when it ends, and rclpy 7's ``shutdown`` destroys
    that guard without waiting for them (its wait is skipped once the shutdown flag is set), so a
    late callback would raise into a future nobody reads ("exception was never retrieved").

    ``timeout_s`` bounds the wait for the pool's threads (None: as long as they take). Returns
    what still runs then, one line per thread (its innermost frames), or [] when every callback
    finished. A thread left running is not waited for here, but the interpreter still joins it
    at exit (concurrent.futures' atexit hook): the caller decides what to do about it."""
    pool = getattr(executor, "_executor", None)  # MultiThreadedExecutor's ThreadPoolExecutor
    running: list[str] = []
    if pool is not None and hasattr(pool, "shutdown"):
        threads = list(getattr(pool, "_threads", ()))
        pool.shutdown(wait=timeout_s is None)
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            running = [_where(t) for t in threads if t.is_alive()]
    executor.shutdown(timeout_sec=0.0 if running else (5.0 if timeout_s is None else timeout_s))
    return running


def _where(thread: threading.Thread, depth: int = 4) -> str:
    """``thread``'s name and innermost ``depth`` frames, innermost first, on one line."""
    frame = sys._current_frames().get(thread.ident or -1)
    stack = traceback.extract_stack(frame)[-depth:] if frame is not None else []
    return f"{thread.name}: " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))


def make_executor(threads: int = 1, context=None) -> SingleThreadedExecutor | MultiThreadedExecutor:
    """An executor built with SIGINT/SIGTERM held back: a Ctrl-C inside rclpy's constructor
    would leave it half-built, and its ``__del__`` then prints a traceback."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if threads > 1:
            return MultiThreadedExecutor(num_threads=threads, context=context)
        return SingleThreadedExecutor(context=context)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
