"""How fast the arms move, and SpecPrune-VLA's coarse | fine switch with hysteresis.

The action controller feeds :class:`MotionEstimator` every commanded action (robot units,
grippers normalized); joint speeds are finite differences, end-effector speeds come from the
ViperX 300 s forward kinematics of each arm's six joints. Speeds are smoothed with an EMA so
one noisy step cannot flip the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_accel_ros.core.robot.config import ARM_JOINTS, MotionConfig, RobotConfig
from vla_accel_ros.core.robot.kinematics import fk, rotation_angle

COARSE, FINE = 0, 1
MODE_NAMES = {COARSE: "coarse", FINE: "fine"}


@dataclass(frozen=True)
class MotionEstimate:
    mode: int  # COARSE or FINE
    switched: bool  # the mode changed on this update
    replan: bool  # switched into FINE and config.replan_on_fine: ask for a new chunk now
    ee_linear: float  # m/s, max over arms (smoothed)
    ee_xy: float
    ee_z: float
    ee_angular: float  # rad/s
    joint_speed: float  # max |q_dot| over joints, rad/s (unsmoothed)
    joint_velocities: np.ndarray  # [D] rad/s (grippers in normalized units / s)


class MotionEstimator:
    def __init__(self, robot: RobotConfig, config: MotionConfig, dt: float) -> None:
        self.robot, self.config, self.dt = robot, config, float(dt)
        # Arms whose six ALOHA joints are all present get end-effector speeds.
        self._arms: list[list[int]] = []
        for arm in robot.arms:
            names = [f"{arm}_{j}" for j in ARM_JOINTS]
            if all(n in robot.joint_names for n in names):
                self._arms.append([robot.joint_names.index(n) for n in names])
        self.reset()

    @property
    def has_kinematics(self) -> bool:
        return bool(self._arms)

    def set_config(self, config: MotionConfig) -> None:
        self.config = config

    def reset(self) -> None:
        self._prev_slot: int | None = None
        self._prev_q: np.ndarray | None = None
        self._qd = np.zeros(0)  # the last joint velocities
        self._prev_T: list[np.ndarray] | None = None
        self._ema = np.zeros(4)  # linear, xy, z, angular
        self._primed = False
        self.mode = COARSE
        self._dwell = 0

    def update(self, action: np.ndarray, slot: int | None = None) -> MotionEstimate:
        """One control step's commanded action [D] (robot units). ``slot``: its control slot on
        the scheduler's grid; speeds divide by the slots since the previous action (a late tick
        that skipped a slot moved the command two slots' worth), and a tick repeating the slot
        of the previous one adds no sample. Without slots, consecutive calls are one dt apart."""
        q = np.asarray(action, np.float64).reshape(-1)
        steps = 1 if slot is None or self._prev_slot is None else slot - self._prev_slot
        if steps <= 0 and self._prev_q is not None:
            return self._estimate(self._qd, switched=False)  # the same slot again: nothing new to measure
        poses = [fk(q[idx]) for idx in self._arms]
        qd = np.zeros_like(q)
        if self._prev_q is not None and self._prev_q.shape == q.shape:
            elapsed = steps * self.dt
            qd = (q - self._prev_q) / elapsed
            sample = np.zeros(4)  # linear, xy, z, angular: max over arms
            for T, T0 in zip(poses, self._prev_T or []):
                dp = (T[:3, 3] - T0[:3, 3]) / elapsed
                lin, xy, z = float(np.linalg.norm(dp)), float(np.hypot(dp[0], dp[1])), abs(float(dp[2]))
                ang = rotation_angle(T0[:3, :3], T[:3, :3]) / elapsed
                sample = np.maximum(sample, [lin, xy, z, ang])
            a = self.config.smoothing
            self._ema = a * sample + (1.0 - a) * self._ema if self._primed else sample
            self._primed = True
        self._prev_q, self._prev_T, self._prev_slot, self._qd = q, poses, slot, qd
        lin, xy, z, ang = (float(x) for x in self._ema)
        return self._estimate(qd, switched=self._switch(lin, xy, z, ang))

    def _estimate(self, qd: np.ndarray, *, switched: bool) -> MotionEstimate:
        lin, xy, z, ang = (float(x) for x in self._ema)
        return MotionEstimate(
            mode=self.mode,
            switched=switched,
            replan=switched and self.mode == FINE and self.config.replan_on_fine,
            ee_linear=lin,
            ee_xy=xy,
            ee_z=z,
            ee_angular=ang,
            joint_speed=float(np.max(np.abs(qd))) if qd.size else 0.0,
            joint_velocities=qd.astype(np.float32),
        )

    def _switch(self, lin: float, xy: float, z: float, ang: float) -> bool:
        c = self.config
        self._dwell += 1
        if self._dwell <= c.min_dwell_steps or not self.has_kinematics:
            return False
        if self.mode == COARSE:
            # The reference rule, with the rotation bound applied to both clauses: otherwise a
            # wrist turning in place enters (|v| small) and leaves (rot high) on alternate steps.
            enter = (lin < c.enter_speed or (xy < c.enter_xy and z < c.enter_z)) and ang < c.enter_rot
            if enter:
                self.mode, self._dwell = FINE, 0
                return True
        else:
            leave = z > c.leave_z or ang > c.leave_rot or lin > c.leave_speed
            if leave:
                self.mode, self._dwell = COARSE, 0
                return True
        return False
