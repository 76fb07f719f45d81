"""``vla-accel demo``: the main job (``make demo``).

1. takes the trained bundles the package ships (``bundles/transfer_cube-{ar,flow}``), or with
   ``--size tiny|small`` creates random-weight demo bundles (speed benchmarks) when missing;
2. records a short scripted transfer_cube episode from the ALOHA simulator when missing;
3. replays that bag through both families in every mode side by side (the replay
   benchmark: latency p50/p95/p99 with selection included, speedup, frames/s, deviation,
   reuse, kept tokens, FLOPs); with the trained bundles also the reasoning bundle
   (``transfer_cube-ar-reasoning``) regenerating its reasoning against MEMO-VLM reuse;
4. evaluates the flow bundle in closed loop in the simulator (``vla-accel eval``: success per
   mode on the same seeds) for a few episodes;
5. runs the ROS graph closed loop (simulator + camera + policy + controller nodes,
   ``bringup --sim``) for a short while;
6. prints the headline figures and where the reports are.

Everything lands under ``--workdir`` (default ``artifacts/``); a second run reuses the
bundles and the bag.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from vla_accel_ros.models.family import get_family
from vla_accel_ros.cli import command

DEMO_MODES = "transformers,baseline,cache,cache-max-reuse,prune,cache+prune"
DRAFT_DEMO_MODES = ("draft", "cache+prune+draft")  # added for a token-decoding bundle (ar) with the default --modes
EVAL_MODES = "baseline,cache,cache+prune"


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "demo", "the main job: bundles, sim bag, replay benchmark, closed loop (writes artifacts/)", "vla-accel demo")
    p.add_argument(
        "--size", choices=("trained", "tiny", "small"), default="trained",
        help="trained: the shipped bundles/transfer_cube-{ar,flow,ar-reasoning}; tiny / small: random-weight demo bundles",
    )  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("artifacts"), help="where bundles, bags and reports go")
    p.add_argument("--steps", type=int, default=40, help="simulated steps in the demo bag (50 Hz)")
    p.add_argument("--modes", default=DEMO_MODES, help="replay modes, side by side")
    p.add_argument("--eval-episodes", type=int, default=3, help="closed-loop eval episodes per mode (0: skip)")
    p.add_argument("--eval-modes", default=EVAL_MODES, help="closed-loop eval modes")
    p.add_argument("--loop-seconds", type=float, default=20.0, help="ROS graph closed-loop duration (0: skip)")
    p.add_argument("--loop-family", choices=("ar", "flow"), default="flow", help="bundle family driving the closed loop")
    p.set_defaults(func=_run)


def ensure_demo_bundle(workdir: Path, family: str, size: str) -> Path:
    from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, shipped_bundle
    from vla_accel_ros.models.factory import create_demo_bundle

    if size == "trained":
        return shipped_bundle(f"transfer_cube-{family}")
    path = workdir / "bundles" / f"{family}-{size}"
    if not ((path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()):
        print(f"[demo] creating {family} bundle {path}", flush=True)
        create_demo_bundle(family, size, path)
    return path


def _vla_accel(*args: str) -> list[str]:
    return [sys.executable, "-m", "vla_accel_ros.cli", *args]


def ensure_demo_bag(workdir: Path, steps: int) -> Path:
    bag = workdir / "bags" / f"transfer_cube-{steps}"
    if not (bag / "metadata.yaml").is_file():
        print(f"[demo] recording {steps} scripted transfer_cube steps from the simulator into {bag}", flush=True)
        bag.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            _vla_accel("sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", str(steps),
                       "--cameras", "top", "--out", str(bag)),
            check=True, env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")},
        )  # fmt: skip
    return bag


def _run(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.replay import ReplayConfig, parse_modes, run_replay
    from vla_accel_ros.bench.report import headline_text, write_report

    from vla_accel_ros.core.errors import ConfigError

    modes = tuple(parse_modes(args.modes))  # before gigabytes of bundles are written
    if args.steps < 1 or args.loop_seconds < 0:
        raise ConfigError(f"--steps must be >= 1 and --loop-seconds >= 0, got {args.steps} and {args.loop_seconds}")
    work = args.workdir
    parse_modes(args.modes)  # a bad mode fails before anything is written
    parse_modes(args.eval_modes)
    bundles = {fam: ensure_demo_bundle(work, fam, args.size) for fam in ("ar", "flow")}
    bag = ensure_demo_bag(work, args.steps)

    reports = {}
    for family, bundle in bundles.items():
        drafts = get_family(family).token_actions and args.modes == DEMO_MODES
        fam_modes = modes + DRAFT_DEMO_MODES if drafts else modes
        print(f"\n[demo] replay benchmark: {family} bundle, modes {','.join(fam_modes)}", flush=True)
        cfg = ReplayConfig(bag=bag, bundle=bundle, modes=fam_modes)
        result = run_replay(cfg, progress=True, command=f"vla-accel demo ({family})")
        out = work / "reports" / f"replay-{family}-{args.size}"
        write_report(result, out)
        reports[family] = out
        print(headline_text(result))

    if args.size == "trained":  # the shipped reasoning bundle: MEMO-VLM reuse against full regeneration
        from vla_accel_ros.core.bundle import shipped_bundle

        memo_modes = ("baseline", "memo", "memo-exact", "memo-exact+draft")
        print(f"\n[demo] replay benchmark: reasoning bundle, modes {','.join(memo_modes)}", flush=True)
        cfg = ReplayConfig(bag=bag, bundle=shipped_bundle("transfer_cube-ar-reasoning"), modes=memo_modes)
        result = run_replay(cfg, progress=True, command="vla-accel demo (reasoning)")
        out = work / "reports" / "replay-ar-reasoning"
        write_report(result, out)
        reports["ar-reasoning"] = out
        print(headline_text(result))
        for name in memo_modes:
            m = result["modes"][name]
            print(f"  {name:<16} reasoning reused {100 * m['reasoning_reused_fraction']['mean']:5.1f}%, "
                  f"agreement with full regeneration {100 * m['reasoning_agreement_vs_baseline']['mean']:6.2f}%")

    evaluation = None
    if args.eval_episodes > 0:
        from vla_accel_ros.bench.eval import EvalConfig, run_eval
        from vla_accel_ros.bench.eval_report import headline_text as eval_headline
        from vla_accel_ros.bench.eval_report import write_report as write_eval

        print(f"\n[demo] closed-loop evaluation in the simulator: flow bundle, {args.eval_episodes} episodes per mode, "
              f"modes {args.eval_modes}", flush=True)  # fmt: skip
        cfg = EvalConfig(bundle=bundles["flow"], episodes=args.eval_episodes, modes=tuple(parse_modes(args.eval_modes)),
                         open_loop_episodes=1)  # fmt: skip
        result = run_eval(cfg, progress=sys.stderr.isatty(), command="vla-accel demo (eval)")
        evaluation = work / "reports" / f"eval-flow-{args.size}"
        write_eval(result, evaluation)
        print(eval_headline(result))

    loop = None
    if args.loop_seconds > 0:
        print(f"\n[demo] closed loop: simulator + camera + policy + controller, {args.loop_family} bundle, "
              f"{args.loop_seconds:.0f} s", flush=True)  # fmt: skip
        loop = work / "reports" / f"closed-loop-{args.loop_family}-{args.size}.json"
        loop.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            _vla_accel("bringup", "--sim", "--bundle", str(bundles[args.loop_family]),
                       "--duration", str(args.loop_seconds), "--json", str(loop)),
            check=True,
        )  # fmt: skip

    print("\n[demo] reports:")
    for family, out in reports.items():
        print(f"  replay {family}: {out / 'report.md'} (report.json, plots)")
    if evaluation is not None:
        print(f"  closed-loop eval: {evaluation / 'report.md'} (report.json, plots)")
    if loop is not None:
        print(f"  ROS closed loop: {loop} (summary printed above)")
    return 0
