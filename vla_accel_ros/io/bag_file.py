"""What the bag reader and writer share: storages, message type names, the ``rosbags``
typestore, the errors it raises, and open/close plumbing.

``rosbags`` is imported on first use, so importing this module costs NumPy only.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.core.robot import config
from vla_accel_ros.core.robot.config import RobotConfig
from vla_accel_ros.core.robot.topics import TopicLayout

if TYPE_CHECKING:
    from typing import Self  # Python >= 3.11; Humble runs 3.10

STORAGES = ("mcap", "sqlite3")
ARM_JOINTS = (*config.ARM_JOINTS, "gripper")  # one arm's joint_states names, gripper last
ACTION_NAMES = config.ALOHA_JOINT_NAMES

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED = "sensor_msgs/msg/CompressedImage"
JOINT_STATE = "sensor_msgs/msg/JointState"
STRING = "std_msgs/msg/String"
INT32 = "std_msgs/msg/Int32"
BOOL = "std_msgs/msg/Bool"


def typestore() -> Any:
    try:
        from rosbags.typesys import Stores, get_typestore
    except ImportError as e:
        raise BagError(f"bags need the `rosbags` package ({e}); pip install -r requirements-sim.txt") from e
    # Jazzy's definitions; sensor_msgs/std_msgs are unchanged since Humble, so bags written
    # here read on either, and Humble bags read here.
    return get_typestore(Stores.ROS2_JAZZY)


def rosbag_errors() -> tuple[type[BaseException], ...]:
    """What rosbags raises for unreadable or malformed input (re-raised as BagError)."""
    from rosbags.rosbag2 import ReaderError, WriterError
    from rosbags.serde import SerdeError

    return (ReaderError, WriterError, SerdeError, OSError, struct.error, ValueError, KeyError)


class BagFile:
    """Open/close and context-manager plumbing shared by the reader and the writer; the
    subclass sets ``path``, ``_handle`` (the rosbags Reader or Writer) and ``_open_what``."""

    path: Path
    _handle: Any
    _open_what: str
    _open = False

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        try:
            self._handle.open()
        except rosbag_errors() as e:
            raise BagError(self._open_what.format(path=self.path, error=e)) from e
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._handle.close()


def robot_for(layout: TopicLayout) -> RobotConfig:
    """The ALOHA robot description with the layout's joint-state topics."""
    return RobotConfig(joint_state_topics=layout.joint_state_topics)


def bag_size_bytes(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
