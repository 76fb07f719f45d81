"""Which patches may keep their vision features? (docs/methods/token-cache.md, "Reusing only
the vision tower's work").

Feeds the first episodes of a bag through a bundle at a stride (the closed loop infers about
every 5th observation of a bag recorded with ``--render-every 4``), once with the full
recompute and once per rule with ``cache.reuse_vision`` past the decoder's depth (the
``vision-only`` preset: the decoder recomputes every token, only the tower's work of the static
patches is reused), and prints per rule the chunk's deviation from the full recompute (max
|delta| / action std per frame: p50, p90, max), the vision stage's median time and the image
tokens whose features were reused. The rules: the token cache's static test (cosine 0.996 and
a relative change of 0.1), bit-identical patches, each with and without the scene cut, and
with a shorter reuse age.

Usage, from the repository root (the shipped bundle, one thread: about 6 min)::

    .venv/bin/python docs/measurements/vision_reuse_rules.py --bundle bundles/transfer_cube-smolvla --bag BAG
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from vla_accel_ros.bench.cache_bench import PRESETS
from vla_accel_ros.core.cache import CacheConfig
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import SyncConfig
from vla_accel_ros.io.bag_reader import BagReader
from vla_accel_ros.models.factory import load_policy

EXACT = {"max_relative_change": 0.0}  # only bit-identical patches are static
RULES = {
    "cosine 0.996 (the cache's default test)": {"max_relative_change": 0.1},
    "cosine 0.996, no scene cut": {"max_relative_change": 0.1, "scene_cut_fraction": 0.0},
    "cosine 0.996, reuse age 2": {"max_relative_change": 0.1, "max_reuse_age": 2},
    "bit-identical (the vision-only preset)": EXACT,
    "bit-identical, no scene cut": {**EXACT, "scene_cut_fraction": 0.0},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--bag", required=True, type=Path)
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--stride", type=int, default=5, help="every this many observations")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    full = load_policy(args.bundle, PolicyConfig(parity_check=False))
    episodes: dict[int, list] = {}
    with BagReader(args.bag) as reader:
        for sample in reader.samples(SyncConfig(cameras=tuple(full.spec.cameras))):
            episodes.setdefault(sample.segment, []).append(sample.observation)
    episodes_obs = [obs[:: args.stride] for obs in list(episodes.values())[: args.episodes]]

    reference, vision_ms = [], []
    for obs in episodes_obs:
        full.reset()
        chunks = [full.infer(o) for o in obs]
        reference.append([c.actions for c in chunks])
        vision_ms += [c.timings_ms["vision"] for c in chunks]
    frames = sum(len(o) for o in episodes_obs)
    std = np.concatenate([np.concatenate(r) for r in reference]).std(0) + 1e-6
    print(f"{frames} frames of {args.bag} ({len(episodes_obs)} episodes, observations {args.stride} apart), "
          f"{args.threads} thread(s); full recompute: vision {np.median(vision_ms):.0f} ms")  # fmt: skip
    print(f"{'rule':42s} {'dev/std p50':>11s} {'p90':>6s} {'max':>6s} {'vision ms':>9s} {'reused tokens':>13s}")
    for name, rule in RULES.items():
        cache = CacheConfig.from_dict({**PRESETS["vision-only"], **rule})
        policy = load_policy(args.bundle, PolicyConfig(parity_check=False, accel="cache", cache=cache))
        dev, ms, reused = [], [], []
        for obs, ref in zip(episodes_obs, reference):
            policy.reset()
            for o, a in zip(obs, ref):
                chunk = policy.infer(o)
                dev.append(float((np.abs(chunk.actions - a).max(0) / std).max()))
                ms.append(chunk.timings_ms["vision"])
                reused.append(chunk.stats["vision_reused"])
        d = np.array(dev)
        tokens = len(full.spec.cameras) * policy.model.vis.num_tokens
        print(f"{name:42s} {np.median(d):11.3f} {np.percentile(d, 90):6.3f} {d.max():6.3f} {np.median(ms):9.0f} "
              f"{np.mean(reused):7.0f} / {tokens}")  # fmt: skip


if __name__ == "__main__":
    main()
