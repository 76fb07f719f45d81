"""The last line before the motors: limits, per-step clamp, watchdog, e-stop and enable.

Every command the controller publishes passes :meth:`SafetyFilter.filter`: it is clipped to
the joint limits, then moved at most ``max_step`` from the reference (the previous command, or
the measured position right after start, an e-stop or a disable; LeRobot's
``max_relative_target``). :class:`Watchdog` measures the time since the last fresh chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_accel_ros.core.robot.config import ARM_JOINTS, RobotConfig, SafetyConfig
from vla_accel_ros.core.robot.kinematics import VX300S_LIMITS


def default_limits(robot: RobotConfig) -> tuple[np.ndarray, np.ndarray]:
    """ViperX 300 s limits for names ending in an ALOHA arm joint, [0, 1] for grippers,
    unbounded otherwise.  # ([D], [D])"""
    lo = np.full(robot.dim, -np.inf)
    hi = np.full(robot.dim, np.inf)
    for i, name in enumerate(robot.joint_names):
        if name in robot.grippers:
            lo[i], hi[i] = 0.0, 1.0
            continue
        for j in ARM_JOINTS:
            if name == j or name.endswith(f"_{j}"):
                lo[i], hi[i] = VX300S_LIMITS[j]
    return lo, hi


@dataclass(frozen=True)
class FilterResult:
    command: np.ndarray  # [D] float64
    limited: bool  # a limit clipped some dimension
    clamped: bool  # the per-step clamp shortened some dimension


class SafetyFilter:
    def __init__(self, robot: RobotConfig, config: SafetyConfig) -> None:
        self.robot = robot
        self.set_config(config)
        self._last: np.ndarray | None = None
        self.estop = False
        self.enabled = config.start_enabled
        self.limited = self.clamped = 0  # counts, for diagnostics

    def set_config(self, config: SafetyConfig) -> None:
        self.config = config
        lo, hi = default_limits(self.robot)
        self.lower = np.asarray(config.lower, np.float64) if config.lower else lo
        self.upper = np.asarray(config.upper, np.float64) if config.upper else hi
        step = np.asarray(config.max_step, np.float64)
        self.max_step = np.broadcast_to(step, (self.robot.dim,)).copy() if step.size == 1 else step

    # -- output gating ----------------------------------------------------------------------
    @property
    def output_allowed(self) -> bool:
        return self.enabled and not self.estop

    def set_estop(self, active: bool) -> bool:
        """Returns True when the state changed. Releasing it keeps output disabled when
        ``estop_requires_enable`` (an operator must re-enable deliberately)."""
        active = bool(active)
        if active == self.estop:
            return False
        self.estop = active
        self._last = None
        if not active and self.config.estop_requires_enable:
            self.enabled = False
        return True

    def set_enabled(self, enabled: bool) -> tuple[bool, str]:
        if enabled and self.estop:
            return False, "e-stop is active; release it first"
        changed = enabled != self.enabled
        self.enabled = bool(enabled)
        self._last = None  # the next command is clamped against the measured position
        return True, ("enabled" if enabled else "disabled") + ("" if changed else " (unchanged)")

    def forget(self) -> None:
        """Clamp the next command against the measured position instead of the last command."""
        self._last = None

    # -- commands -------------------------------------------------------------------------------
    def has_reference(self, measured: np.ndarray | None) -> bool:
        """Whether the next command can be clamped (or the config does not ask for it)."""
        return self._last is not None or measured is not None or not self.config.require_reference

    def filter(self, action: np.ndarray, measured: np.ndarray | None = None) -> FilterResult:
        """``action`` [D] -> the command to publish (limits, then the per-step clamp)."""
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape[0] != self.robot.dim:
            raise ValueError(f"action has {a.shape[0]} dims, the robot {self.robot.dim}")
        cmd = np.clip(a, self.lower, self.upper)
        limited = bool(np.any(cmd != a))
        ref = self._last if self._last is not None else measured
        clamped = False
        if ref is not None:
            delta = np.clip(cmd - ref, -self.max_step, self.max_step)
            stepped = ref + delta
            clamped = bool(np.any(np.abs(stepped - cmd) > 1e-12))
            cmd = np.clip(stepped, self.lower, self.upper)
        self._last = cmd.copy()
        self.limited += limited
        self.clamped += clamped
        return FilterResult(cmd, limited, clamped)

    @property
    def last_command(self) -> np.ndarray | None:
        return None if self._last is None else self._last.copy()


class Watchdog:
    """Trips when ``timeout_ns`` of (ROS) time pass without a fresh chunk (one with an action
    still to come); re-arms on the next.
    Time, not ticks: a loop that runs below its rate must not hold late. Not armed before the
    first chunk (waiting for the policy to start is not a failure)."""

    def __init__(self, timeout_ns: int) -> None:
        self.timeout_ns = int(timeout_ns)
        self._last_ns: int | None = None
        self.tripped = False
        self.trips = 0

    def chunk(self, now_ns: int) -> None:
        self._last_ns = int(now_ns)
        self.tripped = False

    def arm(self, now_ns: int) -> None:
        """The policy answered, but nothing of its answer runs (a chunk all in the past): arm the
        watchdog if no chunk did yet, without refreshing or releasing it."""
        if self._last_ns is None:
            self._last_ns = int(now_ns)

    def since_chunk_ns(self, now_ns: int) -> int | None:
        return None if self._last_ns is None else int(now_ns) - self._last_ns

    def check(self, now_ns: int) -> bool:
        """True exactly on the call it trips."""
        if self._last_ns is None or self.tripped:
            return False
        if int(now_ns) - self._last_ns > self.timeout_ns:
            self.tripped = True
            self.trips += 1
            return True
        return False

    def reset(self) -> None:
        self._last_ns = None
        self.tripped = False
