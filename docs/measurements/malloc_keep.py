"""Chunk stages with and without ``policy.malloc_keep_mb`` (docs/runtime.md, "The allocator").

The setting is process-wide, so each run is its own process: this script times one mode over a
bag's first frames (two warm-up, the rest timed; the frame's noise as the replay draws it) at
one ``--keep`` value and prints the stages' p50 as JSON. Alternate the values to compare.

Usage, from the repository root (one torch thread)::

    for k in 0 64 0 64; do
        .venv/bin/python docs/measurements/malloc_keep.py --bundle A --bag tc3 --keep $k \\
            --mode baseline@auto+openvino+compile --precision graphs=graphsA2
    done
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from vla_accel_ros.bench.modes import mode_of, policy_config
    from vla_accel_ros.bench.replay import ReplayConfig
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--bag", required=True)
    ap.add_argument("--keep", type=int, required=True, help="policy.malloc_keep_mb (0: glibc's defaults)")
    ap.add_argument("--mode", default="baseline")
    ap.add_argument("--precision", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--frames", type=int, default=14)
    args = ap.parse_args()
    torch.set_num_threads(1)
    overrides = dict(p.split("=", 1) for p in args.precision)
    cfg = ReplayConfig(bag=Path(args.bag), bundle=Path(args.bundle), modes=(args.mode,), precision_overrides=overrides)
    policy = load_policy(args.bundle, policy_config(mode_of(args.mode), cfg).replace(parity_check=False, malloc_keep_mb=args.keep))
    with BagReader(Path(args.bag)) as bag:
        sync = SyncConfig.from_dict({"cameras": tuple(policy.spec.cameras)})
        frames = [s.observation for _, s in zip(range(args.frames), bag.samples(sync))]
    timed = []
    for i, obs in enumerate(frames):
        noise = np.random.default_rng((0, i)).standard_normal(policy.noise_shape).astype(np.float32)
        chunk = policy.infer(obs, noise=noise)
        if i >= 2:
            timed.append(chunk.timings_ms)
    p50 = {s: round(float(np.median([t[s] for t in timed])), 1) for s in ("preprocess", "vision", "denoise", "total")}
    print(json.dumps({"keep_mb": args.keep, "mode": args.mode, **p50}))


if __name__ == "__main__":
    main()
