"""rosbag2 writing and reading without ROS: real bag files on disk, real simulator frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rosbags", reason="requirements-sim.txt is not installed")

from vla_accel_ros.core.errors import BagError, ConfigError  # noqa: E402
from vla_accel_ros.core.robot.topics import TopicLayout  # noqa: E402
from vla_accel_ros.io.bag_file import ACTION_NAMES, ARM_JOINTS  # noqa: E402
from vla_accel_ros.core.robot.config import SyncConfig  # noqa: E402
from vla_accel_ros.io.bag_reader import BagReader  # noqa: E402
from vla_accel_ros.io.bag_writer import BagWriter  # noqa: E402
from vla_accel_ros.io.episodes import episodes, summary  # noqa: E402
from vla_accel_ros.io.sim_recorder import FrameRecorder  # noqa: E402
from vla_accel_ros.core.robot.config import RobotConfig
from vla_accel_ros.core.robot.state import state_to_joint_states

H, W = 48, 64
START_NS = 1_700_000_000_000_000_000
DT_NS = 20_000_000
LEFT, RIGHT = "/follower_left/joint_states", "/follower_right/joint_states"
HIGH = "/cam_high/camera/color/image_rect_raw"
WRIST = "/cam_left_wrist/camera/color/image_rect_raw"


@pytest.fixture(scope="module")
def sim_frames():
    """Two short scripted episodes (3 and 4 ticks), two cameras, small images."""
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.sim import AlohaSim, SimConfig, scripted_episode_frames

    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top", "left_wrist"), height=H, width=W))
    return list(scripted_episode_frames(sim, seed=0, steps=3, episode=0)) + list(
        scripted_episode_frames(sim, seed=1, steps=4, episode=1)
    )


def _record(path: Path, frames, storage: str = "mcap", compress: bool | None = None) -> FrameRecorder:
    with BagWriter(path, storage=storage, compress=compress) as w:
        rec = FrameRecorder(w, start_ns=START_NS)
        for f in frames:
            rec.write(f)
    return rec


@pytest.mark.parametrize("storage, compress", [("mcap", True), ("mcap", False), ("sqlite3", False)])
def test_sim_frames_round_trip_bit_exact(tmp_path: Path, sim_frames, storage: str, compress: bool) -> None:
    bag = tmp_path / "run"
    rec = _record(bag, sim_frames, storage, compress)
    assert (rec.ticks, rec.episodes) == (7, 2)
    assert any(bag.glob("*.mcap" if storage == "mcap" else "*.db3"))
    with BagReader(bag) as r:
        counts = {t: s.count for t, s in r.topics.items()}
        assert counts == {
            HIGH: 7, WRIST: 7, LEFT: 7, RIGHT: 7, "/action/joint_command": 7,
            "/episode": 2, "/instruction": 2, "/episode/success": 2,
        }  # fmt: skip
        assert r.start_ns == START_NS and r.duration_ns == 6 * DT_NS
        msgs = list(r.messages([HIGH, WRIST, LEFT, RIGHT, "/action/joint_command"]))
    stamps = sorted({m.stamp_ns for m in msgs})
    assert stamps == [START_NS + k * DT_NS for k in range(7)]
    by = {(m.topic, m.stamp_ns): m.data for m in msgs}
    for k, f in enumerate(sim_frames):
        s = START_NS + k * DT_NS
        np.testing.assert_array_equal(by[(HIGH, s)], f.images["top"])
        np.testing.assert_array_equal(by[(WRIST, s)], f.images["left_wrist"])
        left, right, act = by[(LEFT, s)], by[(RIGHT, s)], by[("/action/joint_command", s)]
        # Joint states in the real robot's units (gripper angle + finger opening), as a live bag.
        (ln, lp, lv), (rn, rp, rv) = state_to_joint_states(RobotConfig(), f.qpos, f.qvel)
        assert left.names == tuple(ln) == ARM_JOINTS + ("left_finger",) and act.names == ACTION_NAMES
        np.testing.assert_array_equal(np.concatenate([left.position, right.position]), lp + rp)
        np.testing.assert_array_equal(np.concatenate([left.velocity, right.velocity]), lv + rv)
        np.testing.assert_array_equal(act.position, f.action)


def test_samples_follow_ticks_and_episodes(tmp_path: Path, sim_frames) -> None:
    bag = tmp_path / "run"
    _record(bag, sim_frames)
    with BagReader(bag) as r:
        samples = list(r.samples(SyncConfig()))
        eps = episodes(r)
        text = summary(r)
    assert len(samples) == 7 and r.skipped == {"stale": 0, "skew": 0, "future": 0, "repeated": 0, "no_state": 0, "stale_state": 0}
    for k, (s, f) in enumerate(zip(samples, sim_frames, strict=True)):
        obs = s.observation
        assert obs.stamp_ns == START_NS + k * DT_NS
        assert obs.episode == f.episode and obs.instruction == f.instruction
        assert set(obs.images) == {"cam_high", "cam_left_wrist"}
        np.testing.assert_array_equal(obs.images["cam_high"], f.images["top"])
        # Normalized grippers come back from the finger opening, as on the robot.
        np.testing.assert_allclose(obs.state, f.qpos, atol=1e-6)
        np.testing.assert_array_equal(s.action, f.action)
        arm = [i for i in range(14) if i not in (6, 13)]
        np.testing.assert_array_equal(s.qvel[arm], f.qvel[arm])
    assert [(e.index, e.frames) for e in eps] == [(0, 3), (1, 4)]
    assert eps[1].start_ns == START_NS + 3 * DT_NS
    assert all(e.success is False for e in eps)  # 3-4 ticks: nothing grasped yet
    assert "Pick up the red cube" in eps[0].instruction
    assert "episodes:  2" in text and "/cam_high/camera/color/image_rect_raw" in text


def _joint(w: BagWriter, topic: str, stamp: int, value: float) -> None:
    w.write_joint_state(topic, stamp, ARM_JOINTS + ("left_finger",), np.full(8, value))


def test_state_is_the_latest_at_or_before_the_frame(tmp_path: Path) -> None:
    """Robot-like streams: camera at 25 Hz, joint states at 100 Hz with their own phase."""
    bag = tmp_path / "robot"
    ms = 1_000_000
    with BagWriter(bag) as w:
        w.write_int32("/episode", 0, 0)
        w.write_string("/instruction", 0, "fold the towel")
        for i in range(40):  # joints every 10 ms from t=3 ms; value = its time in ms
            t = 3 * ms + i * 10 * ms
            _joint(w, LEFT, t, t / ms)
            _joint(w, RIGHT, t + 1 * ms, -t / ms)
        for i in range(10):  # camera every 40 ms from t=0; pixel value = frame index
            w.write_image(HIGH, i * 40 * ms, np.full((H, W, 3), i, np.uint8))
        # Joint states stop after 393 ms: a late frame sees them 207 ms old.
        w.write_image(HIGH, 600 * ms, np.full((H, W, 3), 99, np.uint8))
    with BagReader(bag) as r:
        samples = list(r.samples(SyncConfig(max_state_age_ms=100)))
        skipped = dict(r.skipped)
    # Frame 0 at t=0 comes before any joint state: no state; the frame at 600 ms: a stale state.
    assert skipped == {"stale": 0, "skew": 0, "future": 0, "repeated": 0, "no_state": 1, "stale_state": 1}
    assert [s.observation.stamp_ns // ms for s in samples] == [40 * i for i in range(1, 10)]
    for s in samples:
        t = s.observation.stamp_ns // ms
        latest_left = max(3 + 10 * i for i in range(40) if 3 + 10 * i <= t)
        latest_right = max(4 + 10 * i for i in range(40) if 4 + 10 * i <= t)
        assert s.observation.state[0] == latest_left
        assert s.observation.state[7] == -(latest_right - 1)
        assert s.stamps[LEFT] // ms == latest_left and s.stamps[RIGHT] // ms == latest_right
        assert s.observation.images["cam_high"][0, 0, 0] == t // 40
        assert s.observation.instruction == "fold the towel" and s.action is None


def test_episode_marker_forgets_previous_state(tmp_path: Path) -> None:
    bag = tmp_path / "two"
    with BagWriter(bag) as w:
        w.write_int32("/episode", 0, 0)
        _joint(w, LEFT, 0, 1.0)
        _joint(w, RIGHT, 0, 1.0)
        w.write_image(HIGH, 0, np.zeros((H, W, 3), np.uint8))
        w.write_int32("/episode", 100, 1)
        w.write_image(HIGH, 100, np.zeros((H, W, 3), np.uint8))  # no joint state yet in episode 1
        _joint(w, LEFT, 200, 2.0)
        _joint(w, RIGHT, 200, 2.0)
        w.write_image(HIGH, 200, np.zeros((H, W, 3), np.uint8))
    with BagReader(bag) as r:
        samples = list(r.samples())
        assert r.skipped["no_state"] == 1
    assert [(s.observation.episode, float(s.observation.state[0])) for s in samples] == [(0, 1.0), (1, 2.0)]


def _foreign_bag(path: Path, images: dict[str, dict]) -> Path:
    """A bag written by another recorder: one sensor_msgs/Image per topic at t=10 with the given
    fields (height, width, encoding, step, data)."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    ts = get_typestore(Stores.ROS2_JAZZY)
    t = ts.types
    header = t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id="")
    image = t["sensor_msgs/msg/Image"]
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        for topic, fields in images.items():
            c = w.add_connection(topic, image.__msgtype__, typestore=ts)
            w.write(c, 10, ts.serialize_cdr(image(header=header, is_bigendian=0, **fields), image.__msgtype__))
    return path


