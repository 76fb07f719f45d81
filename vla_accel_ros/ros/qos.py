"""The graph's QoS contract, one place (rosetta's lesson: topics and QoS are part of the API).

| traffic                         | profile                                   |
| ------------------------------- | ----------------------------------------- |
| camera frames, joint states in  | sensor data: best effort, keep last 5     |
| observations (camera -> policy) | reliable, keep last 1 (latest-only)       |
| chunks, requests, stamps        | reliable, keep last 10                    |
| inference stats                 | reliable, transient local, keep last 10   |
| instruction, e-stop, ready      | reliable, transient local, keep last 1    |
| commands out                    | reliable, keep last 10 (driver defaults)  |

A best-effort subscriber matches a reliable publisher, so camera drivers and the Interbotix
SDK (reliable) are received either way.
"""

from __future__ import annotations

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data

SENSOR = qos_profile_sensor_data
LATEST = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE)
RELIABLE = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
LATCHED = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=1,
    reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.TRANSIENT_LOCAL,
)
# A monitor that joins late (an evaluation's watcher still discovering the policy node while the
# first chunk is served) gets the last chunks' statistics; volatile subscribers match it too.
STATS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=10,
    reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.TRANSIENT_LOCAL,
)
COMMANDS = RELIABLE
