"""synthetic_sensors_node: a stand-in robot so the closed loop runs without a simulator.

Publishes ``vla_accel_ros.sim.synthetic.moving_arm_frames`` as ``sensor_msgs/Image`` (rgb8)
on every camera topic, and joint states shaped like ALOHA's (per arm: the six joints, the
gripper joint angle and the finger positions) that follow the controller's ``joint_state``
commands exactly, a perfect position-controlled arm. Frames are precomputed and cycled so the
source costs little CPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import cycle

import numpy as np
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import Image, JointState

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.robot.config import ALOHA_START_ARM, ARM_JOINTS, RobotConfig
from vla_accel_ros.core.robot.state import GripperMap, state_to_joint_states
from vla_accel_ros.core.robot.topics import image_topic
from vla_accel_ros.ros import qos
from vla_accel_ros.ros.spin import spin_node
from vla_accel_ros.ros.conversions import header, rgb_to_image
from vla_accel_ros.ros.params import ConfigParameters
from vla_accel_ros.sim.synthetic import moving_arm_frames


@dataclass(frozen=True)
class SyntheticConfig(Config):
    camera_topics: tuple[str, ...] = param((image_topic("cam_high"),), doc="one image topic per camera", read_only=True)
    image_size: int = param(224, doc="square frame size", range=(16, 2048), read_only=True)
    camera_rate_hz: float = param(30.0, doc="frames per second per camera", range=(0.1, 1000.0), read_only=True)
    joint_rate_hz: float = param(50.0, doc="joint state rate", range=(0.1, 1000.0), read_only=True)
    frames: int = param(60, doc="precomputed frames cycled per camera", range=(1, 10_000), read_only=True)
    command_topic: str = param("joint_commands", doc="sensor_msgs/JointState commands to follow", read_only=True)
    robot: RobotConfig = param(RobotConfig(), doc="action / state layout")


class SyntheticSensorsNode(Node):
    def __init__(self, node_name: str = "synthetic_sensors_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, SyntheticConfig)
        cfg: SyntheticConfig = self.params.config
        robot = cfg.robot
        self._frames = [
            cycle(list(moving_arm_frames(cfg.frames, cfg.image_size, seed=k))) for k in range(len(cfg.camera_topics))
        ]
        self._cam_pubs = [self.create_publisher(Image, t, qos.SENSOR) for t in cfg.camera_topics]
        self._lock = threading.Lock()
        self.gripper = GripperMap(robot.gripper)
        # The arm's position in robot units (gripper joints in rad when commands are in rad).
        self._q = np.zeros(robot.dim)
        for i, name in enumerate(robot.joint_names):
            for j, v in zip(ARM_JOINTS, ALOHA_START_ARM):
                if name.endswith(j):
                    self._q[i] = v
            if name in robot.grippers:
                self._q[i] = self.gripper.normalized_to_joint(0.5) if robot.gripper.command_units == "joint" else 0.5
        self._index = {n: i for i, n in enumerate(robot.joint_names)}
        self._grippers = [self._index[n] for n in robot.grippers]
        self._js_pubs = [self.create_publisher(JointState, t, qos.RELIABLE) for t in robot.joint_state_topics]
        self.create_subscription(JointState, cfg.command_topic, self._on_command, qos.COMMANDS)
        self.frames_published = 0
        self.create_timer(1.0 / cfg.camera_rate_hz, self._publish_frames, callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(1.0 / cfg.joint_rate_hz, self._publish_joints, callback_group=MutuallyExclusiveCallbackGroup())

    def _on_command(self, msg: JointState) -> None:
        with self._lock:
            for name, pos in zip(msg.name, msg.position):
                i = self._index.get(name)
                if i is not None and np.isfinite(pos):
                    self._q[i] = pos

    def _publish_frames(self) -> None:
        now = self.get_clock().now().nanoseconds
        for pub, frames in zip(self._cam_pubs, self._frames):
            pub.publish(rgb_to_image(next(frames), now, "synthetic"))
        self.frames_published += 1

    def _publish_joints(self) -> None:
        robot = self.params.config.robot
        now = self.get_clock().now().nanoseconds
        with self._lock:
            state = self._q.copy()
        if robot.gripper.command_units == "joint":  # the arm holds gripper angles; a state is normalized
            for i in self._grippers:
                state[i] = self.gripper.joint_to_normalized(state[i])
        for (names, positions, _), pub in zip(state_to_joint_states(robot, state), self._js_pubs):
            pub.publish(JointState(header=header(now), name=names, position=positions))

    def reset_stats(self) -> None:
        self.frames_published = 0

    def summary(self) -> dict[str, object]:
        return {"frames": self.frames_published}

    def close(self) -> None:
        pass


def main(args: list[str] | None = None) -> None:
    spin_node(SyntheticSensorsNode, args)


if __name__ == "__main__":
    main()
