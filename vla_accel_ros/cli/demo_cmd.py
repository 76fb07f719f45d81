"""``vla-accel demo``: the main job (``make demo``).

Creates the demo bundles when missing, passes each through the parity gate, runs both
families on a synthetic moving-arm camera stream with every available acceleration mode,
and prints latency and speedup figures measured side by side.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: demo bundles, parity gate, side-by-side figures")
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--frames", type=int, default=8, help="frames per family (after one warm-up frame)")
    p.add_argument("--workdir", type=Path, default=Path("artifacts"), help="where bundles and reports go")
    p.set_defaults(func=_run)


def ensure_demo_bundle(workdir: Path, family: str, size: str) -> Path:
    from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE
    from vla_accel_ros.models.factory import create_demo_bundle

    path = workdir / "bundles" / f"{family}-{size}"
    if not ((path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()):
        print(f"creating demo bundle {path} ...", flush=True)
        create_demo_bundle(family, size, path)
    return path


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from vla_accel_ros.bench.synthetic import synthetic_observations
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    for family in ("ar", "flow"):
        path = ensure_demo_bundle(args.workdir, family, args.size)
        policy = load_policy(path, PolicyConfig(accel="none"))
        print(f"\n== {family} ({path}): parity gate")
        print(policy.parity_report.table())
        frames = synthetic_observations(policy.spec, args.frames + 1)
        noise = np.random.default_rng(0).standard_normal((policy.spec.chunk_size, policy.spec.action_dim)).astype(np.float32)
        ref_ms, eng_ms, stages = [], [], {}
        for i, obs in enumerate(frames):
            ref = policy.reference_infer(obs, **({"noise": noise} if family == "flow" else {}))
            got = policy.infer(obs, noise=noise)
            if i == 0:
                continue  # warm-up
            ref_ms.append(ref.timings_ms["total"])
            eng_ms.append(got.timings_ms["total"])
            for k, v in got.timings_ms.items():
                stages.setdefault(k, []).append(v)
        p50 = lambda xs: float(np.median(xs))  # noqa: E731
        print(f"== {family}: obs-to-action latency over {args.frames} synthetic frames (interleaved)")
        print(f"  transformers forward   p50 {p50(ref_ms):8.1f} ms   p95 {np.percentile(ref_ms, 95):8.1f} ms")
        print(f"  engine                 p50 {p50(eng_ms):8.1f} ms   p95 {np.percentile(eng_ms, 95):8.1f} ms"
              f"   speedup {p50(ref_ms) / p50(eng_ms):.2f}x")
        print("  engine stages (p50 ms): " + ", ".join(f"{k} {p50(v):.1f}" for k, v in stages.items() if k != "total"))
    return 0
