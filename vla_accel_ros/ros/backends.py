"""How commands leave the action controller, chosen by ``command.backend``.

Every backend takes one filtered action [D] per control tick (robot units, grippers
normalized) and publishes it in its robot's message types:

| backend               | messages                                                   | topic(s)                                   |
| --------------------- | ---------------------------------------------------------- | ------------------------------------------ |
| joint_state           | sensor_msgs/JointState (names = robot.joint_names)         | command.topic                              |
| float64_multi_array   | std_msgs/Float64MultiArray (ros2_control forward command)  | command.topic                              |
| joint_trajectory      | trajectory_msgs/JointTrajectory, one point one period out  | command.topic                              |
| interbotix            | interbotix_xs_msgs/JointGroupCommand (arm) + JointSingleCommand (gripper) | /<ns>/commands/joint_group, joint_single |
| ee_pose / ee_twist    | geometry_msgs/PoseStamped / TwistStamped per arm; grippers as JointState | command.ee_topics, command.topic |

Gripper dimensions are converted to the gripper joint angle when
``robot.gripper.command_units`` is ``joint`` (ALOHA: open 1.6214, closed 0.6197 rad).
"""

from __future__ import annotations

import math

import numpy as np
from builtin_interfaces.msg import Duration
from geometry_msgs.msg import PoseStamped, TwistStamped
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import ControllerConfig
from vla_accel_ros.core.robot.state import arm_slices, to_robot_units
from vla_accel_ros.ros import qos
from vla_accel_ros.ros.conversions import header


class Backend:
    def __init__(self, node: Node, cfg: ControllerConfig) -> None:
        self.node, self.cfg = node, cfg
        self.robot = cfg.robot
        self.published = 0

    def publish(self, action: np.ndarray, stamp_ns: int) -> None:
        self._publish(to_robot_units(action, self.robot), stamp_ns)
        self.published += 1

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        raise NotImplementedError

    def topics(self) -> list[str]:
        raise NotImplementedError


class JointStateBackend(Backend):
    def __init__(self, node: Node, cfg: ControllerConfig) -> None:
        super().__init__(node, cfg)
        self.pub = node.create_publisher(JointState, cfg.command.topic, qos.COMMANDS)

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        msg = JointState(header=header(stamp_ns))
        msg.name = list(self.robot.joint_names)
        msg.position = [float(x) for x in cmd]
        self.pub.publish(msg)

    def topics(self) -> list[str]:
        return [self.pub.topic_name]


class Float64MultiArrayBackend(Backend):
    def __init__(self, node: Node, cfg: ControllerConfig) -> None:
        super().__init__(node, cfg)
        self.pub = node.create_publisher(Float64MultiArray, cfg.command.topic, qos.COMMANDS)

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        msg = Float64MultiArray()
        msg.data = [float(x) for x in cmd]
        self.pub.publish(msg)

    def topics(self) -> list[str]:
        return [self.pub.topic_name]


class JointTrajectoryBackend(Backend):
    def __init__(self, node: Node, cfg: ControllerConfig) -> None:
        super().__init__(node, cfg)
        self.pub = node.create_publisher(JointTrajectory, cfg.command.topic, qos.COMMANDS)
        ahead = cfg.command.trajectory_lookahead_s or cfg.scheduler.dt
        self.ahead = Duration(sec=int(ahead), nanosec=int(round((ahead - int(ahead)) * 1e9)))

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        # header.stamp 0: "start now" for joint_trajectory_controller.
        msg = JointTrajectory()
        msg.joint_names = list(self.robot.joint_names)
        msg.points = [JointTrajectoryPoint(positions=[float(x) for x in cmd], time_from_start=self.ahead)]
        self.pub.publish(msg)

    def topics(self) -> list[str]:
        return [self.pub.topic_name]


def interbotix_messages() -> tuple[type, type]:
    """(JointGroupCommand, JointSingleCommand) of interbotix_xs_msgs, or a ConfigError saying
    how to get them."""
    try:
        from interbotix_xs_msgs.msg import JointGroupCommand, JointSingleCommand  # noqa: PLC0415
    except ImportError as e:
        raise ConfigError(
            "command.backend=interbotix needs the interbotix_xs_msgs package (ros-<distro>-interbotix-xs-msgs "
            "or the interbotix_ros_core workspace); it is not installed here. Choose joint_state, "
            "float64_multi_array or joint_trajectory, or install it"
        ) from e
    return JointGroupCommand, JointSingleCommand


def interbotix_topics(namespace: str) -> tuple[str, str]:
    """The interbotix_xs_sdk command topics of one arm: (joint_group, joint_single). A relative
    ``namespace`` (``follower_left``) lies under the node's namespace, as the driver's does when
    it is launched in the robot's namespace; ``/follower_left`` names the absolute one."""
    base = namespace.rstrip("/")
    return f"{base}/commands/joint_group", f"{base}/commands/joint_single"


