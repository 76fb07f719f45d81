"""rosbag2 files (MCAP or sqlite3) without a ROS installation, through ``rosbags``.

Users record bags on their robots and replay them to benchmark settings; the simulator
records the same layout, so both feed the replay benchmark the same way.

Topic layout (defaults of :class:`BagLayout`, the ALOHA conventions)::

  /<cam>/camera/color/image_rect_raw  sensor_msgs/Image rgb8, one per camera and tick
  /follower_left/joint_states         sensor_msgs/JointState, per tick, in the real robot's units
  /follower_right/joint_states          (RobotConfig): waist, shoulder, elbow, forearm_roll,
                                        wrist_angle, wrist_rotate (rad), gripper (joint angle,
                                        rad) and left_finger (finger opening, m); the reader
                                        normalizes grippers exactly as the policy node does
  /action/joint_command               sensor_msgs/JointState, the 14-D action in the policy's
                                        units (grippers normalized 0 closed .. 1 open), names
                                        left_<joint>..., right_<joint>... (Interbotix's own
                                        JointGroupCommand would need interbotix_xs_msgs)
  /episode                            std_msgs/Int32, episode index, once at its first tick
  /instruction                        std_msgs/String, the task instruction, once per episode
  /episode/success                    std_msgs/Bool, once at the episode's last tick

Every message of one tick carries the same bag timestamp and header stamp (sim time on
the recording's clock). The reader (:meth:`BagReader.samples`) turns any bag of this shape,
recorded or simulated, into time-ordered synchronized observations.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import BagError
from vla_accel_ros.core.robot import config
from vla_accel_ros.core.robot.config import RobotConfig
from vla_accel_ros.core.robot.images import ENCODINGS, ImageError, decode_compressed, decode_raw
from vla_accel_ros.core.robot.state import StateAssembler, state_to_joint_states
from vla_accel_ros.core.types import Observation

if TYPE_CHECKING:
    from typing import Self  # Python >= 3.11; Humble runs 3.10

STORAGES = ("mcap", "sqlite3")
ARM_JOINTS = (*config.ARM_JOINTS, "gripper")  # one arm's joint_states names, gripper last
ACTION_NAMES = config.ALOHA_JOINT_NAMES

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED = "sensor_msgs/msg/CompressedImage"
JOINT_STATE = "sensor_msgs/msg/JointState"
STRING = "std_msgs/msg/String"
INT32 = "std_msgs/msg/Int32"
BOOL = "std_msgs/msg/Bool"


@dataclass(frozen=True)
class BagLayout(Config):
    camera_topic: str = param(
        "/{camera}/camera/color/image_rect_raw",
        doc="image topic template; {camera} is the ROS camera name (realsense2_camera >= 4.55)",
    )
    camera_names: tuple[str, ...] = param(
        ("top=cam_high", "left_wrist=cam_left_wrist", "right_wrist=cam_right_wrist"),
        doc="sim camera=ROS camera name; sim cameras not listed keep their own name",
    )
    left_joint_states: str = param("/follower_left/joint_states", doc="left arm JointState topic")
    right_joint_states: str = param("/follower_right/joint_states", doc="right arm JointState topic")
    action_topic: str = param("/action/joint_command", doc="commanded 14-D action (JointState)")
    instruction_topic: str = param("/instruction", doc="task instruction (String), once per episode")
    episode_topic: str = param("/episode", doc="episode index (Int32) at each episode's first tick")
    success_topic: str = param("/episode/success", doc="episode outcome (Bool) at its last tick")

    def validate(self) -> None:
        from vla_accel_ros.core.errors import ConfigError

        if self.camera_topic.count("{camera}") != 1:
            raise ConfigError(
                f"BagLayout.camera_topic must contain {{camera}} once, got {self.camera_topic!r}"
            )
        for entry in self.camera_names:
            if entry.count("=") != 1 or not all(entry.split("=")):
                raise ConfigError(f"BagLayout.camera_names entries are sim=ros, got {entry!r}")

    def ros_camera(self, sim_camera: str) -> str:
        return dict(e.split("=") for e in self.camera_names).get(sim_camera, sim_camera)

    def image_topic(self, ros_camera: str) -> str:
        return self.camera_topic.replace("{camera}", ros_camera)

    def camera_of_topic(self, topic: str) -> str:
        """The camera name in an image topic; topics off the template are named by themselves."""
        prefix, suffix = self.camera_topic.split("{camera}")
        if topic.startswith(prefix) and topic.endswith(suffix) and len(topic) > len(prefix) + len(suffix):
            return topic[len(prefix) : len(topic) - len(suffix)]
        return topic


@dataclass(frozen=True)
class SyncConfig(Config):
    trigger: str = param(
        "", doc="camera whose frames make observations; empty: the first camera in name order"
    )
    cameras: tuple[str, ...] = param((), doc="cameras an observation carries; empty: every camera in the bag")
    max_skew_s: float = param(
        0.1,
        doc="drop an observation whose camera or joint state is older than this vs the trigger",
        range=(0.0, 3600.0),
    )


@dataclass
class JointStateMsg:
    names: tuple[str, ...]
    position: np.ndarray  # [N] float64
    velocity: np.ndarray  # [N] or [0]
    effort: np.ndarray  # [N] or [0]


@dataclass
class BagMessage:
    topic: str
    stamp_ns: int  # the bag's receive timestamp
    msgtype: str
    # Image / CompressedImage -> [H, W, 3] uint8 RGB; JointState -> JointStateMsg;
    # String -> str; Int32 -> int; Bool -> bool; anything else -> the rosbags message object.
    data: Any


@dataclass
class BagSample:
    """One synchronized observation from a bag, ready for ``Policy.infer``.

    observation.images: ROS camera name -> [H, W, 3] uint8; observation.state: [14] float32
    (left 7, right 7, as the joint states carry them) or None when the bag has no joint states.
    action: [14] the action recorded at or before the stamp within the episode, or None.
    qvel: [14] joint velocities when the joint states carry them, else None.
    stamps: topic -> bag timestamp of the message used, to measure skew.
    """

    observation: Observation
    action: np.ndarray | None
    qvel: np.ndarray | None
    stamps: dict[str, int] = field(default_factory=dict)


@dataclass
class TopicSummary:
    topic: str
    msgtype: str
    count: int


@dataclass
class EpisodeSummary:
    index: int
    start_ns: int
    end_ns: int  # stamp of its last message
    instruction: str | None
    success: bool | None  # None: not recorded
    frames: int  # messages on the trigger camera


def _typestore() -> Any:
    try:
        from rosbags.typesys import Stores, get_typestore
    except ImportError as e:
        raise BagError(f"bags need the `rosbags` package ({e}); pip install -r requirements-sim.txt") from e
    # Jazzy's definitions; sensor_msgs/std_msgs are unchanged since Humble, so bags written
    # here read on either, and Humble bags read here.
    return get_typestore(Stores.ROS2_JAZZY)


def _rosbag_errors() -> tuple[type[BaseException], ...]:
    """What rosbags raises for unreadable or malformed input (re-raised as BagError)."""
    from rosbags.rosbag2 import ReaderError, WriterError
    from rosbags.serde import SerdeError

    return (ReaderError, WriterError, SerdeError, OSError, struct.error, ValueError, KeyError)


# --------------------------------------------------------------------------------- writing


class _BagFile:
    """Open/close and context-manager plumbing shared by the reader and the writer; the
    subclass sets ``path``, ``_handle`` (the rosbags Reader or Writer) and ``_open_what``."""

    path: Path
    _handle: Any
    _open_what: str
    _open = False

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        try:
            self._handle.open()
        except _rosbag_errors() as e:
            raise BagError(self._open_what.format(path=self.path, error=e)) from e
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._handle.close()


class BagWriter(_BagFile):
    """Write a rosbag2 directory ``path`` (must not exist) in MCAP or sqlite3 storage.

    Example::

        with BagWriter("run1", storage="mcap") as bag:
            bag.write_image("/cam_high/camera/color/image_rect_raw", stamp_ns, rgb)  # [H, W, 3]
            bag.write_joint_state("/follower_left/joint_states", stamp_ns, ARM_JOINTS, q[:7])
    """

    def __init__(self, path: str | Path, storage: str = "mcap", compress: bool | None = None) -> None:
        """compress: zstd MCAP chunks (None: on for mcap, where rendered frames shrink ~30x)."""
        if storage not in STORAGES:
            raise BagError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        if compress is None:
            compress = storage == "mcap"
        if compress and storage != "mcap":
            raise BagError("compression is only offered for mcap storage (zstd chunks)")
        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path} exists already; rosbag2 bags are never overwritten")
        self.storage = storage
        self._ts = _typestore()
        from rosbags.rosbag2 import CompressionFormat, CompressionMode, StoragePlugin, Writer

        plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
        # Version 9 is Jazzy's; sqlite3 bags are for Humble robots, so the older version 8
        # (the oldest rosbags writes).
        self._writer = Writer(self.path, version=9 if storage == "mcap" else 8, storage_plugin=plugin)
        if compress:
            # zstd-compressed MCAP chunks: transparent to every MCAP reader (rosbag2's too),
            # unlike rosbag2's file/message compression modes.
            self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self._handle = self._writer
        self._open_what = "cannot create bag {path}: {error}"
        self._connections: dict[str, Any] = {}
        self._types: dict[str, str] = {}

    def _write(self, topic: str, msgtype: str, stamp_ns: int, msg: Any) -> None:
        self.write_cdr(topic, msgtype, stamp_ns, self._ts.serialize_cdr(msg, msgtype))

    def write_cdr(self, topic: str, msgtype: str, stamp_ns: int, data: bytes) -> None:
        """Write one already serialized (CDR) message of a type the bag's typestore knows."""
        if not self._open:
            raise BagError(f"bag {self.path} is not open for writing")
        if stamp_ns < 0:
            raise BagError(f"{topic}: negative timestamp {stamp_ns}")
        conn = self._connections.get(topic)
        if conn is None:
            conn = self._writer.add_connection(topic, msgtype, typestore=self._ts)
            self._connections[topic] = conn
            self._types[topic] = msgtype
        elif self._types[topic] != msgtype:
            raise BagError(f"{topic} carries {self._types[topic]}, cannot also write {msgtype}")
        self._writer.write(conn, int(stamp_ns), data)

    def _header(self, stamp_ns: int, frame_id: str) -> Any:
        t = self._ts.types
        sec, nsec = divmod(int(stamp_ns), 1_000_000_000)
        return t["std_msgs/msg/Header"](
            stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec), frame_id=frame_id
        )

    def write_image(self, topic: str, stamp_ns: int, image: np.ndarray, frame_id: str = "") -> None:
        """image: [H, W, 3] uint8 RGB, written as rgb8 with step = 3 W."""
        img = np.asarray(image)
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise BagError(f"{topic}: expected an [H, W, 3] uint8 image, got {img.dtype} {img.shape}")
        h, w = img.shape[:2]
        msg = self._ts.types[IMAGE](
            header=self._header(stamp_ns, frame_id),
            height=h,
            width=w,
            encoding="rgb8",
            is_bigendian=0,
            step=3 * w,
            data=np.ascontiguousarray(img).reshape(-1),
        )
        self._write(topic, IMAGE, stamp_ns, msg)

    def write_joint_state(
        self,
        topic: str,
        stamp_ns: int,
        names: Sequence[str],
        position: Sequence[float],
        velocity: Sequence[float] = (),
        effort: Sequence[float] = (),
        frame_id: str = "",
    ) -> None:
        pos = np.asarray(position, dtype=np.float64)
        vel = np.asarray(velocity, dtype=np.float64)
        eff = np.asarray(effort, dtype=np.float64)
        if pos.shape != (len(names),) or vel.size not in (0, len(names)) or eff.size not in (0, len(names)):
            sizes = f"{pos.size}/{vel.size}/{eff.size}"
            raise BagError(f"{topic}: {len(names)} names but position/velocity/effort sizes {sizes}")
        msg = self._ts.types[JOINT_STATE](
            header=self._header(stamp_ns, frame_id), name=list(names), position=pos, velocity=vel, effort=eff
        )
        self._write(topic, JOINT_STATE, stamp_ns, msg)

    def write_string(self, topic: str, stamp_ns: int, text: str) -> None:
        self._write(topic, STRING, stamp_ns, self._ts.types[STRING](data=str(text)))

    def write_int32(self, topic: str, stamp_ns: int, value: int) -> None:
        if not -(2**31) <= int(value) < 2**31:
            raise BagError(f"{topic}: {value} does not fit an Int32")
        self._write(topic, INT32, stamp_ns, self._ts.types[INT32](data=int(value)))

    def write_bool(self, topic: str, stamp_ns: int, value: bool) -> None:
        self._write(topic, BOOL, stamp_ns, self._ts.types[BOOL](data=bool(value)))


