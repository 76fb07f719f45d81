"""``vla-accel export``: the static-shape step graphs of a bundle as torch.export programs."""

from __future__ import annotations

import argparse

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "export", "export the engine's static-shape steps (with the vla_accel custom ops) for TensorRT and other runtimes",
        "vla-accel export --bundle bundles/transfer_cube-flow --out steps --precision bf16",
        details="Writes <step>.pt2 (torch.export archives: JSON graph, raw weights) and export.json into --out; "
        "each program is checked against the eager engine (max |delta| of the hidden states).",
    )
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--precision", default="fp32", help="precision preset of the weights (fp32, bf16; int8 and hybrid do not export)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max |exported - engine| accepted (exit 1 beyond)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import io

    import torch

    from vla_accel_ros.core.export import check_program, export_step, policy_steps, save_programs
    from vla_accel_ros.core.parity import fixed_observation, gate_noise
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.precision import preset
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(args.bundle, PolicyConfig.from_dict({"precision": preset(args.precision), "parity_check": False}))
    obs = fixed_observation(policy.spec)
    programs, worst = {}, 0.0
    for name, (engine, slots) in policy_steps(policy).items():
        policy.infer(obs, noise=gate_noise(policy))  # a realistic cache state for the check
        ep = export_step(engine, slots)
        buf = io.BytesIO()
        torch.export.save(ep, buf)  # the check runs the saved and reloaded program
        buf.seek(0)
        delta = check_program(torch.export.load(buf), engine, slots)
        worst = max(worst, delta)
        print(f"{name:8s} {slots.numel():4d} rows  max |exported - engine| {delta:.2e}")
        programs[name] = ep
    meta = {"bundle": str(args.bundle), "family": policy.spec.family, "precision": policy.precision.label(), "max_abs_delta": worst}
    for path in save_programs(programs, args.out, meta):
        print(f"wrote {path}")
    return 0 if worst <= args.tolerance else 1
