"""A deterministic closed loop on a simulated clock: policy + latency + scheduler, no ROS.

Used by the tests and by ``vla-accel bench scheduler`` to compare scheduling modes on the same
run. Events happen in time order: a chunk lands at ``request time + latency`` (between ticks if
the latency says so), ticks come every dt; at each tick the loop steps the scheduler, then asks
it whether to infer, exactly as the action-controller node does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vla_accel_ros.core.scheduling.config import SchedulerConfig
from vla_accel_ros.core.scheduling.metrics import SchedulerMetrics
from vla_accel_ros.core.scheduling.scheduler import ChunkScheduler, InferenceRequest
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation, Policy

# Side-by-side modes of the benchmark: name -> SchedulerConfig overrides.
PRESETS: dict[str, dict] = {
    "sync": {"mode": "sync"},
    "latest_only": {"mode": "async", "aggregation": "latest_only"},
    "weighted_average": {"mode": "async", "aggregation": "weighted_average"},
    "average": {"mode": "async", "aggregation": "average"},
    "conservative": {"mode": "async", "aggregation": "conservative"},
    "temporal_ensemble": {"mode": "async", "aggregation": "temporal_ensemble"},
    "rtc": {"mode": "async", "aggregation": "latest_only", "rtc": True},
}


def preset(name: str, **overrides) -> SchedulerConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown scheduler preset {name!r}; choose from {', '.join(PRESETS)}")
    return SchedulerConfig(**{**PRESETS[name], **overrides})


class SyntheticFlowPolicy:
    """A stand-in flow policy with the failure that makes chunk boundaries hard: every chunk
    follows a smooth reference trajectory but with its own error (a bias plus a drift growing
    along the chunk), so consecutive chunks disagree where they overlap. Guidance is honoured
    the way RTC inpainting behaves: frozen rows reproduce ``prev_actions``; the rest move toward
    them by their weight."""

    def __init__(
        self,
        *,
        horizon: int = 50,
        action_dim: int = 14,
        dt: float = 0.02,
        bias: float = 0.02,
        drift: float = 0.05,
        seed: int = 0,
    ) -> None:
        self.horizon, self.action_dim, self.dt = horizon, action_dim, dt
        self.bias, self.drift, self.seed = bias, drift, seed
        rng = np.random.default_rng(seed)
        self._amp = rng.uniform(0.2, 0.6, action_dim)  # [D] rad
        self._freq = rng.uniform(0.2, 0.8, action_dim)  # [D] Hz, ALOHA-like arm motion
        self._phase = rng.uniform(0.0, 2.0 * np.pi, action_dim)  # [D]
        self.calls = 0

    def reference(self, t_ns: np.ndarray | int) -> np.ndarray:
        """The trajectory the task wants, at times ``t_ns`` [T] (or one time).  # [T, D]"""
        t = np.atleast_1d(np.asarray(t_ns, np.float64)) / 1e9
        return self._amp * np.sin(2.0 * np.pi * self._freq * t[:, None] + self._phase)

    def infer(
        self, obs: Observation, *, noise: np.ndarray | None = None, guidance: ChunkGuidance | None = None
    ) -> ActionChunk:
        rng = np.random.default_rng((self.seed, self.calls))
        times = obs.stamp_ns + np.round(np.arange(self.horizon) * self.dt * 1e9).astype(np.int64)
        ramp = (np.arange(self.horizon) + 1.0)[:, None] / self.horizon  # [H, 1]
        err = rng.normal(0.0, self.bias, self.action_dim) + ramp * rng.normal(0.0, self.drift, self.action_dim)
        actions = self.reference(times) + err  # [H, D]
        if guidance is not None:
            w = guidance.weights.astype(np.float64)[:, None]  # [H, 1]
            actions = actions + w * (guidance.prev_actions - actions)
            actions[: guidance.frozen] = guidance.prev_actions[: guidance.frozen]
        self.calls += 1
        return ActionChunk(actions=actions.astype(np.float32), stamp_ns=obs.stamp_ns, dt=self.dt, chunk_id=self.calls)

    def reset(self) -> None:
        self.calls = 0