class FrameRecorder:
    """Writes simulator frames (``vla_accel_ros.sim.Frame``) in the :class:`BagLayout`.

    Ticks are laid end to end on one clock starting at ``start_ns``: tick k of the recording
    is stamped ``start_ns + k * dt``, so episodes follow each other without gaps.
    """

    def __init__(
        self,
        writer: BagWriter,
        layout: BagLayout | None = None,
        start_ns: int = 0,
        dt: float = 0.02,
        robot: RobotConfig | None = None,
    ) -> None:
        self.writer = writer
        self.layout = layout or BagLayout()
        self.robot = robot or robot_for(self.layout)
        if self.robot.joint_names != ACTION_NAMES:
            raise BagError(f"the simulator's frames are {', '.join(ACTION_NAMES)}; robot.joint_names differ")
        self.start_ns = int(start_ns)
        self.dt_ns = int(round(dt * 1e9))
        self.ticks = 0
        self.episodes = 0
        self.successes = 0

    def write(self, frame: Any) -> int:
        """Write one frame; returns its stamp."""
        lay, w = self.layout, self.writer
        stamp = self.start_ns + self.ticks * self.dt_ns
        if frame.step == 0:
            w.write_int32(lay.episode_topic, stamp, frame.episode)
            w.write_string(lay.instruction_topic, stamp, frame.instruction)
        for cam, img in frame.images.items():
            ros_cam = lay.ros_camera(cam)
            w.write_image(lay.image_topic(ros_cam), stamp, img, frame_id=f"{ros_cam}_color_optical_frame")
        # The robot's own units, so a simulated bag reads back exactly like a recorded one.
        messages = state_to_joint_states(self.robot, frame.qpos, frame.qvel)
        for topic, (names, pos, vel) in zip(self.robot.joint_state_topics, messages):
            w.write_joint_state(topic, stamp, names, pos, vel, frame_id="")
        w.write_joint_state(lay.action_topic, stamp, ACTION_NAMES, frame.action)
        if frame.done:
            w.write_bool(lay.success_topic, stamp, frame.success)
            self.episodes += 1
            self.successes += int(frame.success)
        self.ticks += 1
        return stamp


