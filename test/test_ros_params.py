"""Configs mirrored as ROS 2 parameters: generic (recursive), with descriptors, validated on
set, applied when the node takes the staged config. Real rclpy nodes."""

from __future__ import annotations

import pytest

pytest.importorskip("rclpy")

from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from vla_accel_ros.core.config import flatten  # noqa: E402
from vla_accel_ros.core.errors import ConfigError  # noqa: E402
from vla_accel_ros.core.policy_config import PolicyConfig  # noqa: E402
from vla_accel_ros.core.robot.config import ControllerConfig, PolicyNodeConfig  # noqa: E402
from vla_accel_ros.ros.params import ConfigParameters, leaf_specs  # noqa: E402

pytestmark = pytest.mark.ros


def test_every_leaf_of_every_nested_config_becomes_a_parameter():
    names = {s.name for s in leaf_specs(PolicyNodeConfig)}
    assert names == set(flatten(PolicyNodeConfig()))
    # Whatever PolicyConfig holds today (and whatever is added later) shows up as policy.*.
    assert {f"policy.{k}" for k in flatten(PolicyConfig())} <= names
    ctl = {s.name for s in leaf_specs(ControllerConfig)}
    assert {"scheduler.mode", "safety.max_step", "robot.gripper.finger_open", "motion.leave_rot", "command.backend"} <= ctl


def _node(ctx, overrides=(), **kw):
    node = Node("mirror_test", context=ctx, parameter_overrides=list(overrides))
    return node, ConfigParameters(node, ControllerConfig, **kw)


def test_descriptors_carry_doc_range_choices_and_read_only(ros_context):
    node, mirror = _node(ros_context, read_only=("scheduler.control_rate_hz",))
    try:
        d = node.describe_parameter("safety.watchdog_periods")
        assert d.integer_range[0].from_value == 1 and "without a fresh chunk" in d.description
        d = node.describe_parameter("motion.smoothing")
        assert d.floating_point_range[0].from_value == pytest.approx(0.01)
        assert "latest_only" in node.describe_parameter("scheduler.aggregation").additional_constraints
        assert node.describe_parameter("scheduler.control_rate_hz").read_only
        assert node.describe_parameter("command.backend").read_only  # read_only in the dataclass
        # what the nodes build fixed objects from at start-up: changing it live would be ignored
        for name in ("robot.gripper.joint_open", "command.trajectory_lookahead_s", "diagnostics_period_s"):
            assert node.describe_parameter(name).read_only, name
        assert not node.describe_parameter("safety.max_step").read_only
        assert mirror.config == ControllerConfig()
    finally:
        node.destroy_node()


def test_set_validates_by_building_the_config_and_stages_the_change(ros_context):
    node, mirror = _node(ros_context, read_only=("scheduler.control_rate_hz",))
    try:
        r = node.set_parameters([Parameter("safety.watchdog_periods", value=-3)])[0]
        assert not r.successful and "range" in r.reason.lower()
        r = node.set_parameters([Parameter("scheduler.mode", value="sometimes")])[0]
        assert not r.successful and "'sometimes' is not one of" in r.reason
        r = node.set_parameters([Parameter("motion.leave_z", value=0.001)])[0]
        assert not r.successful and "chatters" in r.reason  # a cross-field rule of MotionConfig
        r = node.set_parameters([Parameter("scheduler.control_rate_hz", value=10.0)])[0]
        assert not r.successful and "read-only" in r.reason
        assert mirror.take_pending() is None
        # Two values that are only valid together, atomically.
        r = node.set_parameters_atomically(
            [Parameter("scheduler.rtc", value=True), Parameter("scheduler.aggregation", value="latest_only")]
        )
        assert r.successful, r.reason
        staged = mirror.take_pending()
        assert staged.scheduler.rtc and staged.scheduler.aggregation == "latest_only"
        assert mirror.take_pending() is None  # taken once
    finally:
        node.destroy_node()


def test_yaml_integers_for_floats_and_empty_arrays(ros_context):
    overrides = [
        Parameter("motion.enter_speed", value=0),  # YAML `0` for a float
        Parameter("safety.max_step", value=[1, 2] * 7),  # YAML ints for a float array
    ]
    node, mirror = _node(ros_context, overrides)
    try:
        assert mirror.config.motion.enter_speed == 0.0
        assert mirror.config.safety.max_step == tuple(float(x) for x in [1, 2] * 7)
        assert mirror.config.safety.lower == ()  # declared by type, unset: the config default
    finally:
        node.destroy_node()


def test_a_bad_parameter_file_value_stops_the_node(ros_context):
    with pytest.raises(ConfigError, match="max_step"):
        _node(ros_context, [Parameter("safety.max_step", value=[0.1, 0.2])])
