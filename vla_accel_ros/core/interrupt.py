"""Stopping an inference between layers.

A node that is asked to end (Ctrl-C, ``ros2 launch`` sending SIGINT) must not wait for a whole
inference: on a loaded machine one can take seconds, longer than launch waits before it escalates
to SIGTERM. The thread that runs an inference opens :func:`interruptible` with an event; once the
event is set, the next :func:`check` on that thread, called by the engine and the vision encoder
between two layers, raises :class:`Interrupted`. Outside :func:`interruptible`, :func:`check` does
nothing. An interrupted forward leaves the model's caches partly written, as any forward that
raises part-way (the engine counts the write first): the caller is ending, or resets first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from vla_accel_ros.core.errors import VlaAccelError


class Interrupted(VlaAccelError):
    """The caller stopped the inference between two layers; it has no result."""


_local = threading.local()


@contextlib.contextmanager
def interruptible(stop: threading.Event) -> Iterator[None]:
    """Within, on this thread: :func:`check` raises :class:`Interrupted` once ``stop`` is set."""
    outer = getattr(_local, "stop", None)
    _local.stop = stop
    try:
        yield
    finally:
        _local.stop = outer


def check() -> None:
    """Raise :class:`Interrupted` when this thread's inference was asked to stop."""
    stop = getattr(_local, "stop", None)
    if stop is not None and stop.is_set():
        raise Interrupted("the inference was stopped between two layers")
