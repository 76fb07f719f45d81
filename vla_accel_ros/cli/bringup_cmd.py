"""``vla-accel bringup``: start the ROS graph from the parameter file without launch_ros.

The same description (``vla_accel_ros.ros.graph.describe``) and the same YAML as
``ros2 launch vla_accel_ros aloha.launch.py``, and by default the same process layout: each
node in its own process (``vla_accel_ros.ros.processes``), observations camera -> policy on the
topic, so inference never holds the control loop's interpreter. ``--one-process`` runs every
node on one MultiThreadedExecutor in this process instead (observations through a shared
latest-only buffer). ``--duration S`` runs S seconds and prints what flowed, with the control
loop's rate and jitter percentiles.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "bringup", "start the camera, policy and controller nodes (no launch_ros needed)",
        "vla-accel bringup --bundle bundles/transfer_cube-flow --sim --duration 20",
        details="Starts the graph of launch/aloha.launch.py from the same parameter file, each node in its "
        "own process as ros2 launch does. Needs rclpy (the ROS 2 wheels `make setup` installs, or a sourced ROS install).",
    )
    p.add_argument("--params", type=Path, metavar="F", help="ROS 2 parameter file (default: config/aloha.yaml)")
    p.add_argument("--bundle", type=Path, metavar="B", help="model bundle for the policy node")
    p.add_argument(
        "--sim", action="store_true",
        help="also start the simulated ALOHA (aloha_sim_node); every node then runs on its /clock (sim time)",
    )  # fmt: skip
    p.add_argument(
        "--record", type=Path, metavar="BAG",
        help="also record the graph's topics (the aloha.launch.py record:=true list) to a new MCAP bag",
    )  # fmt: skip
    p.add_argument(
        "--synthetic-camera", action="store_true",
        help="also start a synthetic camera + perfect arm (moving_arm_frames, joint states that follow the commands)",
    )  # fmt: skip
    p.add_argument("--duration", type=float, metavar="S",
                   help="run S seconds of closed loop (counted from the policy's readiness), then stop and print a summary")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="give up when the policy is not ready after S seconds (loading + parity gate)")
    p.add_argument("--namespace", default="", help="namespace of the graph's nodes and topics")
    p.add_argument("--use-sim-time", action="store_true", help="nodes follow /clock")
    p.add_argument("--one-process", action="store_true",
                   help="every node in this process on one executor (inference then competes with the control "
                   "loop for the interpreter: lower loop rate, more jitter)")
    p.add_argument("--topic-observations", action="store_true",
                   help="with --one-process: observations camera -> policy over the Observation topic instead of in memory")
    p.add_argument("--domain-id", type=int, help="ROS_DOMAIN_ID for this graph (default: the environment's)")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vla_accel_ros.ros.graph import describe  # noqa: PLC0415 - no rclpy needed to describe

    graph = describe(
        params_file=args.params,
        bundle=args.bundle,
        sim=args.sim,
        synthetic_camera=args.synthetic_camera,
        namespace=args.namespace,
        use_sim_time=args.use_sim_time,
        shared_observations=args.one_process and not args.topic_observations,
    )
    if args.record is not None and args.record.exists():
        print(f"vla-accel bringup: {args.record} exists already; rosbag2 bags are never overwritten")
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"vla-accel bringup: --json {args.json}: directory {args.json.parent} does not exist")
        return 2
    try:
        from vla_accel_ros.ros import bringup, processes  # noqa: PLC0415 - imports rclpy
        from vla_accel_ros.ros.spin import stop_on_sigint  # noqa: PLC0415
    except ImportError as e:
        print(f"vla-accel bringup needs rclpy ({e}); run `make setup` or source a ROS 2 install")
        return 2
    for note in graph.notes:
        print(f"note: {note}")
    layout = "one process" if args.one_process else "one process per node"
    print(f"parameters {graph.params_file}; nodes ({layout}): {', '.join(n.name for n in graph.nodes)}")
    stop_on_sigint()  # Ctrl-C ends the graph in order, also when started in a script's background
    running = (bringup if args.one_process else processes).start(graph, domain_id=args.domain_id)
    summary: dict[str, object] = {}
    code = 0
    try:
        if args.record is not None:
            _start_recorder(running, args.record)
        t0 = time.monotonic()
        status = running.wait_ready(args.startup_timeout)
        if status:
            print(f"vla-accel bringup: {status}")
            code = 1
        else:
            print(f"policy ready after {time.monotonic() - t0:.1f} s; closed loop running")
            running.reset_stats()  # the summary describes the closed loop, not the start-up
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
                ended = running.exited()
                if ended:
                    print(f"vla-accel bringup: {ended}")
                    code = 1
                    break
    except KeyboardInterrupt:
        pass
    finally:
        summary = running.stop()  # every node closed first: the recorder has flushed what it counts
    print(bringup.format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return code


def _start_recorder(running, out: Path) -> None:
    """The graph's recording list into ``out``, on the graph's clock, as one more node."""
    from vla_accel_ros.ros.graph import RECORDER, RECORDER_MODULE  # noqa: PLC0415

    g = running.graph
    running.add_recorder(RECORDER, RECORDER_MODULE, "RecorderNode", g.recorder_parameters(out))
    print(f"recording {len(g.resolved_record_topics())} topics to {out}")
