"""``vla-accel calibrate-reasoning``: MEMO-VLM thresholds of a reasoning bundle from a bag."""

from __future__ import annotations

import argparse
from pathlib import Path

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "calibrate-reasoning", "per-word reuse thresholds of a reasoning bundle (memo.mode=calibrated) from recorded frames",
        "vla-accel calibrate-reasoning --bundle bundles/transfer_cube-ar-reasoning --bag artifacts/bags/transfer_cube",
        details="Decodes the reasoning of every --frame-stride-th observation of the bags greedily and writes, "
        "per reasoning word, the lowest probability the model gave it where it wrote it and its attention to the "
        "image relative to the average word. The policy loads the file at start-up (memo.calibration; default "
        "reasoning_calibration.json next to the bundle's weights).",
    )
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--bag", required=True, type=Path, nargs="+", help="rosbag2 bags with the bundle's cameras (and states)")
    p.add_argument("--max-frames", type=int, default=200, help="calibrate on at most this many frames (default %(default)s)")
    p.add_argument("--frame-stride", type=int, default=3, help="use every N-th observation (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="output JSON (default: BUNDLE/reasoning_calibration.json)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import itertools

    import torch

    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.errors import BagError, ConfigError
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.reasoning.memo import CALIBRATION_FILE, calibrate
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_policy

    if args.max_frames < 1 or args.frame_stride < 1:
        raise ConfigError(f"--max-frames {args.max_frames} and --frame-stride {args.frame_stride} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = load_policy(args.bundle, PolicyConfig(parity_check=False))
    spec = policy.spec
    sync = SyncConfig.from_dict({"cameras": tuple(spec.cameras)})

    def observations():
        for bag_path in args.bag:
            if not bag_path.exists():
                raise BagError(f"--bag {bag_path} does not exist")
            with BagReader(bag_path) as bag:
                for i, sample in enumerate(bag.samples(sync)):
                    if i % args.frame_stride == 0:
                        yield sample.observation

    out = args.out or args.bundle / CALIBRATION_FILE
    with progress_bar(args.max_frames, "calibrate", "frame") as bar:
        cal = calibrate(
            policy, itertools.islice(observations(), args.max_frames),
            source=", ".join(str(b) for b in args.bag), on_frame=lambda: bar.update(1),
        )  # fmt: skip
    cal.save(out)
    lowest = sorted(cal.min_prob.items(), key=lambda kv: kv[1])[:5]
    print(f"calibrated {len(cal.min_prob)} words on {cal.frames} frames -> {out}")
    print("lowest min_prob: " + ", ".join(f"{w!r} {p:.3f}" for w, p in lowest))
    return 0
