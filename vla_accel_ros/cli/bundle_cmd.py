"""``vla-accel bundle create-demo | inspect``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="create and inspect model bundles")
    bsub = p.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)

    c = bsub.add_parser("create-demo", help="write a random-weight demo bundle")
    c.add_argument("--family", choices=("ar", "flow"), required=True)
    c.add_argument("--size", choices=("tiny", "small"), default="tiny")
    c.add_argument("--out", required=True, help="bundle directory to write")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--cameras", default="cam_high", help="comma-separated camera names (token order)")
    c.add_argument("--action-dim", type=int, default=14, help="14 = ALOHA bimanual joints")
    c.add_argument("--chunk-size", type=int, default=None, help="default: ar 1, flow 50")
    c.add_argument("--lm-type", choices=("llama", "qwen2"), default="llama")
    c.set_defaults(func=_create)

    i = bsub.add_parser("inspect", help="print a bundle's configuration")
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


def _inspect(args: argparse.Namespace) -> int:
    """The loader's checks (config fields and sizes, weights against the config), then the description."""
    from vla_accel_ros.models.factory import inspect_bundle

    print(inspect_bundle(args.path))
    return 0