def test_image_step_padding_and_encodings(tmp_path: Path) -> None:
    """Images from other recorders: padded rows (step > width * channels), bgr8, mono8."""
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    step = 7 * 3 + 5  # 5 bytes of padding per row
    padded = np.zeros((5, step), np.uint8)
    padded[:, : 7 * 3] = rgb[:, :, ::-1].reshape(5, -1)  # bgr8
    gray = rgb[:, :, 0]
    bag = _foreign_bag(tmp_path / "foreign", {
        "/a/camera/color/image_rect_raw": dict(height=5, width=7, encoding="bgr8", step=step, data=padded.reshape(-1)),
        "/b/camera/color/image_rect_raw": dict(height=5, width=7, encoding="mono8", step=7, data=gray.reshape(-1)),
    })  # fmt: skip
    with BagReader(bag) as r:
        assert set(r.cameras()) == {"a", "b"}
        (s,) = list(r.samples())
    np.testing.assert_array_equal(s.observation.images["a"], rgb)
    np.testing.assert_array_equal(s.observation.images["b"], np.repeat(gray[:, :, None], 3, axis=2))
    assert s.observation.state is None  # no joint states in this bag


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(encoding="rgb8", step=26, data=np.zeros(26 * 4 + 21, np.uint8)), "size_mismatch"),  # last row unpadded
        (dict(encoding="rgb8", step=21, data=np.zeros(21 * 5 + 3, np.uint8)), "size_mismatch"),  # trailing bytes
        (dict(encoding="rgb8", step=20, data=np.zeros(20 * 5, np.uint8)), "bad_step"),
        (dict(encoding="32FC1", step=28, data=np.zeros(140, np.uint8)), "unknown_encoding"),
    ],
)
def test_bag_images_follow_the_camera_node_rule(tmp_path: Path, fields: dict, reason: str) -> None:
    """A frame the camera node would drop (decode_raw raises) is a BagError in a bag, for the same reason."""
    from vla_accel_ros.core.robot.images import ImageError, decode_raw

    with pytest.raises(ImageError) as live:
        decode_raw(fields["encoding"], 5, 7, fields["step"], False, fields["data"])
    assert live.value.reason == reason
    bag = _foreign_bag(tmp_path / "bad", {HIGH: dict(height=5, width=7, **fields)})
    with BagReader(bag) as r:
        with pytest.raises(BagError, match=f"{HIGH}: {reason}"):
            list(r.messages())


