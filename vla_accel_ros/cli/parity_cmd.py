"""``vla-accel parity --bundle PATH``: the fail-loud parity gate."""

from __future__ import annotations

import argparse

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "parity",
        "compare the engine with the reference forward (or a reference implementation's outputs); exit 1 beyond tolerance",
        "vla-accel parity --bundle bundles/transfer_cube-flow --accel cache\n"
        "  vla-accel parity --bundle B --reference ../shared/fixtures/smolvla-lerobot",
    )  # fmt: skip
    p.add_argument("--bundle", required=True)
    p.add_argument("--tolerance", type=float, default=None, help="default 1e-3 (1e-4 with --reference)")
    p.add_argument("--accel", default="none", help="acceleration whose path is gated (none, cache)")
    p.add_argument(
        "--precision", default="fp32",
        help="precision preset gated against the bundle's fp32 path (fp32, bf16, int8, hybrid, auto); limits: config/aloha.yaml",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="gate the compiled static steps (torch.compile)")
    p.add_argument(
        "--bag", metavar="BAG",
        help="gate on this rosbag's first and 11th observation (the task's own frames, as the policy node's gate_bag) "
        "instead of a synthetic pair: pruning's bound means something only there",
    )  # fmt: skip
    p.add_argument("--backend", default="torch", choices=("torch", "onnxruntime", "openvino"),
                   help="gate the vision tower as an ONNX graph on this runtime (at the vision precision)")
    p.add_argument(
        "--reference", metavar="DIR",
        help="instead: compare the bundle's fp32 actions with a reference implementation's own outputs in DIR (a fixture "
        "as in ../shared/fixtures/smolvla-lerobot/: raw observation, noise, expected actions, optional debug.* "
        "intermediates); default --tolerance 1e-4 in units of the action spread",
    )  # fmt: skip
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.reference:
        return _reference(args)
    args.tolerance = 1e-3 if args.tolerance is None else args.tolerance
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.errors import ParityError
    from vla_accel_ros.core.parity import PARITY_STEPS, run_parity
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.precision import preset
    from vla_accel_ros.models.factory import load_policy

    frames = None
    if args.bag:
        from pathlib import Path

        from vla_accel_ros.core.bundle import read_spec
        from vla_accel_ros.io.bag_reader import gate_frames_for

        frames = gate_frames_for(Path(args.bag), read_spec(args.bundle))  # a BagError says what the bag lacks
    precision = {**preset(args.precision), "compile": args.compile, "backend": args.backend}
    config = PolicyConfig.from_dict({"accel": args.accel, "parity_tolerance": args.tolerance, "precision": precision})
    print(f"parity of {args.bundle} (accel={args.accel}, precision={args.precision}{', compiled' if args.compile else ''}"
          f"{'' if args.backend == 'torch' else ', vision on ' + args.backend}; "
          f"{'frames of ' + args.bag if frames else 'a synthetic pair of frames'})")  # fmt: skip
    if config.precision.gated_against_fp32:  # the gate needs the fp32 reference the policy builds at load, and runs there
        with progress_bar(1, "parity", "step") as bar:
            bar.set_postfix_str("loading and gating")
            try:
                report = load_policy(args.bundle, config, gate_observations=frames).parity_report
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
                policy, tolerance=args.tolerance, observations=frames,
                on_step=lambda name: (bar.set_postfix_str(name), bar.update(1)),
            )  # fmt: skip
    print(report.table())
    return 0 if report.passed else 1


def _reference(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy
    from vla_accel_ros.models.reference import check_fixture, load_fixture

    tolerance = 1e-4 if args.tolerance is None else args.tolerance
    if args.accel != "none" or args.precision != "fp32" or args.compile:
        print("vla-accel parity: --reference compares the bundle's fp32 eager path; drop --accel / --precision / --compile")
        return 2
    fx = load_fixture(args.reference)
    source = Path(args.bundle) / "source.json"  # an imported bundle: the reference's camera names
    cameras = json.loads(source.read_text()).get("cameras") if source.is_file() else None
    print(f"parity of {args.bundle} against the reference outputs in {args.reference}")
    policy = load_policy(args.bundle, PolicyConfig(parity_check=False))
    report = check_fixture(policy, fx, tolerance, cameras)
    print(report.table())
    return 0 if report.passed else 1
