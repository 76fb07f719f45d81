"""``vla-accel eval``: closed-loop task success per acceleration mode in the simulator."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from vla_accel_ros.cli import command
from vla_accel_ros.cli.options import add_override_flags, overrides, parse_overrides


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "eval", "closed-loop success, latency and open-loop error per mode in the ALOHA simulator (same seeds)",
        "vla-accel eval --bundle bundles/transfer_cube-flow --episodes 20 --modes baseline,cache,cache+prune --report R_eval",
        details="Runs --episodes simulated episodes per mode on the same seeds, through the policy the policy "
        "node builds and the controller's chunk scheduler and safety filter, on simulated time; writes "
        "report.json, report.md and plots into --report.",
    )
    p.add_argument("--bundle", required=True, type=Path, help="model bundle directory")
    p.add_argument("--task", default="transfer_cube", choices=("transfer_cube", "insertion"))
    p.add_argument("--episodes", type=int, default=20, help="episodes per mode (default %(default)s)")
    p.add_argument(
        "--modes", default="baseline,cache",
        help="comma-separated modes, as `vla-accel replay` (baseline added; @<precision>[+<backend>][+compile] suffixes), and "
        "lerobot: LeRobot's own runtime on the same seeds and noise (--lerobot-python)",
    )  # fmt: skip
    p.add_argument("--lerobot", type=Path, default=None, metavar="DIR",
                   help="lerobot mode: LeRobot's checkpoint of the bundle (default: `bundle export-lerobot` of it into "
                   "REPORT/lerobot)")  # fmt: skip
    p.add_argument("--lerobot-python", type=Path, default=None, metavar="PY",
                   help="lerobot mode: the Python of an environment with LeRobot 0.4.4 (its side venv)")
    p.add_argument("--report", required=True, type=Path, help="directory for report.json, report.md and plots")
    p.add_argument("--seed", type=int, default=100_000, help="seed of episode 0 (demonstrations use 0, 1, ...)")
    p.add_argument("--steps", type=int, default=300, help="control steps per episode (300 = 6 s)")
    p.add_argument(
        "--latency", choices=("zero", "measured"), default="zero",
        help="zero: the simulator waits for each chunk (fidelity only); measured: chunks land after their "
        "measured latency while the arm keeps moving",
    )  # fmt: skip
    p.add_argument("--open-loop-episodes", type=int, default=2,
                   help="expert demonstrations for the open-loop error and the first-chunk check (seeds from --seed; may "
                   "exceed --episodes: --episodes 1 --open-loop-episodes 80 --open-loop-stride 300 checks the first chunks alone)")
    p.add_argument("--open-loop-stride", type=int, default=10, help="steps between two open-loop inferences")
    p.add_argument("--height", type=int, default=480, help="rendered image height (the bundle resizes)")
    p.add_argument("--width", type=int, default=640, help="rendered image width")
    p.add_argument("--pipeline-depth", type=int, default=4, help="pipelined modes: frames in flight (default %(default)s)")
    p.add_argument("--pipeline-steps", type=int, default=0, help="pipelined modes: decode steps per frame (0: from the depth)")
    p.add_argument("--stream-every", type=int, default=1, help="pipelined modes: ticks between two observations pushed")
    p.add_argument("--params", type=Path, default=None, help="the graph's parameter file (default: config/aloha.yaml)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--flow-steps", type=int, default=0, help="flow: Euler steps per chunk (0: the bundle's)")
    p.add_argument("--noise-scale", type=float, default=-1.0,
                   help="flow: multiple of the Gaussian noise every chunk starts from, in every mode (lerobot's too); "
                   "-1: the bundle's noise_scale, 1: the trained sampler, 0: deterministic chunks")  # fmt: skip
    add_override_flags(p, "cache", "prune", "precision")
    p.add_argument(
        "--scheduler", action="append", default=[], metavar="FIELD=VALUE",
        help="override a field of the controller's chunk scheduler (SchedulerConfig), e.g. aggregation=temporal_ensemble",
    )  # fmt: skip
    p.add_argument("--no-parity", action="store_true", help="skip the parity gate")
    p.add_argument("--no-baseline", action="store_true",
                   help="do not run the baseline's episodes (an earlier report of it on the same seeds is the "
                   "reference: `vla-accel bench outcomes BASE_REPORT THIS_REPORT`); no speedup vs baseline")  # fmt: skip
    p.add_argument(
        "--through-ros", action="store_true",
        help="also run every mode's episodes through the ROS graph (aloha_sim_node in lockstep, policy_node, "
        "action_controller_node, camera_node; same seeds): modes.<mode>.ros_graph in report.json",
    )  # fmt: skip
    p.add_argument("--one-process", action="store_true", help="--through-ros: every node in this process (bringup --one-process)")
    p.add_argument("--domain-id", type=int, default=None, help="--through-ros: ROS_DOMAIN_ID of the graph (default: the environment's)")
    p.add_argument("--ros-episode-timeout", type=float, default=600.0, metavar="S",
                   help="--through-ros: give up when no episode ends for S seconds of wall time")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.eval import LEROBOT, EvalConfig, eval_modes, run_eval
    from vla_accel_ros.bench.eval_report import headline_text, write_report
    from vla_accel_ros.bench.report import check_report_dir

    cfg = EvalConfig(
        bundle=args.bundle, task=args.task, episodes=args.episodes, modes=tuple(eval_modes(args.modes)),
        lerobot=args.lerobot, lerobot_python=args.lerobot_python,
        seed=args.seed, steps=args.steps, latency=args.latency, open_loop_episodes=args.open_loop_episodes,
        open_loop_stride=args.open_loop_stride, params=args.params, parity_check=not args.no_parity,
        num_threads=args.threads, flow_steps=args.flow_steps, noise_scale=args.noise_scale, cache_overrides=overrides(args, "cache"),
        prune_overrides=overrides(args, "prune"), precision_overrides=overrides(args, "precision"),
        scheduler_overrides=parse_overrides(args.scheduler, "--scheduler"), height=args.height, width=args.width,
        pipeline_depth=args.pipeline_depth, pipeline_steps=args.pipeline_steps, stream_every=args.stream_every,
        through_ros=args.through_ros, ros_one_process=args.one_process, ros_domain_id=args.domain_id,
        ros_episode_timeout_s=args.ros_episode_timeout, run_baseline=not args.no_baseline,
    )  # fmt: skip
    cfg.validate()
    check_report_dir(args.report)
    if LEROBOT in cfg.modes and cfg.lerobot is None:
        from vla_accel_ros.models.smolvla.lerobot_export import export_lerobot

        cfg.lerobot = export_lerobot(cfg.bundle, args.report / "lerobot")
        print(f"lerobot mode: LeRobot's checkpoint of the bundle written to {cfg.lerobot}", file=sys.stderr)
    command = shlex.join(["vla-accel", "eval", *sys.argv[2:]]) if len(sys.argv) > 1 and sys.argv[1] == "eval" else ""
    result = run_eval(cfg, progress=not args.no_progress, command=command)
    if cfg.through_ros:
        _through_ros(cfg, result)
    paths = write_report(result, args.report, plots=not args.no_plots)
    print(headline_text(result))
    print(f"report: {', '.join(str(p) for p in paths.values())}")
    return 0


def _through_ros(cfg, result: dict) -> None:
    """Every mode again, through the graph ``vla-accel bringup --sim`` starts, from a copy of
    the parameter file holding the mode's policy configuration: ``modes.<mode>.ros_graph``."""
    import tempfile

    import yaml

    from vla_accel_ros.bench.eval import ROS_GRAPH, graph_params, graph_sim_parameters, summarize_graph_mode
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.ros.graph import SIM, describe

    try:
        from vla_accel_ros.ros.episodes import run_episodes  # noqa: PLC0415 - imports rclpy
    except ImportError as e:
        raise ConfigError(f"--through-ros needs rclpy ({e}); run `make setup` or source a ROS 2 install") from e
    layout = "one process" if cfg.ros_one_process else "one process per node"
    with tempfile.TemporaryDirectory(prefix="vla_eval_ros_") as tmp:
        for name in result["mode_order"]:
            params_file = Path(tmp) / f"{name}.yaml"
            params_file.write_text(yaml.safe_dump(graph_params(name, cfg)))
            graph = describe(params_file=params_file, bundle=cfg.bundle, sim=True, shared_observations=cfg.ros_one_process)
            graph = graph.with_parameters({SIM: graph_sim_parameters(cfg)})
            print(f"{name}: through the ROS graph ({layout}), {cfg.episodes} episode(s)", file=sys.stderr)
            res = run_episodes(
                graph, cfg.episodes, one_process=cfg.ros_one_process, domain_id=cfg.ros_domain_id,
                startup_timeout_s=cfg.ros_startup_timeout_s, episode_timeout_s=cfg.ros_episode_timeout_s,
                log=lambda text: print(text, file=sys.stderr),
            )  # fmt: skip
            result["modes"][name][ROS_GRAPH] = summarize_graph_mode(
                cfg.episodes, res.summary, res.outcomes, res.inference_ms, res.startup_s, res.wall_s
            )
    result[ROS_GRAPH] = {"layout": layout, "sim_parameters": graph_sim_parameters(cfg)}
