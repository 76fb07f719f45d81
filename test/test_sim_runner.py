"""The simulator loop without ROS and without MuJoCo (sim/runner.py): a stand-in physics, the
publish callbacks recorded; pause, lockstep, policy sync and episodes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from helpers import wait_for  # test/helpers.py
from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES
from vla_accel_ros.sim.live import DT_NS
from vla_accel_ros.sim.runner import LiveSimConfig, SimRunner

START = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 0.5] * 2)


@dataclass
class _Obs:
    qpos: np.ndarray
    images: dict = field(default_factory=dict)
    reward: float = 0.0
    success: bool = False

    @property
    def qvel(self) -> np.ndarray:
        return np.zeros(14)


class _Physics:
    def free(self) -> None:
        pass


class FakeSim:
    """Steps straight to the target; renders a black frame per camera asked for."""

    instruction = "pick up the cube"

    def __init__(self) -> None:
        self.physics = _Physics()
        self.seeds: list[int] = []
        self.q = START.copy()

    def _obs(self, cameras) -> _Obs:
        return _Obs(self.q.copy(), {c: np.zeros((4, 4, 3), np.uint8) for c in cameras})

    def reset(self, seed: int, cameras=()) -> _Obs:
        self.seeds.append(seed)
        self.q = START.copy()
        return self._obs(cameras)

    def observe(self, cameras=()) -> _Obs:
        return self._obs(cameras)

    def step(self, target, cameras=()) -> _Obs:
        self.q = np.asarray(target, np.float64).copy()
        return self._obs(cameras)


class Outputs:
    """SimOutputs that records every call."""

    def __init__(self, watched=("top",)) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple] = []
        self.watched = list(watched)

    def _add(self, *call) -> None:
        with self.lock:
            self.calls.append(call)

    def of(self, kind: str) -> list[tuple]:
        with self.lock:
            return [c[1:] for c in self.calls if c[0] == kind]

    def frames(self, images, stamp):
        self._add("frames", sorted(images), stamp)

    def joint_states(self, qpos, qvel, stamp):
        self._add("joint_states", stamp)

    def clock(self, t_ns):
        self._add("clock", t_ns)

    def action(self, target, stamp):
        self._add("action", stamp)

    def episode_marker(self, episode):
        self._add("episode", episode)

    def instruction(self, text):
        self._add("instruction", text)

    def outcome(self, success):
        self._add("outcome", success)

    def reset_policy(self):
        self._add("reset_policy")

    def watched_cameras(self):
        return list(self.watched)

    def now(self):
        return 0

    def log(self, level, text):
        self._add("log", level, text)


@pytest.fixture
def run():
    runners = []

    def start(**cfg) -> tuple[SimRunner, Outputs, FakeSim]:
        base = dict(wait_for_policy=False, lockstep=False, real_time_factor=0.0, episode_steps=0)
        out, sim = Outputs(), FakeSim()
        runner = SimRunner(LiveSimConfig(**{**base, **cfg}), out, make_sim=lambda c: sim)
        runners.append(runner)
        runner.start()
        return runner, out, sim

    yield start
    for r in runners:
        r.close()


def test_state_frames_and_clock_go_out_in_order_on_one_clock(run):
    runner, out, _ = run()
    wait_for(lambda: runner.steps >= 5, timeout=10, what="five steps")
    runner.close()
    clock = [t for (t,) in out.of("clock")]
    assert clock[0] == DT_NS and all(b - a == DT_NS for a, b in zip(clock, clock[1:]))
    kinds = [c[0] for c in out.calls if c[0] in ("frames", "joint_states", "clock")]
    assert kinds[:3] == ["frames", "joint_states", "clock"]  # a node woken by the clock finds the state
    assert out.of("episode") == [(0,)] and out.of("instruction") == [("pick up the cube",)]
    assert runner.frames_by_camera["top"] == runner.frames > 0


def test_wait_for_policy_holds_sim_time_until_ready(run):
    runner, out, _ = run(wait_for_policy=True)
    wait_for(lambda: len(out.of("joint_states")) >= 2, timeout=10, what="paused state updates")
    assert runner.steps == 0 and runner.waiting_for_policy and {t for (t,) in out.of("clock")} == {DT_NS}
    runner.set_ready(True)
    wait_for(lambda: runner.steps >= 3, timeout=10, what="steps once the policy is ready")


def test_lockstep_steps_once_per_command_of_the_tick(run):
    runner, _, sim = run(lockstep=True, command_timeout_ms=60_000.0)
    names, target = list(ALOHA_JOINT_NAMES), START + 0.1
    target[[6, 13]] = 0.5
    for k in range(3):
        wait_for(lambda k=k: runner.sim_now == (k + 1) * DT_NS, timeout=10, what=f"tick {k + 1}")
        assert runner.steps == k  # no command for this tick yet: sim time holds
        runner.command(lambda d: d.from_joint_state(names, list(target)), stamp_ns=runner.sim_now)
    wait_for(lambda: runner.steps == 3, timeout=10, what="the third step")
    assert runner.commands_at_step == 3 and runner.lockstep_timeouts == 0
    assert np.allclose(sim.q[:6], target[:6])


def test_policy_sync_holds_sim_time_while_a_request_is_unanswered(run):
    runner, _, _ = run(policy_sync=True, policy_timeout_ms=60_000.0)
    wait_for(lambda: runner.steps >= 2, timeout=10, what="steps")
    runner.requested(1)
    wait_for(lambda: runner.policy_waits == 1, timeout=10, what="the wait for the chunk")
    held = runner.steps
    time.sleep(0.1)
    assert runner.steps == held  # sim time holds while the policy thinks
    runner.answered(1, runner.sim_now)
    wait_for(lambda: runner.steps > held + 2, timeout=10, what="steps after the answer")


def test_episodes_end_with_their_outcome_reset_the_policy_and_use_the_next_seed(run):
    runner, out, sim = run(episode_steps=3, seed=5)
    wait_for(lambda: runner.episodes.finished >= 2, timeout=10, what="two episodes")
    assert sim.seeds[:3] == [5, 6, 7]  # episode i: seed + i
    assert out.of("outcome")[:2] == [(False,), (False,)]
    assert [e for (e,) in out.of("episode")][:3] == [0, 1, 2]
    assert len(out.of("reset_policy")) >= 1  # not for the first episode
    clock = [t for (t,) in out.of("clock")]
    assert all(b > a for a, b in zip(clock, clock[1:]))  # resets never move sim time back


def test_a_simulator_that_cannot_start_fails_the_start():
    def broken(cfg):
        raise RuntimeError("no EGL")

    runner = SimRunner(LiveSimConfig(), Outputs(), make_sim=broken)
    with pytest.raises(RuntimeError, match="no EGL"):
        runner.start()