# --------------------------------------------------------------------------------- reading


def image_to_rgb(
    height: int, width: int, encoding: str, step: int, data: Any, where: str = "", is_bigendian: bool = False
) -> np.ndarray:
    """[H, W, 3] uint8 RGB from a sensor_msgs/Image's fields, decoded exactly as the camera
    node decodes live frames; a recorded last row may omit its padding."""
    enc = ENCODINGS.get(encoding)
    if enc is None:
        raise BagError(f"{where}: unsupported image encoding {encoding!r} (supported: {', '.join(ENCODINGS)})")
    row = width * enc.channels * enc.depth
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if height <= 0 or width <= 0 or step < row or buf.size < step * (height - 1) + row:
        raise BagError(f"{where}: image {width}x{height} {encoding} step {step} does not fit {buf.size} bytes")
    if buf.size < step * height:
        buf = np.concatenate([buf, np.zeros(step * height - buf.size, np.uint8)])
    try:
        return decode_raw(encoding, height, width, step, is_bigendian, buf[: step * height])
    except ImageError as e:
        raise BagError(f"{where}: {e}") from e


def _decode_compressed(fmt: str, data: Any, where: str) -> np.ndarray:
    try:
        return decode_compressed(fmt, data)
    except ImageError as e:
        raise BagError(f"{where}: cannot decode compressed image: {e}") from e


