"""Command backends publish what their robots expect (real rclpy publishers and subscribers)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("rclpy")

from geometry_msgs.msg import PoseStamped, TwistStamped  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from std_msgs.msg import Float64MultiArray  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from vla_accel_ros.core.errors import ConfigError  # noqa: E402
from vla_accel_ros.core.robot.config import CommandConfig, ControllerConfig, RobotConfig  # noqa: E402
from vla_accel_ros.ros import qos  # noqa: E402
from vla_accel_ros.ros.backends import make_backend  # noqa: E402

pytestmark = pytest.mark.ros

ACTION = np.array([0.1, -0.9, 1.1, 0.0, -0.3, 0.2, 1.0, -0.1, -0.8, 1.0, 0.1, -0.2, 0.3, 0.0])


def _roundtrip(ctx, backend: str, msg_type, listen: str, **command):
    cfg = ControllerConfig(command=CommandConfig(backend=backend, **command))
    node = Node("backend_test", context=ctx)
    got = []
    node.create_subscription(msg_type, listen, got.append, qos.COMMANDS)
    executor = SingleThreadedExecutor(context=ctx)
    executor.add_node(node)
    try:
        b = make_backend(node, cfg)
        deadline = time.monotonic() + 30.0
        while not got and time.monotonic() < deadline:
            b.publish(ACTION, 1_000_000_000)
            executor.spin_once(timeout_sec=0.05)
        assert got, f"nothing arrived on {listen}"
        return got[0]
    finally:
        executor.shutdown()
        node.destroy_node()


def test_joint_state_backend_maps_grippers_to_joint_angles(ros_context):
    m = _roundtrip(ros_context, "joint_state", JointState, "/joint_commands", topic="/joint_commands")
    assert list(m.name) == list(RobotConfig().joint_names)
    assert m.position[6] == pytest.approx(1.6214) and m.position[13] == pytest.approx(0.6197)
    assert m.position[1] == pytest.approx(-0.9)


def test_forward_command_and_trajectory_backends(ros_context):
    m = _roundtrip(ros_context, "float64_multi_array", Float64MultiArray, "/fwd/commands", topic="/fwd/commands")
    assert len(m.data) == 14 and m.data[2] == pytest.approx(1.1)
    t = _roundtrip(ros_context, "joint_trajectory", JointTrajectory, "/jtc/joint_trajectory", topic="/jtc/joint_trajectory")
    assert len(t.points) == 1 and t.points[0].time_from_start.nanosec == 20_000_000  # one control period
    assert list(t.joint_names) == list(RobotConfig().joint_names)


def test_end_effector_backends(ros_context):
    p = _roundtrip(ros_context, "ee_pose", PoseStamped, "/follower_left/ee_command")
    assert p.header.frame_id == "follower_left/base_link" and p.pose.position.x == pytest.approx(0.1)
    q = p.pose.orientation
    assert q.x**2 + q.y**2 + q.z**2 + q.w**2 == pytest.approx(1.0)
    t = _roundtrip(ros_context, "ee_twist", TwistStamped, "/follower_right/ee_command")
    assert t.twist.linear.x == pytest.approx(-0.1) and t.twist.angular.z == pytest.approx(0.3)


def test_interbotix_backend_needs_its_messages(ros_context):
    node = Node("backend_test", context=ros_context)
    try:
        try:
            import interbotix_xs_msgs  # noqa: F401
        except ImportError:
            with pytest.raises(ConfigError, match="interbotix_xs_msgs"):
                make_backend(node, ControllerConfig(command=CommandConfig(backend="interbotix")))
        else:
            b = make_backend(node, ControllerConfig(command=CommandConfig(backend="interbotix")))
            assert "/follower_left/commands/joint_group" in b.topics()
    finally:
        node.destroy_node()
