"""The action-chunk scheduler: chunks in, one action per control tick out.

ROS-free and clock-free: every call takes ``now_ns`` from the caller's clock, so the node
passes ROS time and tests pass a counter. The action controller calls, from its timer::

    result = scheduler.step(now)                  # the action for this tick, or a hold
    if scheduler.wants_inference(now):
        request = scheduler.request_inference(now, obs.stamp_ns)
        # ... policy.infer(obs, guidance=request.guidance), asynchronously ...
    scheduler.add_chunk(chunk, now)               # whenever a chunk arrives

Time is what keeps execution honest: every action is meant for ``stamp + i*dt``; an action
whose tick has passed is dropped, never executed late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vla_accel_ros.core.scheduling import rtc
from vla_accel_ros.core.scheduling.aggregation import aggregate
from vla_accel_ros.core.scheduling.config import SchedulerConfig
from vla_accel_ros.core.scheduling.latency import LatencyTracker
from vla_accel_ros.core.scheduling.metrics import MetricsRecorder, SchedulerMetrics
from vla_accel_ros.core.errors import SchedulerError
from vla_accel_ros.core.scheduling.queue import ActionTimeline
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance

MAX_CHUNK_SPAN_S = 60.0  # longest time a chunk may cover (action chunks span ~0.2-2 s)

_HOLD = -1  # label of a tick that commanded no planned action


@dataclass(frozen=True)
class StepResult:
    action: np.ndarray | None  # [D] float32; None before any action exists or while holding with hold='none'
    slot: int  # control tick index on the scheduler's grid
    holding: bool  # the queue was dry: ``action`` repeats the last commanded one
    blending: bool  # ``action`` is on the way back from a hold into a new chunk
    stale: int  # planned actions skipped because this tick came late
    label: int  # which merge produced the action (-1 while holding); changes mark chunk switches


@dataclass(frozen=True)
class InferenceRequest:
    stamp_ns: int  # stamp of the observation to infer from; guidance is indexed to it
    issued_ns: int
    delay_steps: int  # d: control steps expected to pass before the chunk lands
    guidance: ChunkGuidance | None  # RTC guidance for a flow policy (rtc=True and a plan to continue)


class ChunkScheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        c = self.config
        self._latency = LatencyTracker(
            window=c.latency_window, percentile=c.latency_percentile, initial_ms=c.initial_latency_ms
        )
        self._metrics = MetricsRecorder(c.dt)
        self.reset()

    def reset(self, hold_action: np.ndarray | None = None) -> None:
        """Start a new run: forget the plan, the request in flight and the metrics (latency
        samples stay: they describe the system, not the episode). ``hold_action`` [D], e.g. the
        robot's current joint positions, is held until the first chunk and blended out of."""
        self._q = ActionTimeline(self.config.dt)
        self._last = None if hold_action is None else np.array(hold_action, np.float32).reshape(-1)
        self._dim = None if self._last is None else self._last.shape[0]
        self._holding = False  # the last tick found the queue dry
        self._blend_until = -1  # slots before this are blended out of a hold
        self._request: InferenceRequest | None = None
        self._request_pos = 0.0  # grid position of the request's observation stamp
        self._chunks = 0
        self._chunk_rows = 0  # H of the latest chunk (policy steps)
        self._span = 0  # control slots the latest chunk covers
        self._since_chunk = 0  # actions executed since the latest chunk arrived (sync)
        self._metrics.clear()

    # -- state --------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Planned actions not yet executed."""
        return self._q.pending

    @property
    def span(self) -> int:
        """Control slots the latest chunk covers (:meth:`add_chunk` returns how many were past)."""
        return self._span

    @property
    def in_flight(self) -> InferenceRequest | None:
        return self._request

    def delay_steps(self) -> int:
        """Control steps the percentile latency spans: RTC's d."""
        return rtc.delay_steps(self._latency.estimate(), self.config.dt)

    def record_latency(self, ms: float) -> None:
        """Add a latency sample measured elsewhere (e.g. a warm-up benchmark before the loop);
        :meth:`add_chunk` records ``now - chunk.stamp_ns`` by itself."""
        self._latency.record(ms)

    def metrics(self) -> SchedulerMetrics:
        return self._metrics.summary(
            latency_p50_ms=self._latency.estimate(50.0),
            latency_p95_ms=self._latency.estimate(),
            delay_steps=self.delay_steps(),
        )

    # -- chunks in ----------------------------------------------------------------------------
    def add_chunk(self, chunk: ActionChunk, now_ns: int) -> int:
        """Merge a chunk that arrived at ``now_ns``; returns how many of its actions were
        already stale (their tick has passed) and so were dropped."""
        q = self._q
        actions = self._check(chunk)
        q.anchor(chunk.stamp_ns)
        latency_ms = (now_ns - chunk.stamp_ns) / 1e6
        if latency_ms >= 0:  # a negative one means the clocks disagree; it says nothing about d
            self._latency.record(latency_ms)
        start, new = q.place(actions, chunk.stamp_ns, chunk.dt)  # new: [M, D] from slot start
        self._chunk_rows, self._span = actions.shape[0], new.shape[0]
        boundary = max(q.cursor, q.slot(now_ns))  # first slot still to come
        stale = int(np.clip(boundary - start, 0, new.shape[0]))
        start, new = start + stale, new[stale:]
        request = self._request
        if request is not None and chunk.stamp_ns >= request.stamp_ns:
            self._request = None  # answered; an older chunk (from a timed-out request) is not the answer
        self._chunks += 1
        self._since_chunk = 0
        if new.shape[0]:
            answers = request is not None and request.guidance is not None and request.stamp_ns == chunk.stamp_ns
            self._merge(start, new, self._chunks, request if answers else None)
            if self._holding and self._last is not None:
                self._blend_in(start)
        self._metrics.on_chunk(stale)
        return stale

    def _check(self, chunk: ActionChunk) -> np.ndarray:
        a = np.asarray(chunk.actions, np.float32)
        if a.ndim != 2 or a.shape[0] == 0:
            raise SchedulerError(f"chunk {chunk.chunk_id}: actions must be [H, D] with H >= 1, got {a.shape}")
        if self._dim is not None and a.shape[1] != self._dim:
            raise SchedulerError(f"chunk {chunk.chunk_id}: action dim {a.shape[1]}, the scheduler runs {self._dim}")
        if not np.isfinite(a).all():
            raise SchedulerError(f"chunk {chunk.chunk_id} has non-finite actions; refusing to command them")
        if not (math.isfinite(chunk.dt) and chunk.dt > 0):
            raise SchedulerError(f"chunk {chunk.chunk_id}: dt must be finite and > 0, got {chunk.dt}")
        if (a.shape[0] - 1) * chunk.dt > MAX_CHUNK_SPAN_S:
            # The plan holds one row per control slot the chunk spans: a wrong dt must not
            # allocate minutes of rows (or, at 1e300, crash the tick).
            raise SchedulerError(
                f"chunk {chunk.chunk_id}: {a.shape[0]} actions at dt {chunk.dt:g} s span "
                f"{(a.shape[0] - 1) * chunk.dt:g} s > {MAX_CHUNK_SPAN_S:g} s"
            )
        if self.config.rtc and abs(chunk.dt - self.config.dt) > 1e-9:
            raise SchedulerError(
                f"rtc=True needs chunks at the control rate (dt {self.config.dt}), chunk {chunk.chunk_id} has dt "
                f"{chunk.dt}: RTC guidance is indexed in control steps"
            )
        self._dim = a.shape[1]
        return a

    def _merge(self, start: int, new: np.ndarray, seq: int, request: InferenceRequest | None) -> None:
        """Write ``new`` [M, D] from slot ``start`` (>= the cursor) over the plan."""
        c, q = self.config, self._q
        n = new.shape[0]
        overlap = int(np.clip(q.end - start, 0, n))  # planned rows the new chunk also covers
        i = q.index(start)
        old, old_label, old_count = q.values[i : i + overlap], q.label[i : i + overlap], q.count[i : i + overlap]
        out = new.copy()
        # Aggregated rows get their own label so the switch into and out of them both count.
        label = np.full(n, 2 * seq + 1, np.int64)
        count = np.ones(n, np.int64)
        if request is not None:
            # RTC: the first d steps of the new time base were committed; keep them bit for bit.
            keep = int(np.clip(math.ceil(self._request_pos + request.delay_steps - 1e-6) - start, 0, overlap))
            out[:keep], label[:keep], count[:keep] = old[:keep], old_label[:keep], old_count[:keep]
        elif overlap and c.aggregation != "latest_only":
            out[:overlap] = aggregate(c.aggregation, old, new[:overlap], old_count, c.ensemble_coeff)
            label[:overlap] = 2 * seq
            count[:overlap] = old_count + 1
        q.write(start, out, label, count)

    def _blend_in(self, start: int) -> None:
        """After a hold, ease from the held action into the plan over blend_steps rows instead
        of jumping. Written into the plan so guidance sees exactly what will execute."""
        n = min(self.config.blend_steps, self._q.end - start)
        if n <= 0:
            return
        i = self._q.index(start)
        alpha = (np.arange(1, n + 1) / (self.config.blend_steps + 1.0))[:, None]  # [n, 1]
        rows = self._q.values[i : i + n]
        self._q.values[i : i + n] = (self._last + alpha * (rows - self._last)).astype(np.float32)
        self._blend_until = start + n
        self._holding = False  # blend once per hold

    # -- actions out --------------------------------------------------------------------------
    def step(self, now_ns: int) -> StepResult:
        """The action for the control tick at ``now_ns`` (call once per tick)."""
        q = self._q
        q.anchor(now_ns)
        k = q.slot(now_ns)
        if k < q.cursor:  # a second tick inside one period: nothing new is due, repeat
            return self._emit(now_ns, k, self._hold_action(), holding=True, stale=0, label=_HOLD)
        stale = q.skip_to(k)
        if k < q.end:
            action = q.values[q.index(k)].copy()
            label = int(q.label[q.index(k)])
            self._last, self._holding = action, False
            self._since_chunk += 1
            result = self._emit(now_ns, k, action.copy(), holding=False, stale=stale, label=label)
        else:
            self._holding = True
            if self._last is not None:
                # History records what the robot holds, so RTC guidance can start from it.
                q.write(k, self._last[None], np.array([_HOLD]), np.ones(1, np.int64))
            result = self._emit(now_ns, k, self._hold_action(), holding=True, stale=stale, label=_HOLD)
        q.cursor = k + 1
        q.trim(keep_history=max(2 * self._chunk_rows, 64))
        return result

    def _hold_action(self) -> np.ndarray | None:
        if self.config.hold == "none" or self._last is None:
            return None
        return self._last.copy()

    def _emit(self, now_ns: int, k: int, action, *, holding: bool, stale: int, label: int) -> StepResult:
        blending = (not holding) and k < self._blend_until
        # The tick after the last blended row still closes the ramp: it belongs to the boundary.
        ramp = (not holding) and k <= self._blend_until
        self._metrics.on_step(now_ns, action, label, holding=holding, blending=ramp, stale=stale)
        return StepResult(action, k, holding, blending, stale, label)

    # -- inference requests -------------------------------------------------------------------
    def wants_inference(self, now_ns: int) -> bool:
        """Whether to start an inference now (call after :meth:`step` in the same tick)."""
        c, q = self.config, self._q
        if self._request is not None:
            if now_ns - self._request.issued_ns < c.request_timeout_ms * 1e6:
                return False
            self._request = None  # lost: a dropped message or a crashed policy must not stall us
            self._metrics.on_timeout()
        if self._chunks == 0 or q.pending == 0:
            return True
        if c.mode == "sync":
            return self._since_chunk >= c.execute_horizon
        if q.pending <= c.async_threshold * self._span:
            return True
        return c.latency_aware_trigger and q.pending < self.delay_steps() + c.trigger_margin_steps

    def request_inference(self, now_ns: int, obs_stamp_ns: int | None = None) -> InferenceRequest:
        """Mark an inference as started on the observation stamped ``obs_stamp_ns`` (default
        ``now_ns``); with rtc=True the request carries the guidance for it. In sync mode the rest
        of the plan is dropped: the robot holds while the policy thinks."""
        c, q = self.config, self._q
        stamp = now_ns if obs_stamp_ns is None else int(obs_stamp_ns)
        q.anchor(now_ns)
        d = self.delay_steps()
        guidance = None
        if c.rtc and self._chunks > 0:
            guidance = self._guidance(q.position(stamp), d)
        if c.mode == "sync":
            self._metrics.on_discard(q.truncate())
        self._request = InferenceRequest(stamp_ns=stamp, issued_ns=int(now_ns), delay_steps=d, guidance=guidance)
        self._request_pos = q.position(stamp)
        self._metrics.on_request()
        return self._request

    def _guidance(self, pos: float, d: int) -> ChunkGuidance | None:
        c, h = self.config, self._chunk_rows
        sampled = self._q.sample(pos, h)
        if sampled is None:
            if self._last is None:
                return None
            sampled = (np.repeat(self._last[None], h, axis=0), 0)
        prev, available = sampled  # prev: [H, D] old plan in the new chunk's time base
        return rtc.make_guidance(
            prev,
            available,
            d,
            execution_horizon=c.rtc_execution_horizon,
            max_guidance=c.rtc_max_guidance,
            schedule=c.rtc_schedule,
        )
