"""Real-Time Chunking, the scheduler's side: delay from measured latency, guidance indexed to the
new chunk's time base, the frozen prefix executed bit for bit, smoother switches than naive.

The flow policy here is a stand-in written for these tests (the real one is tested against the
scheduler separately): a smooth trajectory plus a per-chunk error, honouring guidance the way
RTC inpainting does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from vla_accel_ros.core.scheduling import ChunkScheduler, SchedulerConfig, delay_steps, prefix_weights
from vla_accel_ros.bench.scheduler_sim import constant_latency, preset, simulate
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation

DT = 0.02
DT_NS = 20_000_000
T0 = 3_000_000_000
D = 4


class FlowLikePolicy:
    """Chunk = 0.4 sin(pi t + j) per joint + this chunk's own error (offset + slope along the
    chunk). With guidance: rows < frozen copy prev_actions; the rest move toward it by weight."""

    def __init__(self, horizon: int = 40, seed: int = 0) -> None:
        self.horizon, self.seed, self.calls = horizon, seed, 0
        self.seen: list[ChunkGuidance | None] = []

    def infer(self, obs: Observation, *, noise=None, guidance: ChunkGuidance | None = None) -> ActionChunk:
        t = (obs.stamp_ns + np.arange(self.horizon) * DT_NS) / 1e9  # [H] s
        rng = np.random.default_rng((self.seed, self.calls))
        slope = np.linspace(0.0, 1.0, self.horizon)[:, None]  # [H, 1]
        raw = 0.4 * np.sin(np.pi * t[:, None] + np.arange(D)) + rng.normal(0, 0.04, D) + slope * rng.normal(0, 0.08, D)
        if guidance is not None:
            assert guidance.prev_actions.shape == raw.shape and guidance.weights.shape == (self.horizon,)
            raw = raw + guidance.weights[:, None] * (guidance.prev_actions - raw)
            raw[: guidance.frozen] = guidance.prev_actions[: guidance.frozen]
        self.calls += 1
        self.seen.append(guidance)
        return ActionChunk(actions=raw.astype(np.float32), stamp_ns=obs.stamp_ns, dt=DT, chunk_id=self.calls)

    def reset(self) -> None:
        self.calls = 0


def const_chunk(stamp_ns: int, value: float, h: int = 20) -> ActionChunk:
    return ActionChunk(actions=np.full((h, D), value, np.float32), stamp_ns=stamp_ns, dt=DT)


def tick(k: int) -> int:
    return T0 + k * DT_NS


# -- the pure pieces ------------------------------------------------------------------------------
def test_prefix_weights_follow_the_paper_soft_mask():
    w = prefix_weights(3, 8, 12, "exp")
    assert w.shape == (12,) and w.dtype == np.float32
    np.testing.assert_array_equal(w[:3], 1.0)
    np.testing.assert_array_equal(w[8:], 0.0)
    c = (8 - np.arange(3, 8)) / (8 - 3 + 1)
    np.testing.assert_allclose(w[3:8], c * (np.exp(c) - 1) / (math.e - 1), rtol=1e-6)
    assert np.all(np.diff(w[3:8]) < 0) and 0 < w[7] < w[3] < 1
    np.testing.assert_allclose(prefix_weights(3, 8, 12, "linear")[3:8], c, rtol=1e-6)
    np.testing.assert_array_equal(prefix_weights(3, 8, 12, "ones"), [1.0] * 8 + [0.0] * 4)
    np.testing.assert_array_equal(prefix_weights(3, 8, 12, "zeros"), [1.0] * 3 + [0.0] * 9)
    # Committed actions stay frozen even when the horizon is shorter than the delay.
    np.testing.assert_array_equal(prefix_weights(6, 4, 10), [1.0] * 6 + [0.0] * 4)
    with pytest.raises(ValueError, match="unknown RTC schedule"):
        prefix_weights(1, 2, 3, "cosine")


def test_delay_is_ceil_of_latency_in_control_steps():
    assert delay_steps(120.0, DT) == 6  # lands exactly on tick 6: ticks 0..5 ran from the old plan
    assert delay_steps(120.5, DT) == 7
    assert delay_steps(19.0, DT) == 1
    assert delay_steps(0.0, DT) == 0


def test_delay_uses_the_percentile_of_measured_latency():
    s = ChunkScheduler(preset("rtc", latency_window=20, latency_percentile=95.0))
    assert s.delay_steps() == 5  # initial_latency_ms 100 before any sample
    for ms in [50.0] * 18 + [150.0, 210.0]:
        s.record_latency(ms)
    p95 = np.percentile([50.0] * 18 + [150.0, 210.0], 95)
    assert s.delay_steps() == math.ceil(p95 / 20.0) == 8
    for ms in [30.0] * 20:  # the window forgets the spikes
        s.record_latency(ms)
    assert s.delay_steps() == 2


# -- guidance and splice -------------------------------------------------------------------------
def test_guidance_is_the_plan_reindexed_to_the_new_chunk():
    s = ChunkScheduler(preset("rtc", rtc_execution_horizon=0))
    s.record_latency(100.0)  # d = 5
    s.step(tick(0))
    ramp = np.repeat(np.arange(20, dtype=np.float32)[:, None], D, 1)  # row i = i
    s.add_chunk(ActionChunk(ramp, tick(0), DT), tick(0) + 1000)
    for k in range(1, 4):
        s.step(tick(k))
    req = s.request_inference(tick(3), obs_stamp_ns=tick(2))  # a 20 ms old camera frame
    g = req.guidance
    assert req.delay_steps == 5 and g.frozen == 5
    # Row j is the action for the new chunk's step j (tick 2 + j): executed history, then plan,
    # then the last planned action repeated (what a hold would command).
    np.testing.assert_array_equal(g.prev_actions[:18, 0], np.arange(2, 20))
    np.testing.assert_array_equal(g.prev_actions[18:, 0], 19.0)
    np.testing.assert_array_equal(g.weights, prefix_weights(5, 18, 20))  # soft up to the plan's end


def test_committed_prefix_is_kept_even_if_the_policy_ignores_guidance():
    s = ChunkScheduler(preset("rtc"))
    s.record_latency(100.0)  # d = 5
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 0.0), tick(0) + 1000)
    for k in range(1, 4):
        s.step(tick(k))
    req = s.request_inference(tick(3))
    # A non-flow policy returns 1s everywhere, early (one tick of latency).
    s.add_chunk(const_chunk(req.stamp_ns, 1.0), tick(4) - 1000)
    got = [s.step(tick(k)).action[0] for k in range(4, 11)]
    assert got == [0.0] * 4 + [1.0] * 3  # ticks 4..7 = stamp + 1..4 < stamp + d were committed


@pytest.mark.parametrize("obs_delay_ms", [0.0, 40.0])  # 40 ms: frames two ticks old, part of the prefix is history
def test_rtc_frozen_prefix_is_exactly_what_was_executed(obs_delay_ms):
    policy = FlowLikePolicy()
    res = simulate(preset("rtc"), policy, latency_ms=constant_latency(110.0, 20.0, seed=5), duration_s=6.0, obs_delay_ms=obs_delay_ms)
    by_time = {int(t): a for t, a in zip(res.times_ns, res.actions)}
    checked = 0
    for request, chunk, arrival in res.exchanges:
        g = request.guidance
        if g is None:
            continue
        assert g.frozen == request.delay_steps > 0
        on_time = arrival <= request.stamp_ns + g.frozen * DT_NS
        for j in range(g.frozen):
            t = request.stamp_ns + j * DT_NS
            if t not in by_time:  # past the end of the run
                continue
            np.testing.assert_array_equal(by_time[t], g.prev_actions[j])  # committed = executed
            if on_time:
                np.testing.assert_array_equal(by_time[t], chunk.actions[j])  # and continued by the chunk
            checked += 1
    assert checked > 50
    assert res.metrics.holding_steps == 0


@pytest.mark.parametrize("obs_delay_ms", [0.0, 30.0])  # 30 ms: stamps between ticks, guidance interpolated
def test_rtc_lowers_boundary_discontinuity_versus_naive_switching(obs_delay_ms):
    def run(name):
        lat = constant_latency(120.0, 15.0, seed=9)
        return simulate(preset(name), FlowLikePolicy(seed=1), latency_ms=lat, duration_s=8.0, obs_delay_ms=obs_delay_ms).metrics

    naive, rtc = run("latest_only"), run("rtc")
    assert naive.switches > 10 and rtc.switches > 10
    assert rtc.boundary_disc_max < 0.6 * naive.boundary_disc_max
    assert rtc.boundary_disc_mean < 0.6 * naive.boundary_disc_mean
    assert rtc.jerk_rms < 0.5 * naive.jerk_rms
    assert rtc.holding_fraction == naive.holding_fraction == 0.0


def test_guidance_while_holding_freezes_the_hold():
    s = ChunkScheduler(preset("rtc", blend_steps=0))
    s.record_latency(60.0)  # d = 3
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 0.5, h=4), tick(0) + 1000)
    for k in range(1, 7):
        s.step(tick(k))  # dry from tick 4: holding 0.5
    g = s.request_inference(tick(6)).guidance
    np.testing.assert_array_equal(g.prev_actions, 0.5)  # what the robot will hold until the chunk lands
    np.testing.assert_array_equal(g.weights, [1.0] * 3 + [0.0] * 1)  # nothing planned past the hold


def test_non_rtc_requests_carry_no_guidance():
    s = ChunkScheduler(SchedulerConfig())
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 0.0), tick(0) + 1000)
    assert s.request_inference(tick(1)).guidance is None
