"""``vla-accel bundle create-demo | import | export-lerobot | average | inspect``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vla_accel_ros.models.family import family_names
from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bundle", "create, import and inspect model bundles")
    bsub = p.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)

    c = command(
        bsub, "create-demo", "write a random-weight demo bundle", "vla-accel bundle create-demo --family flow --size small --out B_flow"
    )
    c.add_argument("--family", choices=family_names(can="demo"), required=True)
    c.add_argument("--size", choices=("tiny", "small"), default="tiny")
    c.add_argument("--out", required=True, help="bundle directory to write")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--cameras", default="cam_high", help="comma-separated camera names (token order)")
    c.add_argument("--action-dim", type=int, default=14, help="14 = ALOHA bimanual joints")
    c.add_argument("--chunk-size", type=int, default=None, help="default: ar 1, flow, smolvla and pi05 50")
    c.add_argument("--lm-type", choices=("llama", "qwen2"), default="llama")
    c.set_defaults(func=_create)

    m = command(
        bsub, "import", "write a bundle from a LeRobot checkpoint (SmolVLA, pi0, pi0.5; offline)",
        "vla-accel bundle import --lerobot ../shared/fixtures/smolvla-lerobot/policy --out models/smolvla-fixture",
        details="Reads LeRobot's saved policy (config.json and model.safetensors; SmolVLA: the pre/post-processor "
        "JSON and statistics, and the SmolVLM directory its vlm_model_name names; pi0 and pi05: PaliGemma's tokenizer; "
        "pi05: the processors too) and "
        "writes a bundle of the family its config.json type names.",
    )  # fmt: skip
    m.add_argument("--lerobot", required=True, metavar="DIR", help="LeRobot's saved policy directory")
    m.add_argument(
        "--vlm", metavar="DIR",
        help="smolvla: the SmolVLM directory (config.json, tokenizer); default: vlm_model_name as a path, beside the checkpoint, "
        "or in the local Hugging Face cache (never downloaded)",
    )  # fmt: skip
    m.add_argument(
        "--tokenizer", metavar="DIR",
        help="pi0, pi05: PaliGemma's tokenizer directory (default: google/paligemma-3b-pt-224 in the local Hugging Face cache)",
    )
    m.add_argument("--vision-heads", type=int, default=None, metavar="N", help="pi0, pi05: SigLIP's head count when its width is not So400m's 1152")
    m.add_argument("--out", required=True, help="bundle directory to write (never overwritten)")
    m.add_argument("--name", default=None, help="bundle name (default: the checkpoint directory's name)")
    m.add_argument("--joints", default="", help="comma-separated joint names, one per action dimension (default: ALOHA's for 14)")
    m.add_argument("--fps", type=float, default=50.0, help="control rate the actions were recorded at (dt = 1/fps; default 50)")
    m.add_argument("--instruction", default="", help="the task used when the policy node is given none")
    m.set_defaults(func=_import)

    e = command(
        bsub, "export-lerobot", "write a LeRobot SmolVLA checkpoint from a smolvla bundle (LeRobot 0.4.4 loads it)",
        "vla-accel bundle export-lerobot --bundle bundles/transfer_cube-smolvla --out lerobot/transfer_cube-smolvla",
        details="Writes LeRobot's saved layout: config.json, model.safetensors (fp32, LeRobot's module names), the "
        "pre/post-processor pipelines and statistics, and vlm/ (the SmolVLM config, the bundle's tokenizer and the "
        "processor files) which config.json's vlm_model_name names by its absolute path. Load it with "
        "SmolVLAPolicy.from_pretrained(DIR) in LeRobot; `vla-accel bench lerobot --lerobot DIR --bundle B` compares.",
    )  # fmt: skip
    e.add_argument("--bundle", required=True, help="the smolvla bundle (with its own tokenizer)")
    e.add_argument("--out", required=True, metavar="DIR", help="directory to write (never overwritten)")
    e.add_argument("--vlm-name", default="", help="vlm_model_name to write (default: the absolute path of DIR/vlm)")
    e.add_argument("--image-size", default="480x640", metavar="HxW",
                   help="camera frame size the features declare (default 480x640; LeRobot resizes what arrives)")
    e.set_defaults(func=_export_lerobot)

    a = command(
        bsub, "average", "write the weighted average of bundles of one architecture (a model soup)",
        "vla-accel bundle average --bundle bundles/transfer_cube-smolvla --bundle runs/F2 --weights 0.5,0.5 --out CF2",
        details="Averages every weight (in float32, saved in the first bundle's dtype) and the normalization statistics "
        "with the same weights; the name, noise_scale and num_steps are the first bundle's, every other config field must match. "
        "Meant for runs that start from one bundle (a policy and one trained on from it): their average can keep what "
        "each does well. Judge the result in the closed loop (vla-accel eval) like any other policy.",
    )  # fmt: skip
    a.add_argument("--bundle", action="append", required=True, metavar="B", help="a bundle to average (give it twice or more)")
    a.add_argument("--weights", default="", metavar="W1,W2,...",
                   help="one weight per --bundle, >= 0, summing to 1 (default: uniform)")
    a.add_argument("--out", required=True, help="bundle directory to write (never overwritten)")
    a.set_defaults(func=_average)

    i = command(bsub, "inspect", "print a bundle's configuration", "vla-accel bundle inspect bundles/transfer_cube-flow")
    i.add_argument("path")
    i.set_defaults(func=_inspect)


def _create(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():  # as for bags: never overwrite
        print(f"vla-accel bundle create-demo: {out} exists already; bundles are never overwritten (choose another --out)",
              file=sys.stderr)  # fmt: skip
        return 2
    from vla_accel_ros.models.factory import create_demo_bundle, inspect_bundle

    t = time.perf_counter()
    cameras = tuple(c.strip() for c in args.cameras.split(",") if c.strip())
    path = create_demo_bundle(
        args.family, args.size, out, seed=args.seed, cameras=cameras,
        action_dim=args.action_dim, chunk_size=args.chunk_size, lm_type=args.lm_type,
    )  # fmt: skip
    print(inspect_bundle(path))
    print(f"written in {time.perf_counter() - t:.1f} s")
    return 0


def _import(args: argparse.Namespace) -> int:
    if Path(args.out).exists():
        print(f"vla-accel bundle import: {args.out} exists already; bundles are never overwritten (choose another --out)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not args.fps > 0:
        print(f"vla-accel bundle import: --fps {args.fps} must be > 0", file=sys.stderr)
        return 2
    import json

    from vla_accel_ros.core.errors import BundleError
    from vla_accel_ros.models.factory import inspect_bundle
    from vla_accel_ros.models.family import get_family

    cfg_path = Path(args.lerobot) / "config.json"
    try:
        kind = json.loads(cfg_path.read_text()).get("type")
    except (OSError, json.JSONDecodeError) as e:
        raise BundleError(f"--lerobot {args.lerobot}: no readable config.json ({e})") from e
    importable = family_names(can="import_lerobot")  # LeRobot's policy type is the family's name
    if kind not in importable:
        raise BundleError(f"{cfg_path}: LeRobot policy type {kind!r} does not import here; importable: {', '.join(importable)}")
    t = time.perf_counter()
    joints = tuple(j.strip() for j in args.joints.split(",") if j.strip()) or None
    # Every flag is passed; an unset one is None, and a set one the family does not take is refused by its importer.
    path = get_family(kind).import_lerobot(
        args.lerobot, args.out, vlm=args.vlm, tokenizer=args.tokenizer, vision_heads=args.vision_heads, name=args.name,
        joint_names=joints, fps=args.fps, default_instruction=args.instruction,
    )  # fmt: skip
    print(inspect_bundle(path))
    print(f"imported in {time.perf_counter() - t:.1f} s")
    return 0


def _export_lerobot(args: argparse.Namespace) -> int:
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.models.smolvla.lerobot_export import export_lerobot

    try:
        h, w = (int(x) for x in args.image_size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--image-size {args.image_size!r}: give HEIGHTxWIDTH, e.g. 480x640") from None
    if h < 1 or w < 1:
        raise ConfigError(f"--image-size {args.image_size!r}: both sides must be >= 1")
    t = time.perf_counter()
    out = export_lerobot(args.bundle, args.out, vlm_name=args.vlm_name, image_hw=(h, w))
    print(f"wrote {out} in {time.perf_counter() - t:.1f} s (LeRobot: SmolVLAPolicy.from_pretrained({str(out)!r}))")
    from vla_accel_ros.core.bundle import load_bundle

    scale = load_bundle(args.bundle).spec.noise_scale
    if scale != 1.0:  # LeRobot has no such setting: said here, not left to surprise a comparison
        print(f"note: the bundle runs at noise_scale {scale:g}; LeRobot's runtime samples at 1 "
              "(vla-accel eval --modes lerobot and bench lerobot hand it the noise already scaled)")
    return 0


def _average(args: argparse.Namespace) -> int:
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.models.average import average_bundles
    from vla_accel_ros.models.factory import inspect_bundle

    try:
        weights = [float(w) for w in args.weights.split(",")] if args.weights.strip() else None
    except ValueError:
        raise ConfigError(f"--weights {args.weights!r}: give numbers separated by commas, e.g. 0.5,0.5") from None
    t = time.perf_counter()
    path = average_bundles(args.bundle, args.out, weights)
    print(inspect_bundle(path))  # the loader's checks on what was written
    print(f"averaged {len(args.bundle)} bundles in {time.perf_counter() - t:.1f} s")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """The loader's checks (config fields and sizes, weights against the config), then the description."""
    from vla_accel_ros.models.factory import inspect_bundle

    print(inspect_bundle(args.path))
    return 0
