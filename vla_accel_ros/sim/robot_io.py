"""The simulated ALOHA as the real robot's topics see it, without ROS: joint states out,
the controller's commands in.

The simulator's layout (:class:`~vla_accel_ros.sim.AlohaSim`) is 14-D, ``SIM_JOINTS`` order,
arm joints in radians and grippers NORMALIZED (0 closed, 1 open). The robot's topics follow
:class:`~vla_accel_ros.core.robot.config.RobotConfig` instead, as the real arm and
``synthetic_sensors_node`` do:

* joint states, one message per ``robot.joint_state_topics`` entry, names without the arm
  prefix (``waist`` ... ``wrist_rotate``); each gripper as the gripper joint angle (rad,
  ``gripper.joint_open/close``) and, with ``state_source: finger``, the finger position
  (m, ``gripper.finger_open/close``) under ``gripper.finger_joint``. The state assembler of
  the policy and the controller reads them back to exactly the simulator's normalized value.
* commands, named by ``robot.joint_names``, grippers in ``gripper.command_units`` (joint
  angles for ALOHA): :class:`CommandDecoder` turns each backend's message into the held 14-D
  target, one small method per backend, and follows trajectories over time.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES, RobotConfig
from vla_accel_ros.core.robot.state import GripperMap, state_to_joint_states
from vla_accel_ros.sim.aloha import ACTION_DIM, SimError

SIM_JOINTS = ALOHA_JOINT_NAMES  # the simulator's 14-D order is the robot's
# Backends the simulator can follow: the end-effector ones would need inverse kinematics.
SIM_BACKENDS = ("joint_state", "float64_multi_array", "joint_trajectory", "interbotix")


class CommandError(SimError, ValueError):
    """A command the simulator cannot execute (wrong size, unknown joints, non-finite values)."""


def check_robot(robot: RobotConfig) -> None:
    """The simulator has exactly the ALOHA joints; a robot layout with others cannot be simulated."""
    names = set(robot.joint_names)
    missing = [n for n in SIM_JOINTS if n not in names]
    extra = [n for n in robot.joint_names if n not in SIM_JOINTS]
    if missing or extra:
        raise ConfigError(
            f"the simulated ALOHA has joints {', '.join(SIM_JOINTS)}; robot.joint_names "
            f"{'lacks ' + ', '.join(missing) if missing else ''}{'; ' if missing and extra else ''}"
            f"{'has unknown ' + ', '.join(extra) if extra else ''}"
        )
    bad = [g for g in robot.grippers if not g.endswith("_gripper")]
    if bad:
        raise ConfigError(f"robot.grippers {bad} are not gripper joints of the simulated ALOHA")


# -- joint states out --------------------------------------------------------------------------
def joint_state_messages(
    robot: RobotConfig, qpos: np.ndarray, qvel: np.ndarray | None = None
) -> list[tuple[list[str], list[float], list[float]]]:
    """Per ``robot.joint_state_topics`` entry: (names, positions, velocities) for a simulator
    state ``qpos`` / ``qvel`` [14] (SIM_JOINTS order, grippers normalized)."""
    q = np.asarray(qpos, np.float64)
    v = np.zeros(ACTION_DIM) if qvel is None else np.asarray(qvel, np.float64)
    if q.shape != (ACTION_DIM,) or v.shape != (ACTION_DIM,):
        raise SimError(f"qpos / qvel must have shape ({ACTION_DIM},), got {q.shape} / {v.shape}")
    order = [SIM_JOINTS.index(n) for n in robot.joint_names]
    return state_to_joint_states(robot, q[order], v[order])


# -- commands in -------------------------------------------------------------------------------
class CommandDecoder:
    """The held simulator target [14], updated by commands in the robot's units.

    Every ``from_*`` method updates the target (joints a message does not name keep theirs)
    and returns how many joints it set; a malformed message raises :class:`CommandError` and
    changes nothing. :meth:`target_at` is what the simulator steps towards: the held target,
    or the active trajectory sampled at the end of the step.
    """

    def __init__(self, robot: RobotConfig) -> None:
        check_robot(robot)
        self.robot = robot
        self.gripper = GripperMap(robot.gripper)
        self._joint_units = robot.gripper.command_units == "joint"
        self._sim = {n: SIM_JOINTS.index(n) for n in robot.joint_names}  # robot name -> sim index
        self._grippers = set(robot.grippers)
        self._order = [self._sim[n] for n in robot.joint_names]  # robot order -> sim index
        self.target: np.ndarray | None = None  # [14] sim units
        # Trajectory: sim-time knots [P+1] (ns) and positions [P+1, 14], from the target at receipt.
        self._traj: tuple[np.ndarray, np.ndarray] | None = None

    def hold(self, target: np.ndarray) -> None:
        """Hold ``target`` [14] (sim units): after a reset, the start pose."""
        t = np.asarray(target, np.float64).copy()
        if t.shape != (ACTION_DIM,):
            raise CommandError(f"target must have shape ({ACTION_DIM},), got {t.shape}")
        self.target, self._traj = t, None

    def _sim_value(self, name: str, value: float) -> float:
        if name in self._grippers and self._joint_units:
            return self.gripper.joint_to_normalized(value)
        return value

    def _values(self, names: Sequence[str], values: Sequence[float], what: str) -> dict[int, float]:
        if len(names) != len(values):
            raise CommandError(f"{what}: {len(names)} names for {len(values)} positions")
        out: dict[int, float] = {}
        for name, value in zip(names, values):
            if name not in self._sim:
                continue  # another robot's joint on a shared topic: not ours to follow
            v = float(value)
            if not np.isfinite(v):
                raise CommandError(f"{what}: {name} is {v}")
            out[self._sim[name]] = self._sim_value(name, v)
        return out

    def _apply(self, values: dict[int, float]) -> int:
        if self.target is None:
            raise CommandError("no target to update yet (the simulator has not reset)")
        self._traj = None  # a position command ends a trajectory in progress
        for i, v in values.items():
            self.target[i] = v
        return len(values)

    # joint_state: sensor_msgs/JointState named by robot.joint_names (also the grippers-only
    # JointState of the end-effector backends).
    def from_joint_state(self, names: Sequence[str], positions: Sequence[float]) -> int:
        return self._apply(self._values(names, positions, "JointState command"))

    # float64_multi_array: ros2_control's forward command, robot.joint_names order, no names.
    def from_array(self, data: Sequence[float]) -> int:
        if len(data) != len(self._order):
            raise CommandError(f"Float64MultiArray command has {len(data)} values for {len(self._order)} joints")
        return self._apply(self._values(self.robot.joint_names, data, "Float64MultiArray command"))

    # interbotix: per arm a JointGroupCommand (the six arm joints) and a JointSingleCommand (gripper).
    def from_interbotix_group(self, arm: str, values: Sequence[float]) -> int:
        names = [n for n in self.robot.joint_names if n.startswith(f"{arm}_") and n not in self._grippers]
        if len(values) != len(names):
            raise CommandError(f"JointGroupCommand for {arm}: {len(values)} values for {len(names)} arm joints")
        return self._apply(self._values(names, values, f"JointGroupCommand {arm}"))

    def from_interbotix_single(self, arm: str, joint: str, value: float) -> int:
        name = f"{arm}_{joint}"  # Interbotix names the gripper by gripper_joint within the arm's namespace
        if name not in self._sim:
            raise CommandError(f"JointSingleCommand for {arm}: unknown joint {joint!r}")
        return self._apply(self._values([name], [value], f"JointSingleCommand {arm}"))

    # joint_trajectory: trajectory_msgs/JointTrajectory, positions reached at start + time_from_start.
    def from_trajectory(
        self, names: Sequence[str], times_s: Sequence[float], points: Sequence[Sequence[float]], start_ns: int
    ) -> int:
        """``start_ns``: sim time the trajectory starts (header stamp, or receipt when 0)."""
        if self.target is None:
            raise CommandError("no target to update yet (the simulator has not reset)")
        if not len(points):
            self._traj = None  # an empty trajectory stops: hold where the arm is commanded now
            return 0
        if len(times_s) != len(points):
            raise CommandError(f"JointTrajectory: {len(times_s)} times for {len(points)} points")
        t = np.asarray(times_s, np.float64)
        if np.any(np.diff(t) <= 0) or t[0] < 0:
            raise CommandError("JointTrajectory: time_from_start must increase from >= 0")
        start = self.target_at(start_ns)  # where the arm is commanded to be at the start
        rows = [start]
        matched = 0
        for p in points:
            vals = self._values(names, p, "JointTrajectory point")
            matched = max(matched, len(vals))
            row = rows[-1].copy()
            for i, v in vals.items():
                row[i] = v
            rows.append(row)
        knots = np.concatenate([[0.0], t]) * 1e9 + int(start_ns)
        if knots[1] <= knots[0]:  # a first point at time 0: no ramp from the start
            knots, rows = knots[1:], rows[1:]
        self.target = start
        self._traj = (knots, np.stack(rows))
        return matched

    def target_at(self, t_ns: int) -> np.ndarray:
        """The position to step towards at sim time ``t_ns`` (a copy) [14]."""
        if self.target is None:
            raise CommandError("no target yet (the simulator has not reset)")
        if self._traj is None:
            return self.target.copy()
        knots, rows = self._traj
        if t_ns >= knots[-1]:
            self.target, self._traj = rows[-1].copy(), None  # done: hold the last point
            return self.target.copy()
        if t_ns <= knots[0]:
            return rows[0].copy()
        k = int(np.searchsorted(knots, t_ns, side="right"))  # knots[k-1] <= t < knots[k]
        w = (t_ns - knots[k - 1]) / (knots[k] - knots[k - 1])
        return (1 - w) * rows[k - 1] + w * rows[k]
