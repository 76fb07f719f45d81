"""Action-chunk scheduler: time indexing, stale drops, replanning, aggregation, hold/blend,
metrics, config validation and the benchmark CLI. All on a hand-driven integer clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.scheduling import ChunkScheduler, SchedulerConfig, SchedulerError, aggregate
from vla_accel_ros.core.scheduling.aggregation import temporal_ensemble
from vla_accel_ros.bench.scheduler_sim import SyntheticFlowPolicy, constant_latency, preset, simulate
from vla_accel_ros.core.types import ActionChunk

DT = 0.02
DT_NS = 20_000_000
T0 = 5_000_000_000
D = 3


def tick(k: int) -> int:
    return T0 + k * DT_NS


def ramp_chunk(stamp_ns: int, h: int = 10, offset: float = 0.0, chunk_id: int = 0) -> ActionChunk:
    """Action i = offset + (time index of the action) * 0.01 on every joint: a value that says
    which control tick it was meant for."""
    k0 = (stamp_ns - T0) / DT_NS
    rows = offset + 0.01 * (k0 + np.arange(h, dtype=np.float64))
    return ActionChunk(actions=np.repeat(rows[:, None], D, axis=1).astype(np.float32), stamp_ns=stamp_ns, dt=DT, chunk_id=chunk_id)


def const_chunk(stamp_ns: int, value: float, h: int = 10) -> ActionChunk:
    return ActionChunk(actions=np.full((h, D), value, np.float32), stamp_ns=stamp_ns, dt=DT)


# -- config -------------------------------------------------------------------------------------
def test_config_rejects_out_of_range_and_bad_choices():
    with pytest.raises(ConfigError, match=r"control_rate_hz=0.0 is out of range"):
        SchedulerConfig(control_rate_hz=0.0)
    with pytest.raises(ConfigError, match=r"async_threshold=1.5 is out of range \[0.0, 1.0\]"):
        SchedulerConfig(async_threshold=1.5)
    with pytest.raises(ConfigError, match="aggregation='median' is not one of"):
        SchedulerConfig(aggregation="median")
    with pytest.raises(ConfigError, match="mode='fast'"):
        SchedulerConfig(mode="fast")
    with pytest.raises(ConfigError, match="execute_horizon=0"):
        SchedulerConfig(execute_horizon=0)
    with pytest.raises(ConfigError, match="has no field"):
        SchedulerConfig.from_dict({"threshold": 0.5})


def test_config_cross_field_checks_say_how_to_fix():
    with pytest.raises(ConfigError, match="set mode='async'"):
        SchedulerConfig(rtc=True, mode="sync", aggregation="latest_only")
    with pytest.raises(ConfigError, match="set aggregation='latest_only'"):
        SchedulerConfig(rtc=True, aggregation="weighted_average")
    cfg = SchedulerConfig(rtc=True, aggregation="latest_only")
    assert cfg.dt == pytest.approx(0.02)
    assert SchedulerConfig.from_dict(cfg.to_dict()) == cfg


# -- time indexing and stale drops ------------------------------------------------------------
def test_late_chunk_drops_exactly_the_expired_actions():
    s = ChunkScheduler(SchedulerConfig(latency_aware_trigger=False))
    for k in range(4):  # ticks 0..3 pass while the first inference runs
        assert s.step(tick(k)).action is None
    chunk = ramp_chunk(tick(0), h=10)
    # Lands between ticks 3 and 4: actions 0..3 were meant for ticks that have passed.
    assert s.add_chunk(chunk, tick(3) + DT_NS // 3) == 4
    for k in range(4, 10):
        r = s.step(tick(k))
        assert not r.holding and r.stale == 0
        np.testing.assert_array_equal(r.action, chunk.actions[k])  # meant for tick k, executed at tick k
    assert s.step(tick(10)).holding
    assert s.metrics().stale_dropped == 4


def test_chunk_landing_on_a_tick_keeps_that_ticks_action():
    s = ChunkScheduler()
    s.step(tick(0))
    chunk = ramp_chunk(tick(0), h=10)
    assert s.add_chunk(chunk, tick(5)) == 5  # ticks 0..4 passed, tick 5 is due now
    np.testing.assert_array_equal(s.step(tick(5)).action, chunk.actions[5])


def test_late_tick_skips_exactly_the_missed_actions():
    s = ChunkScheduler()
    s.step(tick(0))
    chunk = ramp_chunk(tick(0), h=10)
    s.add_chunk(chunk, tick(0) + 1000)
    for k in (1, 2):
        np.testing.assert_array_equal(s.step(tick(k)).action, chunk.actions[k])
    r = s.step(tick(5) + DT_NS // 3)  # the timer stalled through ticks 3 and 4; jitter < dt/2 still hits 5
    assert r.stale == 2 and r.slot == 5
    np.testing.assert_array_equal(r.action, chunk.actions[5])
    m = s.metrics()
    assert m.stale_dropped == 1 + 2  # action 0 (its tick had passed on arrival) + the two skipped
    assert m.tick_rate_hz < 30.0  # 3 ticks over 5.3 periods: the stall shows


def test_fully_expired_chunk_is_never_executed():
    s = ChunkScheduler(SchedulerConfig(blend_steps=0))
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 1.0, h=5), tick(0) + 1000)
    for k in range(1, 5):
        s.step(tick(k))
    late = const_chunk(tick(1), 9.0, h=5)  # meant for ticks 1..5; lands at tick 8
    assert s.add_chunk(late, tick(8)) == 5
    for k in range(8, 12):
        r = s.step(tick(k))
        assert r.holding and r.action[0] == 1.0


def test_off_grid_stamp_is_interpolated_to_the_ticks():
    s = ChunkScheduler()
    s.step(tick(0))
    chunk = ramp_chunk(tick(0), h=10)
    chunk.stamp_ns += DT_NS // 2  # the camera is half a period out of phase with the controller
    s.add_chunk(chunk, tick(1))
    r = s.step(tick(2))
    # Tick 2 sits halfway between actions 1 and 2 of the chunk.
    np.testing.assert_allclose(r.action, 0.5 * (chunk.actions[1] + chunk.actions[2]), rtol=0, atol=1e-7)


def test_executed_action_is_always_the_one_meant_for_its_tick():
    """Whatever the latency jitter: at tick t the robot gets the newest chunk's action for t."""
    cfg = preset("latest_only")
    policy = SyntheticFlowPolicy(horizon=30, action_dim=D, bias=0.0, drift=0.0, seed=3)
    res = simulate(cfg, policy, latency_ms=constant_latency(90.0, 30.0, seed=1), duration_s=4.0)
    assert res.metrics.stale_dropped > 0
    ok = ~res.holding & ~np.isnan(res.actions).any(axis=1)
    # Errors are zero, so every chunk is the reference sampled at its own action times.
    np.testing.assert_allclose(res.actions[ok], policy.reference(res.times_ns[ok]), atol=1e-6)


