"""Scripted demonstrations: Cartesian waypoints through the mocap scene, executed in joint space.

ACT's recipe for simulated demonstrations, run in lockstep:

* gym-aloha's end-effector scene welds each gripper to a mocap body. A waypoint script moves
  the mocap bodies (position, orientation, gripper opening) along piecewise-linear paths
  computed from the seeded object placement; the joint positions the arms take are the
  actions. That scene runs with contacts off and its objects floating, i.e. purely as the
  arms' inverse kinematics.
* Each action is executed at once by the joint-position task, the one policies are
  evaluated in. Its objects are the ones the script looks at, so where a grasp really landed
  steers the rest (cube handover, peg alignment); its reward decides success.

The result is an ordinary joint trajectory: ``AlohaSim.reset(seed)`` and the same actions
reproduce the episode exactly.

Waypoints are absolute step indices on gym-aloha's 300-step (6 s) episode; a longer episode
holds the last pose. Positions are those of the mocap body, which sits between the fingers
about 2 cm short of their ends, in the world frame (metres; the table top is z=0, +y points
away from the robot bases, the left arm's base is at x<0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_accel_ros.sim.aloha import TASK_NAMES, MocapSim, SimError

# ---------------------------------------------------------------------------- quaternions
# wxyz, the order MuJoCo uses for mocap_quat.


def quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product a * b (apply b, then a)."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return np.array(
        [
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ]
    )


def quat_axis_angle(axis: tuple[float, float, float], degrees: float) -> np.ndarray:
    axis_v = np.asarray(axis, dtype=np.float64)
    axis_v = axis_v / np.linalg.norm(axis_v)
    half = np.deg2rad(degrees) / 2.0
    return np.concatenate([[np.cos(half)], np.sin(half) * axis_v])


def quat_nlerp(a: np.ndarray, b: np.ndarray, frac: float) -> np.ndarray:
    """Normalized linear interpolation; close enough to slerp for the small rotations here,
    and the sign flip keeps it on the short arc."""
    if np.dot(a, b) < 0.0:
        b = -b
    q = (1.0 - frac) * a + frac * b
    return q / np.linalg.norm(q)


# ------------------------------------------------------------------------------ waypoints


@dataclass(frozen=True)
class Waypoint:
    step: int
    xyz: tuple[float, float, float]
    quat: tuple[float, float, float, float]  # wxyz
    gripper: float  # 0 closed .. 1 open


class ArmPath:
    """Piecewise-linear interpolation through waypoints sorted by step."""

    def __init__(self, waypoints: list[Waypoint]) -> None:
        if not waypoints:
            raise SimError("an arm path needs at least one waypoint")
        steps = [w.step for w in waypoints]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise SimError(f"waypoint steps must be strictly increasing, got {steps}")
        self.waypoints = waypoints

    def __call__(self, step: int) -> np.ndarray:
        """[8] xyz, quat, gripper at ``step`` (held before the first and after the last)."""
        wps = self.waypoints
        if step <= wps[0].step:
            return _pack(wps[0].xyz, np.asarray(wps[0].quat), wps[0].gripper)
        for prev, nxt in zip(wps[:-1], wps[1:], strict=True):
            if step <= nxt.step:
                frac = (step - prev.step) / (nxt.step - prev.step)
                xyz = (1.0 - frac) * np.asarray(prev.xyz) + frac * np.asarray(nxt.xyz)
                quat = quat_nlerp(np.asarray(prev.quat), np.asarray(nxt.quat), frac)
                grip = (1.0 - frac) * prev.gripper + frac * nxt.gripper
                return _pack(xyz, quat, grip)
        last = wps[-1]
        return _pack(last.xyz, np.asarray(last.quat), last.gripper)


def _pack(xyz, quat, gripper) -> np.ndarray:
    return np.concatenate([np.asarray(xyz, dtype=np.float64), quat, [gripper]])


def _wp(step: int, xyz, quat: np.ndarray, gripper: float) -> Waypoint:
    return Waypoint(step, tuple(float(v) for v in xyz), tuple(float(v) for v in quat), float(gripper))


OPEN, CLOSED = 1.0, 0.0


def quat_conj(q: np.ndarray) -> np.ndarray:
    return np.array([q[0], -q[1], -q[2], -q[3]])


def quat_fraction(q: np.ndarray, frac: float) -> np.ndarray:
    """The rotation ``q`` scaled to ``frac`` of its angle (same axis, short arc)."""
    q = q if q[0] >= 0.0 else -q
    angle = 2.0 * np.arccos(np.clip(q[0], -1.0, 1.0))
    s = np.sin(angle / 2.0)
    if s < 1e-9:
        return np.array([1.0, 0.0, 0.0, 0.0])
    axis = q[1:] / s
    half = frac * angle / 2.0
    return np.concatenate([[np.cos(half)], np.sin(half) * axis])


def quat_x_axis(q: np.ndarray) -> np.ndarray:
    """[3] the body x axis of orientation ``q`` in the world frame."""
    w, x, y, z = q
    return np.array([1 - 2 * (y * y + z * z), 2 * (x * y + w * z), 2 * (x * z - w * y)])


def _ramp(step: int, start: int, end: int) -> float:
    """0 before ``start``, 1 after ``end``, linear in between."""
    return float(np.clip((step - start) / max(end - start, 1), 0.0, 1.0))


class TransferCubeScript:
    """Right arm picks the cube from above and lifts it to the middle of the table; the left
    arm, its fingers rolled vertical so they do not clash with the right ones, takes it over,
    then both arms back off.

    A lifted cube hangs where the grasp happened to catch it and slides a little in the right
    fingers, so the left arm aims at the cube's measured position until its fingers close (the
    script is an expert with privileged state).
    """

    def __init__(self, start: np.ndarray, objects: np.ndarray, detour: tuple[np.ndarray, int] | None = None) -> None:
        left0, right0 = start[0], start[1]  # [7] mocap poses after reset
        # The right gripper pitches down towards the table (at rest its fingers point to -x).
        r_down = quat_mul(quat_axis_angle((0, 1, 0), -55.0), right0[3:])
        # The left gripper stays horizontal but rolls 90 degrees: its fingers close along z.
        self.l_roll = quat_mul(quat_axis_angle((1, 0, 0), 90.0), left0[3:])
        hand = np.array([0.02, 0.5, 0.22])  # where the right arm presents the cube
        # A detour (decoy xy, switch tick): the right arm first heads for the decoy as if the
        # cube lay there, then from the switch on turns to the real cube; the steps after
        # the switch are what a policy that reached for the wrong place needs to have seen.
        # Arriving above the cube takes 25 ticks at least, so the later schedule (both arms)
        # runs ``delay`` ticks late.
        self.switch, delay = 0, 0
        self.decoy: ArmPath | None = None
        if detour is not None:
            decoy_xy, self.switch = np.asarray(detour[0], dtype=np.float64), int(detour[1])
            if not 1 <= self.switch <= self.latest_switch:
                raise SimError(f"a detour switches at tick 1..{self.latest_switch}, got {self.switch}")
            self.decoy = ArmPath(self._right_waypoints(right0, r_down, hand, decoy_xy, 0))
            delay = max(0, self.switch + 25 - 50)
        waypoints = self._right_waypoints(right0, r_down, hand, np.asarray(objects[:2], dtype=np.float64), delay)
        if self.decoy is not None:
            at = self.decoy(self.switch)
            waypoints = [_wp(self.switch, at[:3], at[3:7], at[7])] + waypoints[1:]
        self.right = ArmPath(waypoints)
        self.wait = hand + (-0.15, 0.0, 0.0)  # beside the handover, out of the way
        self.left = ArmPath([_wp(0, left0[:3], left0[3:], CLOSED), _wp(110 + delay, self.wait, self.l_roll, OPEN)])
        # Aim at the cube while approaching (until ``aim_until``, then the target is frozen:
        # following it further would chase a cube the left fingers push), reach 150..175,
        # close 180..195, hold while the right lets go, carry the cube away 225..270.
        self.reach, self.close, self.carry = (150 + delay, 175 + delay), (180 + delay, 195 + delay), (225 + delay, 270 + delay)
        self.aim_until = 165 + delay
        self.grasp_xyz = self.wait

    # The last tick a detour may switch at: the decoy path is still above the grasp height
    # (it descends from tick 50), and the delayed schedule ends by tick 290 of 300.
    latest_switch = 45

    def _right_waypoints(self, right0: np.ndarray, r_down: np.ndarray, hand: np.ndarray, cube_xy: np.ndarray,
                         delay: int) -> list[Waypoint]:  # fmt: skip
        cx, cy, d = float(cube_xy[0]), float(cube_xy[1]), delay
        return [
            _wp(0, right0[:3], right0[3:], CLOSED),
            _wp(50 + d, (cx, cy, 0.12), r_down, OPEN),  # above the cube
            _wp(80 + d, (cx, cy, self.grasp_z), r_down, OPEN),  # fingers around it
            _wp(100 + d, (cx, cy, self.grasp_z), r_down, CLOSED),  # grasp
            _wp(140 + d, hand, r_down, CLOSED),  # lift to the middle
            _wp(200 + d, hand, r_down, CLOSED),
            _wp(210 + d, hand, r_down, OPEN),  # let go
            _wp(220 + d, hand, r_down, OPEN),
            _wp(265 + d, hand + (0.15, 0.0, 0.05), r_down, OPEN),  # back off
        ]

    # Mocap height when grasping the cube: fingertips pressed on the table could not close.
    grasp_z = 0.015
    # Left fingertips this far from the cube's centre (x): the right fingers hold its other half.
    grasp_offset = (-0.01, 0.0, 0.0)

    def __call__(self, step: int, objects: np.ndarray) -> np.ndarray:
        """[16] mocap action at ``step`` given the current object poses."""
        if step < self.reach[0]:
            left = self.left(step)
        else:
            if step <= self.aim_until:
                self.grasp_xyz = objects[:3] + np.asarray(self.grasp_offset)
            xyz = self.wait + _ramp(step, *self.reach) * (self.grasp_xyz - self.wait)
            xyz = xyz + _ramp(step, *self.carry) * np.array([-0.15, 0.0, 0.02])
            grip = OPEN + _ramp(step, *self.close) * (CLOSED - OPEN)
            left = _pack(xyz, self.l_roll, grip)
        right = self.decoy(step) if self.decoy is not None and step < self.switch else self.right(step)
        return np.concatenate([left, right])


class InsertionScript:
    """Left arm picks the socket, right arm the peg, both from above; they lift them to face
    each other in the middle and the right arm pushes the peg into the socket.

    The socket's opening leaves the peg 8 mm of play, less than a grasp's offsets and tilts,
    so from ``servo_step`` on the right arm servos the measured peg pose onto the socket's
    axis (position and orientation) while the gap between their centres closes; the peg
    touches the pin below 0.10 m (both are 0.12 m long, the pin 0.08 m).
    """

    pitch = 90.0  # grasp straight from above: a 2 cm peg leaves no room for slanted fingers
    grasp_z = 0.02  # mocap height at the grasp: fingers around the objects, clear of the table
    servo_step = 180
    ramp, settle = 15, 10  # steps to apply the first correction, and to let the arm catch up
    # Integral gains per step (position error across the axis, orientation error). Low: the
    # arm answers a target change with a lag of ~10 steps, and higher gains oscillate.
    gain = 0.02
    rot_gain = 0.05
    max_integral = 0.02  # metres
    # (step, centre distance along the socket's axis): line up 0.15 apart, approach, then press
    # gently past the touching point (0.10) so the peg stays on the pin.
    gap = ((190, 0.15), (215, 0.15), (255, 0.105), (285, 0.095))

    def __init__(self, start: np.ndarray, objects: np.ndarray) -> None:
        left0, right0 = start[0], start[1]  # [7] mocap poses after reset
        px, py = float(objects[0]), float(objects[1])  # peg
        sx, sy = float(objects[7]), float(objects[8])  # socket
        l_down = quat_mul(quat_axis_angle((0, 1, 0), self.pitch), left0[3:])
        r_down = quat_mul(quat_axis_angle((0, 1, 0), -self.pitch), right0[3:])
        meet_y, meet_z, gz = 0.5, 0.2, self.grasp_z

        def pick(x: float, y: float, down: np.ndarray, rest: np.ndarray, present: tuple) -> ArmPath:
            return ArmPath(
                [
                    _wp(0, rest[:3], rest[3:], CLOSED),
                    _wp(60, (x, y, 0.10), down, OPEN),  # above the object
                    _wp(95, (x, y, gz), down, OPEN),  # fingers around it
                    _wp(115, (x, y, gz), down, CLOSED),  # grasp
                    _wp(125, (x, y, gz), down, CLOSED),
                    _wp(145, (x, y, 0.10), down, CLOSED),  # lift
                    _wp(180, present, down, CLOSED),  # face the other arm
                ]
            )

        self.left = pick(sx, sy, l_down, left0, (-0.10, meet_y, meet_z))
        self.right = pick(px, py, r_down, right0, (0.10, meet_y, meet_z))
        self.quat = r_down
        self.base = self.first_target = self.jump = self.integral = np.zeros(3)

    def _gap(self, step: int) -> float:
        steps, gaps = zip(*self.gap, strict=True)
        return float(np.interp(step, steps, gaps))

    def __call__(self, step: int, objects: np.ndarray) -> np.ndarray:
        """[16] mocap action at ``step`` given the current object poses."""
        if step < self.servo_step:
            return np.concatenate([self.left(step), self.right(step)])
        peg_xyz, sock_xyz, sock_q = objects[0:3], objects[7:10], objects[10:14]
        # Where the peg's centre belongs: on the socket's axis, ``gap`` towards +x.
        axis = quat_x_axis(sock_q)
        axis = axis if axis[0] >= 0.0 else -axis
        target = sock_xyz + self._gap(step) * axis
        if step == self.servo_step:
            # Correct the misalignment seen now over ``ramp`` steps, then follow the planned
            # approach (feed-forward) and integrate what error remains.
            self.base = self.right(step)[:3].copy()
            self.first_target = target
            self.jump = target - peg_xyz
            self.integral = np.zeros(3)
        if step >= self.servo_step + self.ramp + self.settle:
            # Only across the axis: along it the pin stops the peg, and integrating an error
            # that cannot close would shove both arms across the table. Bounded for the same
            # reason should the peg jam.
            err = target - peg_xyz
            self.integral = self.integral + self.gain * (err - np.dot(err, axis) * axis)
            norm = float(np.linalg.norm(self.integral))
            if norm > self.max_integral:
                self.integral = self.integral * (self.max_integral / norm)
        ramp = _ramp(step, self.servo_step, self.servo_step + self.ramp)
        xyz = self.base + ramp * self.jump + (target - self.first_target) + self.integral
        # The peg pivots about the fingers' closing axis when moved or bumped; turn the gripper
        # by a fraction of the peg-to-socket rotation each step to keep it on the socket's axis.
        err = quat_mul(sock_q, quat_conj(objects[3:7]))
        self.quat = quat_mul(quat_fraction(err, self.rot_gain), self.quat)
        self.quat = self.quat / np.linalg.norm(self.quat)
        return np.concatenate([self.left(step), _pack(xyz, self.quat, CLOSED)])


class ScriptedExpert:
    """The waypoint script of one task, turned into joint-position actions.

    Every step the script reads the object poses of the joint task it drives (where a grasp
    really landed), moves the mocap targets, and the mocap scene (objects ghosted, so it is
    purely the arms' inverse kinematics) yields the joint positions to command. The actions
    form an ordinary joint trajectory: replayed from the same seed, it reproduces the episode.

    Example::

        sim = AlohaSim(SimConfig(task="insertion"))
        sim.reset(seed=3)
        expert = ScriptedExpert("insertion", seed=3, object_qpos=sim.object_qpos)
        for t in range(EPISODE_STEPS):
            sim.step(expert.act(t, sim.object_qpos))
    """

    def __init__(self, task: str, seed: int, object_qpos: np.ndarray, detour: tuple[np.ndarray, int] | None = None) -> None:
        """``detour``: (decoy xy, switch tick), transfer_cube only (see :class:`TransferCubeScript`)."""
        if task not in TASK_NAMES:
            raise SimError(f"unknown task {task!r}; choose one of {', '.join(TASK_NAMES)}")
        if detour is not None and task != "transfer_cube":
            raise SimError(f"detours are scripted for transfer_cube only, not {task!r}")
        self.task = task
        self.mocap = MocapSim(task, ghost_objects=True)
        self.mocap.reset(seed)
        obj = np.asarray(object_qpos, dtype=np.float64)
        self.script = TransferCubeScript(self.mocap.mocap_pose, obj, detour) if task == "transfer_cube" else InsertionScript(self.mocap.mocap_pose, obj)

    def act(self, step: int, object_qpos: np.ndarray) -> np.ndarray:
        """[14] the joint-position action for control step ``step`` (0-based, in order)."""
        self.mocap.step(self.script(step, np.asarray(object_qpos, dtype=np.float64)))
        return self.mocap.joint_command()
