"""``vla-accel bench cache``: the token cache vs full recompute, end to end, in one run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vla_accel_ros.cli import command
from vla_accel_ros.cli.options import add_override_flags, check_output, overrides
from vla_accel_ros.core.errors import ConfigError


def register_bench(bsub: argparse._SubParsersAction) -> None:
    p = command(
        bsub, "cache", "token cache (VLA-Cache) vs full recompute: obs-to-action latency incl. selection, reuse, deviation",
        "vla-accel bench cache --bundle B_flow --frames 40",
    )
    p.add_argument("--bundle", required=True)
    p.add_argument("--frames", type=int, default=40, help="timed frames (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="frames processed but not timed")
    p.add_argument(
        "--presets", default="default,max-reuse",
        help="comma-separated cache configurations to run side by side: default, max-reuse, public-code, entropy, paper-rule, vision, vision-only",
    )  # fmt: skip
    add_override_flags(p, "cache", applies_to="every preset")
    p.add_argument("--speed", type=float, default=1.0, help="arm speed of the synthetic sequence")
    p.add_argument("--noise", type=float, default=1.0, help="sensor noise std (pixel levels)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the summary as JSON here")
    p.set_defaults(func=_cache)


def _cache(args: argparse.Namespace) -> int:
    import torch

    from vla_accel_ros.bench.cache_bench import format_report, run_cache_bench
    from vla_accel_ros.bench.progress import progress_bar

    if args.frames < 1 or args.warmup < 1:
        raise ConfigError("--frames and --warmup must be at least 1 (the first cached frame is a full recompute)")
    presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    if not presets:
        raise ConfigError(f"--presets {args.presets!r} names no preset")
    check_output(args.json)
    with progress_bar(args.warmup + args.frames, "bench cache", "frame") as bar:
        result = run_cache_bench(
            args.bundle, presets=presets, overrides=overrides(args, "cache"), frames=args.frames,
            warmup=args.warmup, seed=args.seed, speed=args.speed, noise=args.noise, on_frame=lambda _i: bar.update(1),
        )  # fmt: skip
    m = result["meta"]
    print(
        f"bundle {args.bundle} ({m['family']}), torch threads {torch.get_num_threads()}, {m['frames']} frames after "
        f"{m['warmup']} warm-up, synthetic moving arm (speed {m['speed']}, noise {m['noise']}), interleaved per frame"
    )
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
