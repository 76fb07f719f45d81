"""Observation assembly (max age, max skew), latest-only slots, the stamp-keyed channel."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vla_accel_ros.core.robot.observation import LatestSlot, ObservationAssembler, ObservationChannel, SharedChannels

MS = 1_000_000
IMG = np.zeros((4, 4, 3), np.uint8)


def make(max_age_ms=100, max_skew_ms=40):
    return ObservationAssembler(("a", "b"), max_age_ns=max_age_ms * MS, max_skew_ns=max_skew_ms * MS)


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
    asm.set_limits(max_age_ns=1 * MS, max_skew_ns=40 * MS)
    asm.put("a", IMG, 1300 * MS)
    asm.put("b", IMG, 1300 * MS)
    assert asm.assemble(1302 * MS) is None


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