# -- replanning -----------------------------------------------------------------------------
def test_sync_executes_horizon_then_holds_while_inferring():
    s = ChunkScheduler(SchedulerConfig(mode="sync", execute_horizon=4, blend_steps=0))
    s.step(tick(0))
    assert s.wants_inference(tick(0))
    s.request_inference(tick(0))
    assert not s.wants_inference(tick(0))  # one in flight
    s.add_chunk(ramp_chunk(tick(0), h=10), tick(1))  # 1 stale
    for k in range(1, 5):
        assert not s.step(tick(k)).holding
        assert s.wants_inference(tick(k)) == (k == 4)  # after execute_horizon actions
    s.request_inference(tick(4))
    assert s.pending == 0  # the rest of the chunk is dropped: sync waits
    assert s.step(tick(5)).holding
    m = s.metrics()
    assert m.discarded == 10 - 1 - 4 and m.holding_steps == 1 and m.requests == 2


@pytest.mark.parametrize("latency_ms,jitter_ms", [(120.0, 15.0), (300.0, 30.0), (450.0, 0.0)])
def test_async_never_runs_dry_at_the_configured_latency(latency_ms, jitter_ms):
    cfg = preset("weighted_average")  # async, threshold 0.5 of H=50 -> 25 steps = 500 ms of lead
    res = simulate(cfg, SyntheticFlowPolicy(seed=2), latency_ms=constant_latency(latency_ms, jitter_ms, seed=2), duration_s=8.0)
    m = res.metrics
    assert m.chunks > 5
    assert m.holding_steps == 0 and m.hold_events == 0
    assert m.effective_rate_hz == pytest.approx(50.0)


