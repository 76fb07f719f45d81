"""``vla-accel bench <kind>``: side-by-side benchmarks. Kinds register in ``BENCHES``."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

BENCHES = ("vla_accel_ros.cli.bench_cmd", "vla_accel_ros.cli.cache_bench_cmd", "vla_accel_ros.cli.sched_cmd")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bsub = p.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    for name in BENCHES:
        importlib.import_module(name).register_bench(bsub)


def register_bench(bsub: argparse._SubParsersAction) -> None:
    e = bsub.add_parser("engine", help="engine vs transformers; partial recompute vs full prefill")
    e.add_argument("--bundle", required=True)
    e.add_argument("--repeats", type=int, default=5)
    e.add_argument("--reuse", default="0.4,0.6,0.8", help="image-token reuse fractions to time")
    e.add_argument("--json", type=Path, help="also write the rows as JSON here")
    e.set_defaults(func=_engine)


def _engine(args: argparse.Namespace) -> int:
    import torch

    from vla_accel_ros.bench.engine_bench import format_table, run_engine_bench
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(args.bundle, PolicyConfig(accel="none"))
    fractions = tuple(float(f) for f in args.reuse.split(",") if f)
    pairs = run_engine_bench(policy, repeats=args.repeats, fractions=fractions)
    print(f"bundle {args.bundle} ({policy.spec.family}), torch threads {torch.get_num_threads()}, "
          f"{args.repeats} interleaved repeats after warm-up")
    print(format_table(pairs))
    if args.json:
        args.json.write_text(json.dumps([p.row() for p in pairs], indent=2) + "\n")
    return 0
