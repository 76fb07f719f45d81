"""The ``vla-accel`` command line. Each subcommand lives in its own module and registers
itself through ``register(subparsers)``; add new modules to ``COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import sys

from vla_accel_ros import __version__
from vla_accel_ros.core.errors import VlaAccelError

COMMANDS = (
    "vla_accel_ros.cli.bundle_cmd",
    "vla_accel_ros.cli.parity_cmd",
    "vla_accel_ros.cli.bench_cmd",
    "vla_accel_ros.cli.demo_cmd",
    "vla_accel_ros.cli.sim_cmd",
    "vla_accel_ros.cli.bag_cmd",
    "vla_accel_ros.cli.bringup_cmd",
    "vla_accel_ros.cli.replay_cmd",
    "vla_accel_ros.cli.record_cmd",
    "vla_accel_ros.cli.train_cmd",
    "vla_accel_ros.cli.eval_cmd",
    "vla_accel_ros.cli.export_cmd",
    "vla_accel_ros.cli.calibrate_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vla-accel", description="Fast VLA policies for ROS 2.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except VlaAccelError as e:  # expected failures: say what is wrong, no traceback
        print(f"vla-accel: error: {e}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
