"""Behaviour-cloning data from rosbag2 bags, read the way the policy node sees the robot.

Every sample comes from :meth:`~vla_accel_ros.io.bag_reader.BagReader.samples`, i.e. the
package's one observation rule (:class:`~vla_accel_ros.core.robot.observation.ObservationBuilder`:
cameras, the package's one resize, the joint state through the policy node's state assembler,
instruction, episode), so a trained bundle sees at run time exactly the pixels and state it was
trained on. Per kept frame the target is
the chunk of the next ``chunk_size`` recorded actions of its episode (padded with the last
action past the episode's end, and marked invalid there).

Whole episodes are held out for validation (the last ones, so a recording extended with more
episodes keeps its validation set), and the normalization statistics come from the training
episodes only.
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from vla_accel_ros.core.errors import BagError, ConfigError
from vla_accel_ros.core.reasoning.template import ReasoningTemplate
from vla_accel_ros.core.text import words_of


T, R = TypeVar("T"), TypeVar("R")


class PackedFrames:
    """Frames [T, C, S, S, 3] uint8 held LZ4-compressed, one frame (all cameras) per entry:
    rendered scenes compress ~20x, so hundreds of episodes fit in memory. LZ4 rather than zlib:
    measured on three 512 px cameras (2.4 MB a frame), 0.6 ms to pack and 0.4 ms to unpack against
    3.7 and 1.5 ms for zlib at level 1, for a ratio of 20 against 26; unpacking is most of a
    batch's CPU time on a GPU run."""

    def __init__(self, frames: Sequence[np.ndarray] = ()) -> None:
        self._shape: tuple[int, ...] | None = None
        self._blobs: list[bytes] = []
        for f in frames:
            self.append(f)

    def append(self, frame: np.ndarray) -> None:
        """Packs one more frame: a reader packs each frame as it comes, so a bag of hundreds of
        episodes never sits unpacked in memory (3,500 three-camera 512 px frames are 8.3 GB unpacked)."""
        import lz4.block

        a = np.ascontiguousarray(frame, np.uint8)
        if self._shape is None:
            self._shape = tuple(a.shape)
        elif tuple(a.shape) != self._shape:
            raise BagError(f"frame of shape {list(a.shape)} among frames of shape {list(self._shape)}")
        self._blobs.append(lz4.block.compress(a.tobytes(), store_size=True))

    dtype = np.dtype(np.uint8)

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            raise BagError("an episode needs at least one frame")
        return (len(self._blobs), *self._shape)

    def __len__(self) -> int:
        return len(self._blobs)

    def __getitem__(self, i: int) -> np.ndarray:
        import lz4.block

        return np.frombuffer(lz4.block.decompress(self._blobs[int(i)]), np.uint8).reshape(self._shape)


@dataclass
class Episode:
    """One recorded episode at the model's resolution.

    frames: [T, C, S, S, 3] uint8 (an array or :class:`PackedFrames`); states: [T, D_s] float32
    (robot units, grippers normalized) at the frames; actions: [N, D] float32, one per control
    tick; steps: [T] the tick of each frame (None: one frame per tick, N == T; a bag recorded
    with ``sim record --render-every`` has frames at some ticks only, and actions at all);
    instruction: the episode's instruction ('' when the bag has none).
    """

    source: str  # "<bag>#<episode index>"
    frames: np.ndarray | PackedFrames
    states: np.ndarray
    actions: np.ndarray
    instruction: str
    steps: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.frames.shape[0])

    def tick(self, t: int) -> int:
        """The control tick of frame ``t`` (the index of its action)."""
        return int(t) if self.steps is None else int(self.steps[int(t)])


@dataclass
class DataStats:
    """Normalization statistics of a set of episodes, in the bundle's ``norm_stats`` layout."""

    action: dict[str, list[float]]
    state: dict[str, list[float]] | None

    def to_norm_stats(self) -> dict:
        out: dict = {"action": self.action}
        if self.state is not None:
            out["state"] = self.state
        return out


# A joint that never moves in the demonstrations has std 0 and q01 == q99; floors keep the
# normalized values finite and a policy's output near the recorded value.
STD_FLOOR = 1e-2
SPAN_FLOOR = 2e-2