class BagReader(_BagFile):
    """Read a rosbag2 bag (directory, or a single .mcap / .db3 file).

    Example (the replay benchmark)::

        with BagReader("run1") as bag:
            print(bag.summary())
            for sample in bag.samples(SyncConfig(trigger="cam_high")):
                chunk = policy.infer(sample.observation)
    """

    def __init__(self, path: str | Path, layout: BagLayout | None = None, robot: RobotConfig | None = None) -> None:
        self.path = Path(path)
        self.layout = layout or BagLayout()
        # Joint states -> the policy's state vector, with the policy node's own assembler.
        self.robot = robot or robot_for(self.layout)
        self._assembler = StateAssembler(self.robot)  # reset per sample; its name maps are built once
        if not self.path.exists():
            raise BagError(f"bag {self.path} does not exist")
        self._ts = _typestore()
        from rosbags.rosbag2 import Reader

        self._open_what = "{path} is not a readable rosbag2 bag: {error}"
        try:
            self._reader = Reader(self.path)
        except _rosbag_errors() as e:
            raise BagError(self._open_what.format(path=self.path, error=e)) from e
        self._handle = self._reader
        # What samples() skipped and why, for the benchmark's report.
        self.skipped: dict[str, int] = {"incomplete": 0, "stale": 0}

    def _check(self) -> None:
        if not self._open:
            raise BagError(f"bag {self.path} is not open (use it as a context manager)")

    # -- metadata ------------------------------------------------------------------------
    @property
    def topics(self) -> dict[str, TopicSummary]:
        self._check()
        return {
            name: TopicSummary(name, info.msgtype or "?", int(info.msgcount))
            for name, info in sorted(self._reader.topics.items())
        }

    @property
    def start_ns(self) -> int:
        self._check()
        return int(self._reader.start_time) if self._reader.message_count else 0

    @property
    def end_ns(self) -> int:
        """Stamp of the last message."""
        self._check()
        # rosbags reports one past the last message.
        return int(self._reader.end_time) - 1 if self._reader.message_count else 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def message_count(self) -> int:
        self._check()
        return int(self._reader.message_count)

    def cameras(self) -> dict[str, str]:
        """ROS camera name -> image topic, for every Image / CompressedImage topic."""
        return {
            self.layout.camera_of_topic(t.topic): t.topic
            for t in self.topics.values()
            if t.msgtype in (IMAGE, COMPRESSED)
        }

    # -- messages ------------------------------------------------------------------------
    def messages(self, topics: Iterable[str] | None = None, raw: Iterable[str] = ()) -> Iterator[BagMessage]:
        """Messages in bag-timestamp order, decoded (see :class:`BagMessage`); those of the
        ``raw`` topics keep their CDR bytes (for callers that only count or copy them)."""
        self._check()
        wanted = None if topics is None else set(topics)
        conns = [c for c in self._reader.connections if wanted is None or c.topic in wanted]
        if wanted is not None:
            missing = wanted - {c.topic for c in conns}
            if missing:
                raise BagError(f"{self.path} has no topic(s) {', '.join(sorted(missing))}")
        if not conns:
            return
        errors = _rosbag_errors()
        keep_raw = set(raw)
        try:
            for conn, stamp, data in self._reader.messages(connections=conns):
                if conn.topic not in keep_raw:
                    data = self._decode(conn.topic, conn.msgtype, data)
                yield BagMessage(conn.topic, int(stamp), conn.msgtype, data)
        except errors as e:
            raise BagError(f"{self.path}: malformed data: {e}") from e

    def _decode(self, topic: str, msgtype: str, raw: bytes) -> Any:
        if msgtype not in self._ts.types:
            return raw  # a type this typestore does not know: hand over the CDR bytes
        msg = self._ts.deserialize_cdr(raw, msgtype)
        if msgtype == IMAGE:
            return image_to_rgb(msg.height, msg.width, msg.encoding, msg.step, msg.data, topic, bool(msg.is_bigendian))
        if msgtype == COMPRESSED:
            return _decode_compressed(msg.format, msg.data, topic)
        if msgtype == JOINT_STATE:
            return JointStateMsg(
                tuple(msg.name),
                np.asarray(msg.position, dtype=np.float64),
                np.asarray(msg.velocity, dtype=np.float64),
                np.asarray(msg.effort, dtype=np.float64),
            )
        if msgtype in (STRING, INT32, BOOL):
            return msg.data
        return msg

    # -- synchronized observations ---------------------------------------------------------
    def samples(self, sync: SyncConfig | None = None) -> Iterator[BagSample]:
        """Observations as a policy node would build them: on every frame of the trigger
        camera, the latest message (at or before that stamp, within the episode) of every
        other camera and of both joint states. Messages sharing a stamp count as
        simultaneous, so a simulated tick is never split. An episode marker forgets what came
        before it. Observations missing a component, or with one older than ``max_skew_s``,
        are skipped and counted in ``self.skipped``."""
        sync = sync or SyncConfig()
        lay = self.layout
        cams = self.cameras()
        if not cams:
            raise BagError(f"{self.path} has no image topics")
        names = list(sync.cameras) if sync.cameras else sorted(cams)
        unknown = [c for c in names + ([sync.trigger] if sync.trigger else []) if c not in cams]
        if unknown:
            raise BagError(
                f"{self.path} has no camera(s) {', '.join(unknown)}; it has {', '.join(sorted(cams))}"
            )
        trigger = sync.trigger or names[0]
        if trigger not in names:
            names.append(trigger)
        topics_here = self.topics
        joint_topics = [t for t in self.robot.joint_state_topics if t in topics_here]
        if joint_topics and len(joint_topics) != len(self.robot.joint_state_topics):
            raise BagError(f"{self.path} has only {', '.join(joint_topics)} of {', '.join(self.robot.joint_state_topics)}")
        optional = [
            t for t in (lay.action_topic, lay.instruction_topic, lay.episode_topic) if t in topics_here
        ]
        cam_topic = {cams[c]: c for c in names}
        trigger_topic = cams[trigger]
        wanted = list(cam_topic) + joint_topics + optional
        max_skew = int(sync.max_skew_s * 1e9)
        self.skipped = {"incomplete": 0, "stale": 0}

        # Apply episode markers, then instructions, then data within one stamp.
        order = {lay.episode_topic: 0, lay.instruction_topic: 1}
        latest: dict[str, BagMessage] = {}
        episode, instruction = 0, ""

        def flush(group: list[BagMessage]) -> Iterator[BagSample]:
            nonlocal episode, instruction
            group.sort(key=lambda m: order.get(m.topic, 2))
            fire = False
            for m in group:
                if m.topic == lay.episode_topic:
                    episode, instruction = int(m.data), ""
                    latest.clear()
                elif m.topic == lay.instruction_topic:
                    instruction = str(m.data)
                else:
                    latest[m.topic] = m
                    fire = fire or cam_topic.get(m.topic) == trigger
            if fire:
                sample = self._assemble(
                    latest, trigger_topic, cam_topic, joint_topics, max_skew, episode, instruction
                )
                if sample is not None:
                    yield sample

        group: list[BagMessage] = []
        for msg in self.messages(wanted):
            if group and msg.stamp_ns != group[0].stamp_ns:
                yield from flush(group)
                group = []
            group.append(msg)
        if group:
            yield from flush(group)

    def _assemble(
        self,
        latest: dict[str, BagMessage],
        trigger_topic: str,
        cam_topic: dict[str, str],
        joint_topics: list[str],
        max_skew: int,
        episode: int,
        instruction: str,
    ) -> BagSample | None:
        lay = self.layout
        needed = list(cam_topic) + joint_topics
        if any(t not in latest for t in needed):
            self.skipped["incomplete"] += 1
            return None
        # The trigger message just arrived, so it is the newest; skew is against it.
        trigger_stamp = latest[trigger_topic].stamp_ns
        stamps = {t: latest[t].stamp_ns for t in needed}
        if trigger_stamp - min(stamps.values()) > max_skew:
            self.skipped["stale"] += 1
            return None
        state = qvel = None
        if joint_topics:
            state = self._state(latest, joint_topics)  # [D] float32, grippers normalized
            vels = [self._velocity(latest[t].data) for t in joint_topics]
            qvel = None if any(v is None for v in vels) else np.concatenate(vels)
        action = None
        act = latest.get(lay.action_topic)
        if act is not None:
            action = self._action(act.data)
            stamps[lay.action_topic] = act.stamp_ns
        obs = Observation(
            images={cam_topic[t]: latest[t].data for t in cam_topic},
            instruction=instruction,
            stamp_ns=trigger_stamp,
            state=state,
            episode=episode,
        )
        return BagSample(observation=obs, action=action, qvel=qvel, stamps=stamps)

    def _state(self, latest: dict[str, BagMessage], joint_topics: list[str]) -> np.ndarray:
        asm = self._assembler
        asm.reset()
        for k, topic in enumerate(joint_topics):
            js = latest[topic].data
            if js.position.size != len(js.names):
                raise BagError(f"{topic}: {len(js.names)} names but {js.position.size} positions")
            asm.update(k, js.names, js.position, latest[topic].stamp_ns)
        got = asm.state()
        if got is None:
            raise BagError(f"{', '.join(joint_topics)}: JointState lacks joint(s) {', '.join(asm.missing())}")
        return got[0]

    @staticmethod
    def _velocity(js: JointStateMsg) -> np.ndarray | None:
        """[7] velocities in ARM_JOINTS order (gripper: its joint's rate), if the message has them."""
        index = {n: i for i, n in enumerate(js.names)}
        if js.velocity.size != len(js.names) or any(j not in index for j in ARM_JOINTS):
            return None
        return js.velocity[[index[j] for j in ARM_JOINTS]]

    def _action(self, js: JointStateMsg) -> np.ndarray:
        index = {n: i for i, n in enumerate(js.names)}
        if all(n in index for n in ACTION_NAMES) and js.position.size == len(js.names):
            return js.position[[index[n] for n in ACTION_NAMES]].copy()
        want, got = ", ".join(ACTION_NAMES), ", ".join(js.names)
        raise BagError(f"{self.layout.action_topic}: expected joints {want}, got {got}")

    # -- episodes --------------------------------------------------------------------------
    def episodes(self, trigger: str = "") -> list[EpisodeSummary]:
        """One entry per episode marker (a bag without markers is one episode, index 0)."""
        lay = self.layout
        here = self.topics
        cams = self.cameras()
        trig_topic = cams.get(trigger) if trigger else (cams[sorted(cams)[0]] if cams else None)
        if trigger and trig_topic is None:
            raise BagError(f"{self.path} has no camera {trigger!r}")
        wanted = [
            t
            for t in (lay.episode_topic, lay.instruction_topic, lay.success_topic, trig_topic)
            if t and t in here
        ]
        out: list[EpisodeSummary] = []
        cur: EpisodeSummary | None = None
        for m in self.messages(wanted, raw=[trig_topic] if trig_topic else []):  # frames are only counted
            if m.topic == lay.episode_topic or cur is None:
                index = int(m.data) if m.topic == lay.episode_topic else 0
                cur = EpisodeSummary(index, m.stamp_ns, m.stamp_ns, None, None, 0)
                out.append(cur)
            cur.end_ns = m.stamp_ns
            if m.topic == lay.instruction_topic:
                cur.instruction = str(m.data)
            elif m.topic == lay.success_topic:
                cur.success = bool(m.data)
            elif m.topic == trig_topic:
                cur.frames += 1
        return out

    def summary(self) -> str:
        """Human-readable: storage, duration, topics with counts and rates, episodes."""
        dur = self.duration_ns / 1e9
        lines = [
            f"bag:       {self.path}",
            f"duration:  {dur:.3f} s   messages: {self.message_count}",
            "topics:",
        ]
        for t in self.topics.values():
            rate = f"{(t.count - 1) / dur:7.2f} Hz" if dur > 0 and t.count > 1 else "       -  "
            lines.append(f"  {t.topic:<45} {t.msgtype:<28} {t.count:>7}  {rate}")
        eps = self.episodes()
        done = [e for e in eps if e.success is not None]
        lines.append(
            f"episodes:  {len(eps)}"
            + (f"   successes: {sum(bool(e.success) for e in done)}/{len(done)}" if done else "")
        )
        for e in eps:
            ok = "-" if e.success is None else ("success" if e.success else "failure")
            secs = (e.end_ns - e.start_ns) / 1e9
            lines.append(
                f"  #{e.index:<4} {secs:7.2f} s  {e.frames:>5} frames  {ok:<8} {e.instruction or ''}"
            )
        return "\n".join(lines)


def robot_for(layout: BagLayout) -> RobotConfig:
    """The ALOHA robot description with the layout's joint-state topics."""
    return RobotConfig(joint_state_topics=(layout.left_joint_states, layout.right_joint_states))


def bag_size_bytes(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
