"""Simulator frames (``vla_accel_ros.sim.Frame``) into a bag, in the ALOHA topic layout:
what ``vla-accel sim record`` writes. A simulated bag then reads back exactly like one
recorded on the robot (joint states in the robot's units, one timestamp per tick).
"""

from __future__ import annotations

from typing import Any

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.core.robot.config import RobotConfig
from vla_accel_ros.core.robot.state import state_to_joint_states
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.io.bag_file import ACTION_NAMES, robot_for
from vla_accel_ros.io.bag_writer import BagWriter


class FrameRecorder:
    """Writes simulator frames (``vla_accel_ros.sim.Frame``) in the :class:`TopicLayout`.

    Ticks are laid end to end on one clock starting at ``start_ns``: tick k of the recording
    is stamped ``start_ns + k * dt``, so episodes follow each other without gaps.
    """

    def __init__(
        self,
        writer: BagWriter,
        layout: TopicLayout | None = None,
        start_ns: int = 0,
        dt: float = 0.02,
        robot: RobotConfig | None = None,
    ) -> None:
        self.writer = writer
        self.layout = layout or TopicLayout()
        self.robot = robot or robot_for(self.layout)
        if self.robot.joint_names != ACTION_NAMES:
            raise BagError(f"the simulator's frames are {', '.join(ACTION_NAMES)}; robot.joint_names differ")
        self.start_ns = int(start_ns)
        self.dt_ns = int(round(dt * 1e9))
        self.ticks = 0
        self.episodes = 0
        self.successes = 0

    def write(self, frame: Any) -> int:
        """Write one frame; returns its stamp."""
        lay, w = self.layout, self.writer
        stamp = self.start_ns + self.ticks * self.dt_ns
        if frame.step == 0:
            w.write_int32(lay.episode_topic, stamp, frame.episode)
            w.write_string(lay.instruction_topic, stamp, frame.instruction)
        for cam, img in frame.images.items():
            ros_cam = lay.ros_camera(cam)
            w.write_image(lay.image_topic(ros_cam), stamp, img, frame_id=f"{ros_cam}_color_optical_frame")
        # The robot's own units, so a simulated bag reads back exactly like a recorded one.
        messages = state_to_joint_states(self.robot, frame.qpos, frame.qvel)
        for topic, (names, pos, vel) in zip(self.robot.joint_state_topics, messages):
            w.write_joint_state(topic, stamp, names, pos, vel, frame_id="")
        w.write_joint_state(lay.action_topic, stamp, ACTION_NAMES, frame.action)
        if frame.done:
            w.write_bool(lay.success_topic, stamp, frame.success)
            self.episodes += 1
            self.successes += int(frame.success)
        self.ticks += 1
        return stamp