def compute_stats(episodes: Sequence[Episode]) -> DataStats:
    acts = np.concatenate([e.actions for e in episodes]).astype(np.float64)
    q01, q99 = np.quantile(acts, 0.01, axis=0), np.quantile(acts, 0.99, axis=0)
    mid, half = (q01 + q99) / 2, np.maximum((q99 - q01) / 2, SPAN_FLOOR / 2)
    action = {
        "mean": acts.mean(0).tolist(),
        "std": np.maximum(acts.std(0), STD_FLOOR).tolist(),
        "q01": (mid - half).tolist(),
        "q99": (mid + half).tolist(),
    }
    state = None
    if episodes[0].states.shape[1]:
        st = np.concatenate([e.states for e in episodes]).astype(np.float64)
        state = {"mean": st.mean(0).tolist(), "std": np.maximum(st.std(0), STD_FLOOR).tolist()}
    return DataStats(action=action, state=state)


def read_episodes(
    bags: Sequence[str | Path],
    cameras: Sequence[str],
    image_size: int,
    *,
    resize: str = "square",
    workers: int = 0,
    progress: bool = True,
) -> list[Episode]:
    """Every episode of ``bags`` with the ``cameras`` (ROS camera names) at ``image_size``.

    Episodes without recorded actions or joint states are an error: behaviour cloning needs
    both. Frames are kept at the model's resolution only (a 480x640 frame is 4x the memory),
    compressed (:class:`PackedFrames`). The actions are read at every tick, also between
    frames (a bag rendered every few ticks), and each frame knows its tick.

    ``resize`` is the bundle's rule (``BundleSpec.image_resize``): ``square``, the observation
    rule's own resize; ``pad``, the frames as the graph delivers them (their own size), then
    LeRobot's resize with padding, done once here as the policy does it at run time (kept as
    uint8). ``workers`` > 0 reads that many bags at a time in separate processes, in order."""
    if resize not in ("square", "pad"):
        raise ConfigError(f"resize={resize!r}: square or pad")
    if workers > 0 and len(bags) > 1:
        return _read_parallel(bags, cameras, image_size, resize, workers, progress)
    from tqdm import tqdm

    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader

    if resize == "pad":
        from vla_accel_ros.models.lerobot_compat import padded_frames
    episodes: list[Episode] = []
    for path in bags:
        with BagReader(path) as bag:
            have = bag.cameras()
            missing = [c for c in cameras if c not in have]
            if missing:
                raise BagError(f"{path} has no camera(s) {', '.join(missing)}; it has {', '.join(sorted(have))}")
            action_topic = bag.layout.action_topic
            total = bag.topics[have[cameras[0]]].count
            bar = tqdm(total=total, desc=f"reading {Path(path).name}", unit="frame", disable=not progress, leave=False)
            parts: dict[int, dict] = {}  # segment -> packed frames, lists of states and action stamps
            sync = SyncConfig(cameras=tuple(cameras), image_size=image_size if resize == "square" else 0)
            for i, sample in enumerate(bag.samples(sync)):
                bar.update(1)
                obs = sample.observation
                if sample.action is None or obs.state is None:
                    raise BagError(f"{path}: behaviour cloning needs recorded actions and joint states at every frame")
                # every episode marker starts one, even with a repeated index
                cur = parts.setdefault(sample.segment, {"source": f"{path}#{obs.episode}", "instruction": obs.instruction,
                                                        "f": PackedFrames(), "s": [], "t": []})  # fmt: skip
                if resize == "pad":
                    cur["f"].append(padded_frames(obs.images, tuple(cameras), image_size).raw.numpy())
                else:
                    cur["f"].append(np.stack([obs.images[c] for c in cameras]))  # [C, S, S, 3], resized by the rule
                cur["s"].append(np.asarray(obs.state, np.float32))
                cur["t"].append(sample.stamps[action_topic])
                if i % TRIM_EVERY == TRIM_EVERY - 1:
                    _trim_heap()
            bar.close()
            actions = _actions_by_segment(bag, set(parts))
            for seg, p in parts.items():
                stamps, acts = actions[seg]
                steps = np.searchsorted(stamps, np.asarray(p["t"], np.int64))
                if np.any(steps >= len(stamps)) or np.any(stamps[np.minimum(steps, len(stamps) - 1)] != p["t"]):
                    raise BagError(f"{path}: a frame's action is missing from the episode's actions")
                episodes.append(Episode(
                    source=p["source"], frames=p["f"], states=np.stack(p["s"]),
                    actions=acts, instruction=p["instruction"], steps=steps.astype(np.int64),
                ))  # fmt: skip
    if not episodes:
        raise BagError(f"no usable frames in {', '.join(map(str, bags))}")
    return episodes


