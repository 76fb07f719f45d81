"""The process's allocator: large freed blocks stay in the process between inferences.

glibc hands a freed block above its mmap threshold back to the system (the threshold adapts,
but only up to 32 MiB, and the heap's free top is trimmed past 128 KiB), and the next
allocation of the same size faults every page in again. An inference allocates and frees the
same large tensors every time (three 512 px cameras: 9 MiB of float pixels, twice, then the
vision tower's activations), so the faults recur on every chunk: measured on the trained
three-camera SmolVLA, 11 of 122 ms (preprocessing 15.8 -> 4.9 ms; the fp32 baseline's vision
258 -> 243 ms). Raising both thresholds keeps those blocks in the heap. The same as glibc's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables, which act only when
set before the process starts (a launch file or a shell); this works from a running one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory(mb: int) -> bool:
    """Blocks up to ``mb`` MiB stay mapped when freed (and up to twice that of free heap top);
    returns whether the allocator took it (False: ``mb`` is 0, or not glibc: nothing changed)."""
    if mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt  # glibc only (musl has none)
    except (OSError, AttributeError):
        return False
    size = mb << 20
    return mallopt(_M_MMAP_THRESHOLD, size) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * size) == 1
