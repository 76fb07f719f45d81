"""``vla-accel bag inspect``: topics, counts, rates, duration and episodes of a rosbag2 bag;
``vla-accel bag export-lerobot``: bags to a LeRobotDataset v3.0."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vla_accel_ros.cli import command
from vla_accel_ros.core.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bag", "rosbag2 bags (MCAP, sqlite3) without ROS")
    bsub = p.add_subparsers(dest="bag_command", metavar="ACTION", required=True)
    i = command(
        bsub, "inspect", "print a bag's topics, message counts, duration and episodes",
        "vla-accel bag inspect artifacts/bags/transfer_cube",
    )
    i.add_argument("path", help="bag directory, or a single .mcap / .db3 file")
    i.set_defaults(func=_inspect)

    e = command(
        bsub, "export-lerobot", "write bags as a LeRobotDataset v3.0 (LeRobot's own writer, in LeRobot's Python)",
        "vla-accel bag export-lerobot data/tc0 data/tc50 --out datasets/tc --python ~/lerobot-venv/bin/python",
        details="One row per observation the policy node would make (its cameras, joint state and freshness limits), "
        "the action recorded for it, the episode's instruction as task; one dataset episode per episode marker. "
        "The dataset's fps is the observations' rate. The whole loop, bags to a LeRobot policy and back: "
        "docs/lerobot-loop.md.",
    )  # fmt: skip
    e.add_argument("bags", nargs="+", metavar="BAG", help="rosbag2 bags (directories or .mcap / .db3 files), in order")
    e.add_argument("--out", type=Path, required=True, help="dataset directory to create (must not exist)")
    e.add_argument(
        "--python", default=os.environ.get("LEROBOT_PYTHON", ""), metavar="PY",
        help="the Python of an environment with lerobot 0.4.4 (default: $LEROBOT_PYTHON)",
    )  # fmt: skip
    e.add_argument("--cameras", default="", help="comma-separated ROS camera names (default: every camera of the first bag)")
    e.add_argument("--fps", type=int, default=0, help="frames per second (0: the observations' rate; a value must match it)")
    e.add_argument("--video", action="store_true", help="AV1 videos (LeRobot's default, lossy; default: PNG images)")
    e.add_argument("--task", default="", help="task of episodes without an instruction message")
    e.add_argument("--repo-id", default="", help="the dataset's repo id (default local/<out directory name>)")
    e.add_argument("--skip-partial", action="store_true", help="leave out episodes the recording ended inside")
    e.add_argument(
        "--params", type=Path, default=None,
        help="the graph's parameter file: joint order, gripper maps, freshness limits (default: config/aloha.yaml)",
    )  # fmt: skip
    e.add_argument("--json", type=Path, default=None, help="also write the summary as JSON here")
    e.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    e.set_defaults(func=_export_lerobot)


def _inspect(args: argparse.Namespace) -> int:
    from vla_accel_ros.io.bag_file import bag_size_bytes
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.io.episodes import summary

    with BagReader(args.path) as bag:
        print(summary(bag))
    print(f"size:      {bag_size_bytes(args.path) / 2**20:.1f} MiB")
    return 0


def _export_lerobot(args: argparse.Namespace) -> int:
    from vla_accel_ros.io.lerobot_export import ExportConfig, export_lerobot, node_rule

    robot, sync = node_rule(args.params)
    cfg = ExportConfig(
        bags=tuple(str(b) for b in args.bags), out=str(args.out), python=args.python,
        cameras=tuple(c.strip() for c in args.cameras.split(",") if c.strip()), fps=args.fps, video=args.video,
        task=args.task, repo_id=args.repo_id, skip_partial=args.skip_partial, robot=robot, sync=sync,
    )  # fmt: skip
    if args.json is not None and args.json.exists():
        raise ConfigError(f"--json {args.json} exists already")
    summary = export_lerobot(cfg, progress=not args.no_progress)
    left = summary["left_out"]
    print(f"{summary['out']}: LeRobotDataset {summary['codebase_version']} (lerobot {summary['lerobot']} reads it back), "
          f"{summary['episodes']} episodes, {summary['frames']} frames at {summary['fps']} fps, cameras "
          f"{', '.join(summary['cameras'])} as {summary['images']}; {summary['bytes'] / 2**20:.1f} MiB in "
          f"{summary['seconds']:.1f} s")  # fmt: skip
    print(f"left out: rejected by the observation rule {left['rejected_by_rule'] or 0}, before the first command "
          f"{left['before_first_action']}, before the first episode marker {left['before_first_marker']}, partial "
          f"episodes {len(left['partial_episodes'])}; gaps over 1.5 frames: {summary['gaps']}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