# Frames read between two trims of the heap (:func:`_trim_heap`).
TRIM_EVERY = 64


def _trim_heap() -> None:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing).
    Each frame's resize frees megabytes of temporaries among the packed frames that stay, and
    glibc keeps those pages: a reader of a bag of 100 three-camera 512 px episodes grew to 24 GB
    and was killed on a 24 GiB machine. Fixing glibc's mmap threshold instead kept the memory
    too, but read 3x slower."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _read_one(args: tuple) -> list[Episode]:
    import torch as _torch

    _torch.set_num_threads(1)  # one core per reading process
    bag, cameras, image_size, resize = args
    return read_episodes([bag], cameras, image_size, resize=resize, progress=False)


def _read_parallel(bags, cameras, image_size: int, resize: str, workers: int, progress: bool) -> list[Episode]:
    """:func:`read_episodes` of each bag in its own process (spawned: a forked torch can hang
    in OpenMP), episodes in the order of ``bags``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    jobs = [(str(b), tuple(cameras), image_size, resize) for b in bags]
    out: list[Episode] = []
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for eps in tqdm(pool.map(_read_one, jobs), total=len(jobs), desc="reading bags", unit="bag", disable=not progress):
            out.extend(eps)
    return out


def _actions_by_segment(bag, segments: set[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """segment -> (bag stamps [N], actions [N, D] float32) of every recorded action, counting
    segments as :meth:`BagReader.samples` does (one per episode marker)."""
    from vla_accel_ros.io.bag_reader import in_tick_order

    lay = bag.layout
    topics = [t for t in (lay.action_topic, lay.episode_topic) if t in bag.topics]
    out: dict[int, tuple[list, list]] = {}
    segment = 0
    for m in in_tick_order(bag.messages(topics), lay, ()):
        if m.topic == lay.episode_topic:
            segment += 1
        elif segment in segments:
            stamps, acts = out.setdefault(segment, ([], []))
            stamps.append(m.stamp_ns)
            acts.append(np.asarray(bag._action(m.data), np.float32))
    return {k: (np.asarray(st, np.int64), np.stack(a)) for k, (st, a) in out.items()}


def split_episodes(episodes: list[Episode], val_episodes: int) -> tuple[list[Episode], list[Episode]]:
    """The last ``val_episodes`` episodes for validation, the rest for training."""
    if not 0 <= val_episodes < len(episodes):
        raise ConfigError(
            f"val_episodes={val_episodes} must leave at least one training episode of {len(episodes)}"
        )
    cut = len(episodes) - val_episodes
    return episodes[:cut], episodes[cut:]


@dataclass
class Batch:
    frames: torch.Tensor | None  # [B, C, S, S, 3] uint8: normalized where the model runs (siglip_pixels), a quarter of the bytes to move
    states: torch.Tensor  # [B, D_s]
    actions: torch.Tensor  # [B, H, D]
    valid: torch.Tensor  # [B, H] bool
    instruction: str
    reasoning: list[list[str]] | None = None  # per sample, the words written before <act>
    # The random shift's offsets [B * C, 2] (dy, dx) when it is left to the device the model runs
    # on (frames unshifted; :func:`apply_shift`), None when the frames are already shifted.
    offsets: torch.Tensor | None = None
    # [B, C, N, H] a frozen tower's tokens of the frames (``ChunkDataset.image_tokens``); the
    # frames are then not assembled at all (None).
    image_tokens: torch.Tensor | None = None

    def device_frames(self, device) -> torch.Tensor:
        """The frames on ``device``, shifted there if the shift was deferred."""
        frames = self.frames.to(device)
        return frames if self.offsets is None else apply_shift(frames, self.offsets.to(device))


@dataclass
class ChunkDataset:
    """(frame, state, next ``chunk_size`` actions) samples over episodes, every ``stride``-th frame."""

    episodes: list[Episode]
    chunk_size: int
    stride: int = 1
    # A reasoning policy's labels: the template's text at each frame's control step (its index
    # in the episode: one recorded sample per simulator step) and joint state.
    reasoning: ReasoningTemplate | None = None
    index: np.ndarray = field(init=False)  # [N, 2] (episode, frame)
    # Per episode [T, C, N, H]: a frozen tower's tokens of every frame (the trainer's
    # --freeze-vision without the shift), which batches carry instead of frames.
    image_tokens: list[torch.Tensor] | None = None
    # [N, C, S, S, 3] uint8, row r the frame of sample r (:meth:`store_frames`), where the model
    # trains: a batch's frames are then one gather there, nothing unpacked or copied on the host.
    frame_store: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.stride < 1 or self.chunk_size < 1:
            raise ConfigError(f"stride and chunk_size must be >= 1, got {self.stride} and {self.chunk_size}")
        rows = [(i, t) for i, e in enumerate(self.episodes) for t in range(0, len(e), self.stride)]
        self.index = np.asarray(rows, np.int64).reshape(-1, 2)
        instructions = {e.instruction for e in self.episodes}
        if len(instructions) > 1:
            # One prompt length per batch keeps the prefix layout (and its K/V slots) shared.
            raise ConfigError(f"the episodes carry several instructions ({sorted(instructions)}); train one task at a time")

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def frame_bytes(self) -> int:
        """The bytes of every sample's frame unpacked (what :meth:`store_frames` allocates)."""
        e = self.episodes[0]
        return len(self) * int(np.prod(e.frames.shape[1:])) * e.frames.dtype.itemsize

    def store_frames(self, device: torch.device | str, *, block: int = 64, threads: int = 0) -> None:
        """Unpack every sample's frame once into :attr:`frame_store` on ``device``, ``block``
        frames at a time, unpacked on ``threads`` (the host holds a few blocks unpacked, never the
        whole set)."""
        shape = tuple(self.episodes[0].frames.shape[1:])
        store = torch.empty((len(self), *shape), dtype=torch.uint8, device=device)

        def unpack(i: int) -> tuple[int, np.ndarray]:
            return i, np.stack([self.episodes[int(ei)].frames[int(t)] for ei, t in self.index[i : i + block]])

        for i, part in prefetched(unpack, range(0, len(self), block), threads):
            store[i : i + len(part)].copy_(torch.from_numpy(part))
        self.frame_store = store

    @property
    def instruction(self) -> str:
        return self.episodes[0].instruction

    def batch(
        self, rows: np.ndarray, *, shift: int = 0, generator: torch.Generator | None = None, defer_shift: bool = False
    ) -> Batch:  # fmt: skip
        """The samples ``rows`` (indices into this dataset). ``shift`` > 0: random translation
        of each image by up to ``shift`` pixels (edge padding), a cheap, standard augmentation
        for image policies trained on few demonstrations; ``defer_shift``: only its offsets are
        drawn here, :meth:`Batch.device_frames` applies them where the model runs (on a GPU,
        a gather there instead of most of a batch's CPU time at 384 px)."""
        if self.image_tokens is not None and shift > 0:
            raise ConfigError("a batch of precomputed image tokens cannot be shifted (the frozen tower saw the frames once)")
        h = self.chunk_size
        frames, states, actions, valid, reasoning = [], [], [], [], []
        for r in rows:
            ei, t = self.index[int(r)]
            e = self.episodes[int(ei)]
            tick = e.tick(t)
            end = min(len(e.actions), tick + h)
            chunk = e.actions[tick:end]
            pad = h - chunk.shape[0]
            if pad:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
            # the frame, or its frozen tower's tokens when they were computed once (neither when stored)
            if self.image_tokens is not None:
                frames.append(self.image_tokens[int(ei)][int(t)])
            elif self.frame_store is None:
                frames.append(e.frames[t])
            states.append(e.states[t])
            actions.append(chunk)
            valid.append(np.arange(h) < h - pad)
            if self.reasoning is not None:
                reasoning.append(words_of(self.reasoning.text(tick, e.states[t])))
        common = dict(
            states=torch.from_numpy(np.stack(states)), actions=torch.from_numpy(np.stack(actions)),
            valid=torch.from_numpy(np.stack(valid)), instruction=self.instruction,
            reasoning=reasoning if self.reasoning is not None else None,
        )  # fmt: skip
        if self.image_tokens is not None:
            return Batch(frames=None, image_tokens=torch.stack(frames), **common)
        if self.frame_store is not None:
            raw = self.frame_store.index_select(0, torch.as_tensor(rows, dtype=torch.int64).to(self.frame_store.device))
        else:
            raw = torch.from_numpy(np.stack(frames))  # [B, C, S, S, 3] uint8
        offsets = shift_offsets(raw.shape[0] * raw.shape[1], shift, generator) if shift > 0 else None
        if offsets is not None and not defer_shift:
            raw, offsets = _shift_by_slices(raw, offsets), None
        return Batch(frames=raw, offsets=offsets, **common)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Consecutive rows in order (validation)."""
        for i in range(0, len(self), batch_size):
            yield np.arange(i, min(len(self), i + batch_size))


def prefetched(fn: Callable[[T], R], items: Sequence[T], threads: int) -> Iterator[R]:
    """``fn`` of each item, in order, computed up to ``2 * threads`` items ahead on ``threads``
    background threads (0: one at a time, here): work that releases the GIL (LZ4, numpy copies)
    overlaps the consumer's, and no more than the window is held at once."""
    if not threads:
        yield from map(fn, items)
        return
    ahead = 2 * threads
    with ThreadPoolExecutor(threads, thread_name_prefix="prefetch") as pool:
        pending = deque(pool.submit(fn, x) for x in items[:ahead])
        for x in items[ahead:]:
            done = pending.popleft().result()
            pending.append(pool.submit(fn, x))
            yield done
        while pending:
            yield pending.popleft().result()


