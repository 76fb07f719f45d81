"""The ``vla-accel`` command line. Each subcommand lives in its own module and registers
itself through ``register(subparsers)``; add new modules to ``COMMANDS``. Every command is made
by :func:`command`, so its ``--help`` starts with what it does in one line and ends with an
example (``test/test_cli_help.py`` holds every command to it)."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

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


def command(
    sub: argparse._SubParsersAction, name: str, summary: str, example: str | None = None, details: str = ""
) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` is its one line (in the parent's list and atop its ``--help``),
    ``details`` a paragraph after it, ``example`` one command line shown at the end (a group
    of subcommands, e.g. ``bundle``, has none: its subcommands have theirs)."""
    description = summary if not details else f"{summary}\n\n{textwrap.fill(details, 100)}"
    epilog = None if example is None else "example:\n  " + example
    return sub.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vla-accel", description="Fast VLA policies for ROS 2.",
        epilog="example:\n  vla-accel replay BAG --bundle bundles/transfer_cube-flow --modes baseline,cache --report R\n"
        "`vla-accel COMMAND --help` says what a command does, with an example.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
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
