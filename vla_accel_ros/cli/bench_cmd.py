"""``vla-accel bench <kind>``: side-by-side benchmarks. Kinds register in ``BENCHES``."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from vla_accel_ros.cli import command
from vla_accel_ros.cli.options import add_override_flags, check_output, overrides

BENCHES = ("vla_accel_ros.cli.bench_cmd", "vla_accel_ros.cli.cache_bench_cmd", "vla_accel_ros.cli.sched_cmd")


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bench", "benchmarks (ratios measured side by side in one run)")
    bsub = p.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    for name in BENCHES:
        importlib.import_module(name).register_bench(bsub)


def register_bench(bsub: argparse._SubParsersAction) -> None:
    e = command(
        bsub, "engine", "time the engine against transformers, and a partial recompute against a full prefill",
        "vla-accel bench engine --bundle bundles/transfer_cube-flow --repeats 5",
    )
    e.add_argument("--bundle", required=True)
    e.add_argument("--repeats", type=int, default=5)
    e.add_argument("--reuse", default="0.4,0.6,0.8", help="image-token reuse fractions to time")
    e.add_argument("--json", type=Path, help="also write the rows as JSON here")
    e.set_defaults(func=_engine)
    lr = command(
        bsub, "lerobot", "LeRobot's own SmolVLA, pi0 or pi0.5 vs ours on a bag's frames (same weights, noise, threads)",
        "vla-accel bench lerobot --lerobot /tmp/smolvla-full/policy --python /tmp/lerobot-venv/bin/python "
        "--bag artifacts/bags/cube3 --threads 2 --modes baseline,cache+prune@auto --report artifacts/reports/lerobot",
        details="Runs LeRobot's policy in the Python given by --python (an environment with lerobot, e.g. "
        "../shared/tools/lerobot-reference/install_lerobot_venv.sh) and this package's modes on the same frames.",
    )  # fmt: skip
    lr.add_argument("--lerobot", type=Path, required=True, metavar="DIR", help="LeRobot's saved SmolVLA, pi0 or pi05 policy directory")
    lr.add_argument("--vlm", type=Path, default=None, metavar="DIR", help="the SmolVLM directory (default: as the checkpoint names it)")
    lr.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                    help="pi0, pi05: PaliGemma's tokenizer directory (LeRobot loads it by hub name)")
    lr.add_argument("--python", type=Path, required=True, metavar="PY", help="a Python whose environment has lerobot")
    lr.add_argument("--bag", type=Path, required=True, help="rosbag2 bag with the bundle's cameras and joint states")
    lr.add_argument("--modes", default="baseline", help="our modes, as for replay (default %(default)s)")
    lr.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default %(default)s)")
    lr.add_argument("--max-frames", type=int, default=10, help="timed frames (default %(default)s)")
    lr.add_argument("--warmup", type=int, default=1, help="untimed frames first (default %(default)s)")
    lr.add_argument("--bundle", type=Path, default=None, help="the checkpoint already imported (default: import it into REPORT/bundle)")
    lr.add_argument("--no-parity", action="store_true", help="skip the start-up gate of each mode")
    lr.add_argument("--sequential", action="store_true",
                    help="ours on every frame first, then (our weights freed) LeRobot: when both models do not fit in memory "
                    "together; the calls are then not interleaved")  # fmt: skip
    add_override_flags(lr, "cache", "prune", "precision")
    lr.add_argument("--report", type=Path, required=True, help="directory for report.json, report.md, latency.png")
    lr.set_defaults(func=_lerobot)
    o = command(
        bsub, "outcomes", "task stages reached and paired comparisons of eval reports' modes (no simulation)",
        "vla-accel bench outcomes C=evC_a,evC_b F=evF_a,evF_b --reference baseline",
        details="Reads eval reports (report.json or its directory) and prints, per mode, the share of episodes that "
        "reached each task stage and, against the reference mode on the same seeds, the seeds only one of them "
        "reached it on with the exact McNemar p-value. A,B joins reports of one evaluation run in parts (halves of "
        "the seeds in parallel processes); several REPORTs (other bundles, checkpoints, settings on the same seeds) "
        "are compared as REPORT:MODE against the first one's reference mode; NAME=REPORT[,PART...] names them NAME "
        "in the tables instead. --by y adds each mode's stages by where the object started (the seed places it): "
        "a policy that reaches where the object usually is scores in the middle bins only. Works on reports written "
        "before these fields existed.",
    )  # fmt: skip
    o.add_argument("reports", nargs="+", metavar="[NAME=]REPORT[,PART...]",
                   help="eval report directory or its report.json; comma-joined: the parts of one evaluation; "
                   "NAME=: its name in the tables (default: the argument as given)")
    o.add_argument("--reference", default="baseline", metavar="MODE",
                   help="the (first report's) mode every other is paired with, e.g. lerobot (default baseline)")
    o.add_argument("--by", choices=("x", "y"), default=None,
                   help="also tabulate the stages by the object's start coordinate (the cube, the peg), in --bins "
                   "equal bins of the range the simulator draws it from")  # fmt: skip
    o.add_argument("--bins", type=int, default=4, help="--by: number of bins (default 4)")
    o.add_argument("--json", type=Path, help="also write the report with these fields added here")
    o.set_defaults(func=_outcomes)


def parse_fractions(text: str, flag: str = "--reuse") -> tuple[float, ...]:
    """``0.4,0.6`` -> (0.4, 0.6), each in (0, 1), or a ConfigError naming the value."""
    from vla_accel_ros.core.errors import ConfigError

    out = []
    for item in (f.strip() for f in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: {item!r} is not a number; give fractions in (0, 1), e.g. 0.4,0.6,0.8") from None
        if not 0.0 < value < 1.0:
            raise ConfigError(f"{flag} {text!r}: {value:g} is not a fraction in (0, 1)")
        out.append(value)
    if not out:
        raise ConfigError(f"{flag} {text!r} names no fraction; e.g. 0.4,0.6,0.8")
    return tuple(out)


def _engine(args: argparse.Namespace) -> int:
    from vla_accel_ros.core.errors import ConfigError

    fractions = parse_fractions(args.reuse)
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    check_output(args.json)
    import torch

    from vla_accel_ros.bench.engine_bench import format_table, run_engine_bench
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(args.bundle, PolicyConfig(accel="none"))
    with progress_bar(None, "bench engine", "comparison") as bar:
        pairs = run_engine_bench(policy, repeats=args.repeats, fractions=fractions, on_pair=lambda _p: bar.update(1))
    print(f"bundle {args.bundle} ({policy.spec.family}), torch threads {torch.get_num_threads()}, "
          f"{args.repeats} interleaved repeats after warm-up")
    print(format_table(pairs))
    if args.json:
        args.json.write_text(json.dumps([p.row() for p in pairs], indent=2) + "\n")
    return 0


def _outcomes(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.eval_report import paired_rows, position_rows, stage_rows
    from vla_accel_ros.bench.outcomes import STAGES, join_parts, side_by_side, with_outcomes
    from vla_accel_ros.bench.report import _text_table, json_safe
    from vla_accel_ros.core.errors import ConfigError

    check_output(args.json)
    if args.bins < 1:
        raise ConfigError(f"--bins must be >= 1, got {args.bins}")
    evaluations = []
    for entry in args.reports:
        label, named, paths = entry.partition("=")
        # NAME=...: a name without a path separator or comma, so that a path holding "=" still reads as a path
        if not (named and label and not any(c in label for c in "/,")):
            label, paths = entry, entry
        parts = []
        for part in (p for p in paths.split(",") if p):
            path = Path(part) / "report.json" if Path(part).is_dir() else Path(part)
            if not path.is_file():
                raise ConfigError(f"report {part}: no report.json there")
            parts.append(json.loads(path.read_text()))
        if not parts:
            raise ConfigError(f"report {entry!r}: names no report")
        if label in (name for name, _ in evaluations):
            raise ConfigError(f"report {entry!r}: the name {label!r} is given twice")
        evaluations.append((label, parts))
    try:
        joined = [(label, join_parts(parts)) for label, parts in evaluations]
        if len(joined) == 1:
            result, reference = with_outcomes(joined[0][1], baseline=args.reference), args.reference
        else:
            result = side_by_side(joined, reference=args.reference)
            reference = result["mode_order"][0]
    except (ValueError, KeyError) as e:
        raise ConfigError(f"reports {' '.join(args.reports)}: {e}") from None
    print(_text_table(*stage_rows(result)))
    if len(joined) > 1 or args.reference != "baseline":
        print(f"against {reference}, seed by seed: seeds only it reached a stage on / only the mode (McNemar p)")
    print(_text_table(*paired_rows(result)))
    if args.by:
        result = {**result, "by_position": _by_position(result, args.by, args.bins)}
        print(f"by where the object started ({args.by}), stages reached:")
        print(_text_table(*position_rows(result["by_position"]["modes"], STAGES[result["task"]], args.by)))
    if args.json:
        args.json.write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    return 0


def _by_position(result: dict, axis: str, bins: int) -> dict:
    """bench outcomes --by: each mode's stages in equal bins of the simulator's range of the
    object's start along ``axis``; the positions come from the seeds, as the simulator draws them."""
    import numpy as np

    from vla_accel_ros.bench.outcomes import by_position
    from vla_accel_ros.sim.aloha import TASKS, sample_object_qpos

    task = result["task"]
    lo, hi = TASKS[task].object_range[axis]
    edges = [float(v) for v in np.linspace(lo, hi, bins + 1)]
    seeds = {e["seed"] for m in result["modes"].values() for e in m["per_episode"]}
    col = "xy".index(axis)
    position = {s: float(sample_object_qpos(task, s)[col]) for s in seeds}
    return {"axis": axis, "edges": edges, "modes": by_position(result, position, edges)}


