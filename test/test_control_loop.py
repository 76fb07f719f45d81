"""The action controller's tick without ROS (core/robot/control_loop.py), on a counter clock."""

from __future__ import annotations

import numpy as np

from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES, ControllerConfig, SafetyConfig
from vla_accel_ros.core.robot.control_loop import ControlLoop
from vla_accel_ros.core.types import ActionChunk

MS = 1_000_000
DT = 20 * MS  # 50 Hz
T0 = 1_000_000_000
POSE = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 0.5] * 2)


def _loop(**safety) -> ControlLoop:
    return ControlLoop(ControllerConfig(safety=SafetyConfig(start_enabled=True, **safety)))


def _chunk(stamp: int, value: float = 0.0, rows: int = 50, names=ALOHA_JOINT_NAMES) -> ActionChunk:
    actions = np.repeat((POSE + value)[None], rows, axis=0).astype(np.float32)
    return ActionChunk(actions=actions, stamp_ns=stamp, dt=0.02, chunk_id=1, joint_names=tuple(names))


def test_requests_wait_for_an_announced_observation_and_chunks_become_commands():
    loop = _loop()
    out = loop.tick(T0, measured=POSE)
    assert out.request is None and out.command is None  # nothing announced, nothing planned: hold nothing
    out = loop.tick(T0 + DT, measured=POSE, obs_stamp_ns=T0 + DT)
    assert out.request is not None and out.request.stamp_ns == T0 + DT and out.request_id == 1
    assert loop.tick(T0 + 2 * DT, measured=POSE, obs_stamp_ns=T0 + DT).request is None  # asked already
    loop.tick(T0 + 3 * DT, measured=POSE, chunks=[_chunk(T0 + DT, 0.01)], obs_stamp_ns=T0 + DT)
    out = loop.tick(T0 + 4 * DT, measured=POSE, obs_stamp_ns=T0 + DT)
    assert out.command is not None and out.command.shape == (14,)
    np.testing.assert_allclose(out.command, POSE + 0.01, atol=1e-6)  # within the per-step clamp
    assert (loop.chunks_in, loop.commands, loop.requests_out) == (1, 1, 1) and loop.got_chunk


def test_watchdog_holds_the_last_command_when_chunks_stop():
    loop = _loop(watchdog_periods=5)
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0, rows=3)])
    warned = []
    for k in range(1, 12):
        out = loop.tick(T0 + k * DT, measured=POSE)
        warned += out.warnings
    assert loop.watchdog.tripped and loop.watchdog.trips == 1
    assert any("watchdog" in w for w in warned)
    assert out.command is not None and np.allclose(out.command, POSE)  # holding, still commanding
    assert loop.holding_fraction() > 0.5


def test_estop_stops_output_until_released_and_enabled():
    loop = _loop()
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0)])
    assert loop.tick(T0 + DT, measured=POSE).command is not None
    assert loop.set_estop(True) and not loop.set_estop(True)
    assert loop.tick(T0 + 2 * DT, measured=POSE).command is None
    assert loop.set_enabled(True)[0] is False  # refused while the e-stop is active
    loop.set_estop(False)
    assert loop.tick(T0 + 3 * DT, measured=POSE).command is None  # released, not re-enabled
    assert loop.set_enabled(True) == (True, "enabled")
    loop.tick(T0 + 4 * DT, measured=POSE, chunks=[_chunk(T0 + 4 * DT)])
    assert loop.tick(T0 + 5 * DT, measured=POSE).command is not None
    assert loop.gating()[:2] == (True, False)


def test_no_command_without_a_clamp_reference():
    loop = _loop()
    loop.tick(T0, measured=None, chunks=[_chunk(T0)])
    out = loop.tick(T0 + DT, measured=None)
    assert out.command is None and out.drops[0][0] == "no_reference"


def test_a_clock_that_jumps_back_restarts_the_plan_and_may_ask_again():
    loop = _loop()
    assert loop.tick(T0 + 3 * DT, measured=POSE, obs_stamp_ns=T0).request is not None
    out = loop.tick(T0 + DT, measured=POSE, obs_stamp_ns=T0)  # sim time restarted
    assert any("jumped back" in w for w in out.warnings)
    assert out.request is not None and out.request_id == 2  # the plan (and what was asked) is forgotten


