"""Recording a live graph into a rosbag2 bag, the half without ROS (``vla_accel_ros.ros.recorder``
subscribes and hands over serialized messages).

Messages are stored as they travelled (CDR bytes), so any type the bag's typestore knows
records without a conversion: the standard ROS 2 messages, this package's own (registered
from ``msg/*.msg``) and any package whose ``share/<pkg>/msg`` is found.

Bag timestamps: a message with a ``std_msgs/Header`` first is stamped with its header stamp
(every message of one simulated tick then shares one timestamp, as in ``vla-accel sim
record``, which is how :meth:`BagReader.samples` groups them); others with the receive time,
except a latched message published before its subscription existed: it is dated when it was
published (:class:`ClockReadings`), so the frames recorded meanwhile carry it. Messages arrive
slightly out of stamp order (different topics, threads), so a short reorder window writes them
sorted.
"""

from __future__ import annotations

import heapq
import os
import re
import struct
import sys
from collections import deque
from pathlib import Path
from typing import Any, Iterable

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.io.bag_writer import BagWriter

_ENCAPSULATION = {b"\x00\x01": "<", b"\x00\x00": ">"}  # CDR little / big endian (plain CDR)


def header_stamp_ns(cdr: bytes) -> int:
    """The header stamp of a serialized message whose first field is a std_msgs/Header
    (``builtin_interfaces/Time``: int32 sec, uint32 nanosec right after the 4-byte CDR
    encapsulation); 0 when the bytes are too short or not plain CDR."""
    if len(cdr) < 12:
        return 0
    order = _ENCAPSULATION.get(bytes(cdr[:2]))
    if order is None:
        return 0
    sec, nsec = struct.unpack_from(f"{order}iI", cdr, 4)
    return max(0, sec * 1_000_000_000 + nsec)


class ReorderBuffer:
    """Hands items back in stamp order once they are ``window_ns`` older than the newest stamp
    seen. Equal stamps go by ``rank`` (lower first), then arrival: an episode marker and its
    instruction precede the data of the same tick, as ``vla-accel sim record`` writes them.
    At most ``max_items`` wait (stamps that stop advancing, e.g. a paused sim clock, would
    otherwise keep everything): beyond that the oldest leave early, still in order."""

    def __init__(self, window_ns: int, max_items: int = 10_000) -> None:
        if max_items < 1:
            raise ValueError(f"max_items={max_items} must be >= 1")
        self.window_ns, self.max_items = int(window_ns), int(max_items)
        self._heap: list[tuple[int, int, int, Any]] = []
        self._seq = 0
        self._newest = -1
        self.overflowed = 0  # items handed back early because the buffer was full

    def push(self, stamp_ns: int, item: Any, rank: int = 0) -> list[tuple[int, Any]]:
        heapq.heappush(self._heap, (int(stamp_ns), int(rank), self._seq, item))
        self._seq += 1
        self._newest = max(self._newest, int(stamp_ns))
        out = []
        while self._heap and (self._heap[0][0] <= self._newest - self.window_ns or len(self._heap) > self.max_items):
            if self._heap[0][0] > self._newest - self.window_ns:
                self.overflowed += 1
            stamp, _, _, it = heapq.heappop(self._heap)
            out.append((stamp, it))
        return out

    def flush(self) -> list[tuple[int, Any]]:
        out = [(h[0], h[3]) for h in sorted(self._heap, key=lambda h: h[:3])]
        self._heap.clear()
        return out

    def __len__(self) -> int:
        return len(self._heap)


class ClockReadings:
    """The recorder's clock read against the wall clock as messages arrive, to date a message
    on that clock at the wall time it was published (its DDS source timestamp).

    Why: a transient-local subscription created after its publisher spoke gets the latched
    message (an episode marker, an instruction) from the publisher's history. Dated on
    arrival, it would follow the frames recorded meanwhile, which then carry no instruction.
    ``at`` answers the reading at or before a wall time (at most ``every_ns`` early), None
    before the first reading (older than the recording). Readings older than ``keep_ns`` are
    forgotten (a topic is subscribed within a discovery period of appearing, so its history is
    younger than that); an older wall time then gets the oldest reading kept."""

    def __init__(self, keep_ns: int = 30_000_000_000, every_ns: int = 5_000_000) -> None:
        self.keep_ns, self.every_ns = int(keep_ns), int(every_ns)
        self._readings: deque[tuple[int, int]] = deque()
        self._forgot = False

    def note(self, wall_ns: int, clock_ns: int) -> None:
        if self._readings and wall_ns - self._readings[-1][0] < self.every_ns:
            return
        self._readings.append((int(wall_ns), int(clock_ns)))
        while self._readings and self._readings[0][0] < wall_ns - self.keep_ns:
            self._readings.popleft()
            self._forgot = True

    def at(self, wall_ns: int) -> int | None:
        found = self._readings[0][1] if self._forgot and self._readings else None
        for wall, clock in self._readings:  # only for latched messages that came late: rare
            if wall > wall_ns:
                break
            found = clock
        return found

    def clear(self) -> None:
        self._readings.clear()
        self._forgot = False


def _msg_dirs(package: str) -> Iterable[Path]:
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory  # noqa: PLC0415

        try:
            yield Path(get_package_share_directory(package)) / "msg"
        except (PackageNotFoundError, OSError, ValueError):  # OSError: no AMENT_PREFIX_PATH (a plain venv)
            pass
    except ImportError:
        pass
    for prefix in dict.fromkeys([os.environ.get("VIRTUAL_ENV") or "", sys.prefix]):
        if prefix:
            yield Path(prefix) / "share" / package / "msg"
    if package == "vla_accel_ros":  # the source tree
        yield Path(__file__).resolve().parents[2] / "msg"


def find_msg_definition(msgtype: str) -> str | None:
    """The ``.msg`` text of ``pkg/msg/Type`` from an install or this source tree, else None."""
    parts = msgtype.split("/")
    if len(parts) != 3 or parts[1] != "msg":
        return None
    package, _, name = parts
    for d in _msg_dirs(package):
        f = d / f"{name}.msg"
        if f.is_file():
            return f.read_text(encoding="utf-8")
    return None


class CdrBagWriter(BagWriter):
    """A :class:`BagWriter` that also writes already serialized messages of any known type."""

    def knows(self, msgtype: str) -> bool:
        """Whether messages of ``msgtype`` can be written; registers definitions it finds."""
        from rosbags.typesys import TypesysError, get_types_from_msg  # noqa: PLC0415 - BagWriter imported rosbags

        for _ in range(32):  # a type and the custom types it uses, one per round
            try:
                self._ts.generate_msgdef(msgtype, ros_version=2)
                return True
            except TypesysError as e:  # "Type 'pkg/msg/T' is unknown.": the first type it lacks
                found = re.search(r"'([^']+/msg/[^']+)'", str(e))
                if found is None:
                    raise BagError(f"cannot record {msgtype}: {e}") from e
                missing = found.group(1)
            text = find_msg_definition(missing)
            if text is None:
                return False
            self._ts.register(get_types_from_msg(text, missing))
        return False

    def has_header(self, msgtype: str) -> bool:
        """Whether the type's first field is a std_msgs/Header (its stamp then dates the message)."""
        fields = self._ts.fielddefs[msgtype][1]
        return bool(fields) and fields[0][1][-1] == "std_msgs/msg/Header"
