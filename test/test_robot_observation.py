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
    assert b.rejects == {"stale": 0, "skew": 0, "future": 0, "no_state": 1, "stale_state": 0}


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