def test_malformed_input_raises_bag_error(tmp_path: Path) -> None:
    with pytest.raises(BagError, match="does not exist"):
        BagReader(tmp_path / "missing")
    garbage = tmp_path / "garbage.mcap"
    garbage.write_bytes(b"not an mcap file" * 8)
    with pytest.raises(BagError, match="not a readable"):
        with BagReader(garbage):
            pass
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(BagError):
        with BagReader(empty_dir):
            pass
    with pytest.raises(BagError, match="exists"):
        BagWriter(empty_dir)
    with pytest.raises(BagError, match="storage"):
        BagWriter(tmp_path / "x", storage="rosbag1")
    with pytest.raises(BagError, match="compression"):
        BagWriter(tmp_path / "x", storage="sqlite3", compress=True)
    with BagWriter(tmp_path / "bad_writes") as w:
        with pytest.raises(BagError, match=r"\[H, W, 3\]"):
            w.write_image(HIGH, 0, np.zeros((H, W), np.uint8))
        with pytest.raises(BagError, match="names"):
            w.write_joint_state(LEFT, 0, ARM_JOINTS, np.zeros(6))
        w.write_string("/instruction", 0, "x")
        with pytest.raises(BagError, match="carries"):
            w.write_bool("/instruction", 1, True)

    # A JointState without the ALOHA joint names cannot become a state vector.
    bag = tmp_path / "names"
    with BagWriter(bag) as w:
        w.write_joint_state(LEFT, 0, ("j1", "j2"), np.zeros(2))
        w.write_joint_state(RIGHT, 0, ("j1", "j2"), np.zeros(2))
        w.write_image(HIGH, 0, np.zeros((H, W, 3), np.uint8))
    with BagReader(bag) as r:
        with pytest.raises(BagError, match="lacks joint"):
            list(r.samples())
        with pytest.raises(BagError, match="no camera"):
            list(r.samples(SyncConfig(cameras=("cam_low",))))
        with pytest.raises(BagError, match="no topic"):
            list(r.messages(["/nope"]))


