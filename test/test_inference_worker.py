"""The policy node's worker without ROS (core/robot/inference.py), around a stand-in policy."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

import pytest

from vla_accel_ros.core.errors import ConfigError, ObservationError
from vla_accel_ros.core.interrupt import Interrupted, interruptible
from vla_accel_ros.core.interrupt import check as check_interrupt
from vla_accel_ros.core.parity import fixed_observation
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import PolicyNodeConfig, RobotConfig
from vla_accel_ros.core.robot.inference import InferenceWorker, Request
from vla_accel_ros.core.robot.motion import FINE
from vla_accel_ros.core.robot.observation import AssembledObservation, ObservationChannel
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance

MS = 1_000_000
ROBOT = RobotConfig(
    joint_names=("a_x", "b_x"), arms=("a", "b"), joint_state_topics=("/a", "/b"), joint_state_prefixes=("a_", "b_"), grippers=()
)


class FakePolicy:
    """The public interface the worker may use, recorded."""

    def __init__(self, refuse: bool = False) -> None:
        self.spec = SimpleNamespace(state_dim=2)
        self.seen: list = []
        self.resets = 0
        self.modes: list[str] = []
        self.configs: list[PolicyConfig] = []
        self.refuse = refuse
        self.planner_reset = ""  # what the planner itself would report

    def infer(self, obs, *, noise=None, guidance=None) -> ActionChunk:
        self.seen.append((obs, guidance))
        stats = {"reset_reason": self.planner_reset}
        return ActionChunk(np.zeros((2, 2), np.float32), obs.stamp_ns, 0.02, timings_ms={"total": 5.0}, stats=stats)

    def reset(self) -> None:
        self.resets += 1

    def configure(self, config: PolicyConfig) -> bool:
        if self.refuse:
            raise ConfigError("policy.cache.relevance_layer=99 but the model has 4 layers")
        self.configs.append(config)
        return True

    def set_motion_mode(self, mode: str) -> None:
        self.modes.append(mode)

    def text_ids(self, instruction: str) -> list[int]:
        ids = instruction.split()
        if len(ids) > 8:
            raise ObservationError(f"instruction is {len(ids)} tokens long with its template; the bundle accepts max_text_tokens=8")
        return ids


def _worker(**cfg) -> tuple[InferenceWorker, FakePolicy, list, list]:
    drops, logs = [], []
    w = InferenceWorker(
        PolicyNodeConfig(robot=ROBOT, request_wait_ms=0.0, **cfg), ObservationChannel(history=2),
        drop=lambda r, d: drops.append(r), log=lambda lvl, t: logs.append((lvl, t)),
    )  # fmt: skip
    w.policy = FakePolicy()
    w.state.update(0, ["x"], [1.0], 1000 * MS)
    w.state.update(1, ["x"], [2.0], 1000 * MS)
    return w, w.policy, drops, logs


def _obs(stamp: int) -> AssembledObservation:
    return AssembledObservation({"cam": np.zeros((4, 4, 3), np.uint8)}, stamp, 0, 0, 0)


def _job(w: InferenceWorker, stamp_ms: int):
    w.requests.put(Request(stamp_ms * MS, 1, 0))
    return w.next_job(0.0)


def test_a_request_gets_the_observation_it_names_with_its_guidance():
    w, policy, drops, _ = _worker()
    for s in (1000, 1020):
        w.channel.put(s * MS, _obs(s * MS))
    g = ChunkGuidance(np.zeros((2, 2), np.float32), 1, np.ones(2, np.float32))
    w.requests.put(Request(1000 * MS, 7, FINE, g, has_guidance=True))
    job = w.next_job(0.0)
    assert job.stamp_ns == 1000 * MS and job.request_id == 7 and job.guidance is g
    served = w.infer(job, lambda: 1050 * MS)
    assert served.latency_ms == 50.0 and served.motion_mode == "fine" and policy.modes == ["fine"]
    obs, guidance = policy.seen[-1]
    np.testing.assert_array_equal(obs.state, [1.0, 2.0])
    assert guidance is g and not drops and w.chunks == 1


def test_a_request_for_a_forgotten_observation_is_served_by_the_newest_without_guidance():
    w, _, drops, _ = _worker()
    w.requests.put(Request(900 * MS, 1, 0))
    assert w.next_job(0.0) is None and drops == ["no_observation"]
    for s in (1000, 1020, 1040):  # history of 2: 1000 is gone
        w.channel.put(s * MS, _obs(s * MS))
    w.requests.put(Request(1000 * MS, 2, 0, has_guidance=True))
    job = w.next_job(0.0)
    assert job.stamp_ns == 1040 * MS and job.guidance is None and w.superseded == 1
    assert drops[-1] == "guidance_dropped"


def test_an_observation_older_than_max_age_at_inference_start_is_not_used():
    """Issue 33: the observation a request names (or the newest, continuous) is at most
    max_age_ms (100 ms) old when its inference starts; an older one is counted and not used, a
    request is served by a fresh newer observation when there is one, and the age at start is
    a metric."""
    w, policy, drops, _ = _worker()
    w.channel.put(1000 * MS, _obs(1000 * MS))
    assert w.infer(_job(w, 1000), lambda: 1150 * MS) is None  # 150 ms old when it would start
    assert drops == ["stale_observation"] and not policy.seen
    w.channel.put(1140 * MS, _obs(1140 * MS))  # a fresh one arrived meanwhile
    served = w.infer(_job(w, 1000), lambda: 1150 * MS)
    assert served.chunk.stamp_ns == 1140 * MS and w.superseded == 1 and drops == ["stale_observation"] * 2
    values = w.health(failure="", alive=True, ready=True)[2]
    assert values["observation age at start ms max"] == 10.0 and values["observation age at start ms p50"] == 10.0
    c, cpolicy, cdrops, _ = _worker(trigger="continuous")
    c.channel.put(1000 * MS, _obs(1000 * MS))
    assert c.infer(c.next_job(0.0), lambda: 1101 * MS) is None and cdrops == ["stale_observation"] and not cpolicy.seen


def test_the_state_half_of_the_rule_gates_inference():
    w, policy, drops, _ = _worker(max_state_age_ms=100.0)
    w.channel.put(2000 * MS, _obs(2000 * MS))
    assert w.infer(_job(w, 2000), lambda: 2000 * MS) is None  # joint states from 1000 ms
    assert drops == ["stale_state"] and not policy.seen


def test_resets_happen_between_inferences_and_are_counted_once():
    w, policy, _, _ = _worker()
    w.channel.put(1000 * MS, _obs(1000 * MS))
    w.set_instruction("stack the cups")
    w.apply(None)
    assert policy.resets == 1
    served = w.infer(_job(w, 1000), lambda: 1000 * MS)
    assert served.reset_reason == "instruction" and policy.seen[-1][0].instruction == "stack the cups"
    assert w.reset_episode() == 1 and w.channel.latest() is None  # frames of the old episode are gone
    w.apply(None)
    w.channel.put(1020 * MS, _obs(1020 * MS))
    policy.planner_reset = "scene_cut"  # the planner's own reason does not count twice
    served = w.infer(_job(w, 1020), lambda: 1020 * MS)
    assert served.reset_reason == "episode" and policy.seen[-1][0].episode == 1 and w.resets_total == 2


def test_continuous_trigger_takes_each_observation_once():
    w, _, _, _ = _worker(trigger="continuous")
    assert w.next_job(0.0) is None
    w.channel.put(1000 * MS, _obs(1000 * MS))
    assert w.next_job(0.0).stamp_ns == 1000 * MS
    assert w.next_job(0.0) is None


def test_new_policy_options_go_through_configure_or_are_refused_and_the_running_ones_stay():
    w, policy, _, logs = _worker()
    restored = []
    w._restore = restored.append  # noqa: SLF001 - the node's callback
    new = PolicyNodeConfig(robot=ROBOT, request_wait_ms=0.0, policy=PolicyConfig(accel="cache"))
    w.apply(new)
    assert policy.configs == [new.policy] and logs[-1] == ("info", "applied policy.accel='cache'")
    w.channel.put(1000 * MS, _obs(1000 * MS))
    assert w.infer(_job(w, 1000), lambda: 1000 * MS).reset_reason == "config"
    policy.refuse = True
    w.apply(PolicyNodeConfig(robot=ROBOT, request_wait_ms=0.0, max_state_age_ms=300.0, policy=PolicyConfig(accel="none")))
    assert logs[-1][0] == "error" and "policy.accel='none' not applied" in logs[-1][1] and "relevance_layer" in logs[-1][1]
    # The running configuration is untouched where the policy refused; the rest applies.
    assert w.cfg.policy == new.policy and w.cfg.max_state_age_ms == 300.0 and restored == [new.policy]


def test_a_planner_that_fails_to_build_or_a_failing_step_never_stops_the_loop():
    """run() survives what raises inside it: configure (a planner that cannot be built),
    next_job, infer; each is counted and logged, and the next step still serves."""
    w, policy, drops, logs = _worker(trigger="continuous")

    def broken_configure(config):
        raise RuntimeError("the planner could not be built")

    policy.configure = broken_configure
    pending = [PolicyNodeConfig(robot=ROBOT, request_wait_ms=0.0, trigger="continuous", policy=PolicyConfig(accel="cache"))]
    real_next_job, failures = w.next_job, []

    def next_job_failing_once(timeout_s=0.1):
        if not failures:
            failures.append(1)
            raise KeyError("a bug in next_job")
        return real_next_job(0.01)

    w.next_job = next_job_failing_once
    published = []

    def publish(served):
        published.append(served)
        w.stop()

    w.channel.put(1000 * MS, _obs(1000 * MS))
    thread = threading.Thread(target=w.run, args=(lambda: pending.pop() if pending else None, publish, lambda: 1000 * MS))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(published) == 1  # it went on and served after both failures
    assert w.errors == 1 and drops.count("inference_error") == 1 and any("KeyError" in t for _, t in logs)
    assert any("not applied" in t and "RuntimeError" in t for _, t in logs) and w.cfg.policy == PolicyConfig()
    assert w.last_chunk_at is not None and w.since_last_chunk_s() >= 0.0 and w.running_s() == 0.0


def test_health_says_loading_ready_slow_and_dead_worker():
    """The diagnostics' verdict (ROS-free): loading until ready, ERROR when the policy failed or
    the thread died without being stopped, WARN while one inference runs too long."""
    w, _policy, _drops, _logs = _worker(slow_inference_s=0.5)
    assert w.health(failure="", alive=True, ready=False)[:2] == ("warn", "loading the bundle")
    level, message, values = w.health(failure="", alive=True, ready=True)
    assert (level, message) == ("ok", "ready") and values["worker alive"] and values["chunks"] == 0
    assert w.health(failure="", alive=False, ready=True)[0] == "error"  # died, nobody stopped it
    assert w.health(failure="BundleError: no such bundle", alive=False, ready=False)[1].endswith("no such bundle")
    w.busy_since = time.monotonic() - 2.0  # an inference started 2 s ago
    level, message, _ = w.health(failure="", alive=True, ready=True)
    assert level == "warn" and "slow_inference_s" in message
    w.busy_since = None
    w.stop()
    assert w.health(failure="", alive=False, ready=True)[0] == "ok"  # stopped on purpose


def test_an_instruction_too_long_for_the_model_is_refused_and_the_previous_one_stays():
    w, policy, _, _ = _worker(max_instruction_chars=100)
    assert w.set_instruction("stack the cups") == "" and w.instruction_text() == "stack the cups"
    assert "max_instruction_chars 100" in w.set_instruction("x" * 101)  # refused before tokenizing
    assert "max_text_tokens=8" in w.set_instruction("put " * 20)  # the model's own limit
    assert w.instruction_text() == "stack the cups"
    # Taken while no model was loaded (only its length checked), then refused by the model.
    w.policy = None
    assert w.set_instruction("put " * 20) == ""
    w.policy = policy
    assert "max_text_tokens" in w.recheck_instruction() and w.instruction_text() == ""


def test_pipelined_trigger_streams_frames_and_publishes_each_chunk_when_complete(tiny_policies):
    from vla_accel_ros.models.factory import sibling_policy

    w = InferenceWorker(
        PolicyNodeConfig(trigger="pipelined", pipeline_depth=4, request_wait_ms=0.0), ObservationChannel(history=4),
        drop=lambda r, d: None, log=lambda lvl, t: None,
    )  # fmt: skip
    w.policy = sibling_policy(tiny_policies["ar"], PolicyConfig(parity_check=False))  # no state: any robot
    rng = np.random.default_rng(0)
    served, stamps = [], []
    for i in range(8):
        stamp = (1000 + 20 * i) * MS
        w.channel.put(stamp, AssembledObservation({"cam_high": rng.integers(0, 255, (224, 224, 3), np.uint8)}, stamp, 0, 0, i))
        job = w.next_job(0.0)
        assert job.stamp_ns == stamp
        out = w.infer(job, lambda: stamp)
        assert isinstance(out, list)
        served += out
        stamps.append(stamp)
    # depth 4: a frame's chunk comes out 3 frames later, stamped with its own observation
    assert [s.chunk.stamp_ns for s in served] == stamps[:5]
    assert all(s.chunk.stats["pipeline_depth"] == 4 and s.chunk.stats["staleness_calls"] == 3 for s in served)
    assert served[0].latency_ms == 60.0  # observation 1000 ms -> published at 1060 ms
    assert w.pipeline.in_flight == 3 and w.staleness_ms.count == 5
    w.reset_episode()
    w.apply(None)
    assert w.pipeline.in_flight == 0  # an episode reset forgets the frames in flight


def test_stop_interrupts_the_inference_in_progress_between_layers_and_nothing_is_published():
    """A node's Ctrl-C must not wait for a whole inference: stop() during infer ends run() at
    the policy's next layer boundary (core.interrupt.check), with no chunk and no error."""
    w, policy, drops, logs = _worker(trigger="continuous")
    layers_after_stop = []

    def slow_infer(obs, *, noise=None, guidance=None):
        for layer in range(1000):  # a long forward: the engine checks before every layer
            check_interrupt()
            if layer == 3:
                w.stop()  # Ctrl-C arrives mid-inference
            if w.stopped:
                layers_after_stop.append(layer)
        raise AssertionError("the inference ran to its end")

    policy.infer = slow_infer
    published = []
    w.channel.put(1000 * MS, _obs(1000 * MS))
    thread = threading.Thread(target=w.run, args=(lambda: None, published.append, lambda: 1000 * MS))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and published == [] and layers_after_stop == [3]
    assert w.errors == 0 and not drops and not logs and w.running_s() == 0.0


def test_a_real_policy_stops_at_a_layer_boundary_and_infers_again_after_a_reset(tiny_policies):
    """The engine's layer loops and the vision tower's layers (transformers' own loop, through
    forward pre-hooks) check: with the stop set, the tiny bundles' inference raises Interrupted
    in the vision tower (the first stage); without it (or after a reset) they infer as before."""
    for policy in tiny_policies.values():
        obs = fixed_observation(policy.spec, 0)
        stop = threading.Event()
        stop.set()
        with interruptible(stop), pytest.raises(Interrupted) as raised:
            policy.infer(obs)
        assert any(f.name == "_check_interrupt" for f in raised.traceback), "not stopped in the vision tower"
        policy.reset()
        with interruptible(threading.Event()):
            assert np.isfinite(policy.infer(obs).actions).all()