def _lerobot(args: argparse.Namespace) -> int:
    import sys

    from vla_accel_ros.bench.lerobot_bench import LeRobotBenchConfig, run_lerobot_bench
    from vla_accel_ros.bench.report import BAG_FRAMES, precision_lines

    cfg = LeRobotBenchConfig(
        lerobot=args.lerobot, python=args.python, bag=args.bag, report=args.report, vlm=args.vlm, tokenizer=args.tokenizer,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), threads=args.threads,
        max_frames=args.max_frames, warmup=args.warmup, bundle=args.bundle, parity_check=not args.no_parity, sequential=args.sequential,
        cache_overrides=overrides(args, "cache"), prune_overrides=overrides(args, "prune"),
        precision_overrides=overrides(args, "precision"),
    )  # fmt: skip
    result = run_lerobot_bench(cfg, command=" ".join(["vla-accel", *sys.argv[1:]]))
    le = result["lerobot"]["latency_ms"]["p50"]
    print(f"LeRobot p50 {le:.0f} ms; " + "; ".join(
        f"{n} p50 {m['latency_ms']['p50']:.0f} ms ({m['speedup_vs_lerobot']:.2f}x, max dev vs LeRobot "
        f"{m['deviation_vs_lerobot']['max_over_std']:.2g} std)" for n, m in result["modes"].items()))  # fmt: skip
    for line in precision_lines(result, BAG_FRAMES):
        print(line)
    print(f"report: {args.report / 'report.md'}")
    return 0
