"""Recorded bags to a LeRobotDataset v3.0: ``vla-accel bag export-lerobot``.

The rows are the observations the policy node would make from the bags, by the package's one
observation rule (:meth:`~vla_accel_ros.io.bag_reader.BagReader.samples`: the same frame-to-state
pairing, the same freshness limits), so a policy trained on the export sees at run time what it
saw in training:

- ``observation.images.<camera>``: each camera's frame as recorded (decoded by the camera node's
  rule, not resized: LeRobot's policies resize, and a ``bundle import``-ed one resizes as they do);
- ``observation.state``: the joint states assembled by the policy node's state assembler, in the
  robot's ``joint_names`` order (the bundle's order);
- ``action``: the command the bag holds for the observation's tick (``/action/joint_command``:
  the latest one at the observation, within its episode; in a simulator bag the scripted
  expert's action of that tick);
- ``task``: the episode's instruction (``/instruction``);
- one dataset episode per episode marker (``/episode``), timestamps ``frame_index / fps``.

The dataset's fps is the observations' rate (one row per observation), which must be a whole
number: 50 for a simulator bag rendered every tick, 50 / N for ``sim record --render-every N``
(the actions between two frames are not rows: LeRobot has one action per frame).

The writer is LeRobot's own ``LeRobotDataset`` (``create``, ``add_frame``, ``save_episode``,
``finalize``: the rows, PNG images or AV1 videos, and the statistics its normalization reads)
run in LeRobot's Python as :mod:`vla_accel_ros.io.lerobot_dataset_worker`; frames travel to it
over a pipe as safetensors blobs. The dataset is written beside ``out`` and moved there once
LeRobot's metadata reader has read it back; a failure leaves nothing at ``out``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import BagError, ConfigError, VlaAccelError
from vla_accel_ros.core.params_file import default_params_file, load_params, node_config
from vla_accel_ros.core.robot.config import CameraConfig, PolicyNodeConfig, RobotConfig, SyncConfig
from vla_accel_ros.core.robot.topics import TopicLayout, root_name
from vla_accel_ros.io.bag_file import ACTION_NAMES, bag_size_bytes
from vla_accel_ros.io.bag_reader import BagReader, in_tick_order

WORKER = Path(__file__).with_name("lerobot_dataset_worker.py")
CODEBASE_VERSION = "v3.0"  # the LeRobotDataset format LeRobot 0.4 reads and writes
# An episode's median observation interval may differ this much from 1 / fps (a camera at
# 29.97 Hz in a 30 fps dataset passes; 50 / 3 Hz frames, 16.67 fps, are no 17 fps dataset).
RATE_TOLERANCE = 0.01
# No observation may follow the one before by less than this many frame periods (camera jitter
# stays well above it; every tick of a 25 fps recording's start, 0.5, does not).
CLOSE = 0.6
# Rows read to find the dataset's fps before the writer starts (it needs the fps first).
FPS_PROBE = 16


@dataclass(frozen=True)
class ExportConfig(Config):
    bags: tuple[str, ...] = param((), doc="rosbag2 bags (directories, .mcap or .db3 files); episodes follow in order")
    out: str = param("", doc="dataset directory to create (must not exist)")
    python: str = param("", doc="the Python of an environment with lerobot 0.4.4 (LeRobotDataset v3.0)")
    cameras: tuple[str, ...] = param(
        (), doc="ROS camera names, one observation.images.<camera> each, in this order (empty: every camera of the first bag)"
    )
    fps: int = param(
        0, doc="the dataset's frames per second (0: the observations' rate, which a value must match within 1%)",
        range=(0, 1000),
    )
    video: bool = param(False, doc="cameras as AV1 videos (LeRobot's default layout, lossy) instead of PNG images (lossless)")
    task: str = param("", doc="task of an episode without an instruction message ('': such an episode is an error)")
    repo_id: str = param("", doc="the dataset's repo id (default local/<out directory name>)")
    skip_partial: bool = param(
        False, doc="leave out episodes without an outcome message (a recording that ended inside one) instead of failing"
    )
    robot: RobotConfig = param(RobotConfig(), doc="joint order, joint-state topics and gripper maps of the policy node")
    sync: SyncConfig = param(SyncConfig(), doc="the observation rule's limits (the camera and policy nodes' values)")

    def validate(self) -> None:
        if not self.bags:
            raise ConfigError("ExportConfig.bags: give at least one bag")
        if not self.out:
            raise ConfigError("ExportConfig.out: give the dataset directory to create")
        if self.sync.cameras or self.sync.image_size:
            raise ConfigError("ExportConfig.sync: cameras come from ExportConfig.cameras, and frames are not resized")
        if len(set(self.bags)) != len(self.bags):
            raise ConfigError(f"ExportConfig.bags lists a bag twice: {list(self.bags)}")
        if len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(f"ExportConfig.cameras must be unique, got {list(self.cameras)}")

    def check_paths(self) -> None:
        """What must hold before anything is read or written (the CLI's argument check)."""
        for b in self.bags:
            if not Path(b).exists():
                raise BagError(f"bag {b} does not exist")
        if Path(self.out).exists():
            raise ConfigError(f"--out {self.out} exists already; datasets are never overwritten")
        if not Path(self.python).is_file():
            raise ConfigError(
                f"--python {self.python or '(none)'}: not a file; give the Python of an environment with lerobot 0.4.4 "
                "(or set LEROBOT_PYTHON)"
            )

    @property
    def dataset_repo_id(self) -> str:
        return self.repo_id or f"local/{Path(self.out).name}"


@dataclass
class DatasetFrame:
    """One row of the dataset: an observation the policy node would make, and its action."""

    episode: str  # "<bag>#<episode marker>", for messages
    key: tuple[int, int]  # (bag, segment): a new value starts a new dataset episode (a marker may repeat its index)
    images: dict[str, np.ndarray]  # camera -> [H, W, 3] uint8 as recorded, in the configured camera order
    state: np.ndarray  # [S] float32, robot.joint_names order
    action: np.ndarray  # [A] float32, ACTION_NAMES order
    task: str
    stamp_ns: int  # the observation's stamp (its oldest frame)


@dataclass(frozen=True)
class _Segment:
    index: int  # the episode marker's value
    partial: bool = False  # the bag records outcomes and this episode has none: it ends inside it


@dataclass
class FrameCounts:
    """What the reading left out, for the summary."""

    rejected: dict[str, int] = field(default_factory=dict)  # by the observation rule, by reason
    before_first_action: int = 0  # observations before the episode's first command
    before_first_marker: int = 0  # observations before the bag's first episode marker
    partial_episodes: list[str] = field(default_factory=list)  # left out (skip_partial)


class BagFrames:
    """The dataset's rows from ``cfg.bags``, in order, with the bad input found first.

    Constructing it opens every bag and checks what can be checked without reading frames:
    the camera, joint-state and action topics, and episodes without an outcome (a bag that ends
    inside an episode). Iterating reads the bags through the observation rule and raises
    :class:`BagError` naming the bag and topic for joint names that do not match, frames whose
    size changes, an episode without an observation or without an instruction.
    """

    def __init__(self, cfg: ExportConfig, layout: TopicLayout | None = None) -> None:
        self.cfg = cfg
        self.layout = layout or TopicLayout()
        # The parameter file names the joint-state topics relative to the graph's namespace; a
        # bag holds them as a graph in the root namespace resolved them.
        self.robot = cfg.robot.replace(joint_state_topics=tuple(root_name(t) for t in cfg.robot.joint_state_topics))
        self.counts = FrameCounts()
        self.cameras: tuple[str, ...] = cfg.cameras
        self.frames_total = 0  # frames on the first camera's topic, for a progress bar
        self._segments: list[list[_Segment] | None] = []  # per bag
        for path in cfg.bags:
            with self._open(path) as bag:
                self._check(bag)

    def _open(self, path: str) -> BagReader:
        return BagReader(path, layout=self.layout, robot=self.robot)

    def _check(self, bag: BagReader) -> None:
        lay, here = self.layout, bag.topics
        cams = bag.cameras()
        if not self.cameras:
            if not cams:
                raise BagError(f"{bag.path} has no image topics (sensor_msgs/Image or CompressedImage)")
            self.cameras = tuple(sorted(cams))
        for cam in self.cameras:
            if "/" in cam:
                raise BagError(f"{bag.path}: camera {cam!r} (a topic off the {lay.camera_topic} layout) cannot name a "
                               "LeRobot feature; name the cameras with --cameras")  # fmt: skip
            if cam not in cams:
                have = ", ".join(f"{c} ({t})" for c, t in sorted(cams.items())) or "none"
                raise BagError(f"{bag.path} has no {lay.image_topic(cam)} (camera {cam}); its cameras: {have}")
        self.frames_total += here[cams[self.cameras[0]]].count
        for topic in self.robot.joint_state_topics:
            if topic not in here:
                raise BagError(f"{bag.path} has no {topic} (sensor_msgs/JointState): observation.state is assembled from "
                               f"{', '.join(self.robot.joint_state_topics)}")  # fmt: skip
        if lay.action_topic not in here:
            raise BagError(f"{bag.path} has no {lay.action_topic} (sensor_msgs/JointState): the action of each frame is "
                           "the command recorded there")  # fmt: skip
        segments = self._segments_of(bag)
        partial = [s for s in segments or [] if s.partial]
        if partial:
            if not self.cfg.skip_partial:
                which = ", ".join(f"#{s.index}" for s in partial)
                raise BagError(f"{bag.path}: episode(s) {which} have no {lay.success_topic}: the recording ended inside "
                               "them (a truncated bag?); --skip-partial leaves them out")  # fmt: skip
            self.counts.partial_episodes += [f"{bag.path}#{s.index}" for s in partial]
        self._segments.append(segments)

    def _segments_of(self, bag: BagReader) -> list[_Segment] | None:
        """One entry per episode marker, as :meth:`BagReader.samples` counts segments (None:
        the bag has no markers, it is one episode); where the bag records outcomes, an episode
        without one is partial."""
        lay = self.layout
        topics = [t for t in (lay.episode_topic, lay.success_topic) if t in bag.topics]
        if lay.episode_topic not in topics:
            return None
        markers: list[int] = []
        ended: set[int] = set()
        for m in in_tick_order(bag.messages(topics), lay, ()):
            if m.topic == lay.episode_topic:
                markers.append(int(m.data))
            elif markers:
                ended.add(len(markers) - 1)
        outcomes = lay.success_topic in topics
        return [_Segment(index, outcomes and k not in ended) for k, index in enumerate(markers)]

    def __iter__(self) -> Iterator[DatasetFrame]:
        self.counts = FrameCounts(partial_episodes=self.counts.partial_episodes)
        for k, path in enumerate(self.cfg.bags):
            with self._open(path) as bag:
                yield from self._bag_frames(bag, k)

    def _bag_frames(self, bag: BagReader, ordinal: int) -> Iterator[DatasetFrame]:
        lay, cfg = self.layout, self.cfg
        segments = self._segments[ordinal]
        marked = segments is not None
        segments = segments if marked else [_Segment(0)]  # no markers: the bag is one episode
        rows = [0] * len(segments)
        shapes: dict[str, tuple[int, ...]] = {}
        sync = cfg.sync.replace(cameras=self.cameras)
        current = 0
        for sample in bag.samples(sync):
            obs = sample.observation
            if marked and sample.segment == 0:
                self.counts.before_first_marker += 1
                continue
            k = sample.segment - 1 if marked else 0
            seg = segments[k]
            if k != current:
                self._check_earlier(bag, segments[:k], rows)
                current = k
            if seg.partial:
                continue  # left out (skip_partial; refused on construction otherwise)
            if sample.action is None:
                self.counts.before_first_action += 1
                continue
            for cam, img in obs.images.items():
                want = shapes.setdefault(cam, img.shape)
                if img.shape != want:
                    raise BagError(f"{bag.path}: {lay.image_topic(cam)} frames change size from {want[1]}x{want[0]} to "
                                   f"{img.shape[1]}x{img.shape[0]} in episode #{seg.index}")  # fmt: skip
            task = obs.instruction or cfg.task
            if not task:
                raise BagError(f"{bag.path}: episode #{seg.index} has no {lay.instruction_topic} message before its "
                               "first observation; --task gives episodes without one their task")  # fmt: skip
            rows[k] += 1
            yield DatasetFrame(
                episode=f"{bag.path}#{seg.index}", key=(ordinal, k), images=obs.images,
                state=np.asarray(obs.state, np.float32), action=np.asarray(sample.action, np.float32), task=task,
                stamp_ns=obs.stamp_ns,
            )  # fmt: skip
        self._check_earlier(bag, segments, rows)
        for reason, n in bag.skipped.items():
            self.counts.rejected[reason] = self.counts.rejected.get(reason, 0) + n

    def _check_earlier(self, bag: BagReader, segments: list[_Segment], rows: list[int]) -> None:
        """Every episode of ``segments`` has rows (or was left out as partial)."""
        for s, n in zip(segments, rows):
            if n == 0 and not s.partial:
                cams = ", ".join(self.layout.image_topic(c) for c in self.cameras)
                rejected = ", ".join(f"{k} {v}" for k, v in bag.skipped.items() if v) or "none"
                raise BagError(f"{bag.path}: episode #{s.index} has no observation on {cams} with a command on "
                               f"{self.layout.action_topic} (an empty episode; observations the rule rejected so far: "
                               f"{rejected})")  # fmt: skip


def node_rule(params_file: str | os.PathLike | None = None) -> tuple[RobotConfig, SyncConfig]:
    """The policy node's robot and the observation rule's limits (the camera node's frame limits,
    the policy node's state age) as the graph's parameter file sets them (default: the
    package's config/aloha.yaml)."""
    params = load_params(params_file or default_params_file())
    camera = node_config(params, "camera_node", CameraConfig)
    policy = node_config(params, "policy_node", PolicyNodeConfig)
    sync = SyncConfig(max_age_ms=camera.max_age_ms, max_skew_ms=camera.max_skew_ms, max_future_ms=camera.max_future_ms,
                      max_state_age_ms=policy.max_state_age_ms)  # fmt: skip
    return policy.robot, sync


def dataset_fps(stamps_ns: list[int], where: str) -> int:
    """The whole number of frames per second the observation stamps of one episode are taken
    at (their median interval), or a :class:`BagError` saying why there is none."""
    if len(stamps_ns) < 2:
        raise BagError(f"{where}: one observation only, no rate to take the dataset's fps from; give --fps")
    interval = statistics.median(np.diff(np.asarray(stamps_ns, np.int64)).tolist()) / 1e9
    if interval <= 0:
        raise BagError(f"{where}: observations share one stamp; give --fps")
    fps = round(1.0 / interval)
    check_rate(stamps_ns, fps, where)
    return fps


def check_rate(stamps_ns: list[int], fps: int, where: str) -> None:
    """An episode's observations are taken at ``fps`` (median interval within RATE_TOLERANCE, and
    none closer than CLOSE periods to the one before)."""
    if len(stamps_ns) < 2 or fps < 1:
        return
    interval = statistics.median(np.diff(np.asarray(stamps_ns, np.int64)).tolist()) / 1e9
    if abs(interval * fps - 1.0) > RATE_TOLERANCE:
        raise BagError(
            f"{where}: observations every {interval * 1e3:.1f} ms ({1 / interval:.2f} Hz), not a {fps} fps dataset; "
            "a LeRobotDataset has a whole number of frames per second: record frames at such a rate (sim record "
            "--render-every N with N dividing 50)"
        )
    close = int(np.sum(np.diff(np.asarray(stamps_ns, np.int64)) < CLOSE * 1e9 / fps))
    if close:
        # A dataset row's time is its index / fps: frames much closer than a period would be
        # written at times they were not taken (a bag recorded with sim record --render-first).
        raise BagError(
            f"{where}: {close} observation(s) less than {CLOSE:g} of a frame period ({CLOSE * 1e3 / fps:.1f} ms) after the "
            f"one before, in a {fps} fps dataset: a LeRobotDataset's frames are evenly spaced; record without --render-first"
        )


def gaps(stamps_ns: list[int], fps: int) -> int:
    """Intervals longer than 1.5 frame periods (observations the rule did not make)."""
    if len(stamps_ns) < 2:
        return 0
    return int(np.sum(np.diff(np.asarray(stamps_ns, np.int64)) > 1.5e9 / fps))


def frame_message(frame: DatasetFrame) -> bytes:
    """A ``frame`` message of the worker's protocol: a JSON header line, then the arrays as safetensors."""
    from safetensors.numpy import save

    arrays = {f"observation.images.{c}": np.ascontiguousarray(img) for c, img in frame.images.items()}
    arrays["observation.state"] = frame.state
    arrays["action"] = frame.action
    body = save(arrays)
    return json.dumps({"op": "frame", "task": frame.task, "size": len(body)}).encode() + b"\n" + body


def features(frame: DatasetFrame, robot: RobotConfig, video: bool) -> dict[str, dict[str, Any]]:
    """LeRobot's features of the dataset, from its first row."""
    out: dict[str, dict[str, Any]] = {
        f"observation.images.{c}": {"dtype": "video" if video else "image", "shape": list(img.shape),
                                    "names": ["height", "width", "channels"]}
        for c, img in frame.images.items()
    }  # fmt: skip
    out["observation.state"] = {"dtype": "float32", "shape": [frame.state.size], "names": list(robot.joint_names)}
    out["action"] = {"dtype": "float32", "shape": [frame.action.size], "names": list(ACTION_NAMES)}
    return out


class LeRobotWriter:
    """LeRobot's ``LeRobotDataset`` in LeRobot's Python (:mod:`lerobot_dataset_worker`)."""

    def __init__(self, python: str, root: Path, repo_id: str, fps: int, feats: dict, video: bool, log: Path) -> None:
        cmd = [python, str(WORKER), "--root", str(root), "--repo-id", repo_id, "--fps", str(fps),
               "--features", json.dumps(feats)] + (["--video"] if video else [])  # fmt: skip
        self.log = log
        # Offline: LeRobot looks a dataset up on the Hub when it cannot read it locally.
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with log.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        self.info = self._answer("starting")
        if self.info["codebase_version"] != CODEBASE_VERSION:
            raise ConfigError(f"--python {python}: lerobot {self.info['lerobot']} writes LeRobotDataset "
                              f"{self.info['codebase_version']}; the export writes {CODEBASE_VERSION} "
                              "(lerobot 0.4)")  # fmt: skip

    def _failed(self, what: str) -> VlaAccelError:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.is_file() else ""
        return VlaAccelError(f"LeRobot's dataset writer ended while {what} (exit code {self.proc.returncode}):\n{tail}")

    def _answer(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise self._failed(what)
        return json.loads(line)

    def _send(self, data: bytes, what: str) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._failed(what) from None

    def add(self, frame: DatasetFrame) -> None:
        self._send(frame_message(frame), f"adding a frame of {frame.episode}")

    def save_episode(self, name: str) -> dict:
        self._send(b'{"op": "episode"}\n', f"saving {name}")
        return self._answer(f"saving {name}")

    def finish(self) -> dict:
        self._send(b'{"op": "finish"}\n', "finalizing the dataset")
        ans = self._answer("finalizing the dataset")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        return ans

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def export_lerobot(cfg: ExportConfig, progress: bool = True, stream: IO[str] = sys.stderr) -> dict[str, Any]:
    """Write ``cfg.bags`` as a LeRobotDataset v3.0 at ``cfg.out``; returns the summary."""
    from tqdm import tqdm

    cfg.check_paths()
    t0 = time.perf_counter()
    source = BagFrames(cfg)
    target = Path(cfg.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # beside it: the move is a rename
    root = work / "dataset"  # LeRobot creates it
    writer: LeRobotWriter | None = None
    bar = tqdm(total=source.frames_total, desc="export-lerobot", unit="frame", disable=not progress, file=stream)
    try:
        rows = iter(source)
        head: list[DatasetFrame] = []
        for frame in rows:  # the first rows of the first episode: its rate is the dataset's fps
            if head and frame.key != head[0].key:
                rows = itertools.chain([frame], rows)
                break
            head.append(frame)
            if len(head) == FPS_PROBE:
                break
        if not head:
            raise BagError(f"{', '.join(cfg.bags)}: no observation with a command (skipped: {source.counts.rejected})")
        fps = cfg.fps or dataset_fps([f.stamp_ns for f in head], head[0].episode)
        writer = LeRobotWriter(cfg.python, root, cfg.dataset_repo_id, fps, features(head[0], cfg.robot, cfg.video),
                               cfg.video, work / "writer.log")  # fmt: skip
        episodes, stamps, n_gaps = [], [], 0
        current = head[0]
        for frame in itertools.chain(head, rows):
            if frame.key != current.key:
                n_gaps += _end_episode(writer, current.episode, stamps, fps, episodes)
                current, stamps = frame, []
            writer.add(frame)
            stamps.append(frame.stamp_ns)
            bar.update(1)
        n_gaps += _end_episode(writer, current.episode, stamps, fps, episodes)
        read_back = writer.finish()
        written = sum(e["frames"] for e in episodes)
        if read_back["frames"] != written or read_back["episodes"] != len(episodes):
            raise VlaAccelError(f"LeRobot reads back {read_back['episodes']} episodes, {read_back['frames']} frames; "
                                f"{len(episodes)} episodes, {written} frames were written")  # fmt: skip
        root.rename(target)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        shutil.rmtree(work, ignore_errors=True)
    c = source.counts
    return {
        "out": str(target), "bags": list(cfg.bags), "episodes": read_back["episodes"], "frames": read_back["frames"],
        "fps": fps, "cameras": list(source.cameras), "images": "video (AV1)" if cfg.video else "image (PNG)",
        "episodes_from": [e["source"] for e in episodes], "lengths": read_back["lengths"],
        "left_out": {"rejected_by_rule": {k: v for k, v in c.rejected.items() if v},
                     "before_first_action": c.before_first_action, "before_first_marker": c.before_first_marker,
                     "partial_episodes": c.partial_episodes},
        "gaps": n_gaps, "lerobot": writer.info["lerobot"], "codebase_version": read_back["codebase_version"],
        "stats": read_back["stats"], "seconds": round(time.perf_counter() - t0, 2), "bytes": bag_size_bytes(target),
    }  # fmt: skip


def _end_episode(writer: LeRobotWriter, name: str, stamps: list[int], fps: int, episodes: list[dict]) -> int:
    check_rate(stamps, fps, name)
    ans = writer.save_episode(name)
    episodes.append({"source": name, "frames": ans["frames"]})
    return gaps(stamps, fps)