def test_corrupt_message_bytes(tmp_path: Path) -> None:
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    ts = get_typestore(Stores.ROS2_JAZZY)
    bag = tmp_path / "corrupt"
    with Writer(bag, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        c = w.add_connection(HIGH, "sensor_msgs/msg/Image", typestore=ts)
        w.write(c, 5, b"\x00\x01\x00\x00\x07")
    with BagReader(bag) as r:
        with pytest.raises(BagError, match="malformed"):
            list(r.messages())


def test_layout_validation() -> None:
    assert TopicLayout().image_topic(TopicLayout().ros_camera("top")) == HIGH
    assert TopicLayout().camera_of_topic("/cam_low/camera/color/image_rect_raw") == "cam_low"
    assert TopicLayout().camera_of_topic("/usb_cam/image_raw") == "/usb_cam/image_raw"
    with pytest.raises(ConfigError):
        TopicLayout(camera_topic="/camera/image_raw")
    with pytest.raises(ConfigError):
        TopicLayout(camera_names=("top",))


def test_cli_record_and_inspect(tmp_path: Path, capsys) -> None:
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    out = tmp_path / "cli_bag"
    argv = ["sim", "record", "--task", "insertion", "--episodes", "2", "--steps", "3", "--out", str(out),
            "--height", str(H), "--width", str(W), "--storage", "sqlite3", "--start-time", "100"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "recorded 6 frames, 2 episodes, 0 successes" in captured.out
    assert "episode 2/2 (seed 1)" in captured.err
    assert main(["bag", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "episodes:  2   successes: 0/2" in text and "peg" in text
    # Bad arguments fail before anything is written.
    assert (
        main(["sim", "record", "--task", "insertion", "--out", str(tmp_path / "b"), "--height", "999"]) == 2
    )
    assert not (tmp_path / "b").exists()
    assert main(["sim", "record", "--task", "insertion", "--out", str(tmp_path / "b"), "--action-noise", "0.5"]) == 2
    assert "--action-noise 0.5" in capsys.readouterr().err and not (tmp_path / "b").exists()
    for bad in (["--detour", "10,45"], ["--task", "transfer_cube", "--detour", "50,60"], ["--task", "transfer_cube", "--detour", "9"]):
        args = ["sim", "record", "--task", "insertion", "--out", str(tmp_path / "b"), *bad]
        assert main(args) == 2
        assert "--detour" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert main(["bag", "inspect", str(tmp_path / "missing")]) == 2


def test_a_nonfinite_first_joint_reading_rejects_one_sample_as_live(tmp_path: Path) -> None:
    """A glitched (NaN) first reading is not a layout error: the live rule rejects that one
    observation and goes on, and so does the bag reader (it raised and lost the whole bag)."""
    lay = TopicLayout()
    names = ARM_JOINTS + ("left_finger",)
    bag = tmp_path / "b"
    with BagWriter(bag) as w:
        for k in range(4):
            s = 1_000_000_000 + k * 20_000_000
            if k == 0:
                w.write_int32(lay.episode_topic, s, 0)
            w.write_image(lay.image_topic("cam_high"), s, np.full((8, 8, 3), k, np.uint8))
            for t in lay.joint_state_topics:
                pos = np.full(8, 0.1)
                pos[0] = np.nan if k == 0 else 0.1
                w.write_joint_state(t, s, names, pos)
            w.write_joint_state(lay.action_topic, s, ACTION_NAMES, np.zeros(14))
    with BagReader(bag) as r:
        samples = list(r.samples())
        assert len(samples) == 3 and r.skipped.get("no_state") == 1
    # A joint the messages never name is still a layout error.
    bad = tmp_path / "bad"
    with BagWriter(bad) as w:
        s = 1_000_000_000
        w.write_image(lay.image_topic("cam_high"), s, np.zeros((8, 8, 3), np.uint8))
        for t in lay.joint_state_topics:
            w.write_joint_state(t, s, names[1:], np.full(7, 0.1))
    with BagReader(bad) as r, pytest.raises(BagError, match="lacks joint"):
        list(r.samples())


def test_inspect_orders_one_tick_as_the_samples_do(tmp_path: Path) -> None:
    """A tick's episode marker written after its frame (same stamp) still opens the episode the
    frame belongs to, in the inspector as in samples()."""
    lay = TopicLayout()
    bag = tmp_path / "b"
    with BagWriter(bag) as w:
        for k in range(4):
            s = 1_000_000_000 + k * 20_000_000
            w.write_image(lay.image_topic("cam_high"), s, np.zeros((8, 8, 3), np.uint8))
            if k in (0, 2):
                w.write_int32(lay.episode_topic, s, k // 2)
    with BagReader(bag) as r:
        assert [(e.index, e.frames) for e in episodes(r)] == [(0, 2), (1, 2)]
