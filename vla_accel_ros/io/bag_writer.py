"""Writing rosbag2 bags (MCAP or sqlite3) without a ROS installation, through ``rosbags``.

Messages are written in the robot's units and the layout of
:class:`~vla_accel_ros.core.robot.topics.TopicLayout`; :mod:`vla_accel_ros.io.sim_recorder`
writes simulator frames with it and :mod:`vla_accel_ros.io.recording` live graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.io.bag_file import BOOL, IMAGE, INT32, JOINT_STATE, STORAGES, STRING, BagFile, typestore


class BagWriter(BagFile):
    """Write a rosbag2 directory ``path`` (must not exist) in MCAP or sqlite3 storage.

    Example::

        with BagWriter("run1", storage="mcap") as bag:
            bag.write_image("/cam_high/camera/color/image_rect_raw", stamp_ns, rgb)  # [H, W, 3]
            bag.write_joint_state("/follower_left/joint_states", stamp_ns, ARM_JOINTS, q[:7])
    """

    def __init__(self, path: str | Path, storage: str = "mcap", compress: bool | None = None) -> None:
        """compress: zstd MCAP chunks (None: on for mcap, where rendered frames shrink ~30x)."""
        if storage not in STORAGES:
            raise BagError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        if compress is None:
            compress = storage == "mcap"
        if compress and storage != "mcap":
            raise BagError("compression is only offered for mcap storage (zstd chunks)")
        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path} exists already; rosbag2 bags are never overwritten")
        self.storage = storage
        self._ts = typestore()
        from rosbags.rosbag2 import CompressionFormat, CompressionMode, StoragePlugin, Writer

        plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
        # Version 9 is Jazzy's; sqlite3 bags are for Humble robots, so the older version 8
        # (the oldest rosbags writes).
        self._writer = Writer(self.path, version=9 if storage == "mcap" else 8, storage_plugin=plugin)
        if compress:
            # zstd-compressed MCAP chunks: transparent to every MCAP reader (rosbag2's too),
            # unlike rosbag2's file/message compression modes.
            self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self._handle = self._writer
        self._open_what = "cannot create bag {path}: {error}"
        self._connections: dict[str, Any] = {}
        self._types: dict[str, str] = {}

    def _write(self, topic: str, msgtype: str, stamp_ns: int, msg: Any) -> None:
        self.write_cdr(topic, msgtype, stamp_ns, self._ts.serialize_cdr(msg, msgtype))

    def write_cdr(self, topic: str, msgtype: str, stamp_ns: int, data: bytes) -> None:
        """Write one already serialized (CDR) message of a type the bag's typestore knows."""
        if not self._open:
            raise BagError(f"bag {self.path} is not open for writing")
        if stamp_ns < 0:
            raise BagError(f"{topic}: negative timestamp {stamp_ns}")
        conn = self._connections.get(topic)
        if conn is None:
            conn = self._writer.add_connection(topic, msgtype, typestore=self._ts)
            self._connections[topic] = conn
            self._types[topic] = msgtype
        elif self._types[topic] != msgtype:
            raise BagError(f"{topic} carries {self._types[topic]}, cannot also write {msgtype}")
        self._writer.write(conn, int(stamp_ns), data)

    def _header(self, stamp_ns: int, frame_id: str) -> Any:
        t = self._ts.types
        sec, nsec = divmod(int(stamp_ns), 1_000_000_000)
        return t["std_msgs/msg/Header"](
            stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec), frame_id=frame_id
        )

    def write_image(self, topic: str, stamp_ns: int, image: np.ndarray, frame_id: str = "") -> None:
        """image: [H, W, 3] uint8 RGB, written as rgb8 with step = 3 W."""
        img = np.asarray(image)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise BagError(f"{topic}: expected an [H, W, 3] uint8 image, got {img.dtype} {img.shape}")
        h, w = img.shape[:2]
        msg = self._ts.types[IMAGE](
            header=self._header(stamp_ns, frame_id),
            height=h,
            width=w,
            encoding="rgb8",
            is_bigendian=0,
            step=3 * w,
            data=np.ascontiguousarray(img).reshape(-1),
        )
        self._write(topic, IMAGE, stamp_ns, msg)

    def write_joint_state(
        self,
        topic: str,
        stamp_ns: int,
        names: Sequence[str],
        position: Sequence[float],
        velocity: Sequence[float] = (),
        effort: Sequence[float] = (),
        frame_id: str = "",
    ) -> None:
        pos = np.asarray(position, dtype=np.float64)
        vel = np.asarray(velocity, dtype=np.float64)
        eff = np.asarray(effort, dtype=np.float64)
        if pos.shape != (len(names),) or vel.size not in (0, len(names)) or eff.size not in (0, len(names)):
            sizes = f"{pos.size}/{vel.size}/{eff.size}"
            raise BagError(f"{topic}: {len(names)} names but position/velocity/effort sizes {sizes}")
        msg = self._ts.types[JOINT_STATE](
            header=self._header(stamp_ns, frame_id), name=list(names), position=pos, velocity=vel, effort=eff
        )
        self._write(topic, JOINT_STATE, stamp_ns, msg)

    def write_string(self, topic: str, stamp_ns: int, text: str) -> None:
        self._write(topic, STRING, stamp_ns, self._ts.types[STRING](data=str(text)))

    def write_int32(self, topic: str, stamp_ns: int, value: int) -> None:
        if not -(2**31) <= int(value) < 2**31:
            raise BagError(f"{topic}: {value} does not fit an Int32")
        self._write(topic, INT32, stamp_ns, self._ts.types[INT32](data=int(value)))

    def write_bool(self, topic: str, stamp_ns: int, value: bool) -> None:
        self._write(topic, BOOL, stamp_ns, self._ts.types[BOOL](data=bool(value)))
