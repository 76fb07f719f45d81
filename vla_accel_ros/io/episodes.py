"""What a bag holds, per episode and in words: ``vla-accel bag inspect`` and the replay report."""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.errors import BagError
from vla_accel_ros.io.bag_reader import BagReader, in_tick_order


@dataclass
class EpisodeSummary:
    index: int
    start_ns: int
    end_ns: int  # stamp of its last message
    instruction: str | None
    success: bool | None  # None: not recorded
    frames: int  # messages on the counted camera


def episodes(bag: BagReader, camera: str = "") -> list[EpisodeSummary]:
    """One entry per episode marker (a bag without markers is one episode, index 0); frames
    are counted on ``camera`` (empty: the first camera in name order)."""
    lay = bag.layout
    here = bag.topics
    cams = bag.cameras()
    cam_topic = cams.get(camera) if camera else (cams[sorted(cams)[0]] if cams else None)
    if camera and cam_topic is None:
        raise BagError(f"{bag.path} has no camera {camera!r}")
    wanted = [
        t for t in (lay.episode_topic, lay.instruction_topic, lay.success_topic, cam_topic) if t and t in here
    ]
    out: list[EpisodeSummary] = []
    cur: EpisodeSummary | None = None
    frames = [cam_topic] if cam_topic else []  # only counted: read raw
    for m in in_tick_order(bag.messages(wanted, raw=frames), lay, frames):  # as samples() orders them
        if m.topic == lay.episode_topic or cur is None:
            index = int(m.data) if m.topic == lay.episode_topic else 0
            cur = EpisodeSummary(index, m.stamp_ns, m.stamp_ns, None, None, 0)
            out.append(cur)
        cur.end_ns = m.stamp_ns
        if m.topic == lay.instruction_topic:
            cur.instruction = str(m.data)
        elif m.topic == lay.success_topic:
            cur.success = bool(m.data)
        elif m.topic == cam_topic:
            cur.frames += 1
    return out


def summary(bag: BagReader) -> str:
    """Human-readable: storage, duration, topics with counts and rates, episodes."""
    dur = bag.duration_ns / 1e9
    lines = [
        f"bag:       {bag.path}",
        f"duration:  {dur:.3f} s   messages: {bag.message_count}",
        "topics:",
    ]
    for t in bag.topics.values():
        rate = f"{(t.count - 1) / dur:7.2f} Hz" if dur > 0 and t.count > 1 else "       -  "
        lines.append(f"  {t.topic:<45} {t.msgtype:<28} {t.count:>7}  {rate}")
    eps = episodes(bag)
    done = [e for e in eps if e.success is not None]
    lines.append(
        f"episodes:  {len(eps)}"
        + (f"   successes: {sum(bool(e.success) for e in done)}/{len(done)}" if done else "")
    )
    for e in eps:
        ok = "-" if e.success is None else ("success" if e.success else "failure")
        secs = (e.end_ns - e.start_ns) / 1e9
        lines.append(f"  #{e.index:<4} {secs:7.2f} s  {e.frames:>5} frames  {ok:<8} {e.instruction or ''}")
    return "\n".join(lines)
