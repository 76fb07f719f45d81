"""Where a robot's sensor data may come from, without ROS (issue 45): the rule that decides whose
publishers a robot trusts (core/robot/sources.py), and the joint-state messages the state never
merges (other joint names; NaN / inf, or beyond float32)."""

from __future__ import annotations

import numpy as np
import pytest

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import CameraConfig, RobotConfig
from vla_accel_ros.core.robot.sources import UNKNOWN_NAME, UNKNOWN_NAMESPACE, Publisher, refusal, why_unexpected
from vla_accel_ros.core.robot.state import StateAssembler

JS = "/r1/follower_left/joint_states"


@pytest.mark.parametrize(
    ("topic", "own", "publisher", "accept", "expected"),
    [
        (JS, "/r1", Publisher("synthetic_sensors_node", "/r1"), (), True),  # the robot's own node
        (JS, "/r1", Publisher("xs_sdk", "/r1/follower_left"), (), True),  # its driver, below its namespace
        (JS, "/r1", Publisher("probe", "/"), (), True),  # the root namespace may publish anywhere
        ("/follower_left/joint_states", "/r1", Publisher("xs_sdk", "/follower_left"), (), True),  # a driver's own topic
        (JS, "/r1", Publisher("synthetic_sensors_node", "/r2"), (), False),  # another robot's node
        (JS, "/r1", Publisher("synthetic_sensors_node", "/r10"), (), False),  # not below /r1: a namespace, not a prefix
        (JS, "/r1", Publisher("bridge", "/drivers"), ("/drivers",), True),  # trusted by the parameter
        ("/follower_left/joint_states", "/", Publisher("synthetic_sensors_node", "/r2"), (), False),  # a root graph too
        ("/follower_left/joint_states", "/", Publisher("synthetic_sensors_node", "/"), (), True),
        (JS, "/r1", Publisher(UNKNOWN_NAME, UNKNOWN_NAMESPACE), (), False),  # discovery under way
    ],
)
def test_who_may_publish_a_robots_sensor_topic(topic, own, publisher, accept, expected):
    assert (why_unexpected(topic, own, publisher, accept) == "") is expected


def test_a_refusal_names_the_topic_and_every_unexpected_publisher():
    pubs = [Publisher("synthetic_sensors_node", "/r1"), Publisher("synthetic_sensors_node", "/r2"), Publisher(UNKNOWN_NAME, UNKNOWN_NAMESPACE)]
    reason, why = refusal(JS, "/r1", pubs)
    assert reason == "unexpected_publisher"
    assert why.startswith(f"{JS} has an unexpected publisher: /r2/synthetic_sensors_node (in namespace /r2")
    assert "an unidentified node (its node is not identified yet)" in why and "/r1/synthetic" not in why
    assert refusal(JS, "/r1", pubs[:1]) == ("", "")
    # Discovery under way (a publisher without its node, or none listed while a message arrived)
    # is a reason of its own; diagnostics (arrived=False) do not call a silent topic a problem.
    assert refusal(JS, "/r1", [pubs[0], pubs[2]])[0] == "unidentified_publisher"
    reason, why = refusal(JS, "/r1", [])
    assert reason == "unidentified_publisher" and "not identified" in why and refusal(JS, "/r1", [], arrived=False) == ("", "")


def test_accept_publishers_must_be_absolute_namespaces():
    with pytest.raises(ConfigError, match=r"robot\.accept_publishers=\['drivers'\].*absolute"):
        RobotConfig(accept_publishers=("drivers",))
    with pytest.raises(ConfigError, match="accept_publishers"):
        CameraConfig(accept_publishers=("cams",))
    assert CameraConfig(accept_publishers=("/cams",)).accept_publishers == ("/cams",)


# -- joint states the state never merges --------------------------------------------------------------
ARM = ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper", "left_finger", "right_finger"]
START = [0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 1.1, 0.05, -0.05]


def _assembled() -> StateAssembler:
    a = StateAssembler(RobotConfig())
    assert a.update(0, ARM, START, 1) == 7 and a.update(1, ARM, START, 1) == 7
    return a


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e39, -3.5e38, 1e308])
@pytest.mark.parametrize("joint", [0, 5, 7])  # an arm joint, and left_finger (the gripper state reads it)
def test_a_nonfinite_reading_is_refused_whole_and_the_state_stays_finite(joint, value):
    """1e39 is a finite float64 but inf in the policy's float32 state, and the finger map turns
    1e308 into inf: what let 2 of 250 storm messages reach inference before."""
    a = _assembled()
    bad = list(START)
    bad[joint] = value
    bad[1] = 0.5  # a finite reading beside it is not taken either
    assert a.refusal(0, ARM, bad)[0] == "nonfinite_joint_state" and ARM[joint] in a.refusal(0, ARM, bad)[1]
    assert a.update(0, ARM, bad, 2) == 0
    state, stamp = a.state()
    assert np.isfinite(state).all() and stamp == 1 and state[1] == np.float32(-0.96)
    # A non-finite reading of a joint the state does not use (the right finger) refuses nothing.
    other = list(START)
    other[8] = value
    assert a.refusal(0, ARM, other) == ("", "") and a.update(0, ARM, other, 3) == 7


def test_a_message_naming_none_of_the_topics_joints_is_refused():
    a = StateAssembler(RobotConfig())
    reason, detail = a.refusal(0, ["r2_waist", "shoulder_pan_joint"], [0.0, 0.0])
    assert reason == "unexpected_joint_names" and "got r2_waist, shoulder_pan_joint" in detail
    assert a.update(0, ["r2_waist"], [0.0], 1) == 0 and a.missing()[:1] == ["left_waist"] and not a.nonfinite()
