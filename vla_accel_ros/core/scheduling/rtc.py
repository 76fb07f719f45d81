"""Real-Time Chunking, the scheduler's side (Black et al. 2025, "Real-Time Execution of Action
Chunking Flow Policies").

While chunk n+1 is inferred, the first d actions of its time base are executed from chunk n:
they are committed. The policy is told so through :class:`ChunkGuidance`: it reproduces those
d actions exactly (hard mask) and guides the following ones toward chunk n with weights that
decay to 0 (soft mask), so the new chunk continues the executed one instead of jumping.

:func:`prefix_weights` is the paper's soft-mask schedule; flow policies import it from here.
"""

from __future__ import annotations

import math

import numpy as np

from vla_accel_ros.core.types import ChunkGuidance


def prefix_weights(frozen: int, end: int, horizon: int, schedule: str = "exp") -> np.ndarray:
    """Guidance weights over a chunk.  # [horizon] float32

    1 on [0, frozen), decaying on [frozen, end), 0 on [end, horizon). ``exp`` is the paper's
    W_i = c_i (e^{c_i} - 1) / (e - 1) with c_i = (end - i) / (end - frozen + 1); ``linear``
    is c_i; ``ones`` keeps 1 up to ``end``; ``zeros`` guides the frozen prefix only.
    ``end`` below ``frozen`` is raised to it: committed actions are always frozen.
    """
    if horizon < 0 or frozen < 0:
        raise ValueError(f"prefix_weights: horizon={horizon} and frozen={frozen} must be >= 0")
    frozen = min(frozen, horizon)
    end = min(max(end, frozen), horizon)
    w = np.zeros(horizon, np.float64)
    w[:frozen] = 1.0
    i = np.arange(frozen, end)
    c = (end - i) / (end - frozen + 1.0)  # in (0, 1), 1 - 1/(n+1) right after the prefix
    if schedule == "exp":
        w[frozen:end] = c * np.expm1(c) / (math.e - 1.0)
    elif schedule == "linear":
        w[frozen:end] = c
    elif schedule == "ones":
        w[frozen:end] = 1.0
    elif schedule != "zeros":
        raise ValueError(f"unknown RTC schedule {schedule!r}; choose exp, linear, ones or zeros")
    return w.astype(np.float32)


def delay_steps(latency_ms: float, dt: float) -> int:
    """Control steps that elapse during ``latency_ms``: the d of RTC (ceil, so a chunk due at
    exactly a tick counts that tick as still executed from the old chunk's time)."""
    steps = latency_ms / (dt * 1e3)
    return max(0, math.ceil(steps - 1e-9))


def make_guidance(
    prev: np.ndarray, available: int, frozen: int, *, execution_horizon: int, max_guidance: float, schedule: str
) -> ChunkGuidance:
    """Guidance for a new chunk from ``prev`` [H, D], the old plan re-indexed to the new chunk's
    time base; only its first ``available`` rows are real plan (the rest repeat the hold value).

    The soft region ends at ``execution_horizon`` (0: the whole chunk), capped by ``available``
    because past the old plan there is nothing to continue.
    """
    horizon = prev.shape[0]
    end = min(execution_horizon or horizon, available)
    weights = prefix_weights(frozen, end, horizon, schedule)
    return ChunkGuidance(prev_actions=prev, frozen=min(frozen, horizon), weights=weights, max_guidance=max_guidance)
