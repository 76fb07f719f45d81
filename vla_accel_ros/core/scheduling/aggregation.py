"""How two predictions of the same future time steps combine. Stateless.

Every function takes the queued actions ``old`` [N, D], the new chunk's actions for the same
steps ``new`` [N, D] and ``count`` [N], how many predictions are already merged into each
queued row (1 for a row from a single chunk), and returns the merged rows [N, D].
The pairwise weights follow LeRobot's async inference; ``average`` and ``temporal_ensemble``
use ``count`` so every prediction keeps its weight however many chunks overlap.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vla_accel_ros.core.scheduling.config import AGGREGATIONS


def latest_only(old: np.ndarray, new: np.ndarray, count: np.ndarray) -> np.ndarray:
    return new.copy()


def weighted_average(old: np.ndarray, new: np.ndarray, count: np.ndarray) -> np.ndarray:
    return 0.3 * old + 0.7 * new


def conservative(old: np.ndarray, new: np.ndarray, count: np.ndarray) -> np.ndarray:
    return 0.7 * old + 0.3 * new


def average(old: np.ndarray, new: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Running mean: with ``old`` the mean of ``count`` predictions, all count+1 weigh the same."""
    n = count.astype(np.float64)[:, None]  # [N, 1]
    return old + (new - old) / (n + 1.0)


def temporal_ensemble(old: np.ndarray, new: np.ndarray, count: np.ndarray, coeff: float = 0.01) -> np.ndarray:
    """ACT's temporal ensemble, incrementally: prediction j (0 = oldest) weighs exp(-coeff*j).

    ``old`` is the weighted mean of predictions 0..n-1, whose weights sum to
    W_n = sum_j exp(-coeff*j); the new one, number n, weighs exp(-coeff*n).
    """
    n = count.astype(np.float64)[:, None]  # [N, 1]
    if coeff == 0.0:
        w_sum = n
    else:
        w_sum = np.expm1(-coeff * n) / np.expm1(-coeff)
    w_new = np.exp(-coeff * n)
    return (w_sum * old + w_new * new) / (w_sum + w_new)


_PAIRWISE: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "latest_only": latest_only,
    "weighted_average": weighted_average,
    "conservative": conservative,
    "average": average,
}


def aggregate(mode: str, old: np.ndarray, new: np.ndarray, count: np.ndarray, coeff: float = 0.01) -> np.ndarray:
    """Merge ``new`` into ``old`` with aggregation ``mode``; keeps ``old``'s dtype.  # [N, D]"""
    if old.shape != new.shape or count.shape != old.shape[:1]:
        raise ValueError(f"aggregate: old {old.shape}, new {new.shape} and count {count.shape} disagree")
    if mode == "temporal_ensemble":
        out = temporal_ensemble(old, new, count, coeff)
    elif mode in _PAIRWISE:
        out = _PAIRWISE[mode](old, new, count)
    else:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")
    return out.astype(old.dtype, copy=False)
