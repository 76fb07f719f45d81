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
``policy.set_motion_mode``. What the worker decides (which observation, the state from the
state half of the observation rule, resets, statistics) is the ROS-free
:class:`~vla_accel_ros.core.robot.inference.InferenceWorker`; this node converts messages,
loads the bundle, runs the worker's thread and publishes.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from std_msgs.msg import Bool, Header, String
from std_srvs.srv import Trigger

from vla_accel_ros.core.bundle import BundleSpec, read_spec
from vla_accel_ros.core.config import changed_fields, flatten
from vla_accel_ros.core.errors import ConfigError, VlaAccelError
from vla_accel_ros.core.interrupt import Interrupted
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import PolicyNodeConfig
from vla_accel_ros.core.robot.inference import InferenceWorker, Request, Served
from vla_accel_ros.core.robot.observation import AssembledObservation, ObservationChannel, SharedChannels
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest, InferenceStats, MotionState
from vla_accel_ros.msg import Observation as ObservationMsg
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.conversions import (
    chunk_to_msg,
    guidance_from_msg,
    header,
    observation_from_msg,
    stamp_to_ns,
    stats_to_msg,
)
from vla_accel_ros.ros.diagnostics import ERROR, OK, WARN, diagnostics, status, status_name
from vla_accel_ros.ros.drops import DropCounter, capped
from vla_accel_ros.ros.params import ConfigParameters
from vla_accel_ros.ros.sensor_input import SourceCheck, subscribe_joint_states
from vla_accel_ros.ros.spin import spin_node


# How long close() waits for the worker. ros2 launch escalates to SIGTERM 5 s after SIGINT; an
# inference stops at its next layer, so this is only reached by a step outside the layers.
CLOSE_WAIT_S = 3.0


# policy.seed seeds the noise generator once, at load: read-only here.
READ_ONLY = ("policy.seed",)