def shift_offsets(n: int, shift: int, generator: torch.Generator | None) -> torch.Tensor:
    """Random (dy, dx) in [-shift, shift] for ``n`` images.  -> [n, 2] int64"""
    return torch.randint(0, 2 * shift + 1, (n, 2), generator=generator) - shift


def random_shift(frames: torch.Tensor, shift: int, generator: torch.Generator | None) -> torch.Tensor:
    """Translate each image of ``frames`` [B, C, S, S, 3] uint8 by integer offsets in
    [-shift, shift] with the edges replicated (the crop of an edge-padded image)."""
    b, c = frames.shape[:2]
    return _shift_by_slices(frames, shift_offsets(b * c, shift, generator))


def apply_shift(frames: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`random_shift` with given offsets [B * C, 2], as one gather of clamped indices
    (output pixel (r, c) is input (r + dy, c + dx), clamped to the image): the same pixels as
    the slices, for a device where one gather is cheap."""
    b, c, s = frames.shape[:3]
    flat = frames.reshape(b * c, s, s, frames.shape[-1])
    ar = torch.arange(s, device=frames.device)
    rows = (ar[None, :] + offsets[:, :1]).clamp_(0, s - 1)  # [N, S]
    cols = (ar[None, :] + offsets[:, 1:]).clamp_(0, s - 1)
    n = torch.arange(b * c, device=frames.device)[:, None, None]
    return flat[n, rows[:, :, None], cols[:, None, :]].reshape(frames.shape)


def _shift_by_slices(frames: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The shift by row and column slices of the uint8 frames, on the CPU. Measured on 32
    two-camera samples at 224 px, one thread of a loaded 2-core machine, twice: 23-25 ms, against
    220-290 ms for padding and cropping the float images one by one and 270 ms for one gather of
    clamped indices (its index tensors are as large as the images)."""
    b, c, s = frames.shape[:3]
    flat = frames.reshape(b * c, s, s, frames.shape[-1])
    off = offsets.tolist()
    out = torch.empty_like(flat)
    for img, dst, (dy, dx) in zip(flat, out, off):
        rows = img.index_select(0, (torch.arange(s) + dy).clamp_(0, s - 1))  # output row r is row r + dy
        lo, hi = max(0, -dx), max(0, dx)
        dst[:, lo : s - hi] = rows[:, hi : s - lo]
        dst[:, :lo] = rows[:, :1]
        dst[:, s - hi :] = rows[:, -1:]
    return out.reshape(frames.shape)
