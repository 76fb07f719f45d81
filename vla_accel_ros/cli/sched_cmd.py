"""``vla-accel bench scheduler``: every scheduling mode on the same simulated run, side by side."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.bench.scheduler_sim import PRESETS, SyntheticFlowPolicy, constant_latency, preset, simulate
from vla_accel_ros.cli import command

_COLUMNS = (  # header, SimResult -> value, format
    ("disc max", lambda r: r.metrics.boundary_disc_max, "{:.4f}"),
    ("disc mean", lambda r: r.metrics.boundary_disc_mean, "{:.4f}"),
    ("step max", lambda r: r.metrics.step_max, "{:.4f}"),
    ("jerk rms", lambda r: r.metrics.jerk_rms, "{:.0f}"),
    ("hold %", lambda r: 100.0 * r.metrics.holding_fraction, "{:.1f}"),
    ("stale", lambda r: r.metrics.stale_dropped, "{:d}"),
    ("eff Hz", lambda r: r.metrics.effective_rate_hz, "{:.1f}"),
    ("track rmse", lambda r: r.tracking_rmse, "{:.4f}"),
    ("d", lambda r: r.metrics.delay_steps, "{:d}"),
)


def register_bench(bsub: argparse._SubParsersAction) -> None:
    p = command(
        bsub, "scheduler", "compare action-chunk scheduling modes on a simulated clock",
        "vla-accel bench scheduler --latency-ms 60 120 240",
        details="Runs a synthetic flow policy (smooth trajectory, per-chunk errors) through the "
        "scheduler in every mode on the same simulated run and prints boundary discontinuity, jerk, "
        "holding, stale drops and effective control rate side by side. Units: rad, rad/s^3.",
    )
    p.add_argument("--modes", nargs="+", default=list(PRESETS), choices=list(PRESETS), metavar="MODE",
                   help=f"modes to run (default: all of {', '.join(PRESETS)})")
    p.add_argument("--latency-ms", nargs="+", type=float, default=[120.0],
                   help="mean observation-to-chunk latency; several values sweep")
    p.add_argument("--jitter-ms", type=float, default=15.0, help="latency standard deviation")
    p.add_argument("--duration-s", type=float, default=20.0, help="simulated run length")
    p.add_argument("--rate-hz", type=float, default=50.0, help="control rate (ALOHA: 50)")
    p.add_argument("--horizon", type=int, default=50, help="actions per chunk")
    p.add_argument("--action-dim", type=int, default=14, help="joints (ALOHA: 14)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, metavar="OUT", help="also write every metric to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.duration_s <= 0 or args.horizon < 1 or args.action_dim < 1:
        raise ConfigError("--duration-s must be > 0, --horizon and --action-dim >= 1")
    report = []
    for latency in args.latency_ms:
        rows = []
        for mode in args.modes:
            config = preset(mode, control_rate_hz=args.rate_hz)
            policy = SyntheticFlowPolicy(horizon=args.horizon, action_dim=args.action_dim, dt=config.dt, seed=args.seed)
            latency_of = constant_latency(latency, args.jitter_ms, args.seed)  # same draws for every mode
            result = simulate(config, policy, latency_ms=latency_of, duration_s=args.duration_s)
            rows.append((mode, result))
            rmse = None if math.isnan(result.tracking_rmse) else result.tracking_rmse
            report.append({"mode": mode, "latency_ms": latency, "config": config.to_dict(),
                           "tracking_rmse": rmse, **result.metrics.to_dict()})
        print(f"\nlatency {latency:g} ms ± {args.jitter_ms:g}, {args.rate_hz:g} Hz, "
              f"H={args.horizon}, {args.duration_s:g} s simulated")
        _print_table(rows)
    print(_LEGEND)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


_LEGEND = (
    "\ndisc max/mean: largest joint step at chunk switches and blends (rad); step max: anywhere; "
    "jerk rms: rad/s^3;\nhold %: ticks with a dry queue; stale: actions dropped because their time had "
    "passed; eff Hz: planned actions\ncommanded per second; track rmse: distance to the task's reference "
    "trajectory (rad); d: p95 latency in control steps"
)


def _label(mode: str) -> str:
    return mode if mode == "sync" else f"async+{mode}"


def _print_table(rows) -> None:
    cells = [[_label(m)] + [fmt.format(get(r)) for _, get, fmt in _COLUMNS] for m, r in rows]
    header = ["mode"] + [h for h, _, _ in _COLUMNS]
    widths = [max(len(x[i]) for x in [header, *cells]) for i in range(len(header))]
    for row in [header, *cells]:
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
