"""Joint states in, the policy's state vector out; normalized grippers to and from robot units.

ALOHA publishes one ``sensor_msgs/JointState`` per arm (``/follower_left/joint_states``) with
unprefixed names (``waist`` ... ``gripper``, ``left_finger``, ``right_finger``); the policy's
14-D vector is ``[left 6 joints, left gripper, right 6 joints, right gripper]`` with grippers
normalized to [0 closed, 1 open]. :class:`StateAssembler` does that mapping for any layout
described by a :class:`RobotConfig`.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vla_accel_ros.core.robot.config import GripperConfig, RobotConfig


class GripperMap:
    """Normalized gripper <-> finger position (observations) and joint angle (commands)."""

    def __init__(self, cfg: GripperConfig) -> None:
        self.cfg = cfg

    def finger_to_normalized(self, x: float) -> float:
        c = self.cfg
        return (x - c.finger_close) / (c.finger_open - c.finger_close)

    def joint_to_normalized(self, q: float) -> float:
        c = self.cfg
        return (q - c.joint_close) / (c.joint_open - c.joint_close)

    def normalized_to_joint(self, g: float) -> float:
        c = self.cfg
        return c.joint_close + float(g) * (c.joint_open - c.joint_close)

    def state_value(self, raw: float) -> float:
        """A joint_states reading of the configured source -> normalized gripper."""
        src = self.cfg.state_source
        if src == "finger":
            return self.finger_to_normalized(raw)
        if src == "joint":
            return self.joint_to_normalized(raw)
        return float(raw)


class StateAssembler:
    """Keeps the latest reading per joint from several JointState topics; :meth:`state` is the
    policy's vector when every joint has been seen, with the oldest reading's stamp.

    A topic with prefix ``p`` publishes joint ``p + name`` as ``name``. Gripper dimensions read
    the reading named like the gripper joint with ``gripper.gripper_joint`` replaced by
    ``gripper.finger_joint`` (state_source=finger: ``gripper`` -> ``left_finger``), else the
    gripper joint itself.
    """

    def __init__(self, robot: RobotConfig) -> None:
        self.robot = robot
        self.gripper = GripperMap(robot.gripper)
        self.dim = robot.dim
        index = {n: i for i, n in enumerate(robot.joint_names)}
        grippers = set(robot.grippers)
        g = robot.gripper
        source = g.finger_joint if g.state_source == "finger" else g.gripper_joint
        # per topic: joint_states name -> (state index, is gripper)
        self._maps: list[dict[str, tuple[int, bool]]] = []
        for prefix in robot.joint_state_prefixes:
            m: dict[str, tuple[int, bool]] = {}
            for name, i in index.items():
                if not name.startswith(prefix):
                    continue
                local = name[len(prefix) :]  # the name as this topic publishes it
                if name in grippers:
                    # 'gripper' -> 'left_finger' (finger source): the reading replaces the joint name
                    if local.endswith(g.gripper_joint):
                        local = local[: len(local) - len(g.gripper_joint)] + source
                    m[local] = (i, True)
                else:
                    m[local] = (i, False)
            self._maps.append(m)
        self._values = np.full(self.dim, np.nan, np.float64)
        self._stamps = np.full(self.dim, -1, np.int64)
        self._nonfinite = np.zeros(self.dim, bool)  # the joint's latest reading was NaN / inf

    def refusal(self, topic_index: int, names: Sequence[str], positions: Sequence[float]) -> tuple[str, str]:
        """Why a JointState message of topic ``topic_index`` is not merged, ('', '') when it is.
        ``unexpected_joint_names``: it names none of the joints this topic carries (another
        robot's, another arm layout's). ``nonfinite_joint_state``: a joint the state uses is NaN or
        inf, or beyond float32 (the policy's dtype) in the state's units. Either refuses the whole
        message: a reading beside a broken one is not trusted, and nothing non-finite ever
        reaches a state."""
        reason, detail, _ = self._read(topic_index, names, positions)
        return reason, detail

    def _read(self, topic_index: int, names: Sequence[str], positions: Sequence[float]) -> tuple[str, str, list[tuple[int, float]]]:
        """(reason, detail, [(state index, value in the state's units)]): the readings when the
        reason is '', else those that are not finite."""
        m = self._maps[topic_index]
        readings = []
        for name, raw in zip(names, positions):
            entry = m.get(name)
            if entry is not None:
                i, is_gripper = entry
                readings.append((name, i, self.gripper.state_value(float(raw)) if is_gripper else float(raw)))
        if not readings:
            got = _few(list(names)) or "no names"
            return "unexpected_joint_names", f"names none of this topic's joints ({_few(sorted(m))}), got {got}", []
        bad = [(name, i, v) for name, i, v in readings if not _fits(v)]
        if bad:
            detail = f"{_few([n for n, _, _ in bad])} not finite (NaN / inf, or beyond float32)"
            return "nonfinite_joint_state", detail, [(i, v) for _, i, v in bad]
        return "", "", [(i, v) for _, i, v in readings]

    def update(self, topic_index: int, names: Sequence[str], positions: Sequence[float], stamp_ns: int) -> int:
        """Merge one JointState message of topic ``topic_index``; returns the joints merged, 0 when
        :meth:`refusal` refuses it (the joints it had non-finite are remembered: :meth:`nonfinite`)."""
        reason, _, readings = self._read(topic_index, names, positions)
        for i, v in readings:
            if reason:
                self._nonfinite[i] = True  # the last finite reading (if any) stays, and ages
            else:
                self._values[i], self._stamps[i], self._nonfinite[i] = v, int(stamp_ns), False
        return 0 if reason else len(readings)

    def missing(self) -> list[str]:
        """Joints with no finite reading yet."""
        return [n for n, s in zip(self.robot.joint_names, self._stamps) if s < 0]

    def nonfinite(self) -> list[str]:
        """Joints whose latest reading was NaN or inf (or beyond float32)."""
        return [n for n, bad in zip(self.robot.joint_names, self._nonfinite) if bad]

    def state(self) -> tuple[np.ndarray, int] | None:
        """(state [D] float32, oldest stamp) once every joint has a reading, else None."""
        if (self._stamps < 0).any():
            return None
        return self._values.astype(np.float32), int(self._stamps.min())

    def reset(self) -> None:
        self._values[:] = np.nan
        self._stamps[:] = -1
        self._nonfinite[:] = False


def state_to_joint_states(
    robot: RobotConfig, state: np.ndarray, velocity: np.ndarray | None = None
) -> list[tuple[list[str], list[float], list[float]]]:
    """The inverse of :class:`StateAssembler`: a state [D] (``robot.joint_names`` order,
    normalized grippers) as the robot publishes it, per ``robot.joint_state_topics`` entry
    (names, positions, velocities) in robot units: arm joints as they are, each gripper as its
    joint angle and, with ``state_source: finger``, also the finger position."""
    q = np.asarray(state, np.float64).reshape(-1)
    v = np.zeros_like(q) if velocity is None else np.asarray(velocity, np.float64).reshape(-1)
    if q.shape != (robot.dim,) or v.shape != (robot.dim,):
        raise ValueError(f"state / velocity must have {robot.dim} values, got {q.shape} / {v.shape}")
    g = robot.gripper
    gm = GripperMap(g)
    grippers = set(robot.grippers)
    joint_span = g.joint_open - g.joint_close
    finger_span = g.finger_open - g.finger_close
    out = []
    for prefix in robot.joint_state_prefixes:
        names: list[str] = []
        pos: list[float] = []
        vel: list[float] = []
        for i, name in enumerate(robot.joint_names):
            if not name.startswith(prefix):
                continue
            local = name[len(prefix) :]  # what this topic calls the joint
            norm, dnorm = float(q[i]), float(v[i])
            names.append(local)
            if name not in grippers or g.state_source == "normalized":
                pos.append(norm)
                vel.append(dnorm)
                continue
            pos.append(gm.normalized_to_joint(norm))
            vel.append(dnorm * joint_span)
            if g.state_source == "finger":  # ALOHA: the gripper joint angle and the finger opening
                base = local[: len(local) - len(g.gripper_joint)] if local.endswith(g.gripper_joint) else ""
                names.append(f"{base}{g.finger_joint}")
                pos.append(g.finger_close + norm * finger_span)
                vel.append(dnorm * finger_span)
        out.append((names, pos, vel))
    return out


def to_robot_units(action: np.ndarray, robot: RobotConfig) -> np.ndarray:
    """A [D] action with normalized grippers -> robot units (gripper joint angles) when
    ``gripper.command_units`` is joint; a copy either way.  # [D] float64"""
    out = np.asarray(action, np.float64).copy()
    if robot.gripper.command_units == "joint":
        gm = GripperMap(robot.gripper)
        for name in robot.grippers:
            i = robot.joint_names.index(name)
            out[i] = gm.normalized_to_joint(float(out[i]))
    return out


def arm_slices(robot: RobotConfig) -> list[list[int]]:
    """Per arm, the action indices of its joints (``<arm>_*``), in joint_names order."""
    return [[i for i, n in enumerate(robot.joint_names) if n.startswith(f"{arm}_")] for arm in robot.arms]


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _fits(v: float) -> bool:
    """``v`` is finite in float32 too (1e39 is a finite float64 but inf in the policy's state)."""
    return math.isfinite(v) and abs(v) <= FLOAT32_MAX


def _few(names: Sequence[str], n: int = 4) -> str:
    """At most ``n`` names for a message (a joint-state storm must not flood the log)."""
    shown = ", ".join(str(x)[:40] for x in names[:n])
    return shown + (f" ... ({len(names)})" if len(names) > n else "")
