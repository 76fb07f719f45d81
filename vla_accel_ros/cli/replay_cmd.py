"""``vla-accel replay``: a recorded rosbag through a policy in several modes, side by side."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from vla_accel_ros.cli import command
from vla_accel_ros.cli.options import add_override_flags, overrides


def register(sub: argparse._SubParsersAction) -> None:
    # No package imports here: every `vla-accel` call registers this (torch loads only on use).
    p = command(
        sub, "replay", "benchmark modes (baseline, cache, transformers, ...) on a recorded bag: latency, speedup, deviation",
        "vla-accel replay artifacts/bags/transfer_cube --bundle bundles/transfer_cube-flow "
        "--modes baseline,cache,cache+prune@auto --report R",
        details="Feeds a bag's frames through the policy in every mode, interleaved per frame, and writes "
        "report.json, report.md and PNG plots into --report.",
    )
    p.add_argument("bag", help="rosbag2 bag directory, or a single .mcap / .db3 file")
    p.add_argument("--bundle", required=True, help="model bundle directory")
    p.add_argument(
        "--modes", default="baseline,cache",
        help="comma-separated modes run side by side (baseline is added when missing): baseline, transformers, "
        "cache, cache-<preset> for the presets of `bench cache` (max-reuse, public-code, entropy, paper-rule, vision, "
        "vision-only), prune, cache+prune, ...; a suffix @<precision>[+<backend>][+compile] runs a mode at a "
        "precision preset (fp32, bf16, int8, hybrid, auto), its vision tower on ONNX Runtime or OpenVINO (onnxruntime, openvino) and/or compiled, "
        "e.g. baseline@int8, cache+prune@auto+compile, baseline@compile, baseline@auto+openvino",
    )  # fmt: skip
    p.add_argument("--report", required=True, type=Path, help="directory for report.json, report.md and the plots")
    p.add_argument("--warmup", type=int, default=2, help="first frames processed but left out of the statistics")
    p.add_argument("--max-frames", type=int, default=0, help="timed frames at most (0: the whole bag)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-frame flow noise (shared by all modes)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--flow-steps", type=int, default=0, help="flow: Euler steps per chunk (0: the bundle's)")
    add_override_flags(p, "cache", "prune")
    p.add_argument(
        "--sync", action="append", default=[], metavar="FIELD=VALUE",
        help="override a limit of the observation rule (SyncConfig: max_age_ms, max_skew_ms, max_future_ms, "
        "max_state_age_ms, image_size; default: the camera and policy nodes' values; the cameras are the bundle's), "
        "e.g. --sync max_skew_ms=100",
    )  # fmt: skip
    add_override_flags(p, "precision")
    p.add_argument("--pipeline-depth", type=int, default=0, help="pipelined modes: frames in flight (0: derived)")
    p.add_argument("--pipeline-steps", type=int, default=0, help="pipelined modes: decode steps per frame (0: derived)")
    p.add_argument("--no-parity", action="store_true", help="skip the parity gate of the engine modes")
    p.add_argument("--no-plots", action="store_true", help="write report.json and report.md only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    p.set_defaults(func=_replay)


def command_line(args: argparse.Namespace) -> str:
    """The run as a command (canonical form: every option spelled out), for the report."""
    argv = ["vla-accel", "replay", str(args.bag), "--bundle", str(args.bundle), "--modes", args.modes,
            "--report", str(args.report), "--warmup", str(args.warmup), "--seed", str(args.seed)]  # fmt: skip
    for flag, value, default in (
        ("--max-frames", args.max_frames, 0), ("--threads", args.threads, 0), ("--flow-steps", args.flow_steps, 0),
        ("--pipeline-depth", args.pipeline_depth, 0), ("--pipeline-steps", args.pipeline_steps, 0),
    ):  # fmt: skip
        if value != default:
            argv += [flag, str(value)]
    overrides = (("--cache", args.cache), ("--prune", args.prune), ("--precision", args.precision), ("--sync", args.sync))
    for flag, items in overrides:
        for item in items:
            argv += [flag, item]
    argv += [f for f, on in (("--no-parity", args.no_parity), ("--no-plots", args.no_plots)) if on]
    return shlex.join(argv)


def _replay(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.replay import ReplayConfig, parse_modes, run_replay
    from vla_accel_ros.bench.report import check_report_dir, headline_text, write_report

    cfg = ReplayConfig(
        bag=Path(args.bag), bundle=Path(args.bundle), modes=tuple(parse_modes(args.modes)), warmup=args.warmup,
        max_frames=args.max_frames, seed=args.seed, parity_check=not args.no_parity, num_threads=args.threads,
        flow_steps=args.flow_steps, cache_overrides=overrides(args, "cache"), prune_overrides=overrides(args, "prune"),
        precision_overrides=overrides(args, "precision"), sync_overrides=overrides(args, "sync"),
        pipeline_depth=args.pipeline_depth, pipeline_steps=args.pipeline_steps,
    )  # fmt: skip
    check_report_dir(args.report)
    result = run_replay(cfg, progress=not args.no_progress, command=command_line(args))
    paths = write_report(result, args.report, plots=not args.no_plots)
    print(headline_text(result))
    print(f"report: {', '.join(str(p) for p in paths.values())}")
    return 0
