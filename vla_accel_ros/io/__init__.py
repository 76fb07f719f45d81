"""File formats without ROS: rosbag2 bags (MCAP, sqlite3) through ``rosbags``."""

from vla_accel_ros.io.bags import (
    ACTION_NAMES,
    ARM_JOINTS,
    STORAGES,
    BagLayout,
    BagMessage,
    BagReader,
    BagSample,
    BagWriter,
    EpisodeSummary,
    FrameRecorder,
    JointStateMsg,
    SyncConfig,
    TopicSummary,
    bag_size_bytes,
    image_to_rgb,
)

__all__ = [
    "ACTION_NAMES",
    "ARM_JOINTS",
    "STORAGES",
    "BagLayout",
    "BagMessage",
    "BagReader",
    "BagSample",
    "BagWriter",
    "EpisodeSummary",
    "FrameRecorder",
    "JointStateMsg",
    "SyncConfig",
    "TopicSummary",
    "bag_size_bytes",
    "image_to_rgb",
]