class InterbotixBackend(Backend):
    """ALOHA's own driver (interbotix_xs_sdk): per arm, the six arm joints as one
    JointGroupCommand (name ``command.arm_group``) and the gripper as a JointSingleCommand
    (name ``robot.gripper.gripper_joint``)."""

    def __init__(self, node: Node, cfg: ControllerConfig) -> None:
        super().__init__(node, cfg)
        JointGroupCommand, JointSingleCommand = interbotix_messages()
        self._group, self._single = JointGroupCommand, JointSingleCommand
        grippers = set(self.robot.grippers)
        self.arms = []
        for ns, idx in zip(cfg.command.interbotix_namespaces, arm_slices(self.robot)):
            arm_idx = [i for i in idx if self.robot.joint_names[i] not in grippers]
            grip = [i for i in idx if self.robot.joint_names[i] in grippers]
            group_topic, single_topic = interbotix_topics(ns)
            self.arms.append(
                (
                    arm_idx,
                    grip[0] if grip else None,
                    node.create_publisher(JointGroupCommand, group_topic, qos.COMMANDS),
                    node.create_publisher(JointSingleCommand, single_topic, qos.COMMANDS),
                )
            )

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        for arm_idx, grip, group_pub, single_pub in self.arms:
            group_pub.publish(self._group(name=self.cfg.command.arm_group, cmd=[float(cmd[i]) for i in arm_idx]))
            if grip is not None:
                single_pub.publish(self._single(name=self.robot.gripper.gripper_joint, cmd=float(cmd[grip])))

    def topics(self) -> list[str]:
        return [p.topic_name for a in self.arms for p in a[2:]]


def _quaternion(roll: float, pitch: float, yaw: float) -> tuple[float, float, float, float]:
    cr, sr = math.cos(roll / 2), math.sin(roll / 2)
    cp, sp = math.cos(pitch / 2), math.sin(pitch / 2)
    cy, sy = math.cos(yaw / 2), math.sin(yaw / 2)
    return (sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy, cr * cp * sy - sr * sp * cy, cr * cp * cy + sr * sp * sy)


class EndEffectorBackend(Backend):
    """Policies that act in end-effector space: per arm ``[x, y, z, roll, pitch, yaw]`` (a pose
    in ``command.ee_frame_ids``) or ``[vx, vy, vz, wx, wy, wz]`` (a twist), then the gripper."""

    def __init__(self, node: Node, cfg: ControllerConfig, *, twist: bool) -> None:
        super().__init__(node, cfg)
        self.twist = twist
        grippers = set(self.robot.grippers)
        self.arms = []
        for topic, frame, idx in zip(cfg.command.ee_topics, cfg.command.ee_frame_ids, arm_slices(self.robot)):
            body = [i for i in idx if self.robot.joint_names[i] not in grippers]
            if len(body) != 6:
                raise ConfigError(f"command.backend=ee_{'twist' if twist else 'pose'} needs 6 non-gripper dims per arm, got {len(body)}")
            self.arms.append((body, frame, node.create_publisher(TwistStamped if twist else PoseStamped, topic, qos.COMMANDS)))
        self.grip_idx = [self.robot.joint_names.index(g) for g in self.robot.grippers]
        self.grip_pub = node.create_publisher(JointState, cfg.command.topic, qos.COMMANDS) if self.grip_idx else None

    def _publish(self, cmd: np.ndarray, stamp_ns: int) -> None:
        for body, frame, pub in self.arms:
            v = [float(cmd[i]) for i in body]
            if self.twist:
                msg = TwistStamped(header=header(stamp_ns, frame))
                msg.twist.linear.x, msg.twist.linear.y, msg.twist.linear.z = v[:3]
                msg.twist.angular.x, msg.twist.angular.y, msg.twist.angular.z = v[3:]
            else:
                msg = PoseStamped(header=header(stamp_ns, frame))
                msg.pose.position.x, msg.pose.position.y, msg.pose.position.z = v[:3]
                q = _quaternion(*v[3:])
                msg.pose.orientation.x, msg.pose.orientation.y, msg.pose.orientation.z, msg.pose.orientation.w = q
            pub.publish(msg)
        if self.grip_pub is not None:
            msg = JointState(header=header(stamp_ns))
            msg.name = list(self.robot.grippers)
            msg.position = [float(cmd[i]) for i in self.grip_idx]
            self.grip_pub.publish(msg)

    def topics(self) -> list[str]:
        return [a[2].topic_name for a in self.arms] + ([self.grip_pub.topic_name] if self.grip_pub else [])


def make_backend(node: Node, cfg: ControllerConfig) -> Backend:
    b = cfg.command.backend
    if b == "joint_state":
        return JointStateBackend(node, cfg)
    if b == "float64_multi_array":
        return Float64MultiArrayBackend(node, cfg)
    if b == "joint_trajectory":
        return JointTrajectoryBackend(node, cfg)
    if b == "interbotix":
        return InterbotixBackend(node, cfg)
    if b in ("ee_pose", "ee_twist"):
        return EndEffectorBackend(node, cfg, twist=b == "ee_twist")
    raise ConfigError(f"command.backend={b!r} has no implementation")
