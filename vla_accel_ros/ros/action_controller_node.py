"""action_controller_node: action chunks in, one safe joint command per control period out.

A timer at ``scheduler.control_rate_hz`` (50 Hz) drives the ROS-free :class:`ChunkScheduler`
with the node's clock (sim time under ``use_sim_time``). Every tick:

1. swap in an accepted parameter change and drain the inbox (chunks, announced observation
   stamps, enable / e-stop changes), all on this one thread: the scheduler is never shared;
2. the watchdog: ``safety.watchdog_periods`` ticks without a fresh chunk -> hold position
   (the scheduler restarts from the last command and blends into the next chunk);
3. ``scheduler.step`` -> safety filter (limits, per-step clamp) -> the command backend,
   unless output is disabled (``~/enable``) or the e-stop (``estop``) is active;
4. motion estimate (ViperX FK) -> ``motion_state`` (coarse | fine with hysteresis); entering
   fine asks for a new chunk at once;
5. merge the chunks that arrived (after the step, so the grid is anchored on the ticks);
6. when the scheduler wants a chunk: a ``ChunkRequest`` for the newest observation the policy
   announced, with Real-Time Chunking guidance when ``scheduler.rtc``.

``/diagnostics`` reports loop rate, jitter, obs-to-chunk latency, holding and safety state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from std_msgs.msg import Bool, Header
from std_srvs.srv import SetBool

from vla_accel_ros.core.errors import ConfigError, SchedulerError
from vla_accel_ros.core.robot.config import ControllerConfig
from vla_accel_ros.core.robot.loop_stats import LoopStats
from vla_accel_ros.core.robot.motion import MODE_NAMES, MotionEstimator
from vla_accel_ros.core.robot.safety import SafetyFilter, Watchdog
from vla_accel_ros.core.robot.state import StateAssembler
from vla_accel_ros.core.scheduling import ChunkScheduler
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest, MotionState
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.backends import make_backend
from vla_accel_ros.ros.common import ERROR, OK, WARN, DropCounter, diagnostics, spin_node, status, subscribe_joint_states
from vla_accel_ros.ros.conversions import chunk_from_msg, motion_to_msg, request_to_msg, stamp_to_ns
from vla_accel_ros.ros.params import ConfigParameters

# Fixed when the scheduler is built (its timer, latency tracker and metrics): read-only here.
_READ_ONLY = (
    "scheduler.control_rate_hz",
    "scheduler.latency_window",
    "scheduler.latency_percentile",
    "scheduler.initial_latency_ms",
)


def _check(cfg: ControllerConfig) -> None:
    if cfg.scheduler.rtc and not cfg.request_chunks:
        raise ConfigError("scheduler.rtc needs request_chunks: RTC guidance travels in ChunkRequests")


class ActionControllerNode(Node):
    def __init__(self, node_name: str = "action_controller_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, ControllerConfig, read_only=_READ_ONLY, validate=_check)
        cfg: ControllerConfig = self.params.config
        self.cfg = cfg
        self.scheduler = ChunkScheduler(cfg.scheduler)
        self.safety = SafetyFilter(cfg.robot, cfg.safety)
        self.watchdog = Watchdog(cfg.safety.watchdog_periods)
        self.motion = MotionEstimator(cfg.robot, cfg.motion, cfg.scheduler.dt)
        self.state = StateAssembler(cfg.robot)
        self.backend = make_backend(self, cfg)
        self.loop = LoopStats(cfg.scheduler.dt)
        self.drops = DropCounter(self, "chunk", 2.0)

        self._lock = threading.Lock()  # inbox + gating flags, shared with the input callbacks
        self._inbox: deque[ActionChunkMsg] = deque(maxlen=32)
        self._obs_stamp = -1  # newest observation the policy holds
        self._restart = False  # enable / e-stop changed: restart the plan from the measured pose
        self.tick = 0
        self._ticks0 = 0
        self.commands = 0
        self.chunks_in = 0
        self._got_chunk = False
        self.requests_out = 0
        self.late_actions = 0
        self._request_id = 0
        self._last_requested = -1
        self._force_request = False
        self._last_now = -1
        self._holding_ticks = 0
        self._steps = 0

        inputs = MutuallyExclusiveCallbackGroup()
        safety = MutuallyExclusiveCallbackGroup()  # e-stop and enable never wait behind chunks
        self.create_subscription(ActionChunkMsg, graph.ACTION_CHUNK, self._on_chunk, qos.RELIABLE, callback_group=inputs)
        self.create_subscription(Header, graph.OBSERVATION_STAMP, self._on_obs_stamp, qos.RELIABLE, callback_group=inputs)
        subscribe_joint_states(self, cfg.robot.joint_state_topics, self.state, self._lock, inputs)
        self.create_subscription(Bool, graph.ESTOP, self._on_estop, qos.LATCHED, callback_group=safety)
        self.create_service(SetBool, graph.ENABLE, self._on_enable, callback_group=safety)
        self._request_pub = self.create_publisher(ChunkRequest, graph.CHUNK_REQUEST, qos.RELIABLE)
        self._motion_pub = self.create_publisher(MotionState, graph.MOTION_STATE, qos.RELIABLE)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)
        # Diagnostics read the scheduler and the loop statistics, which only the tick thread
        # touches: the same mutually exclusive group keeps the two from ever overlapping.
        control = MutuallyExclusiveCallbackGroup()
        self._timer = self.create_timer(cfg.scheduler.dt, self._on_tick, callback_group=control)
        self.create_timer(cfg.diagnostics_period_s, self._publish_diagnostics, callback_group=control)
        self.get_logger().info(
            f"{cfg.scheduler.control_rate_hz:g} Hz, {cfg.scheduler.mode}"
            f"{' + RTC' if cfg.scheduler.rtc else ''}, backend {cfg.command.backend} -> {', '.join(self.backend.topics())}; "
            f"output {'enabled' if self.safety.enabled else 'disabled (call ~/enable)'}"
        )
        if not self.motion.has_kinematics:
            self.get_logger().warning("no ALOHA arm joints in robot.joint_names: end-effector speeds are not estimated")

    # -- inputs ---------------------------------------------------------------------------------
    def _on_chunk(self, msg: ActionChunkMsg) -> None:
        with self._lock:
            self._inbox.append(msg)

    def _on_obs_stamp(self, msg: Header) -> None:
        with self._lock:
            self._obs_stamp = stamp_to_ns(msg.stamp)  # the latest (not the max: sim time may restart)

    def _on_estop(self, msg: Bool) -> None:
        with self._lock:
            changed = self.safety.set_estop(msg.data)
            self._restart = self._restart or changed
        if changed and msg.data:
            self.get_logger().error("E-STOP active: command output stopped")
        elif changed:  # rclpy wants one severity per call site
            self.get_logger().warning(
                "e-stop released" + (" (output stays disabled until ~/enable)" if not self.safety.enabled else "")
            )

    def _on_enable(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        with self._lock:
            ok, message = self.safety.set_enabled(bool(request.data))
            self._restart = self._restart or ok
        response.success, response.message = ok, message
        self.get_logger().info(f"enable({request.data}): {message}")
        return response

    # -- the control loop ------------------------------------------------------------------------
    def _measured(self) -> np.ndarray | None:
        st = self.state.state()
        return None if st is None else st[0]

    def _apply_pending(self) -> None:
        new = self.params.take_pending()
        if new is None:
            return
        # Accepted changes land here, between two ticks, all at once.
        self.cfg = new
        self.scheduler.config = new.scheduler  # the scheduler reads its config on every call
        with self._lock:
            self.safety.set_config(new.safety)
        self.watchdog.periods = new.safety.watchdog_periods
        self.motion.set_config(new.motion)
        self.get_logger().info("parameters applied")

    def _on_tick(self) -> None:
        now = self.get_clock().now().nanoseconds
        self.loop.tick(time.monotonic_ns())
        self.tick += 1
        self._apply_pending()
        with self._lock:
            inbox = list(self._inbox)
            self._inbox.clear()
            obs_stamp = self._obs_stamp
            restart, self._restart = self._restart, False
            allowed = self.safety.output_allowed
            measured = self._measured()
        if now < self._last_now:  # time jumped back (sim reset, bag loop): the plan is meaningless
            self.get_logger().warning("the clock jumped back: restarting the plan")
            restart = True
            self._last_requested = -1
        self._last_now = now
        if restart:
            self._restart_plan(measured)
        if self.watchdog.check(self.tick):
            self.get_logger().warning(
                f"watchdog: no fresh chunk for {self.watchdog.periods} periods; holding position"
            )
            last = self.safety.last_command
            self.scheduler.reset(hold_action=last if last is not None else measured)
            self.motion.reset()

        result = self.scheduler.step(now)
        action = result.action
        if self._got_chunk:  # waiting for the very first chunk is start-up, not holding
            self._steps += 1
            self._holding_ticks += bool(result.holding)
        if action is not None and allowed and not self.safety.has_reference(measured):
            self.drops.drop("no_reference", "no joint states yet: the first command could not be clamped; not commanding")
        elif action is not None and allowed:
            with self._lock:
                cmd = self.safety.filter(action, measured).command
            self.backend.publish(cmd, now)
            self.commands += 1
            self._motion_step(cmd, now)
        elif not allowed:
            with self._lock:
                self.safety.forget()
        # Chunks merge after the step: the step of a fresh plan anchors the scheduler's grid on
        # this timer's ticks (a chunk stamp, camera time, would put ticks anywhere between two
        # slots, and timer jitter would then repeat and skip slots). They execute from the next tick.
        for msg in inbox:
            self._add_chunk(msg, now)

        if self.cfg.request_chunks:
            self._maybe_request(now, obs_stamp)

    def _restart_plan(self, measured: np.ndarray | None) -> None:
        last = self.safety.last_command
        self.scheduler.reset(hold_action=measured if measured is not None else last)
        self.watchdog.reset()
        self.motion.reset()
        self._last_requested = -1

    def _add_chunk(self, msg: ActionChunkMsg, now: int) -> None:
        try:
            chunk = chunk_from_msg(msg)
            if chunk.joint_names and tuple(chunk.joint_names) != tuple(self.cfg.robot.joint_names):
                raise SchedulerError(f"chunk {chunk.chunk_id} joint_names {list(chunk.joint_names)} differ from robot.joint_names")
            self.scheduler.add_chunk(chunk, now)
            # Nothing planned even after this chunk: all of it was in the past (a 1-action chunk
            # stamped between two ticks covers no tick at all).
            if self.scheduler.pending == 0 and self.cfg.stale_chunks == "execute_last":
                # Opt-in late execution: the newest action, re-stamped to span [now + dt/2,
                # now + 3dt/2], which holds exactly the next tick whatever the timer's phase.
                dt = self.cfg.scheduler.dt
                late = replace(
                    chunk, actions=np.repeat(chunk.actions[-1:], 2, axis=0), stamp_ns=now + int(dt * 0.5e9), dt=dt
                )
                self.scheduler.add_chunk(late, now)
                self.late_actions += 1
        except (ValueError, SchedulerError) as e:
            self.drops.drop("bad_chunk", str(e))
            return
        self.chunks_in += 1
        self._got_chunk = True
        self.watchdog.chunk(self.tick)

    def _motion_step(self, cmd: np.ndarray, now: int) -> None:
        est = self.motion.update(cmd)
        if est.replan and self.cfg.request_chunks:
            self._force_request = True
        if est.switched or self.tick % self.cfg.motion.publish_every == 0:
            self._motion_pub.publish(motion_to_msg(est, now, self.cfg.robot.joint_names))

    def _maybe_request(self, now: int, obs_stamp: int) -> None:
        if obs_stamp <= self._last_requested:
            return  # nothing new to infer from (also: the policy has not announced anything yet)
        forced = self._force_request and self.scheduler.in_flight is None
        if not (forced or self.scheduler.wants_inference(now)):
            return
        try:
            req = self.scheduler.request_inference(now, obs_stamp)
        except SchedulerError as e:
            self.drops.drop("request", str(e))
            return
        self._force_request = False
        self._request_id += 1
        self._last_requested = obs_stamp
        self._request_pub.publish(
            request_to_msg(req, request_id=self._request_id, motion_mode=self.motion.mode, replan=forced)
        )
        self.requests_out += 1

    # -- diagnostics -------------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        loop = self.loop.summary()
        m = self.scheduler.metrics()
        with self._lock:
            enabled, estop = self.safety.enabled, self.safety.estop
            limited, clamped = self.safety.limited, self.safety.clamped
        level, message = OK, "commanding"
        if estop:
            level, message = ERROR, "E-STOP active"
        elif not enabled:
            level, message = WARN, "output disabled (call ~/enable)"
        elif self.watchdog.tripped:
            level, message = WARN, "watchdog: holding position, no fresh chunks"
        elif not self._got_chunk:
            level, message = WARN, "waiting for the first chunk"
        elif loop.rate_hz and loop.rate_hz < 0.8 * self.cfg.scheduler.control_rate_hz:
            level, message = WARN, f"control loop at {loop.rate_hz:.1f} Hz"
        values = {
            "loop rate hz": loop.rate_hz,
            "period mean ms": loop.period_mean_ms,
            "jitter std ms": loop.jitter_std_ms,
            "jitter max ms": loop.jitter_max_ms,
            "obs-to-chunk p50 ms": m.latency_p50_ms,
            "obs-to-chunk p95 ms": m.latency_p95_ms,
            "delay steps": m.delay_steps,
            "holding fraction": self._holding_ticks / max(1, self._steps),
            "stale actions dropped": m.stale_dropped,
            "late actions executed": self.late_actions,
            "chunks": self.chunks_in,
            "requests": self.requests_out,
            "commands": self.commands,
            "enabled": enabled,
            "estop": estop,
            "watchdog trips": self.watchdog.trips,
            "limited": limited,
            "clamped": clamped,
            "motion mode": MODE_NAMES[self.motion.mode],
        }
        values.update({f"dropped {k}": v for k, v in self.drops.counts.items()})
        self._diag_pub.publish(diagnostics(self, [status(f"{self.get_name()}: control", level, message, values)]))

    def reset_stats(self) -> None:
        self._ticks0 = self.tick
        self.commands = self.chunks_in = self.requests_out = 0
        self._holding_ticks = self._steps = 0
        self.loop = LoopStats(self.cfg.scheduler.dt)

    def summary(self) -> dict[str, object]:
        loop = self.loop.summary()
        m = self.scheduler.metrics()
        return {
            "ticks": self.tick - self._ticks0,
            "commands": self.commands,
            "chunks": self.chunks_in,
            "requests": self.requests_out,
            "loop_rate_hz": loop.rate_hz,
            "jitter_std_ms": loop.jitter_std_ms,
            "jitter_max_ms": loop.jitter_max_ms,
            "holding_fraction": self._holding_ticks / max(1, self._steps),
            "latency_p50_ms": m.latency_p50_ms,
            "latency_p95_ms": m.latency_p95_ms,
            "watchdog_trips": self.watchdog.trips,
            "motion_mode": MODE_NAMES[self.motion.mode],
        }

    def close(self) -> None:
        pass


def main(args: list[str] | None = None) -> None:
    spin_node(ActionControllerNode, args)


if __name__ == "__main__":
    main()