class PolicyNode(Node):
    def __init__(self, node_name: str = "policy_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.policy = None
        self._spec: BundleSpec | None = None  # the bundle's config, for checks before the model loads
        self.params = ConfigParameters(self, PolicyNodeConfig, read_only=READ_ONLY, validate=self._check)
        cfg: PolicyNodeConfig = self.params.config
        try:
            self._spec = read_spec(cfg.bundle) if cfg.bundle else None
        except VlaAccelError:
            pass  # the load says why
        self.drops = DropCounter(self, "inference input", 2.0)
        channel = SharedChannels.get(self.context, cfg.shared_channel) if cfg.observation_transport == "shared" else ObservationChannel()
        self.worker = InferenceWorker(cfg, channel, drop=self.drops.drop, log=self._log, restore=self._restore)
        self.channel = channel
        self.channel.listeners.append(self._announce)
        self.ready = False
        self.failure = ""

        inputs = MutuallyExclusiveCallbackGroup()
        control = MutuallyExclusiveCallbackGroup()
        if cfg.observation_transport == "topic":
            self.create_subscription(ObservationMsg, graph.OBSERVATION, self._on_observation, qos.LATEST, callback_group=inputs)
        self.sources = SourceCheck(self, lambda: self.worker.cfg.robot.accept_publishers)
        subscribe_joint_states(self, cfg.robot.joint_state_topics, self.worker.state, self.worker.lock, inputs,
                               max_future_ms=lambda: self.worker.cfg.max_future_ms, drop=self.drops.drop,
                               check=self.sources)  # fmt: skip
        self.create_subscription(String, graph.INSTRUCTION, self._on_instruction, qos.LATCHED, callback_group=control)
        self.create_subscription(ChunkRequest, graph.CHUNK_REQUEST, self._on_request, qos.RELIABLE, callback_group=control)
        self.create_subscription(
            MotionState, graph.MOTION_STATE, lambda m: self.worker.set_motion_mode(m.mode), qos.RELIABLE, callback_group=control
        )
        self.create_service(Trigger, graph.RESET_EPISODE, self._on_reset_episode, callback_group=control)
        self._chunk_pub = self.create_publisher(ActionChunkMsg, graph.ACTION_CHUNK, qos.RELIABLE)
        self._stats_pub = self.create_publisher(InferenceStats, graph.INFERENCE_STATS, qos.STATS)
        self._stamp_pub = self.create_publisher(Header, graph.OBSERVATION_STAMP, qos.RELIABLE)
        self._ready_pub = self.create_publisher(Bool, graph.READY, qos.LATCHED)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)
        self._reasoning_pub = self.create_publisher(String, graph.REASONING, qos.RELIABLE)
        self._ready_pub.publish(Bool(data=False))
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup())
        self._thread = threading.Thread(target=self._run, name=f"{node_name}-worker", daemon=True)
        self._thread.start()

    def _check(self, cfg: PolicyNodeConfig) -> None:
        """A parameter change the loaded policy would refuse is refused now, with its reason;
        while the model loads, layer indices are checked against the bundle's depth."""
        policy = self.policy
        if policy is not None:
            policy.check_config(cfg.policy)
            try:
                policy.text_ids(cfg.instruction)
            except VlaAccelError as e:
                raise ConfigError(str(e)) from e
        elif self._spec is not None:
            if cfg.policy.uses_cache:
                cfg.policy.cache.check_layers(self._spec.decoder_layers)
            if cfg.policy.uses_prune:
                cfg.policy.prune.check_layers(self._spec.decoder_layers)

    def _restore(self, running: PolicyConfig) -> None:
        """Options the policy could not apply: the parameters go back to the running ones."""
        values = flatten(running)
        changed = changed_fields(self.params.config.policy, running)
        params = [self.params.parameter(f"policy.{k}", values[k]) for k in changed]
        for p, r in zip(params, self.set_parameters(params)):
            if not r.successful:  # the parameter now claims an option that does not run
                self.get_logger().error(f"could not set {p.name} back to the running value {p.value!r}: {r.reason}")

    def _log(self, level: str, text: str) -> None:
        (self.get_logger().error if level == "error" else self.get_logger().info)(text)

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
        why = self.worker.set_instruction(msg.data)
        if why:  # counted and throttled: a storm of them cannot flood the log
            self.drops.drop("instruction", f"instruction refused, the previous one stays: {why}: {capped(msg.data, 80)!r}")
        else:
            self.get_logger().info(f"instruction: {capped(msg.data)!r}")

    def _on_request(self, msg: ChunkRequest) -> None:
        req = Request(stamp_to_ns(msg.header.stamp), int(msg.request_id), int(msg.motion_mode), has_guidance=bool(msg.has_guidance))
        try:
            req.guidance = guidance_from_msg(msg)
        except ValueError as e:
            req.guidance_error = str(e)
        self.worker.requests.put(req)

    def _on_reset_episode(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        episode = self.worker.reset_episode()
        response.success = True
        response.message = f"episode {episode}: token cache and policy state reset before the next inference"
        return response

    # -- the worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        nice = self.worker.cfg.worker_nice
        if nice:  # this thread only (Linux: per-thread niceness); torch's threads, started from it, inherit it
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (OSError, AttributeError) as e:
                self.get_logger().warning(f"worker_nice {nice} not applied: {e}")
        try:
            with self.worker.interruptible():  # the parity gate and warm-up infer: Ctrl-C stops them
                self._load()
        except Interrupted:
            return  # closed while loading
        except Exception as e:  # noqa: BLE001 - any load failure: report, stay up, never command
            self.failure = f"{type(e).__name__}: {e}"
            self.get_logger().error(f"the policy did not start: {self.failure}")
            return
        try:
            self.worker.run(self.params.take_pending, self._publish, lambda: self.get_clock().now().nanoseconds)
        except BaseException as e:  # noqa: BLE001 - the loop survives every Exception; anything else ends it: say so
            self.failure = f"the inference worker stopped: {type(e).__name__}: {e}"
            self.get_logger().error(self.failure)

    def _publish(self, served: Served) -> None:
        c = served.chunk
        self._chunk_pub.publish(chunk_to_msg(c, request_id=served.request_id, latency_ms=served.latency_ms))
        self._stats_pub.publish(
            stats_to_msg(c, motion_mode=served.motion_mode, resets_total=self.worker.resets_total, reset_reason=served.reset_reason)
        )
        if "reasoning_text" in c.stats:
            self._reasoning_pub.publish(String(data=c.stats["reasoning_text"]))

    def _load(self) -> None:
        from vla_accel_ros.io.bag_reader import gate_frames_for  # noqa: PLC0415 - as torch: off the node's start
        from vla_accel_ros.models.factory import load_for_robot  # noqa: PLC0415 - torch stays off the node's start

        cfg = self.worker.cfg
        t0 = time.perf_counter()
        self.get_logger().info(f"loading {cfg.bundle} ...")
        gate = None
        if cfg.gate_bag and cfg.policy.parity_check and cfg.bundle:  # no bundle: load_for_robot says so
            spec = self._spec or read_spec(cfg.bundle)  # a bundle's error is not the bag's
            try:
                gate = gate_frames_for(Path(cfg.gate_bag), spec)
            except VlaAccelError as e:
                raise VlaAccelError(f"parameter gate_bag={cfg.gate_bag!r}: {e} (give a rosbag of the task, or '' for a synthetic pair)") from e
        policy = load_for_robot(cfg, gate_observations=gate)  # warmed up on the bundle's instruction: the topic's is checked next
        if self.worker.stopped:  # closed while loading: the node (its publishers) may be gone already
            return
        self.policy = self.worker.policy = policy
        why = self.worker.recheck_instruction()
        if why:
            self.get_logger().error(f"the instruction from the topic is refused by the model and forgotten: {why}")
        self.ready = True
        self._ready_pub.publish(Bool(data=True))
        s = policy.spec
        for note in policy.precision_notes:  # a backend or precision it could not run, and what runs instead
            self.get_logger().warning(note)
        self.get_logger().info(
            f"ready: {s.name} ({s.family}, chunk {s.chunk_size} x {s.action_dim}, cameras {', '.join(s.cameras)}) "
            f"in {time.perf_counter() - t0:.1f} s; precision {policy.precision.label()}; trigger {cfg.trigger}; "
            f"gated on {('the frames of ' + cfg.gate_bag) if policy.gate_observations else 'a synthetic pair of frames'}"
        )

    # -- diagnostics --------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        level, message, values = self.worker.health(failure=self.failure, alive=self._thread.is_alive(), ready=self.ready)
        values.update({f"dropped {k}": v for k, v in self.drops.snapshot().items()})
        level = {"ok": OK, "warn": WARN, "error": ERROR}[level]
        level, message = self.sources.diagnose(level, message)
        self._diag_pub.publish(diagnostics(self, [status(status_name(self, "policy"), level, message, values)]))

    def reset_stats(self) -> None:
        self.worker.reset_counts()
        self.drops.clear()

    def summary(self) -> dict[str, object]:
        w = self.worker
        return {
            "ready": self.ready,
            "chunks": w.chunks,
            "errors": w.errors,
            "latency_p50_ms": w.latency.get(50),
            "infer_p50_ms": w.infer_ms.get(50),
            "obs_age_p50_ms": w.obs_age_ms.get(50),  # the observation's age when its inference started
            "obs_age_max_ms": w.obs_age_ms.max,
            "dropped": self.drops.snapshot(),  # inputs not used (stale_observation, ...), since the node started
        }

    def close(self) -> None:
        """Stop the worker: the inference (or load) in progress stops at its next layer, well
        within the time ``ros2 launch`` gives a node after Ctrl-C."""
        self.worker.stop()
        self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():  # e.g. reading the weights: it returns without publishing once done
            self.get_logger().warning(f"the worker did not stop within {CLOSE_WAIT_S:g} s; closing without it")
        if self._announce in self.channel.listeners:
            self.channel.listeners.remove(self._announce)


def main(args: list[str] | None = None) -> None:
    spin_node(PolicyNode, args)


if __name__ == "__main__":
    main()