def test_stale_chunks_are_dropped_or_executed_late_on_request():
    for mode, expect in (("drop", None), ("execute_last", 0.02)):
        loop = ControlLoop(ControllerConfig(safety=SafetyConfig(start_enabled=True), stale_chunks=mode))
        loop.tick(T0, measured=POSE)
        arrived = loop.tick(T0 + 2 * DT, measured=POSE, chunks=[_chunk(T0 + DT // 2, 0.02, rows=1)])  # all past
        out = loop.tick(T0 + 3 * DT, measured=POSE)
        if expect is None:
            assert out.command is None and loop.late_actions == 0
            assert [d[0] for d in arrived.drops] == ["stale_chunk"]
            assert loop.watchdog.since_chunk_ns(T0 + 3 * DT) == DT  # armed on arrival: the policy started
        else:
            np.testing.assert_allclose(out.command, POSE + expect, atol=1e-6)
            assert loop.late_actions == 1


def test_a_chunk_all_past_leaves_the_watchdog_holding():
    """The policy stalled past the watchdog, then answered later than its whole chunk: nothing of
    that chunk runs, so the arm still holds and the watchdog says so; the next chunk with an
    action to come re-arms it."""
    loop = _loop(watchdog_periods=5)
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0, rows=3)])
    for k in range(1, 8):
        loop.tick(T0 + k * DT, measured=POSE)
    assert loop.watchdog.tripped
    out = loop.tick(T0 + 8 * DT, measured=POSE, chunks=[_chunk(T0 + 2 * DT, 0.01, rows=5)])  # slots 2..6: all past
    assert loop.watchdog.tripped and [d[0] for d in out.drops] == ["stale_chunk"], out.drops
    assert np.allclose(loop.tick(T0 + 9 * DT, measured=POSE).command, POSE)  # holding
    loop.tick(T0 + 10 * DT, measured=POSE, chunks=[_chunk(T0 + 9 * DT, 0.01, rows=5)])  # slots 11..13 to come
    assert not loop.watchdog.tripped and loop.chunks_in == 3


