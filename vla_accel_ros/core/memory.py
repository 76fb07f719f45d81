"""The process's allocator: large freed blocks stay in the process between inferences.

glibc hands a freed block above its mmap threshold back to the system (the threshold adapts,
but only up to 32 MiB, and the heap's free top is trimmed past 128 KiB), and the next
allocation of the same size faults every page in again. An inference allocates and frees the
same large tensors every time (three 512 px cameras: 9 MiB of float pixels, twice, then the
vision tower's activations), so the faults recur on every chunk: measured on the trained
three-camera SmolVLA, the fp32 baseline's chunk 327 -> 304 ms and the fastest mode's 100-112 ->
92-94 ms (docs/runtime.md). Raising both thresholds keeps those blocks in the heap. The same as
glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables, which act only
when set before the process starts (a launch file or a shell); this works from a running one.
"""

from __future__ import annotations

import ctypes
import functools
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_INT_MAX = 2**31 - 1
_OLD_GLIBC_MMAP_MAX = 32 << 20  # glibc < 2.35 refuses a larger mmap threshold


@functools.cache
def keep_freed_memory(mb: int) -> bool:
    """Blocks up to ``mb`` MiB (up to 32 MiB on glibc < 2.35) stay mapped when freed, and up to
    twice that of free heap top; returns whether the allocator took both (False: ``mb`` is 0,
    or not glibc: nothing changed). Once per value: the setting is process-wide."""
    if mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library; glibc only (musl has none)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    size = min(mb << 20, _INT_MAX)
    mmap = mallopt(_M_MMAP_THRESHOLD, size) == 1 or mallopt(_M_MMAP_THRESHOLD, min(size, _OLD_GLIBC_MMAP_MAX)) == 1
    trim = mallopt(_M_TRIM_THRESHOLD, min(2 * size, _INT_MAX)) == 1
    return mmap and trim
