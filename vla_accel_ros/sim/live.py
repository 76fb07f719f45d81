"""What a live simulator loop needs besides the physics, without ROS: pacing against the
wall clock, which steps render, obs-to-chunk latency on both clocks, episode bookkeeping and
the arms' start pose; :mod:`vla_accel_ros.sim.runner` runs the loop with them and
``vla_accel_ros.ros.aloha_sim_node`` is the ROS side.

Sim time advances exactly ``DT`` (20 ms) per step, as integer nanoseconds, never backwards
(episodes follow one another on one clock), so every node of a ``use_sim_time`` graph sees
one monotonic clock and the controller's 50 Hz timer fires once per step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vla_accel_ros.core.robot.loop_stats import Percentiles
from vla_accel_ros.sim.aloha import ACTION_DIM, DT, AlohaSim, SimError

DT_NS = int(round(DT * 1e9))


class Pacer:
    """Keeps sim time at most ``real_time_factor`` times as fast as the wall clock (0: no
    limit). A loop that falls behind (rendering is slow on CPU) runs on from where it is
    instead of racing to catch up, so a slow stretch never turns into a burst of steps."""

    def __init__(self, real_time_factor: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rtf = float(real_time_factor)
        self._clock = clock
        self._ref: tuple[float, float] | None = None  # (wall s, sim s) that correspond

    def set_rate(self, real_time_factor: float) -> None:
        if float(real_time_factor) != self.rtf:
            self.rtf = float(real_time_factor)
            self._ref = None

    def restart(self) -> None:
        """Forget the reference (after a pause: the time spent paused is not owed)."""
        self._ref = None

    def delay(self, sim_s: float) -> float:
        """Seconds to wait before sim time ``sim_s`` may be published (0: now)."""
        now = self._clock()
        if self.rtf <= 0:
            return 0.0
        if self._ref is None:
            self._ref = (now, sim_s)
            return 0.0
        due = self._ref[0] + (sim_s - self._ref[1]) / self.rtf
        if due < now:  # behind: re-anchor here, never catch up
            self._ref = (now, sim_s)
            return 0.0
        return due - now

    def wait(self, sim_s: float, stop: threading.Event) -> None:
        d = self.delay(sim_s)
        if d > 0:
            stop.wait(d)


def render_every(camera_rate_hz: float) -> int:
    """Steps between two rendered frames for a camera rate in Hz of sim time (>= 1)."""
    if camera_rate_hz <= 0:
        raise SimError(f"camera_rate_hz must be > 0, got {camera_rate_hz}")
    return max(1, int(round(1.0 / (camera_rate_hz * DT))))


class LatencyTracker:
    """Obs-to-chunk latency on the sim clock and on the wall clock.

    The simulator remembers when (wall) it published each frame stamp; a chunk carries the
    stamp of the observation it was computed from (its header), so when it arrives both
    latencies are known: ``sim_now - stamp`` (what the controller measures under
    ``use_sim_time``) and the wall time since the frame left the simulator."""

    def __init__(self, history: int = 512, window: int = 1000) -> None:
        self._published: dict[int, int] = {}
        self._history, self._window = history, window
        self.sim_ms = Percentiles(window)
        self.wall_ms = Percentiles(window)
        self.unknown = 0  # chunks for stamps this simulator did not publish (or forgot)
        self._lock = threading.Lock()

    def published(self, stamp_ns: int, wall_ns: int) -> None:
        with self._lock:
            self._published[int(stamp_ns)] = int(wall_ns)
            while len(self._published) > self._history:
                self._published.pop(next(iter(self._published)))

    def chunk(self, stamp_ns: int, sim_now_ns: int, wall_now_ns: int) -> bool:
        with self._lock:
            wall = self._published.get(int(stamp_ns))
            if wall is None:
                self.unknown += 1
                return False
            self.sim_ms.add((sim_now_ns - stamp_ns) / 1e6)
            self.wall_ms.add((wall_now_ns - wall) / 1e6)
            return True

    def forget(self) -> None:
        """Drop the published frames (e.g. sim time paused: their wall age means nothing)."""
        with self._lock:
            self._published.clear()

    def reset(self) -> None:
        with self._lock:
            self.sim_ms, self.wall_ms = Percentiles(self._window), Percentiles(self._window)
            self.unknown = 0


@dataclass
class EpisodeStats:
    """Per-run episode bookkeeping (the node's summary)."""

    episode: int = -1  # index of the current episode
    seed: int = 0
    step: int = 0  # steps into the current episode
    reward: float = 0.0  # the task's grade now (0..4)
    max_reward: float = 0.0  # best grade of the current episode
    success: bool = False
    finished: int = 0  # episodes ended since the stats were reset
    successes: int = 0
    best_reward: float = 0.0  # best grade of any episode since the stats were reset
    # Ended episodes since the stats were reset: an evaluation through the graph reads each
    # one's seed and best grade here (no topic carries the reward).
    results: list[dict[str, object]] = field(default_factory=list)

    def begin(self, episode: int, seed: int) -> None:
        self.episode, self.seed = episode, seed
        self.step, self.reward, self.max_reward, self.success = 0, 0.0, 0.0, False

    def after_step(self, reward: float, success: bool) -> None:
        self.step += 1
        self.reward = float(reward)
        self.max_reward = max(self.max_reward, self.reward)
        self.success = self.success or bool(success)
        self.best_reward = max(self.best_reward, self.max_reward)

    def end(self) -> None:
        self.finished += 1
        self.successes += int(self.success)
        self.results.append(
            {"episode": self.episode, "seed": self.seed, "success": bool(self.success), "max_reward": self.max_reward}
        )

    def reset_counts(self) -> None:
        self.finished = self.successes = 0
        self.best_reward = self.max_reward
        self.results = []


def place_arms(sim: AlohaSim, pose: np.ndarray) -> None:
    """Put both arms at ``pose`` [14] (arm rad, grippers normalized) with the position
    actuators holding it, right after ``sim.reset``: a start pose other than the scene's.

    The scene's qpos starts with per arm six joints and two fingers (the second mirrored),
    and its position actuators take the same 16 values."""
    q = np.asarray(pose, np.float64)
    if q.shape != (ACTION_DIM,) or not np.all(np.isfinite(q)):
        raise SimError(f"start pose must be {ACTION_DIM} finite values, got {q}")
    from gym_aloha.constants import unnormalize_puppet_gripper_position as unnormalize  # noqa: PLC0415 - the task's map

    full = []
    for arm in (q[:7], q[7:]):
        finger = float(unnormalize(arm[6]))
        full += [*arm[:6], finger, -finger]
    with sim.physics.reset_context():
        sim.physics.data.qpos[:16] = full
        sim.physics.data.ctrl[:16] = full
