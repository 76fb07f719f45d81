"""Process settings every node of the package makes at start-up, before it spins: a short GIL
switch interval (the control loop's timer thread must not wait behind the inference thread) and
a fixed glibc mmap threshold (freed frames go back to the system)."""

from __future__ import annotations

import sys

# The control loop's timer thread needs the GIL within a fraction of its 20 ms period while the
# inference thread runs Python between torch ops; CPython's default switch interval (5 ms) makes
# it wait behind that thread several times per tick. 1 ms measured lower jitter (bringup, 2 cores).
GIL_SWITCH_INTERVAL_S = 0.001


def prefer_responsive_threads() -> None:
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


# glibc serves blocks of at least this size with mmap, so they go back to the system when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def return_freed_frames_to_the_system() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (its default, which glibc
    otherwise raises up to 32 MB each time a large block is freed). Without this, after the
    first frames are freed every later frame-sized buffer (decoded images, conversions, on up
    to 8 callback threads) comes from the heap arenas, and a storm of frames leaves hundreds of
    MB with the process for good (measured: a camera node 81 -> 413 MB, still 413 MB 30 s
    later). Returns whether it applied (glibc only)."""
    import ctypes  # noqa: PLC0415

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