def test_a_late_action_waits_for_the_next_tick_however_late_it_comes():
    """execute_last: the next tick commands the late action even when the timer runs late (under
    load a 50 Hz timer ticked at 24 Hz, and a slot chosen on arrival was already past: no command
    at all). A fresher chunk that plans that tick supersedes it."""
    loop = ControlLoop(ControllerConfig(safety=SafetyConfig(start_enabled=True), stale_chunks="execute_last"))
    loop.tick(T0, measured=POSE)
    loop.tick(T0 + 2 * DT, measured=POSE, chunks=[_chunk(T0 + DT // 2, 0.02, rows=1)])  # all past
    out = loop.tick(T0 + 2 * DT + 23 * DT // 10, measured=POSE)  # 2.3 periods later
    np.testing.assert_allclose(out.command, POSE + 0.02, atol=1e-6)
    assert loop.late_actions == 1
    past, fresh = _chunk(T0 + 4 * DT, 0.05, rows=1), _chunk(T0 + 7 * DT, 0.07, rows=5)  # past again, and a newer one
    loop.tick(T0 + 6 * DT, measured=POSE, chunks=[past, fresh])
    out = loop.tick(T0 + 7 * DT, measured=POSE)
    offset = out.command - POSE  # the newer plan, blended in from the held 0.02 (not the past 0.05)
    assert loop.late_actions == 1 and np.allclose(offset, offset[0]) and 0.02 < offset[0] < 0.05


def test_chunks_for_another_robot_are_dropped():
    loop = _loop()
    out = loop.tick(T0, measured=POSE, chunks=[_chunk(T0, names=[f"j{i}" for i in range(14)])])
    assert out.drops[0][0] == "bad_chunk" and loop.chunks_in == 0


def test_chunks_of_the_wrong_size_or_time_span_are_dropped_and_the_loop_keeps_ticking():
    """A chunk without joint names is checked by its size; a dt that is not finite, or spans
    more than a minute, is refused (not raised out of the tick, where it would stop the node)."""
    loop = _loop()
    narrow = ActionChunk(actions=np.zeros((10, 7), np.float32), stamp_ns=T0, dt=0.02, chunk_id=2, joint_names=())
    forever = ActionChunk(actions=np.repeat(POSE[None], 5, 0).astype(np.float32), stamp_ns=T0, dt=float("inf"), chunk_id=3)
    slow = ActionChunk(actions=np.repeat(POSE[None], 5, 0).astype(np.float32), stamp_ns=T0, dt=30.0, chunk_id=4)
    out = loop.tick(T0, measured=POSE, chunks=[narrow, forever, slow])
    reasons = [why for kind, why in out.drops if kind == "bad_chunk"]
    assert len(reasons) == 3 and loop.chunks_in == 0
    assert "7 action dims, the robot 14" in reasons[0] and "finite" in reasons[1] and "span 120 s > 60 s" in reasons[2]
    out = loop.tick(T0 + DT, measured=POSE, chunks=[_chunk(T0 + DT, 0.01)])
    out = loop.tick(T0 + 2 * DT, measured=POSE)
    assert out.command is not None and out.command.shape == (14,) and loop.chunks_in == 1


def test_rtc_freezes_every_action_the_old_plan_ran_before_the_chunk_took_over():
    """Chunks merge after the tick's step, so the tick a chunk arrives on still runs the old
    plan: the frozen prefix of the next request's guidance must count it too."""
    from vla_accel_ros.core.scheduling import SchedulerConfig

    lat = 3  # ticks from the observation to the chunk's arrival
    loop = ControlLoop(ControllerConfig(
        safety=SafetyConfig(start_enabled=True),
        scheduler=SchedulerConfig(rtc=True, aggregation="latest_only", initial_latency_ms=lat * 20.0),
    ))  # fmt: skip
    pending, executed, exchanges, value = {}, {}, [], 0.0
    for k in range(120):
        now = T0 + k * DT
        out = loop.tick(now, measured=POSE, chunks=[pending.pop(k)] if k in pending else [], obs_stamp_ns=now)
        if out.command is not None:
            executed[now] = out.command.copy()
        if out.request is not None:
            value += 0.01
            pending[k + lat] = _chunk(out.request.stamp_ns, value)
            exchanges.append((out.request, value, k + lat))
    checked = 0
    for req, val, arrival in exchanges[2:]:  # latency measured by then
        if req.guidance is None or arrival + 2 >= 120:
            continue
        ran_old = [j for j in range(10) if not np.allclose(executed[req.stamp_ns + j * DT], POSE + val, atol=1e-6)]
        assert req.guidance.frozen == max(ran_old) + 1 == lat + 1
        checked += 1
    assert checked >= 3


def test_a_chunk_or_observation_stamped_in_the_future_is_dropped_and_later_ones_still_work():
    loop = _loop()
    far = T0 + 1000 * 10**9  # a wrong clock: +1000 s
    out = loop.tick(T0, measured=POSE, chunks=[_chunk(far)], obs_stamp_ns=far)
    assert [d[0] for d in out.drops] == ["future_chunk", "future_observation"] and out.request is None
    assert loop.chunks_in == 0 and loop.scheduler.pending == 0  # nothing planned 1000 s ahead
    assert not loop.tick(T0 + DT, measured=POSE, obs_stamp_ns=far).drops  # counted once, not every tick
    # Present-day inputs afterwards: requested and executed as usual.
    out = loop.tick(T0 + 2 * DT, measured=POSE, obs_stamp_ns=T0 + 2 * DT)
    assert out.request is not None and out.request.stamp_ns == T0 + 2 * DT
    loop.tick(T0 + 3 * DT, measured=POSE, chunks=[_chunk(T0 + 2 * DT, 0.01)])
    assert loop.tick(T0 + 4 * DT, measured=POSE).command is not None and loop.chunks_in == 1


def test_an_observation_older_than_max_age_is_not_requested_and_the_arm_holds_until_a_fresh_one():
    """Issue 33: a camera went silent, so the newest observation the policy announced only ages;
    past max_age_ms (100 ms) the controller asks for no chunk on it (counted once), holds on its
    watchdog, and asks again as soon as a fresh observation is announced."""
    loop = _loop(watchdog_periods=10)
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0, rows=25)])  # half a second planned
    drops, requests = [], []
    for k in range(1, 15):  # observation T0 is announced, then nothing newer
        out = loop.tick(T0 + k * DT, measured=POSE, obs_stamp_ns=T0)
        drops += out.drops
        requests += [out.request] if out.request is not None else []
    # The plan runs low at tick 6, when the observation is 120 ms old: no request, one drop.
    assert not requests, [(r.issued_ns - r.stamp_ns) / MS for r in requests]
    assert [d[0] for d in drops] == ["stale_observation"] and "max_age_ms 100" in drops[0][1]
    assert loop.watchdog.tripped  # holding: no fresh chunk for 10 periods
    fresh = T0 + 14 * DT
    out = loop.tick(T0 + 15 * DT, measured=POSE, obs_stamp_ns=fresh)
    assert out.request is not None and out.request.stamp_ns == fresh


def test_the_watchdog_counts_time_not_ticks():
    """50 periods at 50 Hz = 1 s: a loop that ticks at 25 Hz still holds after 1 s, not 2 s."""
    loop = _loop(watchdog_periods=50)
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0, rows=3)])
    tripped_at = None
    for k in range(1, 60):
        now = T0 + k * 2 * DT  # every second tick is missed
        if any("watchdog" in w for w in loop.tick(now, measured=POSE).warnings):
            tripped_at = now
            break
    assert tripped_at is not None and 1.0 < (tripped_at - T0) / 1e9 <= 1.0 + 2 * DT / 1e9


def test_an_estop_after_the_tick_computed_its_command_withholds_it():
    loop = _loop()
    loop.tick(T0, measured=POSE, chunks=[_chunk(T0)])
    out = loop.tick(T0 + DT, measured=POSE)
    sent = []
    assert out.command is not None
    loop.set_estop(True)  # arrives between the tick and the publish
    assert not loop.send(out, sent.append) and not sent and loop.withheld == 1 and loop.commands == 0
    loop.set_estop(False)
    loop.set_enabled(True)
    loop.tick(T0 + 2 * DT, measured=POSE, chunks=[_chunk(T0 + 2 * DT)])
    out = loop.tick(T0 + 3 * DT, measured=POSE)
    assert loop.send(out, sent.append) and len(sent) == 1
