"""``vla-accel bag export-lerobot``: real simulator bags in, a LeRobotDataset v3.0 out.

The fast tests hold the rows the exporter hands LeRobot's writer against the bag's own
messages (frames, joint states, commands, instruction, episode markers) and give it bad bags;
the slow ones (LeRobot's side venv: /tmp/lerobot-venv, or env LEROBOT_PYTHON) export and read
the dataset back with LeRobot 0.4.4's own ``LeRobotDataset``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rosbags", reason="requirements-sim.txt is not installed")

from vla_accel_ros.core.errors import BagError  # noqa: E402
from vla_accel_ros.core.robot.config import RobotConfig  # noqa: E402
from vla_accel_ros.core.robot.state import GripperMap  # noqa: E402
from vla_accel_ros.core.robot.topics import TopicLayout  # noqa: E402
from vla_accel_ros.io.bag_file import ACTION_NAMES, ARM_JOINTS  # noqa: E402
from vla_accel_ros.io.bag_reader import BagReader  # noqa: E402
from vla_accel_ros.io.bag_writer import BagWriter  # noqa: E402
from vla_accel_ros.io.lerobot_export import (  # noqa: E402
    WORKER,
    BagFrames,
    ExportConfig,
    dataset_fps,
    features,
    frame_message,
)

LEROBOT_PY = Path(os.environ.get("LEROBOT_PYTHON", "/tmp/lerobot-venv/bin/python"))
READER = Path(__file__).with_name("lerobot_read_dataset.py")
LAY = TopicLayout()
CAMS = ("cam_high", "cam_left_wrist", "cam_right_wrist")
H, W, STEPS = 96, 128, 8


def _record(out: Path, *, cameras: str = "top,left_wrist,right_wrist", episodes: int = 2, render_every: int = 1) -> Path:
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    argv = ["sim", "record", "--task", "transfer_cube", "--episodes", str(episodes), "--steps", str(STEPS),
            "--cameras", cameras, "--height", str(H), "--width", str(W), "--render-every", str(render_every),
            "--start-time", "1000", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def bag3(tmp_path_factory) -> Path:
    """Two scripted episodes of 8 ticks, three cameras at every tick."""
    return _record(tmp_path_factory.mktemp("bags") / "cube3")


def _cfg(tmp_path: Path, *bags: Path, **kw) -> ExportConfig:
    return ExportConfig(bags=tuple(str(b) for b in bags), out=str(tmp_path / "ds"), **kw)


def _expected(bag: Path) -> list[dict]:
    """What the dataset must hold, from the bag's messages themselves: one row per tick with
    frames (the simulator's ticks share one stamp), its episode marker, the tick's command, its
    instruction, and the joint states as the robot publishes them (grippers as finger positions)."""
    ticks: dict[int, dict] = {}
    with BagReader(bag) as r:
        for m in r.messages():
            ticks.setdefault(m.stamp_ns, {})[m.topic] = m.data
    rows, episode, task = [], None, None
    gripper = GripperMap(RobotConfig().gripper)
    for stamp in sorted(ticks):
        t = ticks[stamp]
        episode = t.get(LAY.episode_topic, episode)
        task = t.get(LAY.instruction_topic, task)
        if LAY.image_topic(CAMS[0]) not in t:
            continue
        act = t[LAY.action_topic]
        assert act.names == ACTION_NAMES
        state = []
        for topic in LAY.joint_state_topics:  # the bag's names (the robot config's, resolved in the root namespace)
            js = t[topic]
            pos = dict(zip(js.names, js.position))
            state += [pos[j] for j in ARM_JOINTS[:-1]] + [gripper.finger_to_normalized(pos["left_finger"])]
        rows.append({"stamp": stamp, "episode": episode, "task": task, "action": act.position, "state": np.asarray(state),
                     "images": {c: t[LAY.image_topic(c)] for c in CAMS if LAY.image_topic(c) in t}})  # fmt: skip
    return rows


def test_rows_are_what_the_bag_holds_at_each_observation(bag3: Path, tmp_path: Path) -> None:
    frames = list(BagFrames(_cfg(tmp_path, bag3)))
    want = _expected(bag3)
    assert len(frames) == len(want) == 2 * STEPS
    assert [f.episode for f in frames] == [f"{bag3}#{w['episode']}" for w in want]
    assert [w["episode"] for w in want] == [0] * STEPS + [1] * STEPS
    for f, w in zip(frames, want):
        assert f.stamp_ns == w["stamp"] and f.task == w["task"] and f.task.startswith("Pick up the red cube")
        assert list(f.images) == list(CAMS)
        for cam in CAMS:
            np.testing.assert_array_equal(f.images[cam], w["images"][cam])
            assert f.images[cam].shape == (H, W, 3)
        np.testing.assert_array_equal(f.action, w["action"].astype(np.float32))
        np.testing.assert_allclose(f.state, w["state"], atol=1e-6)
    assert not any(np.array_equal(frames[0].action, f.action) for f in frames[1:STEPS])  # the expert moves
    feats = features(frames[0], RobotConfig(), video=False)
    assert feats["observation.images.cam_left_wrist"] == {"dtype": "image", "shape": [H, W, 3],
                                                          "names": ["height", "width", "channels"]}  # fmt: skip
    assert feats["observation.state"]["names"] == list(RobotConfig().joint_names)
    assert feats["action"]["names"] == list(ACTION_NAMES)


def test_fps_is_the_observation_rate(bag3: Path, tmp_path: Path) -> None:
    """Every tick: the control rate. ``--render-every 2``: 25 fps, each row the command of its
    frame's tick. ``--render-every 3`` (16.67 Hz) is no whole fps: refused, saying why."""
    assert dataset_fps([f.stamp_ns for f in BagFrames(_cfg(tmp_path, bag3))], "cube3") == 50
    every2 = _record(tmp_path / "every2", cameras="top", episodes=1, render_every=2)
    frames = list(BagFrames(_cfg(tmp_path, every2)))
    want = _expected(every2)
    assert len(frames) == len(want) == STEPS // 2
    assert dataset_fps([f.stamp_ns for f in frames], "every2") == 25
    for f, w in zip(frames, want):
        np.testing.assert_array_equal(f.action, w["action"].astype(np.float32))
    every3 = _record(tmp_path / "every3", cameras="top", episodes=1, render_every=3)
    with pytest.raises(BagError, match=r"every3.*60\.0 ms \(16\.67 Hz\).*whole number"):
        dataset_fps([f.stamp_ns for f in BagFrames(_cfg(tmp_path, every3))], "every3")


def test_frames_closer_than_a_period_are_refused() -> None:
    """A bag recorded with ``sim record --render-first`` (every tick at the start, then every 2nd):
    its median rate is a whole fps, but rows are timed index / fps, so its first frames would be
    written at times they were not taken."""
    ms = [0, 20, 40, 80, 120, 160, 200]  # ticks 0, 1, 2, then every 2nd
    with pytest.raises(BagError, match=r"dense: 2 observation\(s\) less than 0.6 of a frame period \(24.0 ms\).*--render-first"):
        dataset_fps([m * 1_000_000 for m in ms], "dense")
    assert dataset_fps([m * 1_000_000 for m in ms[2:]], "even") == 25


def _copy(src: Path, dst: Path, keep=lambda m: True, marker: int | None = None) -> Path:
    """A bag with the messages of ``src`` that ``keep(message)`` keeps, bytes unchanged (every
    episode marker set to ``marker`` when given)."""
    with BagReader(src) as r, BagWriter(dst) as w:
        topics = list(r.topics)
        for m in r.messages(topics, raw=topics):
            if marker is not None and m.topic == LAY.episode_topic:
                w.write_int32(m.topic, m.stamp_ns, marker)
            elif keep(m):
                w.write_cdr(m.topic, m.msgtype, m.stamp_ns, m.data)
    return dst


def test_episodes_follow_the_markers_across_bags(bag3: Path, tmp_path: Path) -> None:
    """Bags follow one another; every marker starts an episode, also one that repeats the
    previous index (a restarted simulator)."""
    again = _copy(bag3, tmp_path / "again", marker=0)
    frames = list(BagFrames(_cfg(tmp_path, bag3, again)))
    keys = [f.key for f in frames]
    assert [(k, keys.count(k)) for k in dict.fromkeys(keys)] == [((0, 0), 8), ((0, 1), 8), ((1, 0), 8), ((1, 1), 8)]
    names = [frames[i].episode for i in range(0, 4 * STEPS, STEPS)]
    assert names == [f"{bag3}#0", f"{bag3}#1", f"{again}#0", f"{again}#0"]


def _episode_of(bag: Path) -> dict[int, int]:
    """stamp -> episode marker value, from the bag's markers."""
    with BagReader(bag) as r:
        starts = [(m.stamp_ns, int(m.data)) for m in r.messages([LAY.episode_topic])]
        stamps = sorted({m.stamp_ns for m in r.messages(raw=list(r.topics))})
    return {s: max(e for t, e in starts if t <= s) for s in stamps}


def test_bad_bags_fail_naming_the_bag_and_topic(bag3: Path, tmp_path: Path) -> None:
    episode = _episode_of(bag3)
    # A camera the list needs is not in the bag.
    with pytest.raises(BagError, match=rf"{bag3} has no /cam_low/camera/color/image_rect_raw \(camera cam_low\)"):
        BagFrames(_cfg(tmp_path, bag3, cameras=("cam_high", "cam_low")))
    # The bag's joint names are not the robot's (a parameter file for another naming).
    other = RobotConfig(joint_state_prefixes=("l_", "r_"))
    with pytest.raises(BagError, match=rf"{bag3}: /follower_left/joint_states: JointState lacks joint\(s\) of the "
                                       "robot: it names none of this topic's joints"):  # fmt: skip
        list(BagFrames(_cfg(tmp_path, bag3, robot=other)))
    # No commands: no action.
    no_action = _copy(bag3, tmp_path / "no_action", lambda m: m.topic != LAY.action_topic)
    with pytest.raises(BagError, match=rf"{no_action} has no /action/joint_command"):
        BagFrames(_cfg(tmp_path, no_action))
    # No instruction: no task, unless --task gives one.
    no_task = _copy(bag3, tmp_path / "no_task", lambda m: m.topic != LAY.instruction_topic)
    with pytest.raises(BagError, match=rf"{no_task}: episode #0 has no /instruction message.*--task"):
        list(BagFrames(_cfg(tmp_path, no_task)))
    assert {f.task for f in BagFrames(_cfg(tmp_path, no_task, task="hand over the cube"))} == {"hand over the cube"}
    # An episode marker with no frame after it.
    empty = _copy(bag3, tmp_path / "empty", lambda m: not (episode[m.stamp_ns] == 1 and "/camera/" in m.topic))
    with pytest.raises(BagError, match=rf"{empty}: episode #1 has no observation on /cam_high/camera"):
        list(BagFrames(_cfg(tmp_path, empty)))


def test_truncated_bags(bag3: Path, tmp_path: Path) -> None:
    """A recording that ends inside an episode is refused (or its partial episode left out);
    a file cut short is no readable bag."""
    episode = _episode_of(bag3)
    cut_at = sorted(s for s, e in episode.items() if e == 1)[3]
    ended = _copy(bag3, tmp_path / "ended", lambda m: m.stamp_ns < cut_at)
    with pytest.raises(BagError, match=rf"{ended}: episode\(s\) #1 have no /episode/success.*truncated"):
        BagFrames(_cfg(tmp_path, ended))
    source = BagFrames(_cfg(tmp_path, ended, skip_partial=True))
    frames = list(source)
    assert len(frames) == STEPS and {f.episode for f in frames} == {f"{ended}#0"}
    assert source.counts.partial_episodes == [f"{ended}#1"]
    cut = tmp_path / "cut"
    shutil.copytree(bag3, cut)
    (mcap,) = cut.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[: mcap.stat().st_size // 2])
    with pytest.raises(BagError, match=rf"{cut} is not a readable rosbag2 bag"):
        BagFrames(_cfg(tmp_path, bag3, cut))  # before anything of the first bag is written


def test_frames_reach_the_worker_as_sent(bag3: Path, tmp_path: Path) -> None:
    """The pipe's protocol, both ends: the exporter's messages parsed by the worker's reader
    (loaded from its file; it imports LeRobot only in main)."""
    from safetensors.numpy import load

    spec = importlib.util.spec_from_file_location("lerobot_dataset_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    frames = list(BagFrames(_cfg(tmp_path, bag3)))[:3]
    stream = io.BytesIO(b"".join(frame_message(f) for f in frames) + b'{"op": "episode"}\n')
    got = list(worker.messages(stream))
    assert [h["op"] for h, _ in got] == ["frame"] * 3 + ["episode"]
    for f, (head, body) in zip(frames, got):
        arrays = load(body)
        assert head["task"] == f.task
        assert sorted(arrays) == sorted(["action", "observation.state", *(f"observation.images.{c}" for c in CAMS)])
        np.testing.assert_array_equal(arrays["observation.images.cam_right_wrist"], f.images["cam_right_wrist"])
        np.testing.assert_array_equal(arrays["action"], f.action)
        assert arrays["observation.state"].dtype == np.float32
    with pytest.raises(SystemExit, match="ends after"):
        list(worker.messages(io.BytesIO(frame_message(frames[0])[:-5])))


def test_cli_checks_its_arguments_first(bag3: Path, tmp_path: Path, capsys) -> None:
    from vla_accel_ros.cli import main

    out = tmp_path / "ds"
    assert main(["bag", "export-lerobot", str(bag3), "--out", str(out), "--python", str(tmp_path / "nope")]) == 2
    assert "--python" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    assert main(["bag", "export-lerobot", str(bag3), "--out", str(out), "--python", str(LEROBOT_PY)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert main(["bag", "export-lerobot", str(tmp_path / "missing"), "--out", str(tmp_path / "d2"), "--python", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _lerobot_reads(root: Path, tmp_path: Path, rows: list[int]) -> tuple[dict, dict]:
    """The dataset as LeRobot 0.4.4's LeRobotDataset reads it (test/lerobot_read_dataset.py)."""
    from safetensors.numpy import load_file

    out = tmp_path / "read"
    proc = subprocess.run([str(LEROBOT_PY), str(READER), "--root", str(root), "--out", str(out),
                           "--rows", ",".join(map(str, rows))], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(f"{out}.json").read_text()), load_file(f"{out}.safetensors")


def _need_lerobot() -> None:
    if not LEROBOT_PY.is_file():
        pytest.skip(f"LeRobot's side venv is missing ({LEROBOT_PY}; "
                    "../shared/tools/lerobot-reference/install_lerobot_venv.sh, or env LEROBOT_PYTHON)")


def _export(tmp_path: Path, monkeypatch, *argv: str) -> Path:
    from vla_accel_ros.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # LeRobot's reader caches the rows as Arrow there
    out = tmp_path / "dataset"
    assert main(["bag", "export-lerobot", *argv, "--out", str(out), "--python", str(LEROBOT_PY), "--no-progress"]) == 0
    return out


@pytest.mark.slow
def test_lerobot_reads_the_export_of_a_three_camera_sim_bag(tmp_path: Path, monkeypatch, capsys) -> None:
    _need_lerobot()
    bag = _record(tmp_path / "cube3")  # --cameras top,left_wrist,right_wrist
    root = _export(tmp_path, monkeypatch, str(bag))
    assert "2 episodes, 16 frames at 50 fps" in capsys.readouterr().out
    rows = [0, STEPS + 3]
    meta, arrays = _lerobot_reads(root, tmp_path, rows)
    want = _expected(bag)
    assert meta["codebase_version"] == "v3.0" and meta["fps"] == 50
    assert meta["num_frames"] == meta["len"] == len(want) == 2 * STEPS and meta["num_episodes"] == 2
    assert [(e["from"], e["to"]) for e in meta["episodes"]] == [(0, STEPS), (STEPS, 2 * STEPS)]
    np.testing.assert_array_equal(arrays["episode_index"], [w["episode"] for w in want])
    np.testing.assert_allclose(arrays["timestamp"], np.tile(np.arange(STEPS) / 50, 2), atol=1e-6)
    np.testing.assert_array_equal(arrays["action"], np.stack([w["action"] for w in want]).astype(np.float32))
    np.testing.assert_allclose(arrays["observation.state"], np.stack([w["state"] for w in want]), atol=1e-6)
    assert meta["row_task"] == [want[r]["task"] for r in rows]
    assert meta["camera_keys"] == [f"observation.images.{c}" for c in CAMS] and not meta["video_keys"]
    for r in rows:
        for cam in CAMS:
            np.testing.assert_array_equal(arrays[f"observation.images.{cam}@{r}"], want[r]["images"][cam])  # PNG: exact
    # The statistics LeRobot's normalization reads, over every row.
    actions = np.stack([w["action"] for w in want])
    np.testing.assert_allclose(meta["stats"]["action"]["mean"], actions.mean(0), atol=1e-5)
    np.testing.assert_allclose(meta["stats"]["action"]["max"], actions.max(0), atol=1e-6)
    assert meta["features"]["observation.state"]["names"] == list(RobotConfig().joint_names)


@pytest.mark.slow
def test_lerobot_reads_a_video_export_at_the_frame_rate(tmp_path: Path, monkeypatch) -> None:
    """``--video``: LeRobot's MP4 (AV1) layout; a bag rendered every 2 ticks is a 25 fps dataset."""
    _need_lerobot()
    bag = _record(tmp_path / "every2", render_every=2)
    root = _export(tmp_path, monkeypatch, str(bag), "--video")
    rows = [1, STEPS // 2 + 2]
    meta, arrays = _lerobot_reads(root, tmp_path, rows)
    want = _expected(bag)
    assert meta["fps"] == 25 and meta["num_frames"] == len(want) == STEPS and meta["num_episodes"] == 2
    assert meta["video_keys"] == [f"observation.images.{c}" for c in CAMS]
    np.testing.assert_array_equal(arrays["action"], np.stack([w["action"] for w in want]).astype(np.float32))
    for r in rows:
        for cam in CAMS:
            got = arrays[f"observation.images.{cam}@{r}"].astype(float)
            errors = [np.abs(got - w["images"][cam].astype(float)).mean() for w in want]
            # Lossy (mean |error| 0.4-1.9 of 255 here, against 2.7-39 to the other rows' frames),
            # but this row's frame: the video's timestamps are the rows'.
            assert got.shape == (H, W, 3) and errors[r] < 3.0 and int(np.argmin(errors)) == r
