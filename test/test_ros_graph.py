"""The ROS graph end to end: real rclpy nodes over DDS, the tiny flow bundle, no mocks.

One graph (camera -> policy -> action controller, observations over the Observation topic)
runs for the module; a probe node plays the robot: it publishes camera frames and ALOHA joint
states and records what comes out. Every wait is a condition with a timeout, never a sleep
used as an assertion. The last test stops the policy, so it runs last.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from rcl_interfaces.msg import Parameter as ParameterMsg  # noqa: E402
from rcl_interfaces.msg import ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import SetParameters, SetParametersAtomically  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rclpy.context import Context  # noqa: E402
from rclpy.node import Node  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Bool, Header, String  # noqa: E402
from std_srvs.srv import SetBool, Trigger  # noqa: E402

from vla_accel_ros.core.robot.images import encode_raw  # noqa: E402
from vla_accel_ros.msg import ActionChunk, ChunkRequest, InferenceStats, MotionState  # noqa: E402
from vla_accel_ros.ros import bringup, qos  # noqa: E402
from vla_accel_ros.ros.conversions import stamp_to_ns  # noqa: E402
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, describe  # noqa: E402
import helpers  # noqa: E402  (test/helpers.py)

pytestmark = pytest.mark.ros

CAM_TOPIC = "/cam_high/camera/color/image_rect_raw"
ARM, START = helpers.ARM, helpers.START
WATCHDOG = 25  # control periods (the shipped default is 50)
TIMEOUT = 120.0  # generous: the machine is shared; conditions usually hold within a second


def wait_for(cond, timeout: float = TIMEOUT, what: str = "condition") -> None:
    helpers.wait_for(cond, timeout, what)


class Probe(Node):
    """The robot side: camera frames (rgb8, 64x48, padded rows) at 20 Hz, joint states of both
    arms at 50 Hz; records commands, chunks, stats and announced observation stamps."""

    def __init__(self, context: Context) -> None:
        super().__init__("probe", context=context)
        self.lock = threading.Lock()
        self.commands: list[tuple[float, JointState]] = []
        self.chunks: list[ActionChunk] = []
        self.stats: list[InferenceStats] = []
        self.stamps: list[int] = []
        self.frame_stamps: set[int] = set()
        self.streaming = True
        self.clients_by_name: dict = {}
        self.image_pub = self.create_publisher(Image, CAM_TOPIC, qos.SENSOR)
        self.js_pubs = [self.create_publisher(JointState, f"/follower_{s}/joint_states", qos.RELIABLE) for s in ("left", "right")]
        self.instruction_pub = self.create_publisher(String, "instruction", qos.LATCHED)
        self.estop_pub = self.create_publisher(Bool, "estop", qos.LATCHED)
        self.create_subscription(JointState, "joint_commands", self._on_command, qos.COMMANDS)
        self.create_subscription(ActionChunk, "action_chunk", lambda m: self._add(self.chunks, m), qos.RELIABLE)
        self.create_subscription(InferenceStats, "inference_stats", lambda m: self._add(self.stats, m), qos.RELIABLE)
        self.create_subscription(Header, "observation_stamp", lambda m: self._add(self.stamps, m.stamp), qos.RELIABLE)
        self.diagnostics: dict[str, dict[str, str]] = {}
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, qos.RELIABLE)
        self.requests: list[ChunkRequest] = []
        self.motion: list[MotionState] = []
        self.create_subscription(ChunkRequest, "chunk_request", lambda m: self._add(self.requests, m), qos.RELIABLE)
        self.create_subscription(MotionState, "motion_state", lambda m: self._add(self.motion, m), qos.RELIABLE)
        rng = np.random.default_rng(0)
        self.frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(8)]
        self.k = 0
        self.create_timer(0.05, self._publish_frame)
        self.create_timer(0.02, self._publish_joints)

    def _add(self, where: list, item) -> None:
        with self.lock:
            where.append(item)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        with self.lock:
            for st in msg.status:
                self.diagnostics[st.name] = {kv.key: kv.value for kv in st.values}

    def _on_command(self, msg: JointState) -> None:
        with self.lock:
            self.commands.append((time.monotonic(), msg))

    def image(self, rgb: np.ndarray, encoding: str = "rgb8", pad: int = 4) -> Image:
        h, w, step, data = encode_raw(rgb, encoding, pad=pad)
        msg = Image(height=h, width=w, step=step, encoding=encoding, is_bigendian=0)
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.data = data
        return msg

    def _publish_frame(self) -> None:
        if not self.streaming:
            return
        msg = self.image(self.frames[self.k % len(self.frames)])
        self.k += 1
        with self.lock:
            self.frame_stamps.add(msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)
        self.image_pub.publish(msg)

    def _publish_joints(self) -> None:
        helpers.publish_joint_states(self, self.js_pubs)

    def count(self, what: str) -> int:
        with self.lock:
            return len(getattr(self, what))

    def call(self, srv_type, name: str, request, timeout: float = 30.0):
        client = self.clients_by_name.get(name)
        if client is None:
            client = self.clients_by_name[name] = self.create_client(srv_type, name)
        assert client.wait_for_service(timeout_sec=timeout), f"service {name} not available"
        future = client.call_async(request)
        wait_for(future.done, timeout, f"reply of {name}")
        return future.result()

    def set_parameters_atomically(self, node: str, values: dict):
        params = [ParameterMsg(name=k, value=_value(v)) for k, v in values.items()]
        req = SetParametersAtomically.Request(parameters=params)
        return self.call(SetParametersAtomically, f"/{node}/set_parameters_atomically", req).result

    def set_parameter(self, node: str, name: str, value):
        req = SetParameters.Request(parameters=[ParameterMsg(name=name, value=_value(value))])
        return self.call(SetParameters, f"/{node}/set_parameters", req).results[0]


def _value(value) -> ParameterValue:
    if isinstance(value, bool):
        return ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
    if isinstance(value, int):
        return ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
    if isinstance(value, float):
        return ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value)
    if isinstance(value, str):
        return ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
    return ParameterValue(type=ParameterType.PARAMETER_DOUBLE_ARRAY, double_array_value=[float(v) for v in value])


@pytest.fixture(scope="module")
def system(tiny_bundles, ros_params_file):
    with helpers.module_ros_context() as ctx:
        graph = describe(params_file=ros_params_file, bundle=tiny_bundles["flow"], shared_observations=False)
        graph = graph.with_parameters({CONTROLLER: {"safety.watchdog_periods": WATCHDOG}})
        running = bringup.start(graph, context=ctx, threads=6)
        probe = Probe(ctx)
        running.add_node("probe", probe)  # survives stop_node's executor swap
        try:
            assert running.wait_ready(TIMEOUT) == ""
            yield running, probe
        finally:
            running.shutdown()


def test_frames_and_joint_states_come_out_as_joint_commands(system):
    running, probe = system
    wait_for(lambda: probe.count("commands") >= 20, what="20 joint commands")
    with probe.lock:
        cmds = [m for _, m in probe.commands]
        chunks = list(probe.chunks)
        frame_stamps = set(probe.frame_stamps)
    names = list(running.nodes[CONTROLLER].cfg.robot.joint_names)
    assert all(list(m.name) == names for m in cmds)
    pos = np.array([list(m.position) for m in cmds])  # [N, 14]
    assert pos.shape[1] == 14 and np.isfinite(pos).all()
    ctl = running.nodes[CONTROLLER]
    lo, hi = ctl.control.safety.lower.copy(), ctl.control.safety.upper.copy()
    lo[[6, 13]], hi[[6, 13]] = 0.6197, 1.6214  # grippers leave as joint angles (rad)
    assert (pos >= lo - 1e-6).all() and (pos <= hi + 1e-6).all()
    assert np.abs(np.diff(pos[:, [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]], axis=0)).max() <= 0.05 + 1e-6  # per-step clamp
    # Every chunk is stamped with the time of the camera frame it was computed from.
    assert chunks and all(c.header.stamp.sec * 10**9 + c.header.stamp.nanosec in frame_stamps for c in chunks)
    assert all(c.horizon == 50 and c.action_dim == 14 and len(c.actions) == 700 for c in chunks)
    assert all(c.request_id > 0 for c in chunks)  # answers to the controller's requests
    wait_for(lambda: probe.count("stats") >= 1, what="inference stats")
    s = probe.stats[-1]
    assert s.total_ms > 0 and "denoise" in list(s.stage_names) and s.tokens_total > 0
    # /diagnostics: loop rate, jitter and latencies from the controller, readiness from the policy.
    wait_for(lambda: float(probe.diagnostics.get(f"{CONTROLLER}: control", {}).get("chunks", 0)) > 0, what="diagnostics")
    ctl_diag = probe.diagnostics[f"{CONTROLLER}: control"]
    assert {"loop rate hz", "jitter std ms", "jitter max ms", "obs-to-chunk p95 ms", "estop", "enabled"} <= set(ctl_diag)
    wait_for(lambda: probe.diagnostics.get(f"{POLICY}: policy", {}).get("ready") == "True", what="policy diagnostics")


def test_instruction_change_and_episode_reset_reset_the_policy(system):
    running, probe = system
    n = probe.count("stats")
    probe.instruction_pub.publish(String(data="pick up the red cube"))
    wait_for(lambda: any(s.reset_reason == "instruction" for s in probe.stats[n:]), what="a reset for the instruction")
    reply = probe.call(Trigger, f"/{POLICY}/reset_episode", Trigger.Request())
    assert reply.success and "episode 1" in reply.message
    n = probe.count("stats")
    wait_for(lambda: any(s.reset_reason == "episode" for s in probe.stats[n:]), what="a reset for the episode")
    assert probe.stats[-1].cache_resets_total >= 2


def test_parameter_change_takes_effect_and_bad_values_are_rejected_with_a_reason(system):
    running, probe = system
    ctl = running.nodes[CONTROLLER]
    # Out of range: rejected (by the descriptor's range), the old value stays.
    r = probe.set_parameter(CONTROLLER, "safety.watchdog_periods", 0)
    assert not r.successful and "range" in r.reason.lower()
    r = probe.set_parameter(CONTROLLER, "safety.max_step", [-1.0])
    assert not r.successful and "out of range" in r.reason and "max_step" in r.reason
    # Cross-field: rejected by building the config (the ConfigError is the reason).
    r = probe.set_parameter(CONTROLLER, "scheduler.rtc", True)
    assert not r.successful and "aggregation" in r.reason
    # Shape-changing: read-only.
    r = probe.set_parameter(CONTROLLER, "scheduler.control_rate_hz", 25.0)
    assert not r.successful and "read-only" in r.reason
    assert ctl.cfg.safety.watchdog_periods == WATCHDOG and ctl.cfg.safety.max_step == (0.05,)
    # Accepted: a tighter per-step clamp applies at the next tick.
    r = probe.set_parameter(CONTROLLER, "safety.max_step", [0.001])
    assert r.successful, r.reason
    wait_for(lambda: ctl.cfg.safety.max_step == (0.001,), what="the new max_step to apply")
    start = probe.count("commands")
    wait_for(lambda: probe.count("commands") >= start + 15, what="commands under the new clamp")
    with probe.lock:
        pos = np.array([list(m.position) for _, m in probe.commands[start + 2 :]])
    assert np.abs(np.diff(pos, axis=0)).max() <= 0.001 * (1.6214 - 0.6197) + 1e-6  # grippers scale to rad
    # The policy node takes a new PolicyConfig between two inferences.
    pol = running.nodes[POLICY]
    r = probe.set_parameter(POLICY, "policy.flow_steps", 3)
    assert r.successful, r.reason
    wait_for(lambda: pol.policy.config.flow_steps == 3, what="flow_steps to reach the policy")
    assert probe.set_parameter(POLICY, "policy.flow_steps", 5000).successful is False
    assert probe.set_parameter(CONTROLLER, "safety.max_step", [0.05]).successful


def test_a_burst_of_malformed_images_is_survived(system):
    running, probe = system
    cam = running.nodes[CAMERA]
    good = probe.frames[0]
    kinds = ("unknown_encoding", "bad_step", "empty", "size_mismatch", "bad_size")

    def burst() -> bool:
        # Best-effort sensor QoS keeps the last 5 per subscriber: a burst loses frames, so
        # repeat it until every kind of malformed frame has reached the node.
        for k in range(25):
            m = probe.image(good)
            kind = kinds[k % 5]
            if kind == "unknown_encoding":
                m.encoding = "weird16"
            elif kind == "bad_step":
                m.step = 10  # shorter than a row
            elif kind == "empty":
                m.data = b""
            elif kind == "size_mismatch":
                m.data = bytes(m.data)[:-7]
            else:
                m.height, m.width = 0, 0
            probe.image_pub.publish(m)
        return set(kinds) <= set(cam.drops.counts)

    wait_for(burst, what="every kind of malformed frame to be dropped")
    # Still alive: new observations are assembled and commands keep flowing.
    n_obs, n_cmd = probe.count("stamps"), probe.count("commands")
    wait_for(lambda: probe.count("stamps") >= n_obs + 5 and probe.count("commands") >= n_cmd + 10, what="the graph to go on")


def test_estop_stops_command_output_until_released_and_enabled(system):
    running, probe = system
    ctl = running.nodes[CONTROLLER]
    probe.estop_pub.publish(Bool(data=True))
    wait_for(lambda: ctl.control.safety.estop, what="the e-stop to reach the controller")
    tick = ctl.control.tick_count
    wait_for(lambda: ctl.control.tick_count >= tick + 2, what="two control ticks")  # no command is in flight now
    published = ctl.control.commands
    wait_for(lambda: probe.count("commands") >= published, timeout=10.0, what="in-flight commands")
    n = probe.count("commands")
    tick = ctl.control.tick_count
    wait_for(lambda: ctl.control.tick_count >= tick + 25, what="25 control ticks")
    assert ctl.control.commands == published and probe.count("commands") == n
    probe.estop_pub.publish(Bool(data=False))
    wait_for(lambda: not ctl.control.safety.estop, what="the release")
    tick = ctl.control.tick_count
    wait_for(lambda: ctl.control.tick_count >= tick + 10, what="10 control ticks")
    assert ctl.control.commands == published  # released, but not re-enabled
    reply = probe.call(SetBool, f"/{CONTROLLER}/enable", SetBool.Request(data=True))
    assert reply.success
    wait_for(lambda: probe.count("commands") >= n + 10, what="commands after enabling")


def test_rtc_guidance_travels_from_controller_to_policy_and_is_honoured(system):
    running, probe = system
    r = probe.set_parameters_atomically(CONTROLLER, {"scheduler.rtc": True, "scheduler.aggregation": "latest_only"})
    assert r.successful, r.reason
    n = probe.count("requests")

    def answered() -> list[tuple[ChunkRequest, ActionChunk]]:
        """Guided requests and their chunks, computed from the observation the controller named
        (one older than max_age_ms when its inference would start is served by a fresh newer
        one, without guidance, which is indexed to the old stamp)."""
        with probe.lock:
            reqs = {q.request_id: q for q in probe.requests[n:] if q.has_guidance}
            return [(reqs[c.request_id], c) for c in probe.chunks
                    if c.request_id in reqs and c.header.stamp == reqs[c.request_id].header.stamp]  # fmt: skip

    wait_for(lambda: len(answered()) >= 2, what="two guided chunks")
    for req, chunk in answered():
        h, d = req.horizon, req.action_dim
        prev = np.asarray(req.prev_actions, np.float32).reshape(h, d)
        actions = np.asarray(chunk.actions, np.float32).reshape(chunk.horizon, chunk.action_dim)
        # frozen = the delay in control steps from the latency p95; on a loaded machine a slow
        # first inference can put it past the whole chunk (then every row is committed).
        assert 0 < req.frozen <= h and len(req.weights) == h
        np.testing.assert_array_equal(actions[: req.frozen], prev[: req.frozen])  # committed prefix kept
    # The controller's motion state reaches the policy, whose stats say which mode it used.
    wait_for(lambda: probe.count("motion") >= 3, what="motion state")
    assert {s.motion_mode for s in probe.stats} <= {"coarse", "fine"}
    r = probe.set_parameters_atomically(CONTROLLER, {"scheduler.rtc": False, "scheduler.aggregation": "weighted_average"})
    assert r.successful, r.reason


def test_continuous_trigger_infers_without_requests(system):
    running, probe = system
    assert probe.set_parameter(POLICY, "trigger", "continuous").successful
    n = probe.count("chunks")
    wait_for(lambda: any(c.request_id == 0 for c in probe.chunks[n:]), what="an unrequested chunk")
    assert probe.set_parameter(POLICY, "trigger", "request").successful


def test_inputs_stamped_in_the_future_are_dropped_and_the_loop_goes_on(system):
    """A wrong clock (+1000 s) on a few frames, a chunk and a joint state: each is dropped and
    counted by the node it reaches, and requests, chunks and commands go on afterwards."""
    running, probe = system
    cam, ctl, pol = running.nodes[CAMERA], running.nodes[CONTROLLER], running.nodes[POLICY]
    wait_for(lambda: probe.count("chunks") >= 1, what="a running loop")

    def future(msg):
        msg.header.stamp.sec += 1000
        return msg

    def burst() -> bool:
        for _ in range(5):  # best-effort sensor QoS: repeat until they arrived
            probe.image_pub.publish(future(probe.image(probe.frames[1])))
        return cam.drops.counts.get("future_stamp", 0) >= 5

    wait_for(burst, what="future frames to be dropped")
    chunk_pub = probe.create_publisher(ActionChunk, "action_chunk", qos.RELIABLE)
    with probe.lock:
        chunk = probe.chunks[-1]
    future(chunk)
    chunk.request_id = 0
    chunk_pub.publish(chunk)
    wait_for(lambda: ctl.drops.counts.get("future_chunk", 0) >= 1, what="the future chunk to be dropped")
    js = JointState(name=ARM, position=START)
    js.header.stamp = probe.get_clock().now().to_msg()
    probe.js_pubs[0].publish(future(js))
    wait_for(lambda: pol.drops.counts.get("future_stamp", 0) >= 1 and ctl.drops.counts.get("future_stamp", 0) >= 1,
             what="the future joint state to be dropped by policy and controller")  # fmt: skip
    n_req, n_chunks, n_cmd = probe.count("requests"), probe.count("chunks"), probe.count("commands")
    wait_for(lambda: probe.count("requests") >= n_req + 3 and probe.count("chunks") >= n_chunks + 3
             and probe.count("commands") >= n_cmd + 20, what="requests, chunks and commands to go on")  # fmt: skip
    now = probe.get_clock().now().nanoseconds
    with probe.lock:
        stamps = [s.sec * 10**9 + s.nanosec for s in probe.stamps]
    assert max(stamps) <= now  # no observation was ever announced with a future stamp
    wait_for(lambda: "dropped future_stamp" in probe.diagnostics.get(f"{CAMERA}: cameras", {}), what="camera diagnostics")
    # chunk_pub stays until the graph shuts down: destroying it under the running executor can
    # raise InvalidHandle in the spin thread (rclpy builds its wait set from a list taken
    # earlier), which ends every node's callbacks.


def test_controller_holds_within_the_watchdog_time_when_the_policy_stops(system):
    running, probe = system
    ctl = running.nodes[CONTROLLER]
    wait_for(lambda: probe.count("chunks") >= 1 and probe.count("commands") >= 5, what="a running loop")
    running.stop_node(POLICY)
    t_stop = time.monotonic()
    n_chunks = probe.count("chunks")
    wait_for(lambda: ctl.control.watchdog.tripped, what="the watchdog")
    # It tripped WATCHDOG periods of time after the last chunk arrived (a chunk may have been in flight).
    assert ctl.control.watchdog.since_chunk_ns(ctl.get_clock().now().nanoseconds) > WATCHDOG * 0.02e9
    t_trip = time.monotonic()
    # By stamp, not by arrival: under load the probe receives commands of earlier ticks late.
    tripped_ns = ctl.get_clock().now().nanoseconds

    def held_commands():
        with probe.lock:
            return [list(m.position) for _, m in probe.commands if stamp_to_ns(m.header.stamp) > tripped_ns]

    # The hold target is the last command; the per-step clamp against the measured joints may
    # ramp the first held commands toward it (longer when the loaded simulator lags), and then
    # they stay put. The ramp's last step lands on the (float32) target in float64 arithmetic,
    # within float32 resolution of it.
    def settled() -> bool:
        held = held_commands()
        tail = np.array(held[-15:])
        return len(held) >= 40 and bool(np.abs(tail - tail[-1]).max() <= 1e-6)

    wait_for(settled, what="15 held commands in a row at one position")
    assert ctl.control.watchdog.tripped
    assert probe.count("chunks") <= n_chunks + 1
    # Bound on the wall clock: the loop runs below 50 Hz on a loaded machine, so allow slack.
    assert t_trip - t_stop < WATCHDOG * 0.02 + 5.0
