"""policy_node: observations + joint states + instruction in, action chunks out.

With ``policy.num_threads: 0`` the node leaves one CPU core to the control loop and DDS
(torch's own default takes them all). The bundle loads on a background thread (``~/ready`` turns true, transient local, and
``/diagnostics`` says so). Inference runs on its own worker thread, never inside a callback:

* ``trigger: request`` (default): the controller asks with a ``ChunkRequest`` naming an
  observation by the stamp this node announced on ``observation_stamp``; the request carries
  Real-Time Chunking guidance when the controller runs RTC. Requests are latest-only.
* ``trigger: continuous``: infer back to back on the newest observation.

Between two inferences the worker applies, atomically, what accumulated meanwhile: an accepted
parameter change (``policy.configure``: validated against the loaded model when it is set, so
a bad value is refused with the reason) and resets (instruction change, ``~/reset_episode``).
The motion mode from the controller (``motion_state``, or the request's own) goes to
``policy.set_motion_mode``. The state attached to an observation comes from the state half of
the one observation rule (:class:`~vla_accel_ros.core.robot.observation.StateGate`).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from std_msgs.msg import Bool, Header, String
from std_srvs.srv import Trigger

from vla_accel_ros.core.config import changed_fields
from vla_accel_ros.core.errors import ConfigError, VlaAccelError
from vla_accel_ros.core.robot.loop_stats import Percentiles
from vla_accel_ros.core.robot.config import PolicyNodeConfig
from vla_accel_ros.core.robot.motion import COARSE, MODE_NAMES
from vla_accel_ros.core.robot.observation import (
    AssembledObservation,
    LatestSlot,
    ObservationChannel,
    SharedChannels,
    StateGate,
)
from vla_accel_ros.core.types import ChunkGuidance, Observation
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest, InferenceStats, MotionState
from vla_accel_ros.msg import Observation as ObservationMsg
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.common import ERROR, OK, WARN, DropCounter, diagnostics, spin_node, status, subscribe_joint_states
from vla_accel_ros.ros.conversions import (
    chunk_to_msg,
    guidance_from_msg,
    header,
    observation_from_msg,
    stamp_to_ns,
    stats_to_msg,
)
from vla_accel_ros.ros.params import ConfigParameters


def _torch_threads() -> int:
    import torch  # noqa: PLC0415

    return torch.get_num_threads()


@dataclass
class _Job:
    obs: AssembledObservation
    stamp_ns: int
    request_id: int = 0
    guidance: ChunkGuidance | None = None
    motion_mode: int | None = None


class PolicyNode(Node):
    def __init__(self, node_name: str = "policy_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.policy = None
        # policy.seed seeds the noise generator once, at load: read-only here.
        self.params = ConfigParameters(self, PolicyNodeConfig, read_only=("policy.seed",), validate=self._check)
        cfg: PolicyNodeConfig = self.params.config
        self._cfg = cfg  # the config the worker runs with (swapped between inferences)
        self._lock = threading.Lock()
        self.state = StateGate(cfg.robot, max_state_age_ns=int(cfg.max_state_age_ms * 1e6))  # the rule's state half
        self.channel = (
            SharedChannels.get(self.context, cfg.shared_channel)
            if cfg.observation_transport == "shared"
            else ObservationChannel()
        )
        self.channel.listeners.append(self._announce)
        self.requests: LatestSlot[ChunkRequest] = LatestSlot()
        self._seen_seq = 0
        self._reset_reason = ""
        self._instruction = ""  # from the topic; '' = the parameter / the bundle's default
        self._episode = 0
        self._pending_reset = ""
        self._motion_mode = COARSE
        self._stop = threading.Event()
        self.ready = False
        self.failure = ""
        self.spec = None
        self.chunks = 0
        self.errors = 0
        self.superseded = 0  # requests served with a newer observation than they named
        self._tracebacks: set[str] = set()
        self.resets_total = 0
        self.latency = Percentiles()
        self.infer_ms = Percentiles()
        self.drops = DropCounter(self, "inference input", 2.0)

        inputs = MutuallyExclusiveCallbackGroup()
        control = MutuallyExclusiveCallbackGroup()
        if cfg.observation_transport == "topic":
            self.create_subscription(ObservationMsg, graph.OBSERVATION, self._on_observation, qos.LATEST, callback_group=inputs)
        subscribe_joint_states(self, cfg.robot.joint_state_topics, self.state, self._lock, inputs)
        self.create_subscription(String, graph.INSTRUCTION, self._on_instruction, qos.LATCHED, callback_group=control)
        self.create_subscription(ChunkRequest, graph.CHUNK_REQUEST, self._on_request, qos.RELIABLE, callback_group=control)
        self.create_subscription(MotionState, graph.MOTION_STATE, self._on_motion, qos.RELIABLE, callback_group=control)
        self.create_service(Trigger, graph.RESET_EPISODE, self._on_reset_episode, callback_group=control)
        self._chunk_pub = self.create_publisher(ActionChunkMsg, graph.ACTION_CHUNK, qos.RELIABLE)
        self._stats_pub = self.create_publisher(InferenceStats, graph.INFERENCE_STATS, qos.RELIABLE)
        self._stamp_pub = self.create_publisher(Header, graph.OBSERVATION_STAMP, qos.RELIABLE)
        self._ready_pub = self.create_publisher(Bool, graph.READY, qos.LATCHED)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)
        self._ready_pub.publish(Bool(data=False))
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup())
        self._worker = threading.Thread(target=self._run, name=f"{node_name}-worker", daemon=True)
        self._worker.start()

    def _check(self, cfg: PolicyNodeConfig) -> None:
        """A parameter change the loaded policy would refuse is refused now, with its reason."""
        if self.policy is not None:
            self.policy.check_config(cfg.policy)

    # -- inputs (short callbacks) -------------------------------------------------------------
    def _on_observation(self, msg: ObservationMsg) -> None:
        try:
            images, stamp = observation_from_msg(msg)
        except VlaAccelError as e:
            self.drops.drop("observation", str(e))
            return
        self.channel.put(stamp, AssembledObservation(images, stamp, int(msg.skew_ms * 1e6), int(msg.age_ms * 1e6), int(msg.seq)))

    def _announce(self, stamp_ns: int, _obs: object) -> None:
        """Tell the controller which observation it may ask for (after it is stored here)."""
        self._stamp_pub.publish(header(stamp_ns))

    def _on_instruction(self, msg: String) -> None:
        with self._lock:
            if msg.data != self._instruction:
                self._instruction = msg.data
                self._pending_reset = self._pending_reset or "instruction"
        self.get_logger().info(f"instruction: {msg.data!r}")

    def _on_request(self, msg: ChunkRequest) -> None:
        self.requests.put(msg)

    def _on_motion(self, msg: MotionState) -> None:
        self._motion_mode = int(msg.mode)

    def _on_reset_episode(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            self._episode += 1
            self._pending_reset = "episode"
            episode = self._episode
        self.channel.clear()  # frames of the old episode must not seed the new one
        response.success = True
        response.message = f"episode {episode}: token cache and policy state reset before the next inference"
        return response

    # -- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - any load failure: report, stay up, never command
            self.failure = f"{type(e).__name__}: {e}"
            self.get_logger().error(f"the policy did not start: {self.failure}")
            return
        while not self._stop.is_set():
            job = self._next_job()
            if job is None or self._stop.is_set():
                continue
            try:
                self._infer(job)
            except Exception as e:  # noqa: BLE001 - one bad inference must not stop the node
                self.errors += 1
                if not isinstance(e, VlaAccelError) and type(e).__name__ not in self._tracebacks:
                    self._tracebacks.add(type(e).__name__)  # a bug, not bad input: show where, once per type
                    self.get_logger().error(traceback.format_exc())
                self.drops.drop("inference_error", f"{type(e).__name__}: {e}")

    def _load(self) -> None:
        from vla_accel_ros.core.bundle import read_spec  # noqa: PLC0415 - heavy imports stay off the node's start
        from vla_accel_ros.models.factory import load_policy  # noqa: PLC0415

        cfg = self._cfg
        if not cfg.bundle:
            raise VlaAccelError("parameter 'bundle' is empty: give the path of a model bundle")
        spec = read_spec(cfg.bundle)
        if tuple(spec.joint_names) != tuple(cfg.robot.joint_names):
            raise VlaAccelError(
                f"the bundle's joint_names {list(spec.joint_names)} differ from robot.joint_names {list(cfg.robot.joint_names)}"
            )
        if spec.state_dim and spec.state_dim != cfg.robot.dim:
            raise VlaAccelError(f"the bundle expects a {spec.state_dim}-D state, the robot has {cfg.robot.dim} joints")
        t0 = time.perf_counter()
        if not cfg.policy.num_threads:
            # torch's default takes every core; the control loop, the camera callbacks and DDS
            # then wait behind inference (measured: 2 threads on 2 cores ran inference 10-30x
            # slower than 1). Leave one core to the rest of the graph.
            import torch  # noqa: PLC0415

            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        self.get_logger().info(f"loading {cfg.bundle} (torch threads {_torch_threads()}) ...")
        policy = load_policy(cfg.bundle, cfg.policy)
        if cfg.warmup:
            blank = {c: np.zeros((spec.image_size, spec.image_size, 3), np.uint8) for c in spec.cameras}
            state = np.zeros(spec.state_dim, np.float32) if spec.state_dim else None
            policy.infer(Observation(images=blank, instruction=self._instruction_text(), stamp_ns=0, state=state))
            policy.reset()
        self.policy, self.spec = policy, spec
        self.ready = True
        self._ready_pub.publish(Bool(data=True))
        self.get_logger().info(
            f"ready: {spec.name} ({spec.family}, chunk {spec.chunk_size} x {spec.action_dim}, cameras "
            f"{', '.join(spec.cameras)}) in {time.perf_counter() - t0:.1f} s; trigger {cfg.trigger}"
        )

    def _instruction_text(self) -> str:
        return self._instruction or self._cfg.instruction or ""

    def _next_job(self) -> _Job | None:
        self._apply_pending()
        if self._stop.is_set():
            return None
        if self._cfg.trigger == "continuous":
            seq = getattr(self, "_seen_seq", 0)
            if not self.channel.wait_newer(seq, 0.1):
                return None
            self._seen_seq = self.channel.seq
            latest = self.channel.latest()
            return None if latest is None else _Job(latest[1], latest[0])
        if not self.requests.wait(0.1):
            return None
        req = self.requests.take()
        if req is None or self._stop.is_set():
            return None
        stamp = stamp_to_ns(req.header.stamp)
        obs = self.channel.wait_for_stamp(stamp, self._cfg.request_wait_ms / 1e3)
        guidance = None
        if obs is None:
            latest = self.channel.latest()
            if latest is None:
                self.drops.drop("no_observation", f"request {req.request_id}: no observation held")
                return None
            # The request waited longer than the history covers (the worker was busy or still
            # loading): the newest observation serves it, stamped as what it is. Only the RTC
            # guidance, indexed to the old stamp, cannot be used.
            self.superseded += 1
            if req.has_guidance:
                self.drops.drop("guidance_dropped", f"request {req.request_id}: observation {stamp} no longer held; inferring on the newest without guidance")
            stamp, obs = latest
        else:
            try:
                guidance = guidance_from_msg(req)
            except ValueError as e:
                self.drops.drop("bad_guidance", str(e))
        return _Job(obs, stamp, int(req.request_id), guidance, int(req.motion_mode))

    def _apply_pending(self) -> None:
        """Between two inferences: swap in an accepted config, run pending resets."""
        new = self.params.take_pending()
        if new is not None:
            old, self._cfg = self._cfg, new
            with self._lock:
                self.state.set_limit(max_state_age_ns=int(new.max_state_age_ms * 1e6))
            if self.policy is not None and new.policy != old.policy:
                self._reconfigure(old.policy, new.policy)
            if new.instruction != old.instruction and not self._instruction:
                with self._lock:
                    self._pending_reset = self._pending_reset or "instruction"
        with self._lock:
            reason, self._pending_reset = self._pending_reset, ""
        if reason and self.policy is not None:
            self.policy.reset()
            self._reset_reason = reason

    def _reconfigure(self, old, new) -> None:
        try:
            if self.policy.configure(new):  # a fresh planner: its caches start empty
                self._reset_reason = "config"
        except ConfigError as e:  # checked when set; the policy keeps its old options
            self.get_logger().error(f"policy options not applied: {e}")
            return
        self.get_logger().info(f"applied policy.{', policy.'.join(changed_fields(old, new))}")

    def _infer(self, job: _Job) -> None:
        policy, spec = self.policy, self.spec
        with self._lock:
            state = self.state.state_for(job.stamp_ns) if spec.state_dim else None
            reason, why = self.state.last_reason, self.state.last_reject
            episode = self._episode
        if spec.state_dim and state is None:
            self.drops.drop(reason, why)
            return
        mode = self._motion_mode if job.motion_mode is None else job.motion_mode
        policy.set_motion_mode(MODE_NAMES.get(mode, "coarse"))
        obs = Observation(images=job.obs.images, instruction=self._instruction_text(), stamp_ns=job.stamp_ns, state=state, episode=episode)
        chunk = policy.infer(obs, guidance=job.guidance)
        now = self.get_clock().now().nanoseconds
        latency_ms = (now - job.stamp_ns) / 1e6
        # One count per inference that started from an empty cache, whoever decided it: this
        # node (instruction, episode, config) or the planner itself (scene cut, camera change).
        reason, self._reset_reason = self._reset_reason or str(chunk.stats.get("reset_reason", "")), ""
        if reason:
            self.resets_total += 1
        self._chunk_pub.publish(chunk_to_msg(chunk, request_id=job.request_id, latency_ms=latency_ms))
        self._stats_pub.publish(
            stats_to_msg(chunk, motion_mode=MODE_NAMES.get(mode, "coarse"), resets_total=self.resets_total, reset_reason=reason)
        )
        self.chunks += 1
        self.latency.add(latency_ms)
        self.infer_ms.add(float(chunk.timings_ms.get("total", float("nan"))))

    # -- diagnostics --------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        if self.failure:
            level, message = ERROR, f"not running: {self.failure}"
        elif not self.ready:
            level, message = WARN, "loading the bundle"
        elif self.errors:
            level, message = WARN, f"{self.errors} inference errors"
        else:
            level, message = OK, "ready"
        values = {
            "ready": self.ready,
            "bundle": self._cfg.bundle,
            "trigger": self._cfg.trigger,
            "chunks": self.chunks,
            "inference ms p50": self.infer_ms.get(50),
            "obs-to-chunk ms p50": self.latency.get(50),
            "obs-to-chunk ms p95": self.latency.get(95),
            "cache resets": self.resets_total,
            "motion mode": MODE_NAMES.get(self._motion_mode, "?"),
            "requests overwritten": self.requests.overwritten,
            "requests served newer": self.superseded,
        }
        values.update({f"dropped {k}": v for k, v in self.drops.counts.items()})
        self._diag_pub.publish(diagnostics(self, [status(f"{self.get_name()}: policy", level, message, values)]))

    def reset_stats(self) -> None:
        self.chunks = self.errors = 0
        self.latency, self.infer_ms = Percentiles(), Percentiles()
        self.drops.counts.clear()

    def summary(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "chunks": self.chunks,
            "errors": self.errors,
            "latency_p50_ms": self.latency.get(50),
            "infer_p50_ms": self.infer_ms.get(50),
        }

    def close(self) -> None:
        """Stop the worker (it finishes the inference in progress)."""
        self._stop.set()
        self.requests.put(ChunkRequest())  # wake it
        self._worker.join(timeout=10.0)
        if self.channel is not None and self._announce in self.channel.listeners:
            self.channel.listeners.remove(self._announce)


def main(args: list[str] | None = None) -> None:
    spin_node(PolicyNode, args)


if __name__ == "__main__":
    main()
