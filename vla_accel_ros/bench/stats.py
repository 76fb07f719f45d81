"""Summary statistics the benchmarks share: percentiles and action deviation from a reference
run on the same frames."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (NaN for no samples)."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def distribution(xs: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 50), "p95": percentile(xs, 95), "p99": percentile(xs, 99), "mean": float(np.mean(xs)),
            "min": float(np.min(xs)), "max": float(np.max(xs))}  # fmt: skip


def action_std(spec) -> np.ndarray:
    """The bundle's per-dimension action spread (its std; half the min-max or quantile range
    where the statistics have no std), floored so a constant joint cannot divide by 0.  # [D]"""
    st = spec.norm_stats["action"]
    lo, hi = ("min", "max") if "min" in st else ("q01", "q99")
    spread = st["std"] if "std" in st else (np.asarray(st[hi]) - np.asarray(st[lo])) / 2
    return np.maximum(np.asarray(spread, dtype=np.float32), 1e-6)


@dataclass
class Deviation:
    """Per frame, how far a run's actions are from the reference run's (robot units)."""

    max_abs: list[float]  # max |delta| over the chunk
    mean_abs: list[float]
    max_over_std: list[float]  # max |delta| / action std: comparable across joints
    token_share: list[float] | None  # ar: share of identical action tokens
    identical_chunks: float | None  # ar: share of frames whose tokens all agree


def action_deviation(
    actions: Sequence[np.ndarray],
    ref_actions: Sequence[np.ndarray],
    std: np.ndarray,
    tokens: Sequence[Sequence[int]] = (),
    ref_tokens: Sequence[Sequence[int]] = (),
) -> Deviation:
    deltas = [np.abs(a - b) for a, b in zip(actions, ref_actions)]  # [H, D] each
    share = chunks = None
    if tokens and ref_tokens:
        share = [float(np.mean([x == y for x, y in zip(a, b)])) for a, b in zip(tokens, ref_tokens)]
        chunks = float(np.mean([list(a) == list(b) for a, b in zip(tokens, ref_tokens)]))
    return Deviation(
        max_abs=[float(d.max()) for d in deltas],
        mean_abs=[float(d.mean()) for d in deltas],
        max_over_std=[float((d / std).max()) for d in deltas],
        token_share=share,
        identical_chunks=chunks,
    )