def test_latency_aware_trigger_prevents_starvation_a_plain_threshold_suffers():
    lat = constant_latency(400.0, 10.0, seed=4)  # 20 steps, beyond a 0.3*50 = 15 step threshold
    plain = simulate(preset("latest_only", async_threshold=0.3, latency_aware_trigger=False), SyntheticFlowPolicy(), latency_ms=lat, duration_s=8.0)
    assert plain.metrics.hold_events > 3  # the test can fail: a starving queue shows up
    aware = simulate(preset("latest_only", async_threshold=0.3), SyntheticFlowPolicy(), latency_ms=constant_latency(400.0, 10.0, seed=4), duration_s=8.0)
    assert aware.metrics.holding_steps == 0


def test_request_timeout_releases_a_lost_inference():
    s = ChunkScheduler(SchedulerConfig(request_timeout_ms=100.0))
    s.step(tick(0))
    s.request_inference(tick(0))
    assert not s.wants_inference(tick(4))
    assert s.wants_inference(tick(5))  # 100 ms: give up, ask again
    assert s.metrics().request_timeouts == 1
    assert s.in_flight is None


# -- aggregation --------------------------------------------------------------------------------
def test_aggregation_functions_match_their_definitions():
    old = np.full((4, 2), 1.0, np.float32)
    new = np.full((4, 2), 3.0, np.float32)
    one = np.ones(4, np.int64)
    np.testing.assert_allclose(aggregate("latest_only", old, new, one), 3.0)
    np.testing.assert_allclose(aggregate("weighted_average", old, new, one), 0.3 * 1 + 0.7 * 3)
    np.testing.assert_allclose(aggregate("conservative", old, new, one), 0.7 * 1 + 0.3 * 3)
    np.testing.assert_allclose(aggregate("average", old, new, one), 2.0)
    np.testing.assert_allclose(aggregate("average", old, new, 2 * one), (2 * 1 + 3) / 3, rtol=1e-6)  # old = mean of 2
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate("median", old, new, one)


def test_temporal_ensemble_is_act_exponential_weighting():
    preds = [np.array([[0.0]]), np.array([[1.0]]), np.array([[4.0]]), np.array([[-2.0]])]
    for m in (0.01, 0.5, -0.3, 0.0):
        acc, count = preds[0], np.ones(1, np.int64)
        for p in preds[1:]:
            acc = temporal_ensemble(acc, p, count, m)
            count = count + 1
        w = np.exp(-m * np.arange(len(preds)))  # ACT: oldest first, weight exp(-m*i)
        expected = sum(wi * p for wi, p in zip(w, preds)) / w.sum()
        np.testing.assert_allclose(acc, expected, rtol=1e-12)


@pytest.mark.parametrize(
    "mode,expected_overlap",
    [
        ("latest_only", 1.0),
        ("weighted_average", 0.7),
        ("average", 0.5),
        ("conservative", 0.3),
        ("temporal_ensemble", 1.0 / (1.0 + np.exp(0.01))),  # weights 1 (old) and e^-0.01 (new)
    ],
)
def test_scheduler_aggregates_overlapping_chunks_per_mode(mode, expected_overlap):
    s = ChunkScheduler(SchedulerConfig(aggregation=mode, latency_aware_trigger=False))
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 0.0, h=10), tick(0) + 1000)  # slots 0..9
    for k in range(1, 5):
        s.step(tick(k))
    s.add_chunk(const_chunk(tick(4), 1.0, h=10), tick(4) + 1000)  # slots 4..13; 4 is stale
    got = np.array([s.step(tick(k)).action[0] for k in range(5, 14)])
    np.testing.assert_allclose(got[:5], expected_overlap, rtol=1e-6)  # slots 5..9: both chunks
    np.testing.assert_allclose(got[5:], 1.0)  # slots 10..13: only the new one
    m = s.metrics()
    expected_switches = 1 if mode == "latest_only" else 2  # into the mix, and out of it
    assert m.switches == expected_switches
    assert m.boundary_disc_max == pytest.approx(max(expected_overlap, 1.0 - expected_overlap), rel=1e-6)


