"""The controller's ROS-free logic: state mapping, gripper maps, kinematics, motion modes,
safety filter and watchdog, and the node configs."""

from __future__ import annotations

import numpy as np
import pytest

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import (
    ALOHA_JOINT_NAMES,
    ControllerConfig,
    GripperConfig,
    MotionConfig,
    RobotConfig,
    SafetyConfig,
)
from vla_accel_ros.core.robot.kinematics import VX300S_HOME, fk, rotation_angle
from vla_accel_ros.core.robot.loop_stats import LoopStats
from vla_accel_ros.core.robot.motion import COARSE, FINE, MotionEstimator
from vla_accel_ros.core.robot.safety import SafetyFilter, Watchdog, default_limits
from vla_accel_ros.core.robot.state import GripperMap, StateAssembler, to_robot_units

ARM = ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate"]
START = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0])


# -- state and grippers ---------------------------------------------------------------------------
def test_gripper_maps_use_the_interbotix_constants():
    g = GripperMap(GripperConfig())
    assert g.finger_to_normalized(0.0579) == pytest.approx(1.0)
    assert g.finger_to_normalized(0.0440) == pytest.approx(0.0)
    assert g.normalized_to_joint(1.0) == pytest.approx(1.6214)
    assert g.normalized_to_joint(0.0) == pytest.approx(0.6197)
    assert g.joint_to_normalized(g.normalized_to_joint(0.3)) == pytest.approx(0.3)
    with pytest.raises(ConfigError):
        GripperConfig(finger_open=0.05, finger_close=0.05)


def test_aloha_joint_states_become_the_14d_state():
    robot = RobotConfig()
    asm = StateAssembler(robot)
    names = [*ARM, "gripper", "left_finger", "right_finger"]
    left = [*START, 1.2, 0.0579, -0.0579]
    right = [*(START + 0.1), 0.9, 0.0440, -0.0440]
    assert asm.state() is None
    assert asm.update(0, names, left, 100) == 7  # six joints + the finger -> gripper
    assert asm.state() is None and asm.missing()[0] == "right_waist"
    asm.update(1, names, right, 90)
    state, stamp = asm.state()
    assert state.shape == (14,) and stamp == 90
    np.testing.assert_allclose(state[:6], START, atol=1e-6)
    assert state[6] == pytest.approx(1.0) and state[13] == pytest.approx(0.0)  # finger open / closed
    np.testing.assert_allclose(state[7:13], START + 0.1, atol=1e-6)


def test_combined_joint_state_topic_with_normalized_grippers():
    robot = RobotConfig(
        joint_state_topics=("/joint_states",), joint_state_prefixes=("",),
        gripper=GripperConfig(state_source="normalized"),
    )  # fmt: skip
    asm = StateAssembler(robot)
    asm.update(0, list(ALOHA_JOINT_NAMES), list(np.linspace(0, 1, 14)), 5)
    state, _ = asm.state()
    np.testing.assert_allclose(state, np.linspace(0, 1, 14), atol=1e-6)


def test_commands_map_grippers_to_joint_angles():
    robot = RobotConfig()
    a = np.zeros(14)
    a[6], a[13] = 1.0, 0.0
    out = to_robot_units(a, robot)
    assert out[6] == pytest.approx(1.6214) and out[13] == pytest.approx(0.6197)
    normalized = RobotConfig(gripper=GripperConfig(command_units="normalized"))
    np.testing.assert_array_equal(to_robot_units(a, normalized), a)


