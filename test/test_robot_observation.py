"""Observation assembly (max age, max skew), latest-only slots, the stamp-keyed channel."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vla_accel_ros.core.robot.observation import LatestSlot, ObservationAssembler, ObservationChannel, SharedChannels

MS = 1_000_000
IMG = np.zeros((4, 4, 3), np.uint8)


def make(max_age_ms=100, max_skew_ms=40):
    return ObservationAssembler(("a", "b"), max_age_ns=max_age_ms * MS, max_skew_ns=max_skew_ms * MS, max_future_ns=50 * MS)


def test_assembles_only_when_every_camera_has_a_new_frame():
    asm = make()
    asm.put("a", IMG, 1000 * MS)
    assert asm.assemble(1001 * MS) is None and asm.missing() == ["b"]
    asm.put("b", IMG, 1010 * MS)
    obs = asm.assemble(1020 * MS)
    assert obs is not None and set(obs.images) == {"a", "b"}
    assert obs.stamp_ns == 1000 * MS  # the oldest frame's stamp
    assert obs.skew_ns == 10 * MS and obs.age_ns == 20 * MS
    # Same frames again: nothing new.
    assert asm.assemble(1021 * MS) is None
    asm.put("a", IMG, 1033 * MS)
    assert asm.assemble(1034 * MS) is None  # b has nothing new
    asm.put("b", IMG, 1040 * MS)
    assert asm.assemble(1041 * MS).seq == 2


def test_stale_and_skewed_sets_are_rejected_with_a_reason():
    asm = make(max_age_ms=100, max_skew_ms=40)
    asm.put("a", IMG, 1000 * MS)
    asm.put("b", IMG, 1000 * MS)
    assert asm.assemble(1200 * MS) is None
    assert "old" in asm.last_reject and asm.rejects["stale"] == 1
    asm.put("a", IMG, 1190 * MS)
    asm.put("b", IMG, 1100 * MS)
    assert asm.assemble(1195 * MS) is None
    assert "span" in asm.last_reject and asm.rejects["skew"] == 1
    asm.put("b", IMG, 1180 * MS)  # the lagging camera catches up
    assert asm.assemble(1195 * MS) is not None and asm.last_reject == ""
    asm.set_limits(max_age_ns=1 * MS, max_skew_ns=40 * MS, max_future_ns=50 * MS)
    asm.put("a", IMG, 1300 * MS)
    asm.put("b", IMG, 1300 * MS)
    assert asm.assemble(1302 * MS) is None


def test_a_frame_stamped_in_the_future_is_never_kept_and_later_frames_still_assemble():
    asm = make()
    # A wrong clock: one set stamped +1000 s. Refused (counted), not stored.
    assert asm.too_new(2000 * 1000 * MS, 1000 * MS) and not asm.too_new(1040 * MS, 1000 * MS)
    assert asm.add("a", IMG, 2000 * 1000 * MS, 1000 * MS) is None
    assert asm.add("b", IMG, 2000 * 1000 * MS, 1000 * MS) is None
    assert asm.rejects["future"] == 2 and "ahead of the clock" in asm.last_reject
    assert asm.missing() == ["a", "b"]
    # Valid frames afterwards make observations stamped with their own (present) time.
    asm.add("a", IMG, 1010 * MS, 1011 * MS)
    obs = asm.add("b", IMG, 1012 * MS, 1013 * MS)
    assert obs is not None and obs.stamp_ns == 1010 * MS
    asm.add("a", IMG, 1030 * MS, 1031 * MS)
    assert asm.add("b", IMG, 1030 * MS, 1031 * MS).stamp_ns == 1030 * MS


def test_a_frame_re_sent_with_its_old_stamp_is_not_a_new_frame():
    """Issue 33: a camera that re-sends one frame (same stamp) adds nothing: no observation is
    made from it again, however fresh the other cameras are; it is counted."""
    asm = make()
    asm.add("a", IMG, 1000 * MS, 1001 * MS)
    assert asm.add("b", IMG, 1000 * MS, 1002 * MS).stamp_ns == 1000 * MS
    asm.add("a", IMG, 1033 * MS, 1034 * MS)
    assert asm.add("b", IMG, 1000 * MS, 1035 * MS) is None  # b re-sends the frame it sent at 1000
    assert asm.rejects["repeated"] == 1
    assert asm.add("b", IMG, 1033 * MS, 1036 * MS).stamp_ns == 1033 * MS  # b streams again


def _stream(asm, cameras, start_ms: int, end_ms: int, stamp_ms=None) -> None:
    """Frames every 33 ms from ``start_ms`` to ``end_ms`` (arrival = stamp + 1 ms, or re-sent with ``stamp_ms``)."""
    for t in range(start_ms, end_ms, 33):
        for c in cameras:
            asm.add(c, IMG, (t if stamp_ms is None else stamp_ms) * MS, (t + 1) * MS)


def test_health_names_a_camera_that_is_silent_or_re_sends_one_stamp_until_it_recovers():
    """Per camera: OK while it sends new frames; WARN once its newest new frame is older than
    max_age (100 ms here), ERROR after error_ns (1 s here); a camera re-sending one stamp is named
    as such; OK again once it sends a new frame."""
    asm = make()
    err = 1000 * MS

    def levels(now_ms: int) -> dict[str, tuple[str, str]]:
        return {h.camera: (h.level, h.message) for h in asm.health(now_ms * MS, error_ns=err)}

    assert levels(1000) == {"a": ("warn", "no frames yet"), "b": ("warn", "no frames yet")}
    _stream(asm, "ab", 1000, 1200)
    assert {c: lvl for c, (lvl, _) in levels(1200).items()} == {"a": "ok", "b": "ok"}
    _stream(asm, "a", 1200, 1500)  # b goes silent after its frame at 1198
    now = levels(1500)
    assert now["a"][0] == "ok" and now["b"][0] == "warn" and "no new frame for 0.3 s" in now["b"][1]
    _stream(asm, "a", 1500, 2300)
    assert levels(2300)["b"][0] == "error"
    _stream(asm, "b", 2300, 2400, stamp_ms=1198)  # b re-sends its last frame with its stamp
    level, message = levels(2400)["b"]
    assert level == "error" and "re-sending one stamp" in message and "for 1.2 s" in message
    assert {h.camera: h.resent for h in asm.health(2400 * MS, error_ns=err)}["b"] == 4
    _stream(asm, "ab", 2400, 2500)
    assert {c: lvl for c, (lvl, _) in levels(2500).items()} == {"a": "ok", "b": "ok"}
    # An error time below max_age never turns a fresh camera to ERROR: WARN comes first.
    assert {h.camera: h.level for h in asm.health(2550 * MS, error_ns=10 * MS)} == {"a": "ok", "b": "ok"}
    assert {h.camera: h.level for h in asm.health(2700 * MS, error_ns=10 * MS)} == {"a": "error", "b": "error"}


def test_unknown_camera_is_an_error():
    with pytest.raises(KeyError):
        make().put("c", IMG, 0)


def test_latest_slot_keeps_only_the_newest_and_wakes_waiters():
    slot: LatestSlot[int] = LatestSlot()
    assert slot.take() is None and not slot.wait(0.0)
    slot.put(1)
    slot.put(2)
    assert slot.overwritten == 1 and slot.take() == 2 and slot.take() is None
    got = []
    t = threading.Thread(target=lambda: got.append(slot.wait(5.0)))
    t.start()
    slot.put(3)
    t.join(5.0)
    assert got == [True]


def test_channel_finds_observations_by_stamp_and_announces_them():
    ch = ObservationChannel(history=3)
    seen = []
    ch.listeners.append(lambda stamp, obs: seen.append(stamp))
    for s in (10, 20, 30, 40):
        ch.put(s, f"obs{s}")
    assert seen == [10, 20, 30, 40]
    assert ch.get(10) is None and ch.get(20) == "obs20"  # history of 3
    assert ch.latest() == (40, "obs40") and ch.seq == 4
    assert ch.wait_for_stamp(40, 0.0) == "obs40" and ch.wait_for_stamp(50, 0.01) is None
    assert not ch.wait_newer(4, 0.01) and ch.wait_newer(3, 0.0)


def test_shared_channels_are_per_owner():
    a, b = object(), object()
    assert SharedChannels.get(a, "obs") is SharedChannels.get(a, "obs")
    assert SharedChannels.get(a, "obs") is not SharedChannels.get(b, "obs")
    SharedChannels.drop(a)
    SharedChannels.drop(b)


# -- the state half and the whole rule --------------------------------------------------------------
def _gate(max_state_age_ms=100):
    from vla_accel_ros.core.robot.config import RobotConfig
    from vla_accel_ros.core.robot.observation import StateGate

    robot = RobotConfig(joint_names=("a_x", "b_x"), arms=("a", "b"), joint_state_topics=("/a", "/b"),
                        joint_state_prefixes=("a_", "b_"), grippers=())  # fmt: skip
    return robot, StateGate(robot, max_state_age_ns=max_state_age_ms * MS)


def test_nonfinite_joint_states_are_named_as_such_not_as_missing():
    _, gate = _gate()
    gate.update(0, ["x"], [1.0], 1000 * MS)
    gate.update(1, ["x"], [float("nan")], 1000 * MS)
    assert gate.state_for(1000 * MS) is None and gate.last_reject == "joint states for b_x are not finite (NaN / inf)"
    gate.update(1, ["x"], [2.0], 1001 * MS)
    assert gate.state_for(1001 * MS) is not None


def test_state_gate_attaches_the_state_or_says_why_not():
    _, gate = _gate(max_state_age_ms=100)
    gate.update(0, ["x"], [1.0], 1000 * MS)
    assert gate.state_for(1010 * MS) is None and gate.last_reason == "no_state" and "b_x" in gate.last_reject
    gate.update(1, ["x"], [2.0], 1005 * MS)
    np.testing.assert_array_equal(gate.state_for(1050 * MS), [1.0, 2.0])
    assert gate.last_reason == ""
    assert gate.state_for(1101 * MS) is None and gate.last_reason == "stale_state"  # the oldest reading counts
    assert gate.rejects == {"no_state": 1, "stale_state": 1}
    gate.set_limit(max_state_age_ns=200 * MS)
    assert gate.state_for(1101 * MS) is not None


def test_builder_runs_both_halves_and_episodes_reset_it():
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.core.robot.observation import ObservationBuilder

    robot, _ = _gate()
    b = ObservationBuilder(("a", "b"), SyncConfig(max_state_age_ms=100, image_size=2), robot)
    b.begin_episode(3)
    b.set_instruction("stack")
    b.joint_state(0, ["x"], [1.0], 1000 * MS)
    b.joint_state(1, ["x"], [2.0], 1000 * MS)
    assert b.frame("a", IMG, 1000 * MS, 1000 * MS) is None  # b has no frame yet
    obs = b.frame("b", IMG, 1010 * MS, 1010 * MS)
    assert obs.stamp_ns == 1000 * MS and obs.episode == 3 and obs.instruction == "stack"
    assert obs.images["a"].shape == (2, 2, 3)  # resized by the rule's image_size
    np.testing.assert_array_equal(obs.state, [1.0, 2.0])
    b.begin_episode(4)  # nothing from episode 3 is used in episode 4
    assert b.instruction == "" and b.frame("a", IMG, 1020 * MS, 1020 * MS) is None
    assert b.frame("b", IMG, 1020 * MS, 1020 * MS) is None and b.rejects["no_state"] == 1
    assert b.rejects == {"stale": 0, "skew": 0, "future": 0, "repeated": 0, "no_state": 1, "stale_state": 0}


def test_a_clock_that_jumps_back_starts_over():
    asm = make()
    asm.add("a", IMG, 1000 * MS, 1000 * MS)
    asm.add("a", IMG, 10 * MS, 10 * MS)  # sim time restarted: the frame of 1000 ms is forgotten
    assert asm.add("b", IMG, 11 * MS, 11 * MS).stamp_ns == 10 * MS


def test_one_resize_for_every_path():
    """The camera node's prepare, the policy's preprocessing and resize_rgb give the same pixels."""
    from vla_accel_ros.core.robot.images import ImageError, resize_rgb
    from vla_accel_ros.models.common import resize_uint8

    frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    asm = ObservationAssembler(("a",), max_age_ns=MS, max_skew_ns=MS, max_future_ns=MS, image_size=16)
    live = asm.prepare(frame)
    assert live.shape == (16, 16, 3) and live.dtype == np.uint8
    np.testing.assert_array_equal(live, resize_rgb(frame, 16))
    np.testing.assert_array_equal(live, resize_uint8(frame, 16).numpy())
    assert resize_rgb(live, 16) is live  # at size: untouched
    with pytest.raises(ImageError):
        asm.prepare(np.zeros((0, 4, 3), np.uint8))
    with pytest.raises(ImageError):
        resize_rgb(frame.astype(np.float32), 16)
