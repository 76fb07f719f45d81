"""What the engine's plan memo buys: a flow policy's denoise with and without each thing the
engine kept between the forwards of one plan (docs/results.md, "Engine plan memo").

Variants, as policies sharing one model's weights, interleaved per frame in one process:

* ``before``: the engine of commit 3e2cbf2 (it kept each layer's windows, the gathered keys
  updated in place while nothing else wrote the cache, and handed a bf16 attention output to a
  bf16 ``o_proj`` as it is, ``takes_bf16``);
* ``before_no_handoff``: the same engine without the ``takes_bf16`` handoff;
* ``now``: this engine (the per-layer windows only);
* ``now_no_windows``: this engine with its windows cleared before every forward.

Usage, from the repository root (the bundle and bag as in docs/results.md)::

    git show 3e2cbf2:vla_accel_ros/core/engine.py > /tmp/engine_before.py
    vla-accel bundle create-demo --family flow --size small --out B_flow
    vla-accel sim record --task transfer_cube --episodes 1 --steps 40 --out BAG
    .venv/bin/python docs/measurements/engine_plan_memo.py B_flow BAG /tmp/engine_before.py [frames]
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import torch

from vla_accel_ros.core import engine as now
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import preset
from vla_accel_ros.core.robot.config import SyncConfig
from vla_accel_ros.io.bag_reader import BagReader
from vla_accel_ros.models.factory import load_bundle, load_policy, sibling_policy


class NoWindows(now.Engine):
    def _forward(self, x, plan, differentiable):
        scratch = plan.memo.get("engine")
        if scratch is not None:
            scratch.windows.clear()
        return super()._forward(x, plan, differentiable)


def main(bundle_path: str, bag: str, before_path: str, frames: int = 40) -> None:
    spec = importlib.util.spec_from_file_location("engine_before", before_path)
    before = importlib.util.module_from_spec(spec)
    sys.modules["engine_before"] = before
    spec.loader.exec_module(before)
    torch.set_num_threads(1)
    bundle = load_bundle(bundle_path)
    fp32 = load_policy(bundle, PolicyConfig.from_dict({"parity_check": False, "num_threads": 1}))
    cfg = PolicyConfig.from_dict({
        "accel": "cache+prune", "parity_check": False, "num_threads": 1, "precision": preset("auto"),
        "cache": {"topk_reuse": 256, "relevance_mode": "off"},  # the max-reuse settings
    })  # fmt: skip
    converted: dict = {}
    names = ("before", "before_no_handoff", "now", "now_no_windows")
    policies = {n: sibling_policy(fp32, cfg, converted=converted) for n in names}
    for name, engine_class in (("before", before.Engine), ("before_no_handoff", before.Engine), ("now_no_windows", NoWindows)):
        for engine in (policies[name].vlm_engine, policies[name].expert_engine):
            engine.__class__ = engine_class
    # The converted weights are shared: the handoff is switched per call, by the engine that runs.
    handoff = [m.o_proj for m in policies["before"].model.modules() if hasattr(m, "o_proj")]
    sync = SyncConfig.from_dict({"cameras": tuple(bundle.spec.cameras)})
    with BagReader(bag) as reader:
        observations = [s.observation for s in reader.samples(sync)][:frames]
    times = {n: [] for n in names}
    actions = {n: [] for n in names}
    for i, obs in enumerate(observations):
        noise = np.random.default_rng(i).standard_normal(fp32.noise_shape).astype(np.float32)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # a rotating order
            for p in handoff:
                p.takes_bf16 = name == "before"
            chunk = policies[name].infer(obs, noise=noise)
            if i >= 2:  # warm-up
                times[name].append(chunk.timings_ms["denoise"])
                actions[name].append(chunk.actions)
    for name in names:
        t = np.asarray(times[name])
        same = all(np.array_equal(a, b) for a, b in zip(actions[name], actions["now"]))
        print(f"{name:18s} denoise p50 {np.median(t):7.2f} ms, mean {t.mean():7.2f}; paired median ratio to now "
              f"{np.median(np.asarray(times['now']) / t):.4f}; actions identical to now: {same}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
