"""Pruning against the policy's own sampling spread, per setting (docs/methods/pruning.md, "The
gate and trained policies").

For each named setting, the parity gate's metrics on the gate's synthetic frames and on a bag's
real frames (its first observation and its ``--second``-th): the pruned first frame's mean
|delta| against the full recompute, the policy's sampling spread there (mean |full recompute
with the gate's noise - with another noise|), and their ratio (``prune_over_sampling_spread``,
what ``policy.parity_tolerance_prune`` bounds). A setting is ``NAME=ACCEL[:JSON]``, the JSON
overriding PolicyConfig fields.

Usage, from the repository root (one torch thread)::

    .venv/bin/python docs/measurements/prune_gate_spread.py --bundle bundles/transfer_cube-flow --bag BAG \\
        prune=prune 'half=prune:{"prune":{"keep_global":128,"keep_local":128,"keep_dynamic":64,"min_keep":64}}'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    from vla_accel_ros.io.bag_reader import gate_frames_from_bag
    from vla_accel_ros.core.parity import run_parity
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.models.factory import load_bundle, load_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--bag", required=True, help="a bag with the bundle's cameras (the real frames)")
    ap.add_argument("--second", type=int, default=10, help="the real pair's second frame: this sample of the bag")
    ap.add_argument("settings", nargs="+", metavar="NAME=ACCEL[:JSON]")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundle = load_bundle(Path(args.bundle))
    real = gate_frames_from_bag(Path(args.bag), SyncConfig.from_dict({"cameras": tuple(bundle.spec.cameras)}), second=args.second)
    print(f"{'setting':<16} {'frames':<9} {'pruned':>7} {'spread':>7} {'ratio':>6}")
    for setting in args.settings:
        name, rest = setting.split("=", 1)
        accel, _, overrides = rest.partition(":")
        fields = {"accel": accel, "parity_check": False, **(json.loads(overrides) if overrides else {})}
        policy = load_policy(bundle, PolicyConfig.from_dict(fields))
        for frames, obs in (("synthetic", None), ("real", real)):
            m = run_parity(policy, observations=obs, accel_tolerance=100.0).metrics
            print(f"{name:<16} {frames:<9} {m['prune_first_frame_mean_abs_norm']:7.3f} "
                  f"{m['sampling_spread_mean_abs_norm']:7.3f} {m['prune_over_sampling_spread']:6.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
