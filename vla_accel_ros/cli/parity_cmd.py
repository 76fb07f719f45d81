"""``vla-accel parity --bundle PATH``: the fail-loud parity gate."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare the engine with transformers' forward; exit 1 beyond tolerance")
    p.add_argument("--bundle", required=True)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--accel", default="none", help="acceleration whose path is gated (none, cache)")
    p.add_argument(
        "--precision", default="fp32",
        help="precision preset gated against the bundle's fp32 path (fp32, bf16, int8, hybrid, auto); limits: config/aloha.yaml",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="gate the compiled static steps (torch.compile)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.errors import ParityError
    from vla_accel_ros.core.parity import PARITY_STEPS, run_parity
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.precision import preset
    from vla_accel_ros.models.factory import load_policy

    precision = {**preset(args.precision), "compile": args.compile}
    config = PolicyConfig.from_dict({"accel": args.accel, "parity_tolerance": args.tolerance, "precision": precision})
    print(f"parity of {args.bundle} (accel={args.accel}, precision={args.precision}{', compiled' if args.compile else ''})")
    if config.precision.reduced:  # the gate needs the fp32 reference the policy builds at load, and runs there
        with progress_bar(1, "parity", "step") as bar:
            bar.set_postfix_str("loading and gating")
            try:
                report = load_policy(args.bundle, config).parity_report
            except ParityError as e:
                print(e)
                return 1
            bar.update(1)
    else:
        with progress_bar(1 + len(PARITY_STEPS), "parity", "step") as bar:
            bar.set_postfix_str("loading")
            policy = load_policy(args.bundle, config.replace(parity_check=False))
            bar.update(1)
            report = run_parity(
                policy, tolerance=args.tolerance, on_step=lambda name: (bar.set_postfix_str(name), bar.update(1))
            )
    print(report.table())
    return 0 if report.passed else 1
