"""Per-run execution quality, accumulated in O(1) memory per tick (the node runs for hours)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SchedulerMetrics:
    """What a run looked like from the robot's side. Steps count from the first chunk's arrival
    (waiting for the very first inference is start-up, not holding). Joint units are the
    action units (rad for ALOHA joints)."""

    steps: int  # control ticks
    executed: int  # ticks that commanded a planned action
    holding_steps: int  # ticks with a dry queue
    holding_fraction: float
    hold_events: int  # times the queue ran dry
    chunks: int  # chunks received
    requests: int  # inferences requested
    request_timeouts: int  # requests given up unanswered
    switches: int  # ticks whose action came from a different merge than the previous one
    boundary_disc_max: float  # largest joint step at a switch or inside the blend after a hold
    boundary_disc_mean: float  # mean over switches of the largest joint step
    step_max: float  # largest joint step anywhere (natural motion included), for reference
    jerk_rms: float  # third difference / dt^3, RMS over ticks and joints
    jerk_max: float
    stale_dropped: int  # actions never executed because their time had passed
    discarded: int  # planned actions thrown away by sync re-planning
    tick_rate_hz: float  # ticks per second of run time
    effective_rate_hz: float  # planned actions commanded per second of run time
    latency_p50_ms: float
    latency_p95_ms: float
    delay_steps: int  # the current RTC d / latency in control steps

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


class MetricsRecorder:
    def __init__(self, dt: float) -> None:
        self.dt = dt
        self.clear()

    def clear(self) -> None:
        self.started = False
        self.steps = self.executed = self.holding = self.hold_events = 0
        self.chunks = self.requests = self.timeouts = 0
        self.switches = 0
        self.disc_max = self.disc_sum = self.step_max = 0.0
        self.jerk_sq = self.jerk_max = 0.0
        self.jerk_n = 0
        self.stale = self.discarded = 0
        self.t_first: int | None = None
        self.t_last = 0
        self._was_holding = False
        self._label: int | None = None  # merge of the last planned action
        self._hist: list[np.ndarray] = []  # last three commanded actions, for jerk

    def on_chunk(self, stale: int) -> None:
        self.started = True
        self.chunks += 1
        self.stale += stale

    def on_request(self) -> None:
        self.requests += 1

    def on_timeout(self) -> None:
        self.timeouts += 1

    def on_discard(self, n: int) -> None:
        self.discarded += n

    def on_step(
        self, now_ns: int, action: np.ndarray | None, label: int, *, holding: bool, blending: bool, stale: int
    ) -> None:
        self.stale += stale
        if not self.started:
            return
        if self.t_first is None:
            self.t_first = now_ns
        self.t_last = now_ns
        self.steps += 1
        if holding:
            self.holding += 1
            self.hold_events += not self._was_holding
        else:
            self.executed += 1
        self._was_holding = holding
        if action is None:
            self._hist.clear()  # nothing commanded: no motion to differentiate
            return
        a = action.astype(np.float64)
        if self._hist:
            jump = float(np.max(np.abs(a - self._hist[-1])))
            self.step_max = max(self.step_max, jump)
            if not holding and self._label is not None and label != self._label:
                self.switches += 1
                self.disc_sum += jump
                self.disc_max = max(self.disc_max, jump)
            elif blending:  # a blend spreads the switch over several ticks; all of them are the boundary
                self.disc_max = max(self.disc_max, jump)
        if not holding:
            self._label = label
        self._hist.append(a)
        if len(self._hist) == 4:
            h = self._hist
            jerk = (h[3] - 3.0 * h[2] + 3.0 * h[1] - h[0]) / self.dt**3  # [D]
            self.jerk_sq += float(np.mean(jerk**2))
            self.jerk_max = max(self.jerk_max, float(np.max(np.abs(jerk))))
            self.jerk_n += 1
            h.pop(0)

    def summary(self, *, latency_p50_ms: float, latency_p95_ms: float, delay_steps: int) -> SchedulerMetrics:
        span = 0.0 if self.t_first is None else (self.t_last - self.t_first) / 1e9 + self.dt
        return SchedulerMetrics(
            steps=self.steps,
            executed=self.executed,
            holding_steps=self.holding,
            holding_fraction=self.holding / self.steps if self.steps else 0.0,
            hold_events=self.hold_events,
            chunks=self.chunks,
            requests=self.requests,
            request_timeouts=self.timeouts,
            switches=self.switches,
            boundary_disc_max=self.disc_max,
            boundary_disc_mean=self.disc_sum / self.switches if self.switches else 0.0,
            step_max=self.step_max,
            jerk_rms=float(np.sqrt(self.jerk_sq / self.jerk_n)) if self.jerk_n else 0.0,
            jerk_max=self.jerk_max,
            stale_dropped=self.stale,
            discarded=self.discarded,
            tick_rate_hz=self.steps / span if span else 0.0,
            effective_rate_hz=self.executed / span if span else 0.0,
            latency_p50_ms=latency_p50_ms,
            latency_p95_ms=latency_p95_ms,
            delay_steps=delay_steps,
        )
