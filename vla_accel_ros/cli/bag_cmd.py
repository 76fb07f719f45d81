"""``vla-accel bag inspect``: topics, counts, rates, duration and episodes of a rosbag2 bag."""

from __future__ import annotations

import argparse

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bag", "rosbag2 bags (MCAP, sqlite3) without ROS")
    bsub = p.add_subparsers(dest="bag_command", metavar="ACTION", required=True)
    i = command(
        bsub, "inspect", "print a bag's topics, message counts, duration and episodes",
        "vla-accel bag inspect artifacts/bags/transfer_cube",
    )
    i.add_argument("path", help="bag directory, or a single .mcap / .db3 file")
    i.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from vla_accel_ros.io.bag_file import bag_size_bytes
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.io.episodes import summary

    with BagReader(args.path) as bag:
        print(summary(bag))
    print(f"size:      {bag_size_bytes(args.path) / 2**20:.1f} MiB")
    return 0
