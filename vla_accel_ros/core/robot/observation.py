"""The one observation rule, and the latest-only hand-offs between threads.

An observation is made when every camera has delivered a frame not used before (a frame whose
stamp is not newer than the camera's previous one is the same frame re-sent: ignored); it is stamped
with the OLDEST frame's stamp (actions are at least as old as their oldest pixel); it is
rejected when its frames are too skewed (``max_skew``) or too old (``max_age``); a frame
stamped more than ``max_future`` ahead of the clock is never kept (it would date observations,
and so chunks and requests, in the future and hold back every later one); the state
attached is the joint-state vector, rejected when it is older than ``max_state_age`` at the
observation's stamp. Two halves, so the graph can split them:

* :class:`ObservationAssembler`, the image half (frames in, resized to the model's size by the
  package's one resize): the camera node.
* :class:`StateGate`, the state half (joint states in through :class:`StateAssembler`, the state
  for an observation stamp out): the policy node.
* :class:`ObservationBuilder` runs both end to end, which is what the bag reader (replay,
  training data, evaluation) does with a bag's messages in bag order.

Clock-free: every call takes ``now_ns`` from the caller's clock (ROS time in the nodes, sim
time under ``use_sim_time``, the bag timestamp of the message being processed in replay).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np

from vla_accel_ros.core.robot.config import RobotConfig, SyncConfig
from vla_accel_ros.core.robot.images import ImageError, resize_rgb
from vla_accel_ros.core.robot.state import StateAssembler
from vla_accel_ros.core.types import Observation

T = TypeVar("T")


@dataclass
class Frame:
    image: np.ndarray  # [H, W, 3] uint8 RGB (already at the policy's size when preprocessed)
    stamp_ns: int  # sensor time from the message header
    seq: int  # per-camera arrival counter


@dataclass
class CameraHealth:
    """One camera as :meth:`ObservationAssembler.health` sees it."""

    camera: str
    level: str  # "ok" | "warn" (no new frame for max_age) | "error" (none for the caller's error time)
    message: str  # '' when ok: "no frames yet", "no new frame for 1.2 s", "re-sending one stamp for 1.2 s (36 frames)"
    since_new_ms: float  # since the camera's newest new frame arrived (nan: none yet)
    resent: int  # frames re-sent with a stamp already seen, since the start (or the last reset)


@dataclass
class AssembledObservation:
    images: dict[str, np.ndarray]  # camera -> [H, W, 3] uint8, in the configured camera order
    stamp_ns: int  # the OLDEST frame's stamp: actions are at least as old as their oldest pixel
    skew_ns: int  # newest - oldest frame stamp
    age_ns: int  # now - oldest stamp at assembly
    seq: int


class ObservationAssembler:
    """The image half. Keeps the latest frame per camera and assembles an observation when

    * every camera has delivered a frame not used in a previous observation (so equal-rate
      cameras yield one observation per frame period and a dead camera yields none),
    * the oldest frame is at most ``max_age_ns`` old, and
    * the frames' stamps lie within ``max_skew_ns`` of one another.

    When a set is complete but too old or too skewed, :meth:`assemble` returns None and
    :attr:`last_reject` says why; newer frames replace the offending ones as they arrive. A
    frame stamped more than ``max_future_ns`` ahead of ``now`` is not kept at all
    (:meth:`too_new`; counted as ``future``), nor is one stamped no later than the camera's
    previous frame (the same frame re-sent by a stuck driver; counted as ``repeated``).
    ``image_size`` (0: keep) is the square size :meth:`prepare` resizes frames to.

    :meth:`health` says per camera whether it streams: when its newest new frame arrived (on
    the caller's clock) and whether it re-sends one stamp.
    """

    def __init__(
        self, cameras: Sequence[str], *, max_age_ns: int, max_skew_ns: int, max_future_ns: int, image_size: int = 0
    ) -> None:
        if not cameras or len(set(cameras)) != len(cameras):
            raise ValueError(f"cameras must be unique and non-empty, got {list(cameras)}")
        self.cameras = tuple(cameras)
        self.image_size = int(image_size)
        self.set_limits(max_age_ns=max_age_ns, max_skew_ns=max_skew_ns, max_future_ns=max_future_ns)
        self._latest: dict[str, Frame] = {}
        self._used: dict[str, int] = {}  # camera -> seq of the frame in the last observation
        self._seq = 0
        self._last_now: int | None = None
        self._new_at: dict[str, int] = {}  # camera -> now_ns when its newest new frame arrived
        self._sent_at: dict[str, int] = {}  # ... and its newest frame, re-sent or not
        self._resent: dict[str, int] = {}  # camera -> frames re-sent with an old stamp (all, and in a row)
        self._resent_run: dict[str, int] = {}
        self.last_reject = ""
        self.rejects: dict[str, int] = {"stale": 0, "skew": 0, "future": 0, "repeated": 0}

    def set_limits(self, *, max_age_ns: int, max_skew_ns: int, max_future_ns: int) -> None:
        self.max_age_ns, self.max_skew_ns, self.max_future_ns = int(max_age_ns), int(max_skew_ns), int(max_future_ns)

    def too_new(self, stamp_ns: int, now_ns: int) -> str:
        """Why a frame stamped ``stamp_ns`` is refused at ``now_ns`` ('' when it is not): it
        lies more than ``max_future_ns`` ahead (a camera with a wrong clock). Callers may ask
        before decoding; :meth:`add` asks again."""
        ahead = int(stamp_ns) - int(now_ns)
        if ahead > self.max_future_ns:
            return f"stamped {ahead / 1e6:.1f} ms ahead of the clock > max future {self.max_future_ns / 1e6:g} ms"
        return ""

    def prepare(self, image: np.ndarray) -> np.ndarray:
        """A decoded frame at the model's size (touches no state: callers may run it in
        parallel, outside their lock). Raises :class:`ImageError` for an unusable frame."""
        if image.ndim < 2 or image.shape[0] == 0 or image.shape[1] == 0:
            raise ImageError("empty", "decoded to an empty image")
        return resize_rgb(image, self.image_size) if self.image_size else image

    def add(self, camera: str, image: np.ndarray, stamp_ns: int, now_ns: int) -> AssembledObservation | None:
        """One prepared frame in; the observation it completes, if any. A clock that jumped
        back (sim time restarted, a bag looped) forgets every frame first, so callers on several
        threads read their clock and call this in one order (under one lock)."""
        if self._last_now is not None and now_ns < self._last_now:
            self.reset()
        self._last_now = int(now_ns)
        why = self.too_new(stamp_ns, now_ns)
        if why:  # never kept: it would stamp, and so hold back, every later observation
            self.rejects["future"] += 1
            self.last_reject = why
            return None
        self._sent_at[camera] = int(now_ns)
        if not self.put(camera, image, stamp_ns):
            return None
        self._new_at[camera] = int(now_ns)
        return self.assemble(now_ns)

    def put(self, camera: str, image: np.ndarray, stamp_ns: int) -> bool:
        """Keep ``image`` as ``camera``'s latest frame; False (counted, not kept) when its stamp
        is not newer than the frame held: the camera re-sent a frame."""
        if camera not in self.cameras:
            raise KeyError(f"unknown camera {camera!r}; configured: {', '.join(self.cameras)}")
        prev = self._latest.get(camera)
        if prev is not None and int(stamp_ns) <= prev.stamp_ns:
            self.rejects["repeated"] += 1
            self._resent[camera] = self._resent.get(camera, 0) + 1
            self._resent_run[camera] = self._resent_run.get(camera, 0) + 1
            return False
        self._resent_run[camera] = 0
        self._latest[camera] = Frame(image, int(stamp_ns), 0 if prev is None else prev.seq + 1)
        return True

    def missing(self) -> list[str]:
        return [c for c in self.cameras if c not in self._latest]

    def assemble(self, now_ns: int) -> AssembledObservation | None:
        if self.missing():
            return None
        frames = [self._latest[c] for c in self.cameras]
        if any(self._used.get(c) == f.seq for c, f in zip(self.cameras, frames)):
            return None  # some camera has nothing new since the last observation
        stamps = [f.stamp_ns for f in frames]
        oldest, newest = min(stamps), max(stamps)
        age, skew = int(now_ns) - oldest, newest - oldest
        if age > self.max_age_ns:
            return self._reject("stale", f"oldest frame is {age / 1e6:.1f} ms old > max age {self.max_age_ns / 1e6:g} ms")
        if skew > self.max_skew_ns:
            return self._reject("skew", f"frames span {skew / 1e6:.1f} ms > max skew {self.max_skew_ns / 1e6:g} ms")
        self._used = {c: f.seq for c, f in zip(self.cameras, frames)}
        self._seq += 1
        self.last_reject = ""
        images = {c: f.image for c, f in zip(self.cameras, frames)}
        return AssembledObservation(images, oldest, skew, age, self._seq)

    def _reject(self, key: str, why: str) -> None:
        if self.last_reject != why:
            self.rejects[key] += 1
        self.last_reject = why
        return None

    def health(self, now_ns: int, *, error_ns: int) -> list[CameraHealth]:
        """Per camera, in order: "ok" while its newest new frame arrived at most ``max_age_ns``
        before ``now_ns``, else "warn", and "error" beyond ``error_ns`` too; the message says
        whether it sends nothing or re-sends one stamp (its frames arrive, their stamp does not move)."""
        out = []
        for cam in self.cameras:
            new_at = self._new_at.get(cam)
            resent, run = self._resent.get(cam, 0), self._resent_run.get(cam, 0)
            if new_at is None:
                out.append(CameraHealth(cam, "warn", "no frames yet", float("nan"), resent))
                continue
            since = int(now_ns) - new_at
            level = "ok" if since <= self.max_age_ns else "error" if since > error_ns else "warn"
            message = ""
            if level != "ok":
                re_sending = run and int(now_ns) - self._sent_at[cam] <= self.max_age_ns
                message = (f"re-sending one stamp for {since / 1e9:.1f} s ({run} frames)" if re_sending
                           else f"no new frame for {since / 1e9:.1f} s")  # fmt: skip
            out.append(CameraHealth(cam, level, message, since / 1e6, resent))
        return out

    def reset(self) -> None:
        """Forget every frame (a new episode, or the clock jumped back)."""
        self._latest.clear()
        self._used.clear()
        self._new_at.clear()
        self._sent_at.clear()
        self._resent_run.clear()
        self._last_now = None


class StateGate:
    """The state half: joint-state readings in (through :class:`StateAssembler`), the policy's
    state vector for an observation stamped ``stamp_ns`` out, or a reject: ``no_state`` (some
    joint never reported) or ``stale_state`` (the readings are more than ``max_state_age_ns``
    older than the observation). :attr:`last_reason` / :attr:`last_reject` say why."""

    def __init__(self, robot: RobotConfig, *, max_state_age_ns: int) -> None:
        self.assembler = StateAssembler(robot)
        self.max_state_age_ns = int(max_state_age_ns)
        self.last_reason = self.last_reject = ""
        self.rejects: dict[str, int] = {"no_state": 0, "stale_state": 0}

    def set_limit(self, *, max_state_age_ns: int) -> None:
        self.max_state_age_ns = int(max_state_age_ns)

    def refusal(self, topic_index: int, names: Sequence[str], positions: Sequence[float]) -> tuple[str, str]:
        """Why that message would not be merged (:meth:`StateAssembler.refusal`); ('', '') when it would."""
        return self.assembler.refusal(topic_index, names, positions)

    def update(self, topic_index: int, names: Sequence[str], positions: Sequence[float], stamp_ns: int) -> int:
        """One JointState message of topic ``topic_index``; returns the joints it merged (0: refused)."""
        return self.assembler.update(topic_index, names, positions, stamp_ns)

    def missing(self) -> list[str]:
        return self.assembler.missing()

    def state_for(self, stamp_ns: int) -> np.ndarray | None:
        """The state [D] float32 to pair with an observation stamped ``stamp_ns``, or None."""
        st = self.assembler.state()
        if st is None:
            missing = self.missing()
            bad = [n for n in self.assembler.nonfinite() if n in missing]
            if bad:
                more = " ..." if len(bad) > 4 else ""
                return self._reject("no_state", f"joint states for {', '.join(bad[:4])}{more} are not finite (NaN / inf)")
            more = " ..." if len(missing) > 4 else ""
            return self._reject("no_state", f"no joint states yet for {', '.join(missing[:4])}{more}")
        state, state_stamp = st
        age_ns = int(stamp_ns) - state_stamp
        if age_ns > self.max_state_age_ns:
            return self._reject("stale_state", f"joint states are {age_ns / 1e6:.0f} ms older than the observation")
        self.last_reason = self.last_reject = ""
        return state

    def _reject(self, reason: str, why: str) -> None:
        self.rejects[reason] += 1
        self.last_reason, self.last_reject = reason, why
        return None

    def reset(self) -> None:
        self.assembler.reset()


class ObservationBuilder:
    """Both halves end to end: frames and joint states in, :class:`Observation` out, exactly as
    the camera node and the policy node make them between them. The bag reader feeds it a bag's
    messages in order (joint states of a stamp before its frames); :meth:`begin_episode` is an
    episode marker: nothing from before it is used after it."""

    def __init__(self, cameras: Sequence[str], config: SyncConfig | None = None, robot: RobotConfig | None = None) -> None:
        c = config or SyncConfig()
        self.frames = ObservationAssembler(
            cameras, max_age_ns=int(c.max_age_ms * 1e6), max_skew_ns=int(c.max_skew_ms * 1e6),
            max_future_ns=int(c.max_future_ms * 1e6), image_size=c.image_size,
        )  # fmt: skip
        self.state = None if robot is None else StateGate(robot, max_state_age_ns=int(c.max_state_age_ms * 1e6))
        self.episode, self.instruction = 0, ""
        self.last_age_ns = 0  # of the latest observation made: now - its oldest frame's stamp

    @property
    def rejects(self) -> dict[str, int]:
        """Observations not made, by reason (frames: stale, skew, future, repeated; state: no_state, stale_state)."""
        return {**self.frames.rejects, **(self.state.rejects if self.state is not None else {})}

    def begin_episode(self, episode: int) -> None:
        self.episode, self.instruction = int(episode), ""
        self.frames.reset()
        if self.state is not None:
            self.state.reset()

    def set_instruction(self, text: str) -> None:
        self.instruction = str(text)

    def joint_state(self, topic_index: int, names: Sequence[str], positions: Sequence[float], stamp_ns: int) -> int:
        return 0 if self.state is None else self.state.update(topic_index, names, positions, stamp_ns)

    def frame(self, camera: str, image: np.ndarray, stamp_ns: int, now_ns: int) -> Observation | None:
        """One decoded frame in; the observation it completes (state attached), if any."""
        obs = self.frames.add(camera, self.frames.prepare(image), stamp_ns, now_ns)
        if obs is None:
            return None
        state = None
        if self.state is not None:
            state = self.state.state_for(obs.stamp_ns)
            if state is None:
                return None
        self.last_age_ns = obs.age_ns
        return Observation(
            images=obs.images, instruction=self.instruction, stamp_ns=obs.stamp_ns, state=state, episode=self.episode
        )


class LatestSlot(Generic[T]):
    """A thread-safe latest-only mailbox: ``put`` overwrites, ``take`` empties, ``wait`` blocks.

    The policy worker reads its requests through one; a producer never blocks and a slow
    consumer only ever sees the newest item (older ones are counted as ``overwritten``).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: T | None = None
        self.overwritten = 0

    def put(self, item: T) -> None:
        with self._cond:
            if self._item is not None:
                self.overwritten += 1
            self._item = item
            self._cond.notify_all()

    def take(self) -> T | None:
        with self._cond:
            item, self._item = self._item, None
            return item

    def wait(self, timeout: float | None = None) -> bool:
        """True when an item is waiting (returns at once if one already is)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._item is not None, timeout)


@dataclass
class ObservationChannel:
    """Observations from the camera side to the policy side, keyed by stamp.

    Latest-only for the policy's "infer on the newest" path, plus a short history so a chunk
    request that names an observation by its stamp finds it even if a newer frame landed in
    between. The camera node writes it directly when both nodes share a process; otherwise the
    policy node's subscription does. ``listeners`` run after every put (the policy node
    announces the stamp there); they must be quick and must not block.
    """

    history: int = 16
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _ring: "OrderedDict[int, object]" = field(default_factory=OrderedDict)
    _seq: int = 0
    listeners: list[Callable[[int, object], None]] = field(default_factory=list)

    def put(self, stamp_ns: int, observation: object) -> None:
        with self._cond:
            self._ring[int(stamp_ns)] = observation
            self._ring.move_to_end(int(stamp_ns))
            while len(self._ring) > self.history:
                self._ring.popitem(last=False)
            self._seq += 1
            self._cond.notify_all()
        for fn in list(self.listeners):
            fn(int(stamp_ns), observation)

    @property
    def seq(self) -> int:
        """Puts so far; a consumer remembers it to wait for something newer."""
        with self._cond:
            return self._seq

    def latest(self) -> tuple[int, object] | None:
        with self._cond:
            if not self._ring:
                return None
            stamp = next(reversed(self._ring))
            return stamp, self._ring[stamp]

    def get(self, stamp_ns: int) -> object | None:
        with self._cond:
            return self._ring.get(int(stamp_ns))

    def wait_for_stamp(self, stamp_ns: int, timeout: float) -> object | None:
        with self._cond:
            self._cond.wait_for(lambda: int(stamp_ns) in self._ring, timeout)
            return self._ring.get(int(stamp_ns))

    def wait_newer(self, seq: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._seq > seq, timeout)

    def clear(self) -> None:
        with self._cond:
            self._ring.clear()


class SharedChannels:
    """In-process registry of :class:`ObservationChannel` by name, for nodes that share a
    process (``vla-accel bringup``). Keyed by (owner, name) so two graphs in one process (tests)
    never see each other's observations; the ROS layer uses the rclpy context as the owner."""

    _lock = threading.Lock()
    _channels: dict[tuple[int, str], ObservationChannel] = {}

    @classmethod
    def get(cls, owner: object, name: str, history: int = 16) -> ObservationChannel:
        key = (id(owner), name)
        with cls._lock:
            ch = cls._channels.get(key)
            if ch is None:
                ch = cls._channels[key] = ObservationChannel(history=history)
            return ch

    @classmethod
    def drop(cls, owner: object) -> None:
        with cls._lock:
            for key in [k for k in cls._channels if k[0] == id(owner)]:
                del cls._channels[key]
