"""Reading rosbag2 bags (a directory, or a single .mcap / .db3 file) without ROS, through
``rosbags``: metadata, decoded messages in timestamp order, and synchronized samples.

Bags in the :class:`~vla_accel_ros.core.robot.topics.TopicLayout` (the ALOHA conventions),
recorded on a robot or simulated, turn into time-ordered observations with
:meth:`BagReader.samples`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.core.robot.config import RobotConfig, SyncConfig
from vla_accel_ros.core.robot.images import ImageError, decode_compressed, decode_raw
from vla_accel_ros.core.robot.observation import ObservationBuilder
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.core.types import Observation
from vla_accel_ros.io.bag_file import (
    ACTION_NAMES,
    ARM_JOINTS,
    BOOL,
    COMPRESSED,
    IMAGE,
    INT32,
    JOINT_STATE,
    STRING,
    BagFile,
    robot_for,
    rosbag_errors,
    typestore,
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
    header_ns: int = 0  # header stamp of Image / CompressedImage / JointState (0: none, or unstamped)

    @property
    def sensor_ns(self) -> int:
        """When the sensor took it: the header stamp, else (unstamped) the receive time, as a node sees it."""
        return self.header_ns or self.stamp_ns


@dataclass
class BagSample:
    """One synchronized observation from a bag, ready for ``Policy.infer``.

    observation.images: ROS camera name -> [H, W, 3] uint8; observation.state: [14] float32
    (left 7, right 7, as the joint states carry them) or None when the bag has no joint states.
    action: [14] the latest action recorded within the episode when the observation was made
    (a simulated tick's own action), or None.
    qvel: [14] joint velocities when the joint states carry them, else None.
    stamps: topic -> bag timestamp of the message used, to measure skew.
    segment: episode markers read before it (0: before the first): a new value starts a new
    episode even where a marker repeats the previous index (a restarted simulator).
    age_ms: the observation's age when it was made (bag timestamp - its oldest frame's stamp);
    replay infers on each observation as it is made, so this is its age at inference start.
    """

    observation: Observation
    action: np.ndarray | None
    qvel: np.ndarray | None
    stamps: dict[str, int] = field(default_factory=dict)
    segment: int = 0
    age_ms: float = 0.0


@dataclass
class TopicSummary:
    topic: str
    msgtype: str
    count: int


def decode_image(msgtype: str, msg: Any, where: str) -> np.ndarray:
    """[H, W, 3] uint8 RGB from a deserialized Image / CompressedImage, by the camera node's
    rule (:mod:`vla_accel_ros.core.robot.images`): a frame the camera node would drop is a
    :class:`BagError` here."""
    try:
        if msgtype == COMPRESSED:
            return decode_compressed(msg.format, msg.data)
        return decode_raw(msg.encoding, msg.height, msg.width, msg.step, bool(msg.is_bigendian), msg.data)
    except ImageError as e:
        raise BagError(f"{where}: {e}") from e


class BagReader(BagFile):
    """Read a rosbag2 bag (directory, or a single .mcap / .db3 file).

    Example (the replay benchmark)::

        with BagReader("run1") as bag:
            for sample in bag.samples(SyncConfig(cameras=("cam_high",))):
                chunk = policy.infer(sample.observation)
    """

    def __init__(self, path: str | Path, layout: TopicLayout | None = None, robot: RobotConfig | None = None) -> None:
        self.path = Path(path)
        self.layout = layout or TopicLayout()
        # Joint states -> the policy's state vector, with the policy node's own assembler.
        self.robot = robot or robot_for(self.layout)
        if not self.path.exists():
            raise BagError(f"bag {self.path} does not exist")
        self._ts = typestore()
        from rosbags.rosbag2 import Reader

        self._open_what = "{path} is not a readable rosbag2 bag: {error}"
        try:
            self._reader = Reader(self.path)
        except rosbag_errors() as e:
            raise BagError(self._open_what.format(path=self.path, error=e)) from e
        self._handle = self._reader
        self._builder: ObservationBuilder | None = None  # of the latest samples() run

    @property
    def skipped(self) -> dict[str, int]:
        """Observations the latest :meth:`samples` did not make, by reason (for the report)."""
        return {} if self._builder is None else self._builder.rejects

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
        errors = rosbag_errors()
        keep_raw = set(raw)
        try:
            for conn, stamp, data in self._reader.messages(connections=conns):
                header_ns = 0
                if conn.topic not in keep_raw:
                    data, header_ns = self._decode(conn.topic, conn.msgtype, data)
                yield BagMessage(conn.topic, int(stamp), conn.msgtype, data, header_ns)
        except errors as e:
            raise BagError(f"{self.path}: malformed data: {e}") from e

    def _decode(self, topic: str, msgtype: str, raw: bytes) -> tuple[Any, int]:
        """(decoded data, header stamp or 0)."""
        if msgtype not in self._ts.types:
            return raw, 0  # a type this typestore does not know: hand over the CDR bytes
        msg = self._ts.deserialize_cdr(raw, msgtype)
        if msgtype in (IMAGE, COMPRESSED, JOINT_STATE):
            stamp = msg.header.stamp
            header_ns = int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)
            if msgtype != JOINT_STATE:
                return decode_image(msgtype, msg, topic), header_ns
            js = JointStateMsg(
                tuple(msg.name),
                np.asarray(msg.position, dtype=np.float64),
                np.asarray(msg.velocity, dtype=np.float64),
                np.asarray(msg.effort, dtype=np.float64),
            )
            return js, header_ns
        if msgtype in (STRING, INT32, BOOL):
            return msg.data, 0
        return msg, 0

    # -- observations ----------------------------------------------------------------------
    def samples(self, sync: SyncConfig | None = None) -> Iterator[BagSample]:
        """Observations exactly as the camera and policy nodes make them, by the one rule of
        :class:`~vla_accel_ros.core.robot.observation.ObservationBuilder`: the bag's messages
        go in in bag order (stamps from their headers, "now" from the bag timestamp; within
        one timestamp episode markers, then instructions, joint states and actions, then
        frames, so a simulated tick is never split and yields one sample). An episode marker
        forgets what came before it. Observations not made are counted by reason in
        ``self.skipped``."""
        sync = sync or SyncConfig()
        lay = self.layout
        cams = self.cameras()
        if not cams:
            raise BagError(f"{self.path} has no image topics")
        names = list(sync.cameras) or sorted(cams)
        unknown = [c for c in names if c not in cams]
        if unknown:
            raise BagError(f"{self.path} has no camera(s) {', '.join(unknown)}; it has {', '.join(sorted(cams))}")
        here = self.topics
        joint_topics = [t for t in self.robot.joint_state_topics if t in here]
        if joint_topics and len(joint_topics) != len(self.robot.joint_state_topics):
            raise BagError(f"{self.path} has only {', '.join(joint_topics)} of {', '.join(self.robot.joint_state_topics)}")
        camera_of = {cams[c]: c for c in names}
        joint_index = {t: k for k, t in enumerate(joint_topics)}
        optional = [t for t in (lay.action_topic, lay.instruction_topic, lay.episode_topic) if t in here]
        builder = self._builder = ObservationBuilder(names, sync, self.robot if joint_topics else None)
        latest: dict[str, BagMessage] = {}  # per topic, within the episode: stamps, velocities, action
        merged: set[str] = set()  # joint-state topics with a message the state took, within the episode
        segment = 0
        for m in in_tick_order(self.messages(list(camera_of) + joint_topics + optional), lay, camera_of):
            if m.topic == lay.episode_topic:
                builder.begin_episode(int(m.data))
                latest.clear()
                merged.clear()
                segment += 1
            elif m.topic == lay.instruction_topic:
                builder.set_instruction(str(m.data))
            elif m.topic in joint_index:
                js = m.data
                if js.position.size != len(js.names):
                    raise BagError(f"{self.path}: {m.topic}: {len(js.names)} names but {js.position.size} positions")
                reason, detail = builder.state.refusal(joint_index[m.topic], js.names, js.position)
                if reason == "unexpected_joint_names":  # not a glitch: the bag's layout is not the robot's
                    raise BagError(f"{self.path}: {m.topic}: JointState lacks joint(s) of the robot: it {detail}")
                if builder.joint_state(joint_index[m.topic], js.names, js.position, m.sensor_ns):
                    merged.add(m.topic)  # (a message with NaN / inf is refused whole, as live)
                latest[m.topic] = m
            elif m.topic in camera_of:
                latest[m.topic] = m
                no_state = builder.rejects.get("no_state", 0)
                obs = builder.frame(camera_of[m.topic], m.data, m.sensor_ns, m.stamp_ns)
                if obs is not None:
                    yield self._sample(obs, latest, list(camera_of) + joint_topics, segment)
                elif builder.rejects.get("no_state", 0) > no_state and merged.issuperset(joint_topics):
                    # Every joint-state topic has a message the state took and a joint is still
                    # missing: the bag's JointStates do not name the robot's joints (a layout
                    # error). Messages refused for NaN / inf only reject samples, as live.
                    absent = builder.state.missing()
                    if absent:
                        raise BagError(f"{self.path}: {', '.join(joint_topics)}: JointState lacks joint(s) {', '.join(absent)}")
            else:
                latest[m.topic] = m  # the action

    def _sample(self, obs: Observation, latest: dict[str, BagMessage], used: list[str], segment: int) -> BagSample:
        stamps = {t: latest[t].stamp_ns for t in used}
        qvel = action = None
        vels = [self._velocity(latest[t].data) for t in used if latest[t].msgtype == JOINT_STATE]
        if vels and all(v is not None for v in vels):
            qvel = np.concatenate(vels)
        act = latest.get(self.layout.action_topic)
        if act is not None:
            action = self._action(act.data)
            stamps[self.layout.action_topic] = act.stamp_ns
        age_ms = self._builder.last_age_ns / 1e6
        return BagSample(observation=obs, action=action, qvel=qvel, stamps=stamps, segment=segment, age_ms=age_ms)

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
        raise BagError(f"{self.path}: {self.layout.action_topic}: expected joints {want}, got {got}")


def in_tick_order(messages: Iterable[BagMessage], layout: TopicLayout, frame_topics: Iterable[str]) -> Iterator[BagMessage]:
    """``messages`` (in bag order) with those of one timestamp in a simulated tick's order: the
    ending episode's outcome, the next episode's marker, its instruction, joint states and
    actions, then frames, so a tick is never split (whatever order they were written in)."""
    rank = {layout.success_topic: -1, layout.episode_topic: 0, layout.instruction_topic: 1, **{t: 3 for t in frame_topics}}
    for group in _same_stamp(messages):
        yield from sorted(group, key=lambda m: rank.get(m.topic, 2))


def _same_stamp(messages: Iterable[BagMessage]) -> Iterator[list[BagMessage]]:
    """Runs of messages that share one bag timestamp."""
    group: list[BagMessage] = []
    for m in messages:
        if group and m.stamp_ns != group[0].stamp_ns:
            yield group
            group = []
        group.append(m)
    if group:
        yield group


def inspect_bag(path: Path, spec) -> dict[str, Any]:
    """Check that the bag can feed this bundle before any weights load; return its metadata."""
    with BagReader(path) as bag:
        cams = bag.cameras()
        missing = [c for c in spec.cameras if c not in cams]
        if missing:
            raise BagError(
                f"bag {path} has no camera(s) {', '.join(missing)} that bundle {spec.name} needs; "
                f"it has {', '.join(sorted(cams)) or 'none'}"
            )
        topics = bag.topics
        wanted = bag.robot.joint_state_topics  # the reader assembles the state from these
        if spec.state_dim and not all(t in topics for t in wanted):
            raise BagError(
                f"bag {path} has no joint states ({', '.join(wanted)}) "
                f"but the {spec.family} bundle {spec.name} needs a {spec.state_dim}-D state"
            )
        if spec.state_dim and spec.state_dim != bag.robot.dim:
            raise BagError(f"bag {path} yields {bag.robot.dim}-D states; bundle {spec.name} expects {spec.state_dim}-D")
        return {
            "path": str(path),
            "cameras": sorted(cams),
            "frames": min(topics[cams[c]].count for c in spec.cameras),  # observations at most
            "duration_s": bag.duration_ns / 1e9,
            "messages": bag.message_count,
        }


def gate_frames_from_bag(path: Path, sync: SyncConfig, second: int = 10) -> tuple[Observation, Observation] | None:
    """The bag's first observation and its ``second``-th (or last): the task's own frames for
    the parity gate (``replay``, the policy node's ``gate_bag``); None when the bag has fewer
    than two."""
    first = last = None
    with BagReader(path) as bag:
        for i, sample in enumerate(bag.samples(sync)):
            if first is None:
                first = sample.observation
            else:
                last = sample.observation
            if i >= second:
                break
    return None if last is None else (first, last)


def gate_frames_for(path: Path, spec) -> tuple[Observation, Observation]:
    """:func:`gate_frames_from_bag` for bundle ``spec``, the bag checked against it first
    (cameras, joint states); a :class:`BagError` says what is missing."""
    path = Path(path)
    if not path.exists():
        raise BagError(f"no such bag {path}")
    inspect_bag(path, spec)
    frames = gate_frames_from_bag(path, SyncConfig(cameras=tuple(spec.cameras)))
    if frames is None:
        raise BagError(f"bag {path} has fewer than two observations of cameras {', '.join(spec.cameras)}")
    return frames
