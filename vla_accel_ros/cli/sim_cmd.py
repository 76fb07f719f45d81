"""``vla-accel sim record``: scripted ALOHA episodes straight into a rosbag2 bag, no ROS graph."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "sim", "the simulated ALOHA (gym-aloha, MuJoCo) without ROS")
    ssub = p.add_subparsers(dest="sim_command", metavar="ACTION", required=True)

    r = command(
        ssub, "record", "record scripted demonstrations to a rosbag2 bag (MCAP or sqlite3)",
        "vla-accel sim record --task transfer_cube --episodes 30 --seed 0 --out data/tc0",
    )
    r.add_argument("--task", choices=("transfer_cube", "insertion"), required=True)
    r.add_argument("--episodes", type=int, default=1, help="episodes to record (episode i uses seed S+i)")
    r.add_argument("--out", type=Path, required=True, help="bag directory to create (must not exist)")
    r.add_argument("--seed", type=int, default=0, help="seed of the first episode (object placement)")
    r.add_argument("--steps", type=int, default=300, help="control steps per episode at 50 Hz (300 = 6 s)")
    r.add_argument(
        "--cameras", default="top", help="comma-separated sim cameras to render, e.g. top,left_wrist"
    )
    r.add_argument("--height", type=int, default=480, help="image height (<= 480)")
    r.add_argument("--width", type=int, default=640, help="image width (<= 640)")
    r.add_argument(
        "--render-every", type=int, default=1, metavar="N",
        help="render the cameras every N ticks only (joint states and actions at every tick; the phase shifts "
        "per episode): rendering is most of the cost, and training reads the actions between frames. "
        "0: only the ticks before --render-first (with --render-first 1, each episode's tick 0 alone)",
    )  # fmt: skip
    r.add_argument(
        "--render-first", type=int, default=0, metavar="T",
        help="also render every tick before tick T (default 0: none). 1 renders each episode's tick 0, the arm at home, "
        "where only the object says where the chunk goes; the phase of --render-every gives it to 1 episode in N. "
        "The frames are then not evenly spaced, which a LeRobotDataset cannot hold (bag export-lerobot refuses such a bag)",
    )  # fmt: skip
    r.add_argument(
        "--action-noise", type=float, default=0.0, metavar="RAD",
        help="execute each arm joint's command with an offset drawn from N(0, RAD), held --noise-hold ticks, "
        "and record the expert's action as it is: demonstrations of coming back to the path (DART). Each draw "
        "is checked to still complete the task first (default 0: none)",
    )  # fmt: skip
    r.add_argument("--noise-hold", type=int, default=25, metavar="N", help="ticks each --action-noise offset is held (25 = 0.5 s)")
    r.add_argument(
        "--detour", default=None, metavar="FIRST,LAST",
        help="transfer_cube recovery demonstrations: the right arm first reaches for a decoy drawn from the cube's "
        "range, then at a tick drawn from FIRST..LAST (1..45) turns to the cube; rendering starts at that tick "
        "(both rendering rules count from it), so the frames show the arm off the cube and the actions that bring "
        "it there. Each draw is checked to complete the task first (default: none)",
    )  # fmt: skip
    r.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="sqlite3 for Humble robots")
    r.add_argument(
        "--no-compress", action="store_true",
        help="write mcap chunks uncompressed (default: zstd, ~30x smaller for rendered frames)",
    )  # fmt: skip
    r.add_argument(
        "--start-time", type=float, default=None,
        help="bag time of the first tick in seconds since the epoch (default: now)",
    )  # fmt: skip
    r.set_defaults(func=_record)


def _record(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.io.bag_file import bag_size_bytes
    from vla_accel_ros.io.bag_writer import BagWriter
    from vla_accel_ros.io.sim_recorder import FrameRecorder
    from vla_accel_ros.sim import ActionNoise, Detour, SimConfig, SimError, scripted_frames
    from vla_accel_ros.sim.episodes import check_rendering

    cameras = tuple(c.strip() for c in args.cameras.split(",") if c.strip())
    if args.episodes < 1 or args.steps < 1:
        raise ConfigError(f"--episodes and --steps must be >= 1, got {args.episodes} and {args.steps}")
    try:
        check_rendering(args.render_every, args.render_first)
    except SimError as e:
        raise ConfigError(f"--render-every {args.render_every} / --render-first {args.render_first}: {e}") from None
    # Validate before the bag directory exists (the frame generator starts lazily).
    SimConfig(task=args.task, cameras=cameras, height=args.height, width=args.width)
    try:
        noise = ActionNoise(std=args.action_noise, hold=args.noise_hold)
    except ConfigError as e:
        raise ConfigError(f"--action-noise {args.action_noise} / --noise-hold {args.noise_hold}: {e}") from None
    detour = _detour(args.detour, args.task, noise)
    frames = scripted_frames(
        args.task, args.episodes, seed=args.seed, steps=args.steps,
        cameras=cameras, height=args.height, width=args.width, render_every=args.render_every, noise=noise,
        render_first=args.render_first, detour=detour,
    )  # fmt: skip
    start_ns = time.time_ns() if args.start_time is None else int(args.start_time * 1e9)
    print(
        f"recording {args.episodes} x {args.steps} steps of {args.task} (cameras {', '.join(cameras)}, "
        f"{args.width}x{args.height}) to {args.out} [{args.storage}]"
        + (f", commands with {noise.std:g} rad of noise held {noise.hold} ticks" if noise.std > 0 else "")
        + (f", detours switching at ticks {detour.first}..{detour.last}" if detour is not None else ""),
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    bar = progress_bar(args.episodes * args.steps, "sim record", "step")
    with BagWriter(args.out, storage=args.storage, compress=False if args.no_compress else None) as writer, bar:
        rec = FrameRecorder(writer, start_ns=start_ns)
        for frame in frames:
            rec.write(frame)
            bar.update(1)
            if frame.done:
                outcome = "success" if frame.success else "failure"
                bar.write(f"  episode {frame.episode + 1}/{args.episodes} (seed {frame.seed}): {outcome}  "
                          f"[{time.perf_counter() - t0:.1f} s]", file=sys.stderr)  # fmt: skip
    seconds = time.perf_counter() - t0
    size = bag_size_bytes(args.out)
    print(
        f"recorded {rec.ticks} frames, {rec.episodes} episodes, {rec.successes} successes "
        f"in {seconds:.1f} s ({rec.ticks / seconds:.1f} frames/s); {args.out}: {size / 2**20:.1f} MiB"
    )
    return 0


def _detour(spec: str | None, task: str, noise):
    """``--detour FIRST,LAST`` as a :class:`~vla_accel_ros.sim.Detour` (None without the flag)."""
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.sim import Detour

    if spec is None:
        return None
    if task != "transfer_cube":
        raise ConfigError(f"--detour {spec}: detours are scripted for transfer_cube only, not {task}")
    if noise.std > 0:
        raise ConfigError(f"--detour {spec} with --action-noise {noise.std:g}: a recording takes one or the other")
    try:
        first, last = (int(v) for v in spec.split(","))
    except ValueError:
        raise ConfigError(f"--detour {spec!r}: two ticks FIRST,LAST, e.g. 10,45") from None
    try:
        return Detour(first=first, last=last)
    except ConfigError as e:
        raise ConfigError(f"--detour {spec}: {e}") from None
