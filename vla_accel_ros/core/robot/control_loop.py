"""The action controller's tick without ROS: what ``action_controller_node`` does every control
period, as a class the tests drive with a counter for a clock.

Every :meth:`ControlLoop.tick`:

1. a clock that jumped back (sim time restarted, a bag looped), or an enable / e-stop change,
   restarts the plan from the measured pose;
2. the watchdog: ``safety.watchdog_periods`` control periods of time (periods x dt, on the
   tick's clock, however many ticks ran meanwhile) without a fresh chunk -> hold position (the
   scheduler restarts from the last command and blends into the next chunk);
3. ``scheduler.step`` -> safety filter (limits, per-step clamp) -> the command to send, unless
   output is disabled or the e-stop is active;
4. motion estimate (ViperX FK) of the command: coarse | fine with hysteresis; entering fine
   asks for a new chunk at once;
5. the chunks that arrived are merged (after the step, so the scheduler's grid is anchored on
   the ticks); a chunk that is all past executes its last action late only with
   ``stale_chunks: execute_last`` (otherwise it is dropped and does not refresh the watchdog);
   a chunk stamped more than ``max_future_ms`` ahead of the clock is dropped (it would plan
   the arm's motion from then on and stop all requests);
6. when the scheduler wants a chunk and the policy announced an observation not asked for
   yet: an inference request for it (with Real-Time Chunking guidance when ``scheduler.rtc``);
   an observation stamped in the future the same way is never asked for, nor one older than
   ``max_age_ms`` (a camera stopped: the loop waits for a fresh one, holding on its watchdog).

The node converts messages, calls :meth:`tick` from its timer and sends the command through
:meth:`send`. Enable and e-stop come from other threads (a service, a latched topic):
:meth:`set_enabled` / :meth:`set_estop` are thread-safe and take effect at once: a command a
tick computed before they arrived is withheld by :meth:`send` (counted in ``withheld``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from vla_accel_ros.core.errors import SchedulerError
from vla_accel_ros.core.robot.config import ControllerConfig
from vla_accel_ros.core.robot.motion import MotionEstimate, MotionEstimator
from vla_accel_ros.core.robot.safety import SafetyFilter, Watchdog
from vla_accel_ros.core.scheduling.scheduler import ChunkScheduler, InferenceRequest
from vla_accel_ros.core.types import ActionChunk


@dataclass
class TickOutput:
    command: np.ndarray | None = None  # [D] for the command backend (robot units of the action space)
    motion: MotionEstimate | None = None  # to publish: on a switch and every motion.publish_every ticks
    request: InferenceRequest | None = None  # to send as a chunk request
    request_id: int = 0
    replan: bool = False  # the request was forced by a switch into fine motion
    drops: list[tuple[str, str]] = field(default_factory=list)  # (reason, detail): inputs not used
    warnings: list[str] = field(default_factory=list)  # to log


class ControlLoop:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.scheduler = ChunkScheduler(config.scheduler)
        self.safety = SafetyFilter(config.robot, config.safety)
        self.watchdog = Watchdog(self._watchdog_ns(config))
        self.motion = MotionEstimator(config.robot, config.motion, config.scheduler.dt)
        self._lock = threading.Lock()  # the safety gating, shared with enable / e-stop callers
        self._restart = False  # enable / e-stop changed: restart the plan from the measured pose
        self.tick_count = 0
        self.commands = self.chunks_in = self.requests_out = self.late_actions = 0
        self.withheld = 0  # commands computed, then stopped by an e-stop / disable before they left
        self.got_chunk = False  # waiting for the very first chunk is start-up, not holding
        self.holding_ticks = self.steps = 0
        self._request_id = 0
        self._last_requested = -1  # newest observation stamp asked for
        self._force_request = False
        self._last_now: int | None = None
        self._late: ActionChunk | None = None  # a chunk all past, its last action due at the next tick
        self._refused_stamp = -1  # the future observation stamp dropped last (counted once)
        self._stale_stamp = -1  # the stale observation stamp not asked for last (counted once)

    # -- from other threads --------------------------------------------------------------------
    def set_estop(self, active: bool) -> bool:
        """Returns True when the state changed (releasing it keeps output disabled when
        ``safety.estop_requires_enable``)."""
        with self._lock:
            changed = self.safety.set_estop(active)
            self._restart = self._restart or changed
        return changed

    def set_enabled(self, enabled: bool) -> tuple[bool, str]:
        with self._lock:
            ok, message = self.safety.set_enabled(bool(enabled))
            self._restart = self._restart or ok
        return ok, message

    def send(self, out: TickOutput, publish: Callable[[np.ndarray], None]) -> bool:
        """Publish ``out.command`` unless output was stopped after the tick computed it. Holds
        the gating lock while publishing: an e-stop or disable that arrives now waits for this
        one publish, and once :meth:`set_estop` returns no command leaves."""
        if out.command is None:
            return False
        with self._lock:
            if not self.safety.output_allowed:
                self.commands -= 1
                self.withheld += 1
                return False
            publish(out.command)
            return True

    def gating(self) -> tuple[bool, bool, int, int]:
        """(enabled, e-stop, commands limited, commands clamped), read consistently."""
        with self._lock:
            s = self.safety
            return s.enabled, s.estop, s.limited, s.clamped

    # -- between two ticks ---------------------------------------------------------------------
    def set_config(self, config: ControllerConfig) -> None:
        """An accepted parameter change, all at once (the scheduler reads its config on every call)."""
        self.config = config
        self.scheduler.config = config.scheduler
        with self._lock:
            self.safety.set_config(config.safety)
        self.watchdog.timeout_ns = self._watchdog_ns(config)
        self.motion.set_config(config.motion)

    @staticmethod
    def _watchdog_ns(config: ControllerConfig) -> int:
        return int(config.safety.watchdog_periods * config.scheduler.dt * 1e9)

    def holding_fraction(self) -> float:
        return self.holding_ticks / max(1, self.steps)

    def reset_counts(self) -> None:
        self.commands = self.chunks_in = self.requests_out = 0
        self.holding_ticks = self.steps = 0

    # -- the tick ------------------------------------------------------------------------------
    def tick(
        self, now_ns: int, *, measured: np.ndarray | None, chunks: Sequence[ActionChunk] = (), obs_stamp_ns: int = -1
    ) -> TickOutput:
        """One control period at ``now_ns``. ``measured`` [D]: the joint state (None before the
        first); ``chunks``: those that arrived since the last tick; ``obs_stamp_ns``: the newest
        observation the policy announced (-1: none yet)."""
        out = TickOutput()
        self.tick_count += 1
        with self._lock:
            restart, self._restart = self._restart, False
            allowed = self.safety.output_allowed
        if self._last_now is not None and now_ns < self._last_now:  # the plan is meaningless now
            out.warnings.append("the clock jumped back: restarting the plan")
            restart = True
        self._last_now = int(now_ns)
        if restart:
            self._restart_plan(measured)
        if self.watchdog.check(now_ns):
            out.warnings.append(
                f"watchdog: no fresh chunk for {self.watchdog.timeout_ns / 1e6:.0f} ms "
                f"({self.config.safety.watchdog_periods} periods); holding position"
            )
            last = self.safety.last_command
            self.scheduler.reset(hold_action=last if last is not None else measured)
            self.motion.reset()

        self._place_late(now_ns)
        result = self.scheduler.step(now_ns)
        if self.got_chunk:
            self.steps += 1
            self.holding_ticks += bool(result.holding)
        action = result.action
        if action is not None and allowed and not self.safety.has_reference(measured):
            out.drops.append((
                "no_reference",
                "no usable joint states yet (none arrived, or not finite: see dropped nonfinite_joint_state): "
                "the first command could not be clamped; not commanding",
            ))  # fmt: skip
        elif action is not None and allowed:
            with self._lock:
                out.command = self.safety.filter(action, measured).command
            self.commands += 1
            self._motion_step(out, out.command, result.slot)
        elif not allowed:
            with self._lock:
                self.safety.forget()
        # Chunks merge after the step: the step of a fresh plan anchors the scheduler's grid on
        # these ticks (a chunk stamp, camera time, would put ticks anywhere between two slots,
        # and timer jitter would then repeat and skip slots). They execute from the next tick.
        for chunk in chunks:
            self._add_chunk(out, chunk, now_ns)
        if self.config.request_chunks:
            self._maybe_request(out, now_ns, obs_stamp_ns)
        return out

    def _restart_plan(self, measured: np.ndarray | None) -> None:
        last = self.safety.last_command
        self.scheduler.reset(hold_action=measured if measured is not None else last)
        self.watchdog.reset()
        self.motion.reset()
        self._last_requested = -1
        self._force_request = False  # a replan for the motion before the restart is moot

    def _ahead(self, stamp_ns: int, now_ns: int) -> str:
        """Why ``stamp_ns`` is refused at ``now_ns`` for lying in the future ('' when it is not)."""
        ahead = int(stamp_ns) - int(now_ns)
        limit = self.config.max_future_ms
        return f"stamped {ahead / 1e6:.1f} ms ahead of the clock > max_future_ms {limit:g}" if ahead > limit * 1e6 else ""

    def _add_chunk(self, out: TickOutput, chunk: ActionChunk, now_ns: int) -> None:
        cfg = self.config
        why = self._ahead(chunk.stamp_ns, now_ns)
        if why:
            out.drops.append(("future_chunk", f"chunk {chunk.chunk_id} {why}"))
            return
        try:
            if chunk.joint_names and tuple(chunk.joint_names) != tuple(cfg.robot.joint_names):
                raise SchedulerError(f"chunk {chunk.chunk_id} joint_names {list(chunk.joint_names)} differ from robot.joint_names")
            shape = np.shape(chunk.actions)
            if len(shape) == 2 and shape[1] != cfg.robot.dim:  # a chunk without names is checked by its size
                raise SchedulerError(f"chunk {chunk.chunk_id} has {shape[1]} action dims, the robot {cfg.robot.dim}")
            # Merged after this tick's step, its actions apply from the next tick: that is when it
            # counts as arrived, so the latency (RTC's d) covers every action the old plan ran.
            stale = self.scheduler.add_chunk(chunk, now_ns + int(cfg.scheduler.dt * 1e9))
            # Nothing planned even after this chunk: all of it was in the past (a 1-action chunk
            # stamped between two ticks covers no tick at all). Opt-in late execution: its last
            # action goes to the next tick, placed when that tick comes (a timer running late,
            # as under load, would miss any slot chosen now).
            self._late = chunk if self.scheduler.pending == 0 and cfg.stale_chunks == "execute_last" else None
        except (ValueError, SchedulerError) as e:
            out.drops.append(("bad_chunk", str(e)))
            return
        self.chunks_in += 1
        self.got_chunk = True
        if stale < self.scheduler.span or self._late is not None:
            self.watchdog.chunk(now_ns)
        else:  # the policy answered, later than its whole chunk: nothing of it runs, so the
            # watchdog is armed (the policy started) but not refreshed or released: it would say
            # the arm follows the policy while it holds
            self.watchdog.arm(now_ns)
            out.drops.append(("stale_chunk", f"chunk {chunk.chunk_id}: all of its {stale} control slots are past; none runs"))

    def _place_late(self, now_ns: int) -> None:
        """Plan the late action (``stale_chunks: execute_last``) for the tick at ``now_ns``
        unless a fresher chunk planned it meanwhile: re-stamped to span [now - dt/2, now + dt/2],
        which holds this tick's slot whatever the timer's phase."""
        late, self._late = self._late, None
        if late is None or self.scheduler.pending:
            return
        dt = self.config.scheduler.dt
        stamp = now_ns - int(dt * 0.5e9)
        late = replace(late, actions=np.repeat(np.asarray(late.actions)[-1:], 2, axis=0), stamp_ns=stamp, dt=dt)
        # Arrival just before the new stamp: a copy says nothing about the policy's latency (the
        # chunk itself recorded it); the rows before this tick are past and dropped.
        self.scheduler.add_chunk(late, stamp - 1)
        self.late_actions += 1

    def _motion_step(self, out: TickOutput, cmd: np.ndarray, slot: int) -> None:
        est = self.motion.update(cmd, slot)
        if est.replan and self.config.request_chunks:
            self._force_request = True
        if est.switched or self.tick_count % self.config.motion.publish_every == 0:
            out.motion = est

    def _maybe_request(self, out: TickOutput, now_ns: int, obs_stamp_ns: int) -> None:
        if obs_stamp_ns < 0 or obs_stamp_ns == self._last_requested:
            return  # nothing announced yet, or asked for already (a newer stamp, or any other, is new:
            # a stamp a little ahead of the clock must not hold back the ones after it)
        why = self._ahead(obs_stamp_ns, now_ns)
        if why:  # asking for it would make every later (present) observation look old
            if obs_stamp_ns != self._refused_stamp:
                self._refused_stamp = obs_stamp_ns
                out.drops.append(("future_observation", f"observation {why}"))
            return
        forced = self._force_request and self.scheduler.in_flight is None
        if not (forced or self.scheduler.wants_inference(now_ns)):
            return
        age_ns = int(now_ns) - int(obs_stamp_ns)
        if age_ns > self.config.max_age_ms * 1e6:  # its inference would start later still
            if obs_stamp_ns != self._stale_stamp:
                self._stale_stamp = obs_stamp_ns
                out.drops.append((
                    "stale_observation",
                    f"the newest observation is {age_ns / 1e6:.0f} ms old > max_age_ms {self.config.max_age_ms:g}: "
                    "no request until a fresh one is announced",
                ))  # fmt: skip
            return
        try:
            out.request = self.scheduler.request_inference(now_ns, obs_stamp_ns)
        except SchedulerError as e:
            out.drops.append(("request", str(e)))
            return
        self._force_request = False
        self._request_id += 1
        self._last_requested = obs_stamp_ns
        out.request_id, out.replan = self._request_id, forced
        self.requests_out += 1