def test_three_chunk_temporal_ensemble_through_the_scheduler():
    s = ChunkScheduler(SchedulerConfig(aggregation="temporal_ensemble", ensemble_coeff=0.5, latency_aware_trigger=False))
    s.step(tick(0))
    for j, v in enumerate((0.0, 1.0, 4.0)):
        s.add_chunk(const_chunk(tick(0), v, h=10), tick(0) + 1000 + j)
    w = np.exp(-0.5 * np.arange(3))
    np.testing.assert_allclose(s.step(tick(1)).action, np.dot(w, [0.0, 1.0, 4.0]) / w.sum(), rtol=1e-6)


# -- hold and blend ----------------------------------------------------------------------------
def test_hold_engages_on_dry_queue_and_releases_smoothly():
    n = 4
    s = ChunkScheduler(SchedulerConfig(blend_steps=n, latency_aware_trigger=False))
    s.step(tick(0))
    first = ramp_chunk(tick(0), h=5)
    s.add_chunk(first, tick(0) + 1000)
    for k in range(1, 5):
        assert not s.step(tick(k)).holding
    last = first.actions[4]
    for k in range(5, 9):  # dry: hold the last commanded action, not zeros
        r = s.step(tick(k))
        assert r.holding and r.label == -1
        np.testing.assert_array_equal(r.action, last)
    second = ramp_chunk(tick(8), h=20, offset=1.0)  # 1 rad away from where the robot holds
    s.add_chunk(second, tick(8) + 1000)
    out = [s.step(tick(k)) for k in range(9, 9 + n + 3)]
    acts = np.array([r.action for r in out])
    target = second.actions[1 : 1 + len(out)]
    for j in range(n):
        assert out[j].blending and not out[j].holding
        alpha = (j + 1) / (n + 1)
        np.testing.assert_allclose(acts[j], last + alpha * (target[j] - last), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(acts[n:], target[n:])  # then exactly the chunk
    assert not out[n].blending
    steps = np.abs(np.diff(np.vstack([last, acts]), axis=0)).max(axis=1)
    assert steps.max() < 1.05 / (n + 1) + 0.02  # the 1 rad gap spread over n+1 ticks
    m = s.metrics()
    assert m.holding_steps == 4 and m.hold_events == 1
    assert m.holding_fraction == pytest.approx(4 / m.steps)
    assert m.boundary_disc_max == pytest.approx(steps.max(), rel=1e-6)


def test_hold_without_blend_jumps_and_the_metric_sees_it():
    s = ChunkScheduler(SchedulerConfig(blend_steps=0, latency_aware_trigger=False))
    s.step(tick(0))
    s.add_chunk(const_chunk(tick(0), 0.0, h=3), tick(0) + 1000)
    for k in range(1, 6):
        s.step(tick(k))
    s.add_chunk(const_chunk(tick(5), 1.0, h=5), tick(5) + 1000)
    assert s.step(tick(6)).action[0] == 1.0
    assert s.metrics().boundary_disc_max == pytest.approx(1.0)


def test_hold_none_commands_nothing_and_initial_hold_action_blends_out():
    s = ChunkScheduler(SchedulerConfig(hold="none", blend_steps=1))
    s.reset(hold_action=np.zeros(D))
    r = s.step(tick(0))
    assert r.holding and r.action is None
    s.add_chunk(const_chunk(tick(0), 2.0, h=5), tick(0) + 1000)
    np.testing.assert_allclose(s.step(tick(1)).action, 1.0)  # halfway from the robot's pose
    np.testing.assert_allclose(s.step(tick(2)).action, 2.0)


# -- errors, metrics, determinism -------------------------------------------------------------
def test_bad_chunks_raise_typed_errors():
    s = ChunkScheduler()
    bad = const_chunk(tick(0), 0.0)
    bad.actions[3, 1] = np.nan
    with pytest.raises(SchedulerError, match="non-finite"):
        s.add_chunk(bad, tick(1))
    s.add_chunk(const_chunk(tick(0), 0.0), tick(1))
    with pytest.raises(SchedulerError, match="action dim 5"):
        s.add_chunk(ActionChunk(np.zeros((10, 5), np.float32), tick(1), DT), tick(2))
    with pytest.raises(SchedulerError, match="control rate"):
        ChunkScheduler(preset("rtc")).add_chunk(ActionChunk(np.zeros((10, D), np.float32), tick(0), 0.1), tick(1))


def test_metrics_rates_and_jerk():
    s = ChunkScheduler(SchedulerConfig(latency_aware_trigger=False))
    s.step(tick(0))
    # Constant acceleration: position 0.5*a*t^2 has zero jerk except where motion starts.
    t = np.arange(20) * DT
    pos = 0.5 * 2.0 * t**2
    s.add_chunk(ActionChunk(np.repeat(pos[:, None], D, 1).astype(np.float32), tick(0), DT), tick(0) + 1000)
    for k in range(1, 20):
        s.step(tick(k))
    m = s.metrics()
    assert m.steps == 19 and m.executed == 19 and m.holding_fraction == 0.0
    assert m.tick_rate_hz == pytest.approx(50.0) and m.effective_rate_hz == pytest.approx(50.0)
    assert m.jerk_max < 1.0  # float32 rounding only
    assert m.latency_p95_ms == pytest.approx(0.001)


def test_simulation_is_deterministic():
    a = simulate(preset("temporal_ensemble"), SyntheticFlowPolicy(seed=7), latency_ms=constant_latency(150, 40, 7), duration_s=3.0)
    b = simulate(preset("temporal_ensemble"), SyntheticFlowPolicy(seed=7), latency_ms=constant_latency(150, 40, 7), duration_s=3.0)
    np.testing.assert_array_equal(a.actions, b.actions)
    assert a.metrics == b.metrics


def test_sync_holds_and_async_does_not_on_the_same_run():
    lat = constant_latency(120.0, 15.0, 0)
    sync = simulate(preset("sync"), SyntheticFlowPolicy(), latency_ms=lat, duration_s=6.0).metrics
    asyn = simulate(preset("latest_only"), SyntheticFlowPolicy(), latency_ms=constant_latency(120.0, 15.0, 0), duration_s=6.0).metrics
    assert sync.holding_fraction > 0.1 and asyn.holding_fraction == 0.0
    assert sync.effective_rate_hz < 45.0 and asyn.effective_rate_hz == pytest.approx(50.0)


def test_bench_scheduler_cli(tmp_path, capsys):
    from vla_accel_ros.cli import main

    out = tmp_path / "sched.json"
    rc = main(["bench", "scheduler", "--modes", "sync", "latest_only", "rtc", "--duration-s", "3", "--latency-ms", "100", "200", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "async+rtc" in text and "disc max" in text and "hold %" in text
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["latency_ms"]) for r in rows] == [(m, l) for l in (100.0, 200.0) for m in ("sync", "latest_only", "rtc")]
    assert {"boundary_disc_max", "jerk_rms", "holding_fraction", "stale_dropped", "effective_rate_hz"} <= set(rows[0])


def test_a_late_answer_to_a_timed_out_request_does_not_release_the_new_one():
    s = ChunkScheduler(SchedulerConfig(request_timeout_ms=100.0))
    s.step(tick(0))
    s.request_inference(tick(0))
    assert s.wants_inference(tick(6))
    fresh = s.request_inference(tick(6))
    s.add_chunk(const_chunk(tick(0), 0.0, h=20), tick(7))  # the lost one shows up after all
    assert s.in_flight is fresh and not s.wants_inference(tick(7))
    s.add_chunk(const_chunk(tick(6), 1.0, h=20), tick(9))
    assert s.in_flight is None