@dataclass
class SimResult:
    metrics: SchedulerMetrics
    times_ns: np.ndarray  # [T] tick times
    actions: np.ndarray  # [T, D] commanded actions (NaN where none)
    holding: np.ndarray  # [T] bool
    labels: np.ndarray  # [T] merge label of each tick (-1 holding)
    # (request, the chunk it produced, arrival time ns), in request order
    exchanges: list[tuple[InferenceRequest, ActionChunk, int]] = field(default_factory=list)
    tracking_rmse: float = float("nan")  # vs the policy's reference, when it has one


def constant_latency(ms: float, jitter_ms: float = 0.0, seed: int = 0) -> Callable[[int], float]:
    """Latency of request i: ``ms`` plus Gaussian jitter (clipped at 1 ms), deterministic."""
    rng = np.random.default_rng(seed)
    draws: list[float] = []

    def sample(i: int) -> float:
        while len(draws) <= i:
            draws.append(max(1.0, ms + jitter_ms * float(rng.standard_normal())) if jitter_ms else ms)
        return draws[i]

    return sample


def simulate(
    config: SchedulerConfig,
    policy: Policy,
    *,
    latency_ms: float | Callable[[int], float],
    duration_s: float = 10.0,
    obs_delay_ms: float = 0.0,
    start_ns: int = 1_000_000_000,
) -> SimResult:
    """Run ``policy`` under ``config`` for ``duration_s`` of simulated time. ``latency_ms`` is
    the time from observation to chunk arrival (a number, or a function of the request index);
    ``obs_delay_ms`` ages each observation (camera latency) before the request is made."""
    latency = latency_ms if callable(latency_ms) else constant_latency(float(latency_ms))
    sched = ChunkScheduler(config)
    dt_ns = config.dt * 1e9
    n_ticks = int(round(duration_s * config.control_rate_hz))
    times = start_ns + np.round(np.arange(n_ticks) * dt_ns).astype(np.int64)
    out: list[np.ndarray | None] = []
    holding, labels = np.zeros(n_ticks, bool), np.zeros(n_ticks, np.int64)
    exchanges: list[tuple[InferenceRequest, ActionChunk, int]] = []
    in_flight: tuple[int, ActionChunk] | None = None
    for k, now in enumerate(times.tolist()):
        if in_flight is not None and in_flight[0] <= now:
            sched.add_chunk(in_flight[1], in_flight[0])
            in_flight = None
        r = sched.step(now)
        out.append(r.action)
        holding[k], labels[k] = r.holding, r.label
        if in_flight is None and sched.wants_inference(now):
            stamp = now - int(round(obs_delay_ms * 1e6))
            request = sched.request_inference(now, stamp)
            obs = Observation(images={}, instruction="", stamp_ns=stamp, state=r.action)
            chunk = policy.infer(obs, guidance=request.guidance)
            arrival = stamp + int(round(latency(len(exchanges)) * 1e6))
            in_flight = (max(arrival, now), chunk)
            exchanges.append((request, chunk, in_flight[0]))
    dim = next((a.shape[0] for a in out if a is not None), 0)
    nothing = np.full(dim, np.nan, np.float32)
    actions = np.array([nothing if a is None else a for a in out], np.float32).reshape(n_ticks, dim)
    result = SimResult(sched.metrics(), times, actions, holding, labels, exchanges)
    reference = getattr(policy, "reference", None)
    if reference is not None and dim:
        ok = ~np.isnan(actions).any(axis=1)  # the start-up wait commands nothing
        if ok.any():
            result.tracking_rmse = float(np.sqrt(np.mean((actions[ok] - reference(times[ok])) ** 2)))
    return result
