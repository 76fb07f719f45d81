"""Action-chunk scheduling: turn chunks predicted from past observations into one fresh action
per control tick. ROS-free; the action-controller node drives :class:`ChunkScheduler` from its
timer with its own clock.

Modules: ``queue`` (time-indexed plan on the tick grid), ``aggregation`` (overlap merging),
``rtc`` (Real-Time Chunking guidance; flow policies import :func:`prefix_weights`),
``latency``, ``metrics``, ``scheduler``. Scheduling knows nothing of the robot: the action
controller's tick, which joins the scheduler with the robot's safety filter and motion switch,
is :mod:`vla_accel_ros.core.robot.control_loop`. The deterministic closed loop of
``vla-accel bench scheduler`` is ``vla_accel_ros.bench.scheduler_sim``.
"""

from vla_accel_ros.core.scheduling.aggregation import aggregate
from vla_accel_ros.core.scheduling.config import AGGREGATIONS, SchedulerConfig
from vla_accel_ros.core.scheduling.metrics import SchedulerMetrics
from vla_accel_ros.core.errors import SchedulerError
from vla_accel_ros.core.scheduling.rtc import delay_steps, prefix_weights
from vla_accel_ros.core.scheduling.scheduler import ChunkScheduler, InferenceRequest, StepResult

__all__ = [
    "AGGREGATIONS",
    "ChunkScheduler",
    "InferenceRequest",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerMetrics",
    "StepResult",
    "aggregate",
    "delay_steps",
    "prefix_weights",
]