# -- kinematics and motion -------------------------------------------------------------------------
def test_vx300s_forward_kinematics_home_and_waist_rotation():
    np.testing.assert_allclose(fk(np.zeros(6)), VX300S_HOME, atol=1e-12)
    T = fk([np.pi / 2, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(T[:3, 3], [0.0, 0.536494, 0.42705], atol=1e-9)
    # Shoulder at -pi/2 (about +y through the shoulder at z 0.12705): the forearm, 0.536494 m
    # ahead and 0.3 m above the shoulder at home, swings up and the 0.3 m rise points back.
    T = fk([0, -np.pi / 2, 0, 0, 0, 0])
    np.testing.assert_allclose(T[:3, 3], [-0.3, 0.0, 0.12705 + 0.536494], atol=1e-9)
    # Pure wrist rotation changes orientation, not position.
    T0, T1 = fk(START), fk(START + [0, 0, 0, 0, 0, 0.5])
    np.testing.assert_allclose(T0[:3, 3], T1[:3, 3], atol=1e-9)
    assert rotation_angle(T0[:3, :3], T1[:3, :3]) == pytest.approx(0.5)


def _joints(arm_q):
    a = np.zeros(14)
    a[:6], a[7:13] = arm_q, START
    a[6] = a[13] = 0.5
    return a


def test_motion_switches_to_fine_when_slow_and_back_with_hysteresis():
    cfg = MotionConfig(min_dwell_steps=2, smoothing=1.0)
    est = MotionEstimator(RobotConfig(), cfg, dt=0.02)
    q = START.copy()
    modes = []
    for _ in range(10):  # fast waist motion: about 0.2 m/s at the tool
        q[0] += 0.01
        modes.append(est.update(_joints(q)))
    assert modes[-1].mode == COARSE and modes[-1].ee_linear > 0.1
    for _ in range(5):  # holding still
        r = est.update(_joints(q))
    switched = [r]
    assert r.mode == FINE
    # Slow xy drift below leave_speed and no z / rotation: stays fine (hysteresis).
    for _ in range(10):
        q[0] += 0.0003
        r = est.update(_joints(q))
        assert r.mode == FINE
    # Rotating the wrist fast leaves fine mode.
    for _ in range(5):
        q[5] += 0.02
        r = est.update(_joints(q))
    assert r.mode == COARSE and r.ee_angular > cfg.leave_rot
    assert switched


def test_entering_fine_asks_for_a_replan_once():
    est = MotionEstimator(RobotConfig(), MotionConfig(min_dwell_steps=0, smoothing=1.0), dt=0.02)
    results = [est.update(_joints(START)) for _ in range(4)]
    assert [r.replan for r in results].count(True) == 1
    assert results[-1].mode == FINE


def test_motion_config_rejects_inverted_hysteresis():
    with pytest.raises(ConfigError, match="chatters"):
        MotionConfig(enter_z=0.1, leave_z=0.05)
    # An enter region that reaches outside the stay region: a steady motion would enter fine
    # on one clause and leave it on another, a replan each time.
    with pytest.raises(ConfigError, match=r"hypot\(enter_xy, enter_z\) <= leave_speed"):
        MotionConfig(enter_xy=0.2, leave_speed=0.05, enter_speed=0.04)
    with pytest.raises(ConfigError, match="enter_speed=0.06 > leave_z=0.05"):
        MotionConfig(enter_speed=0.06)


def test_speeds_divide_by_the_slots_that_passed():
    """A late tick that skipped a slot moved the command two slots' worth: the same speed,
    not twice it; a tick repeating a slot adds no (zero-speed) sample."""
    est = MotionEstimator(RobotConfig(), MotionConfig(smoothing=1.0, min_dwell_steps=1000), dt=0.02)
    q = START.copy()
    speeds = {}
    for slot in (0, 1, 2, 3, 5, 5, 6):  # slot 4 skipped, slot 5 ticked twice
        q = START.copy()
        q[0] = 0.5 * 0.02 * slot  # the waist at 0.5 rad/s along the slots
        r = est.update(_joints(q), slot)
        speeds.setdefault(slot, []).append((r.joint_speed, r.ee_linear))
    for slot in (1, 2, 3, 5, 6):
        for joint, linear in speeds[slot]:
            assert joint == pytest.approx(0.5) and linear == pytest.approx(speeds[1][0][1], rel=1e-3)  # chord vs arc


# -- safety ------------------------------------------------------------------------------------------
def test_limits_and_per_step_clamp():
    robot = RobotConfig()
    f = SafetyFilter(robot, SafetyConfig(max_step=(0.1,), start_enabled=True))
    lo, hi = default_limits(robot)
    assert lo[1] == pytest.approx(-1.85005) and hi[6] == 1.0
    first = f.filter(_joints(START), measured=_joints(START))
    assert not first.clamped
    far = _joints(START + 1.0)
    r = f.filter(far)
    assert r.clamped and np.max(np.abs(r.command - first.command)) == pytest.approx(0.1)
    crazy = _joints(START)
    crazy[1] = -10.0
    out = r.command
    for _ in range(200):
        out = f.filter(crazy).command
    assert out[1] == pytest.approx(lo[1])  # walked to the limit, never past it


def test_no_command_without_a_clamp_reference():
    f = SafetyFilter(RobotConfig(), SafetyConfig(start_enabled=True))
    assert not f.has_reference(None) and f.has_reference(_joints(START))
    f.filter(_joints(START), measured=_joints(START))
    assert f.has_reference(None)  # the previous command is one
    assert SafetyFilter(RobotConfig(), SafetyConfig(require_reference=False)).has_reference(None)


def test_estop_and_enable_gate_output():
    f = SafetyFilter(RobotConfig(), SafetyConfig(start_enabled=True, estop_requires_enable=True))
    assert f.output_allowed
    assert f.set_estop(True) and not f.output_allowed
    assert f.set_enabled(True) == (False, "e-stop is active; release it first")
    f.set_estop(False)
    assert not f.output_allowed  # released, but an operator must re-enable
    ok, _ = f.set_enabled(True)
    assert ok and f.output_allowed


def test_watchdog_trips_after_its_time_without_a_chunk():
    w = Watchdog(5)  # ns
    assert not any(w.check(t) for t in range(100))  # not armed before the first chunk
    w.chunk(100)
    assert not any(w.check(t) for t in range(100, 106))
    assert w.check(106) and w.tripped and not w.check(107)  # trips once
    w.chunk(110)
    assert not w.tripped and w.trips == 1


def test_controller_config_cross_checks():
    with pytest.raises(ConfigError, match="max_step"):
        ControllerConfig(safety=SafetyConfig(max_step=(0.1, 0.2)))
    with pytest.raises(ConfigError, match="lower"):
        ControllerConfig(safety=SafetyConfig(lower=(0.0,) * 3))
    with pytest.raises(ConfigError, match="out of range"):
        ControllerConfig.from_dict({"safety": {"watchdog_periods": 0}})
    lower, upper = [-1.0] * 14, [1.0] * 14
    lower[3] = 2.0
    with pytest.raises(ConfigError, match=r"safety.lower\[3\]=2.0 exceeds safety.upper\[3\]=1.0 \(left_forearm_roll\)"):
        ControllerConfig(safety=SafetyConfig(lower=tuple(lower), upper=tuple(upper)))


def test_loop_stats():
    s = LoopStats(0.02)
    for k in range(51):
        s.tick(k * 20_000_000 + (1_000_000 if k == 25 else 0))
    m = s.summary()
    assert m.rate_hz == pytest.approx(50.0, rel=1e-3) and m.jitter_max_ms == pytest.approx(1.0)
    assert m.jitter_p50_ms == pytest.approx(0.0) and 0.0 < m.jitter_p99_ms <= 1.0  # two periods of 50 are off by 1 ms
