"""recorder: selected topics of a live graph into a rosbag2 bag (MCAP or sqlite3), no rosbag2 needed.

What ``ros2 bag record -s mcap`` does, for machines with rclpy but no rosbag2 (the pip ROS
wheels): the node looks for its topics on the graph every ``discovery_period_s``, subscribes
to each one as it appears with a QoS its publishers accept (reliable / transient local only
when every publisher offers it, as rosbag2 chooses), and stores the serialized messages as
they arrived through :class:`~vla_accel_ros.io.recording.CdrBagWriter`. The default
topic list (:func:`vla_accel_ros.ros.graph.record_topics`) is the one ``aloha.launch.py
record:=true`` records, and includes the ``vla-accel sim record`` layout, so ``vla-accel
replay`` reads the result.

Clock: ``clock: auto`` switches the node to sim time as soon as ``/clock`` is on the graph,
so header-less messages (``/episode``, ``/instruction``) are dated on the same clock as the
stamped ones. A latched message published before its subscription existed is dated when it
was published (its DDS source timestamp, read on that clock), or at the recording's start when
it is older than the recording, so the frames recorded in the meantime carry it.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.io.bag_file import STORAGES
from vla_accel_ros.io.recording import CdrBagWriter, ClockReadings, ReorderBuffer, header_stamp_ns
from vla_accel_ros.ros.spin import spin_node
from vla_accel_ros.ros.params import ConfigParameters


@dataclass(frozen=True)
class RecorderConfig(Config):
    out: str = param("", doc="bag directory to create (must not exist)", read_only=True)
    topics: tuple[str, ...] = param((), doc="topics to record (relative names live under the node's namespace)", read_only=True)
    storage: str = param("mcap", doc="mcap, or sqlite3 for Humble tools", choices=STORAGES, read_only=True)
    compress: bool = param(True, doc="zstd-compressed MCAP chunks (mcap only)", read_only=True)
    stamps: str = param(
        "header", doc="bag timestamps: header (a message's header stamp when it has one, else the receive time) or receive; "
        "either way a latched message received from its publisher's history is dated when it was published",
        choices=("header", "receive"), read_only=True,
    )  # fmt: skip
    clock: str = param(
        "auto", doc="receive times on sim time (sim), the system clock (wall), or sim time once /clock appears (auto)",
        choices=("auto", "sim", "wall"), read_only=True,
    )  # fmt: skip
    reorder_window_s: float = param(
        0.5, doc="messages are written in timestamp order within this window", range=(0.0, 60.0), read_only=True
    )
    reorder_max_messages: int = param(
        10_000, doc="at most this many messages wait in the reorder window (then the oldest are written early)",
        range=(1, 10_000_000), read_only=True,
    )  # fmt: skip
    discovery_period_s: float = param(0.5, doc="how often the graph is searched for topics not found yet", range=(0.01, 60.0), read_only=True)
    depth: int = param(100, doc="subscription queue depth per topic", range=(1, 100_000), read_only=True)

    def validate(self) -> None:
        if self.compress and self.storage != "mcap":
            raise ConfigError("RecorderConfig.compress is only offered for mcap storage")


def _message_class(msgtype: str):
    pkg, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


class RecorderNode(Node):
    def __init__(self, node_name: str = "vla_recorder", *, on_built: Callable[[RecorderNode], None] | None = None, **kwargs) -> None:
        """``on_built``: called with the finished node before the constructor returns, so a
        caller holds it (to close its bag) even if a Ctrl-C lands before the assignment."""
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, RecorderConfig)
        cfg: RecorderConfig = self.params.config
        if not cfg.out:
            raise ConfigError("parameter 'out' is empty: give the bag directory to create")
        if not cfg.topics:
            raise ConfigError("parameter 'topics' is empty: nothing to record")
        lay = TopicLayout()
        ns = self.get_namespace().rstrip("/")
        # Within a stamp: episode marker, instruction, data; the graph publishes these topics
        # absolute or under its namespace, so both spellings rank.
        self._rank: dict[str, int] = {}
        for topic, rank in ((lay.episode_topic, -2), (lay.instruction_topic, -1)):
            self._rank[topic] = self._rank[ns + topic] = rank
        self.wanted = list(dict.fromkeys(t if t.startswith("/") else f"{ns}/{t}" for t in cfg.topics))
        self.writer = CdrBagWriter(cfg.out, storage=cfg.storage, compress=cfg.compress)
        # A Ctrl-C (or any error) before the constructor returns leaves no node for the caller
        # to close: the bag is closed here, so it is never left without its metadata.
        try:
            self.writer.open()
            self._lock = threading.Lock()  # the writer and the buffer (callbacks vs close)
            self._buffer = ReorderBuffer(int(cfg.reorder_window_s * 1e9), cfg.reorder_max_messages)
            self._closed = False
            self.counts: Counter[str] = Counter()
            self.types: dict[str, str] = {}  # topic -> msgtype, once subscribed
            self.unrecordable: dict[str, str] = {}  # topic -> why not
            self._subs = []
            self._subscribed_ns: dict[str, int] = {}  # topic -> wall time its subscription was made
            self._readings = ClockReadings()
            self._start: int | None = None  # the recording's start on the bag's clock
            self._sim_clock = cfg.clock == "sim"
            if self._sim_clock:
                self.set_parameters([Parameter("use_sim_time", value=True)])
            self._group = MutuallyExclusiveCallbackGroup()
            wall = Clock(clock_type=ClockType.STEADY_TIME)  # discovery must not wait for sim time
            self.create_timer(cfg.discovery_period_s, self._discover, callback_group=MutuallyExclusiveCallbackGroup(), clock=wall)
            self.get_logger().info(f"recording {len(self.wanted)} topics to {cfg.out} ({cfg.storage})")
            if on_built is not None:
                on_built(self)
        except BaseException:
            self.writer.close()
            raise

    # -- discovery ----------------------------------------------------------------------------------
    def _discover(self) -> None:
        cfg: RecorderConfig = self.params.config
        available = dict(self.get_topic_names_and_types())
        if cfg.clock == "auto" and not self._sim_clock and "/clock" in available:
            self._sim_clock = True
            self.set_parameters([Parameter("use_sim_time", value=True)])
            with self._lock:  # readings and start were on the wall clock
                self._readings.clear()
                self._start = None
            self.get_logger().info("/clock is on the graph: receive times are sim time")
        for topic in self.wanted:
            if topic in self.types or topic in self.unrecordable or topic not in available:
                continue
            msgtype = available[topic][0]
            if not self.writer.knows(msgtype):
                self.unrecordable[topic] = f"no message definition for {msgtype}"
                self.get_logger().warning(f"not recording {topic}: no message definition for {msgtype} found")
                continue
            qos = self._qos(topic)
            if qos is None:
                continue  # publishers not visible yet: next round
            try:
                cls = _message_class(msgtype)
            except (ImportError, AttributeError, ValueError) as e:
                self.unrecordable[topic] = f"{msgtype} does not import here ({e})"
                self.get_logger().warning(f"not recording {topic}: {self.unrecordable[topic]}")
                continue
            stamped = cfg.stamps == "header" and self.writer.has_header(msgtype)
            self._subscribed_ns[topic] = time.time_ns()
            self._subs.append(
                self.create_subscription(
                    cls, topic, partial(self._on_message, topic, msgtype, stamped), qos, raw=True, callback_group=self._group
                )
            )
            self.types[topic] = msgtype

    def _qos(self, topic: str) -> QoSProfile | None:
        """rosbag2's rule: reliable / transient local only if every publisher offers it, so the
        subscription matches them all (and still receives a latched message published earlier)."""
        pubs = self.get_publishers_info_by_topic(topic)
        if not pubs:
            return None
        reliable = all(p.qos_profile.reliability == ReliabilityPolicy.RELIABLE for p in pubs)
        latched = all(p.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL for p in pubs)
        return QoSProfile(
            history=HistoryPolicy.KEEP_LAST,
            depth=self.params.config.depth,
            reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
            durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE,
        )

    # -- messages -----------------------------------------------------------------------------------
    def _on_message(self, topic: str, msgtype: str, stamped: bool, data: bytes, info: dict) -> None:
        now = self.get_clock().now().nanoseconds
        stamp = header_stamp_ns(data) if stamped else 0
        with self._lock:
            if self._closed:
                return
            self._readings.note(time.time_ns(), now)
            if self._start is None:  # a window back: messages arrive up to that late
                self._start = max(0, (stamp or now) - self._buffer.window_ns)
            if not stamp:
                stamp = now
                published = int(info.get("source_timestamp", 0))
                # From the publisher's history. The source time is the publisher's wall clock:
                # across machines it is only as good as their clock sync (NTP: a few ms).
                if 0 < published < self._subscribed_ns.get(topic, 0):
                    reading = self._readings.at(published)
                    stamp = self._start if reading is None else min(now, reading)
            for s, (t, mt, d) in self._buffer.push(stamp, (topic, msgtype, data), self._rank.get(topic, 0)):
                self._write(t, mt, s, d)

    def _write(self, topic: str, msgtype: str, stamp: int, data: bytes) -> None:
        self.writer.write_cdr(topic, msgtype, stamp, data)
        self.counts[topic] += 1

    def missing(self) -> list[str]:
        """Wanted topics nothing was recorded from."""
        return [t for t in self.wanted if not self.counts[t]]

    def summary(self) -> dict[str, object]:
        with self._lock:
            total = sum(self.counts.values()) + len(self._buffer)
        return {"bag": str(self.writer.path), "messages": total, "topics": len(self.types), "missing": len(self.missing())}

    def reset_stats(self) -> None:
        pass  # a recording keeps everything it recorded

    def close(self) -> None:
        """Write what is buffered and close the bag (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s, (t, mt, d) in self._buffer.flush():
                self._write(t, mt, s, d)
            self.writer.close()


def main(args: list[str] | None = None) -> None:
    spin_node(RecorderNode, args)


if __name__ == "__main__":
    main()
