"""``vla-accel parity --bundle PATH``: the fail-loud parity gate."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare the engine with transformers' forward; exit 1 beyond tolerance")
    p.add_argument("--bundle", required=True)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--accel", default="none", help="acceleration whose path is gated (none, cache)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.parity import PARITY_STEPS, run_parity
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    config = PolicyConfig(accel=args.accel, parity_check=False, parity_tolerance=args.tolerance)  # ConfigError first
    with progress_bar(1 + len(PARITY_STEPS), "parity", "step") as bar:
        bar.set_postfix_str("loading")
        policy = load_policy(args.bundle, config)
        bar.update(1)
        report = run_parity(policy, tolerance=args.tolerance, on_step=lambda name: (bar.set_postfix_str(name), bar.update(1)))
    print(f"parity of {args.bundle} (accel={args.accel})")
    print(report.table())
    return 0 if report.passed else 1
