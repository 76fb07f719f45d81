"""``vla-accel record``: topics of a live ROS graph into a rosbag2 bag (MCAP by default).

The default topics are the graph's recording list (``vla_accel_ros.ros.graph.record_topics``,
the list ``aloha.launch.py record:=true`` hands to ``ros2 bag record``), which holds the
layout ``vla-accel sim record`` writes, so ``vla-accel replay`` reads the result.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "record", "record topics of a running ROS graph to a rosbag2 bag (MCAP; no rosbag2 needed)",
        "vla-accel record --out artifacts/bags/live --duration 20",
        details="Subscribes to the topics of a live graph (the robot or `vla-accel bringup --sim`) and writes "
        "them to a new bag. Needs rclpy. Stop with --duration or Ctrl-C.",
    )
    p.add_argument("--out", type=Path, required=True, metavar="BAG", help="bag directory to create (must not exist)")
    p.add_argument(
        "--topics", action="append", default=[], metavar="T[,T...]",
        help="topics to record (repeatable, comma-separated); default: the graph's recording list",
    )  # fmt: skip
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (wall clock)")
    p.add_argument("--params", type=Path, metavar="F", help="parameter file the default topics come from (default: config/aloha.yaml)")
    p.add_argument("--bundle", type=Path, metavar="B", help="bundle whose cameras the graph runs with (default topics)")
    p.add_argument("--namespace", default="", help="namespace of the graph")
    p.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="sqlite3 for Humble tools")
    p.add_argument("--no-compress", action="store_true", help="mcap chunks uncompressed")
    p.add_argument("--clock", choices=("auto", "sim", "wall"), default="auto",
                   help="receive times on sim time, the system clock, or sim time once /clock appears (auto)")  # fmt: skip
    p.add_argument("--domain-id", type=int, help="ROS_DOMAIN_ID of the graph (default: the environment's)")
    p.set_defaults(func=run)


def topics_for(args: argparse.Namespace) -> list[str]:
    """--topics, else the recording list of the graph described by --params / --bundle / --namespace."""
    given = [t.strip() for item in args.topics for t in item.split(",") if t.strip()]
    if given:
        return given
    from vla_accel_ros.ros.graph import describe  # noqa: PLC0415 - no rclpy needed to describe

    return describe(params_file=args.params, bundle=args.bundle, namespace=args.namespace).resolved_record_topics()


def run(args: argparse.Namespace) -> int:
    from vla_accel_ros.core.errors import BagError  # noqa: PLC0415

    if args.out.exists():
        raise BagError(f"{args.out} exists already; rosbag2 bags are never overwritten")
    topics = topics_for(args)
    try:
        import rclpy  # noqa: PLC0415
        from rclpy.context import Context  # noqa: PLC0415
        from rclpy.executors import ExternalShutdownException  # noqa: PLC0415
        from rclpy.parameter import Parameter  # noqa: PLC0415

        from vla_accel_ros.ros.executors import make_executor  # noqa: PLC0415
        from vla_accel_ros.ros.spin import stop_on_sigint  # noqa: PLC0415
        from vla_accel_ros.ros.recorder import RecorderNode  # noqa: PLC0415
    except ImportError as e:
        print(f"vla-accel record needs rclpy ({e}); run `make setup` or source a ROS 2 install")
        return 2
    overrides = [
        Parameter("out", value=str(args.out)),
        Parameter("topics", value=topics),
        Parameter("storage", value=args.storage),
        Parameter("compress", value=args.storage == "mcap" and not args.no_compress),
        Parameter("clock", value=args.clock),
    ]
    stop_on_sigint()  # Ctrl-C ends the recording, also when started in a script's background
    context = Context()
    rclpy.init(context=context, domain_id=args.domain_id)
    node = executor = None
    built: list = []
    counts: dict[str, int] = {}
    missing: list[str] = []
    why: dict[str, str] = {}
    try:
        kwargs = dict(context=context, parameter_overrides=overrides)
        if args.namespace:
            kwargs["namespace"] = args.namespace
        # The node hands itself over before its constructor returns: a Ctrl-C landing between
        # that return and the assignment left an open bag nobody closed (seen once in the suite).
        node = RecorderNode(**kwargs, on_built=built.append)
        executor = make_executor(1, context)
        executor.add_node(node)
        print(f"recording {len(topics)} topics to {args.out} ({args.storage}); " + ("Ctrl-C stops" if args.duration is None else f"{args.duration:g} s"))
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while context.ok() and (deadline is None or time.monotonic() < deadline):
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass  # Ctrl-C, also while it starts: the bag is closed below
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the bag's closing short
        if node is None and built:
            node = built[0]
        if node is not None:
            node.close()
            counts, missing, why = dict(node.counts), node.missing(), dict(node.unrecordable)
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown(context=context)
    for topic in topics:
        if counts.get(topic):
            print(f"  {topic:<48} {counts[topic]:>7}")
    if missing:
        print(f"nothing from {len(missing)} topic(s): " + ", ".join(f"{t}{' (' + why[t] + ')' if t in why else ''}" for t in missing))
    total = sum(counts.values())
    print(f"recorded {total} messages on {len(counts)} topics to {args.out}")
    if not total:
        print("nothing was recorded: is the graph running on this ROS_DOMAIN_ID (and discovery range)?")
        return 1
    return 0
