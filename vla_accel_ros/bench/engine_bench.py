"""Engine vs plain transformers, and partial recompute vs full prefill, side by side.

Every comparison runs both contenders on the same inputs in the same process, interleaved
(A, B, A, B, ...) after a warm-up, and reports medians, p95 and the ratio of medians.
Absolute CPU times drift from run to run; the ratios are the figures to quote.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.parity import fixed_observation
from vla_accel_ros.core.prefix import PrefixPlan


@dataclass
class Pair:
    name: str
    baseline: str
    contender: str
    base_ms: list[float]
    cont_ms: list[float]

    @staticmethod
    def _p(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q))

    @property
    def speedup(self) -> float:
        return statistics.median(self.base_ms) / statistics.median(self.cont_ms)

    def row(self) -> dict:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "contender": self.contender,
            "baseline_ms": {"p50": self._p(self.base_ms, 50), "p95": self._p(self.base_ms, 95)},
            "contender_ms": {"p50": self._p(self.cont_ms, 50), "p95": self._p(self.cont_ms, 95)},
            "speedup": self.speedup,
        }


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t) / 1e6


def interleave(name: str, baseline: tuple[str, Callable], contender: tuple[str, Callable], repeats: int, warmup: int = 1) -> Pair:
    for _ in range(warmup):
        baseline[1]()
        contender[1]()
    b, c = [], []
    for _ in range(repeats):
        b.append(_time(baseline[1]))
        c.append(_time(contender[1]))
    return Pair(name, baseline[0], contender[0], b, c)


def reuse_plan(layout, fraction: float, seed: int = 0) -> PrefixPlan:
    """Reuse ``fraction`` of the image tokens at every layer; recompute the rest and the text."""
    rng = np.random.default_rng(seed)
    img = layout.image_slots().numpy()
    reused = set(rng.choice(img, size=int(round(fraction * img.size)), replace=False).tolist())
    reused.update(layout.fixed_slots)
    rows = torch.tensor([s for s in range(layout.length) if s not in reused])
    return PrefixPlan(layer_slots=[rows] * layout.num_layers, full=False)


def run_engine_bench(policy, repeats: int = 5, fractions=(0.4, 0.6, 0.8), on_pair: Callable[[Pair], None] | None = None) -> list[Pair]:
    """Every comparison, interleaved; ``on_pair`` is called as each one completes (progress)."""
    pairs: list[Pair] = []

    def add(pair: Pair) -> None:
        pairs.append(pair)
        if on_pair is not None:
            on_pair(pair)

    spec = policy.spec
    obs = fixed_observation(spec)
    layout, ids = policy.layout_of(obs)
    frames = policy.frames(obs)
    cams = list(range(len(layout.cameras)))
    full = policy.prefix_embeddings(obs, layout, ids, frames.pixels, cams)
    engine = policy.prefix_engine
    policy.prepare_cache(layout)
    all_slots = layout.all_slots()
    full_step = StepPlan(slots=all_slots, positions=all_slots, output_slots=all_slots[-1:])

    def eng_prefill():
        return engine.forward(full[None], full_step)

    # The family's comparisons: the prefill, its step after the prefill (a denoise step, a
    # decode token) and a whole inference, each transformers against the engine.
    for name, baseline, contender, times in policy.bench_pairs(obs, layout, full):
        add(interleave(name, baseline, contender, repeats * times))

    # Partial recompute: the cache holds this observation's K/V from the full prefill above.
    eng_prefill()
    for frac in fractions:
        plan = reuse_plan(layout, frac)
        rows = plan.layer_slots[0]
        step = StepPlan(slots=rows, positions=rows, layer_slots=plan.layer_slots, output_slots=all_slots[-1:])
        x_rows = full[rows][None]
        add(
            interleave(
                f"prefill, {int(frac * 100)}% image reuse",
                ("engine full", eng_prefill),
                ("engine partial", lambda s=step, xr=x_rows: engine.forward(xr, s)),
                repeats,
            )
        )
    return pairs


def format_table(pairs: list[Pair]) -> str:
    lines = [
        f"{'comparison':<28} {'baseline':<14} {'p50 ms':>9} {'p95 ms':>9}   {'contender':<15} {'p50 ms':>9} {'p95 ms':>9} {'speedup':>8}",
    ]
    for p in pairs:
        r = p.row()
        lines.append(
            f"{p.name:<28} {p.baseline:<14} {r['baseline_ms']['p50']:9.1f} {r['baseline_ms']['p95']:9.1f}   "
            f"{p.contender:<15} {r['contender_ms']['p50']:9.1f} {r['contender_ms']['p95']:9.1f} {p.speedup:7.2f}x"
        )
    return "\n".join(lines)
