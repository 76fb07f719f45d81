"""Single nodes under hostile input, over real DDS (issue 12): each test starts the real node
with its parameters and a probe node that plays the rest of the graph, no mocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from sensor_msgs.msg import CompressedImage, JointState  # noqa: E402
from std_msgs.msg import Bool  # noqa: E402

from vla_accel_ros.msg import ActionChunk, Observation  # noqa: E402
from vla_accel_ros.ros import graph, qos  # noqa: E402
from vla_accel_ros.ros.conversions import header, observation_to_msg  # noqa: E402
import helpers  # noqa: E402  (test/helpers.py)
from test_robot_images import _bilevel_png  # noqa: E402

pytestmark = pytest.mark.ros
TIMEOUT = 60.0


spinning = helpers.spinning


def _collect(node: Node, msg_type, topic: str, profile) -> list:
    got: list = []
    node.create_subscription(msg_type, topic, got.append, profile)
    return got


def test_camera_node_refuses_a_compressed_frame_by_its_header_size(ros_context):
    from vla_accel_ros.ros.camera_node import CameraNode

    topic = "/cam_high/image/compressed"
    cam = CameraNode(
        context=ros_context,
        parameter_overrides=[
            Parameter("cameras", value=["cam_high"]), Parameter("topics", value=[topic]),
            Parameter("transports", value=["compressed"]), Parameter("image_size", value=16),
            Parameter("max_age_ms", value=60_000.0), Parameter("max_pixels", value=640 * 480),
        ],
    )  # fmt: skip
    probe = Node("probe", context=ros_context)
    pub = probe.create_publisher(CompressedImage, topic, qos.SENSOR)
    observations = _collect(probe, Observation, graph.OBSERVATION, qos.LATEST)

    def frame(png: bytes) -> CompressedImage:
        msg = CompressedImage(format="png", data=png)
        msg.header.stamp = probe.get_clock().now().to_msg()
        return msg

    huge, small = _bilevel_png(9000, 9000), _bilevel_png(64, 48)
    with spinning(ros_context, cam, probe):

        def sent_huge() -> bool:
            pub.publish(frame(huge))
            return cam.drops.counts.get("too_large", 0) >= 1

        helpers.wait_for(sent_huge, TIMEOUT, "the oversized frame to be refused")
        assert not observations and cam.frames["cam_high"] == 0

        def sent_small() -> bool:
            pub.publish(frame(small))
            return len(observations) >= 1

        helpers.wait_for(sent_small, TIMEOUT, "an observation from a frame within the bound")
        img = observations[0].images[0]
        assert (img.width, img.height) == (16, 16)
        # The bound is a parameter: lowered at run time, the small frame is refused too.
        assert cam.set_parameters([Parameter("max_pixels", value=64 * 47)])[0].successful
        before = cam.drops.counts.get("too_large", 0)

        def refused_small() -> bool:
            pub.publish(frame(small))
            return cam.drops.counts.get("too_large", 0) > before

        helpers.wait_for(refused_small, TIMEOUT, "the lowered bound to apply")


# -- the policy node on its own: observations and joint states from a probe --------------------------
ARM = ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper", "left_finger", "right_finger"]
START = [0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 1.1, 0.05, -0.05]


class RobotProbe(Node):
    """Observations (as the camera node sends them) at 20 Hz and joint states at 50 Hz; records
    chunks and diagnostics. ``positions`` may be changed to send other joint states."""

    def __init__(self, context) -> None:
        super().__init__("probe", context=context)
        self.lock = threading.Lock()
        self.chunks: list[ActionChunk] = []
        self.diagnostics: dict[str, dict[str, str]] = {}
        self.levels: dict[str, int] = {}
        self.messages: dict[str, str] = {}
        self.positions = list(START)
        self.streaming = True
        self.obs_pub = self.create_publisher(Observation, graph.OBSERVATION, qos.LATEST)
        self.js_pubs = [self.create_publisher(JointState, f"/follower_{s}/joint_states", qos.RELIABLE) for s in ("left", "right")]
        self.create_subscription(ActionChunk, graph.ACTION_CHUNK, self._on_chunk, qos.RELIABLE)
        self.create_subscription(DiagnosticArray, graph.DIAGNOSTICS, self._on_diagnostics, qos.RELIABLE)
        self.image = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        self.create_timer(0.05, self._publish_observation)
        self.create_timer(0.02, self._publish_joints)

    def _on_chunk(self, msg: ActionChunk) -> None:
        with self.lock:
            self.chunks.append(msg)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        with self.lock:
            for st in msg.status:
                self.diagnostics[st.name] = {kv.key: kv.value for kv in st.values}
                self.levels[st.name] = int.from_bytes(st.level, "little") if isinstance(st.level, bytes) else int(st.level)
                self.messages[st.name] = st.message

    def _publish_observation(self) -> None:
        if self.streaming:
            now = self.get_clock().now().nanoseconds
            self.obs_pub.publish(observation_to_msg({"cam_high": self.image}, now, 0, 0, 0))

    def _publish_joints(self) -> None:
        for pub in self.js_pubs:
            msg = JointState(header=header(self.get_clock().now().nanoseconds), name=ARM, position=list(self.positions))
            pub.publish(msg)

    def count(self) -> int:
        with self.lock:
            return len(self.chunks)

    def diag(self, name: str) -> tuple[int, str, dict[str, str]]:
        with self.lock:
            return self.levels.get(name, -1), self.messages.get(name, ""), dict(self.diagnostics.get(name, {}))


@pytest.fixture(scope="module")
def policy_graph(tiny_bundles, ros_params_file):
    """policy_node (tiny flow bundle, continuous trigger, observations over the topic) and a probe."""
    from vla_accel_ros.ros.policy_node import PolicyNode

    with helpers.module_ros_context() as ctx:
        node = PolicyNode(
            context=ctx,
            cli_args=["--ros-args", "--params-file", str(ros_params_file)],
            parameter_overrides=[
                Parameter("bundle", value=str(tiny_bundles["flow"])), Parameter("trigger", value="continuous"),
                Parameter("slow_inference_s", value=0.5),
            ],
        )  # fmt: skip
        probe = RobotProbe(ctx)
        with spinning(ctx, node, probe):
            helpers.wait_for(lambda: node.ready or node.failure, 120.0, "the policy to load")
            assert node.ready, node.failure
            helpers.wait_for(lambda: probe.count() >= 2, TIMEOUT, "chunks")
            yield node, probe


POLICY = f"{graph.POLICY}: policy"


def test_a_layer_index_beyond_the_model_is_refused_when_set_and_nothing_changes(policy_graph):
    node, probe = policy_graph
    depth = node.policy.num_layers
    before = node.get_parameter("policy.cache.relevance_layer").value
    result = node.set_parameters([Parameter("policy.cache.relevance_layer", value=depth + 5)])[0]
    assert not result.successful
    # The reason names the parameter, the value and the range this model allows.
    assert f"policy.cache.relevance_layer={depth + 5}" in result.reason and f"[-1, {depth - 1}]" in result.reason
    result = node.set_parameters([Parameter("policy.cache.reuse_layers", value=[2, depth])])[0]
    assert not result.successful and f"policy.cache.reuse_layers=({2}, {depth})" in result.reason
    assert node.get_parameter("policy.cache.relevance_layer").value == before
    assert node.worker.cfg.policy.cache.relevance_layer == before == node.policy.config.cache.relevance_layer
    n = probe.count()
    helpers.wait_for(lambda: probe.count() >= n + 3, TIMEOUT, "chunks after the refused changes")


def test_before_the_model_loads_layer_indices_are_checked_against_the_bundle(ros_context, tiny_bundles, tmp_path):
    """No model yet (here it never loads: the weights are missing): the bundle's config.json
    still says how deep the model is, and a change beyond it is refused when it is set."""
    import shutil

    from vla_accel_ros.core.bundle import CONFIG_FILE
    from vla_accel_ros.ros.policy_node import PolicyNode

    bundle = tmp_path / "config_only"
    bundle.mkdir()
    shutil.copy(tiny_bundles["flow"] / CONFIG_FILE, bundle / CONFIG_FILE)
    overrides = [Parameter("bundle", value=str(bundle)), Parameter("policy.accel", value="cache")]
    node = PolicyNode(context=ros_context, parameter_overrides=overrides)
    try:
        helpers.wait_for(lambda: node.failure, TIMEOUT, "the load to fail")
        assert node.policy is None
        result = node.set_parameters([Parameter("policy.cache.relevance_layer", value=9)])[0]
        assert not result.successful and "policy.cache.relevance_layer=9" in result.reason and "[-1, 3]" in result.reason
        assert node.set_parameters([Parameter("policy.cache.relevance_layer", value=3)])[0].successful
        # The other accelerations that use the cache, and pruning's layers, are checked too.
        result = node.set_parameters_atomically(
            [Parameter("policy.accel", value="cache+prune"), Parameter("policy.cache.reuse_layers", value=[2, 7])]
        )
        assert not result.successful and "policy.cache.reuse_layers" in result.reason
        result = node.set_parameters_atomically(
            [Parameter("policy.accel", value="prune"), Parameter("policy.prune.spec_layers", value=4)]
        )
        assert not result.successful and "spec_layers=4 leaves no layer to prune" in result.reason
        assert node.get_parameter("policy.accel").value == "cache"
    finally:
        node.close()
        node.destroy_node()


def test_options_the_policy_refuses_go_back_to_the_running_ones_even_empty_lists(ros_context, tiny_bundles, tmp_path):
    """The worker puts the parameters back to what runs when the policy refuses a change; an
    empty list (reuse_layers' default) must go back as the declared array type (rclpy types a
    bare [] as a byte array, which the parameter refuses)."""
    import shutil

    from vla_accel_ros.core.bundle import CONFIG_FILE
    from vla_accel_ros.ros.policy_node import PolicyNode

    bundle = tmp_path / "config_only"
    bundle.mkdir()
    shutil.copy(tiny_bundles["flow"] / CONFIG_FILE, bundle / CONFIG_FILE)
    node = PolicyNode(context=ros_context, parameter_overrides=[Parameter("bundle", value=str(bundle))])
    try:
        running = node.params.config.policy
        assert running.cache.reuse_layers == ()
        assert node.set_parameters([Parameter("policy.cache.reuse_layers", value=[2])])[0].successful
        node._restore(running)  # what the worker does when the policy refuses the change
        assert tuple(node.get_parameter("policy.cache.reuse_layers").value) == ()
        assert node.params.config.policy.cache.reuse_layers == ()
    finally:
        node.close()
        node.destroy_node()


def test_the_start_up_gate_runs_on_the_frames_of_gate_bag(ros_context, tiny_bundles, tmp_path):
    """With gate_bag the node's parity gate checks the accelerated path on the bag's first
    observation and its 11th (the task's own frames), and keeps them for later changes."""
    pytest.importorskip("gym_aloha")
    from vla_accel_ros.core.bundle import read_spec
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import gate_frames_from_bag
    from vla_accel_ros.ros.policy_node import PolicyNode

    bag = helpers.record_sim_bag(tmp_path / "bag", episodes=1, steps=12)
    spec = read_spec(tiny_bundles["flow"])
    overrides = [Parameter("bundle", value=str(tiny_bundles["flow"])), Parameter("gate_bag", value=str(bag)),
                 Parameter("policy.accel", value="cache")]  # fmt: skip
    node = PolicyNode(context=ros_context, parameter_overrides=overrides)
    try:
        helpers.wait_for(lambda: node.ready or node.failure, TIMEOUT, "the policy to load")
        assert node.ready, node.failure
        assert node.policy.parity_report.passed
        first, second = gate_frames_from_bag(bag, SyncConfig(cameras=tuple(spec.cameras)))
        gated = node.policy.gate_observations
        for got, want in zip(gated, (first, second)):
            assert want.stamp_ns == got.stamp_ns and np.array_equal(got.images["cam_high"], want.images["cam_high"])
        assert first.stamp_ns != second.stamp_ns and np.array_equal(gated[0].state, first.state)
    finally:
        node.close()
        node.destroy_node()


def test_a_gate_bag_that_cannot_feed_the_bundle_is_named(ros_context, tiny_bundles, tmp_path):
    import json

    from vla_accel_ros.core.bundle import CONFIG_FILE
    from vla_accel_ros.ros.policy_node import PolicyNode

    bundle = tmp_path / "two_cameras"  # a config is enough: the bag is checked before any weights load
    bundle.mkdir()
    config = json.loads((tiny_bundles["flow"] / CONFIG_FILE).read_text())
    (bundle / CONFIG_FILE).write_text(json.dumps({**config, "cameras": ["cam_high", "cam_left_wrist"]}))
    top_only = helpers.still_bag(tmp_path, camera="cam_high", joints=True)
    for gate_bag, why in ((tmp_path / "missing", "no such bag"), (top_only, "no camera(s) cam_left_wrist")):
        overrides = [Parameter("bundle", value=str(bundle)), Parameter("gate_bag", value=str(gate_bag))]
        node = PolicyNode(context=ros_context, parameter_overrides=overrides)
        try:
            helpers.wait_for(lambda: node.failure, TIMEOUT, "the load to fail")
            assert f"gate_bag={str(gate_bag)!r}" in node.failure and why in node.failure, node.failure
            assert node.policy is None and not node.ready
        finally:
            node.close()
            node.destroy_node()


def test_instructions_are_bounded_in_the_log_and_by_the_model(policy_graph, capfd):
    """A 100 kB instruction is refused, counted, and logged at most ~200 characters long (over a
    storm it was ~9 MB of log a minute); one with more tokens than the bundle takes is refused
    with the model's reason; the instruction in use stays. The log is read where rcutils writes
    it (stderr, captured at the file descriptor)."""
    from std_msgs.msg import String

    from vla_accel_ros.ros.drops import capped

    node, probe = policy_graph
    pub = probe.create_publisher(String, graph.INSTRUCTION, qos.LATCHED)
    pub.publish(String(data="pick up the cube"))
    helpers.wait_for(lambda: node.worker.instruction_text() == "pick up the cube", TIMEOUT, "the instruction")

    def refused(text: str) -> None:  # latched, depth 1: one at a time
        n = node.drops.counts.get("instruction", 0)
        pub.publish(String(data=text))
        helpers.wait_for(lambda: node.drops.counts.get("instruction", 0) > n, TIMEOUT, f"{capped(text, 20)!r} to be refused")

    for _ in range(3):
        refused("a" * 100_000)
    words = " ".join(["cube"] * (node.policy.spec.max_text_tokens + 10))
    refused(words)
    assert node.worker.instruction_text() == "pick up the cube"
    # Parameter too: refused with the model's reason, and the value in the reason is capped.
    r = node.set_parameters([Parameter("instruction", value=words)])[0]
    assert not r.successful and "max_text_tokens" in r.reason and len(r.reason) < 1000
    r = node.set_parameters([Parameter("instruction", value="b" * 5000)])[0]
    assert not r.successful and "max_instruction_chars" in r.reason and len(r.reason) < 1000
    n = probe.count()
    helpers.wait_for(lambda: probe.count() >= n + 2, TIMEOUT, "chunks after the storm")
    log = [line for line in capfd.readouterr().err.splitlines() if "[policy_node]" in line]
    assert any("instruction: 'pick up the cube'" in line for line in log)
    assert any("100000 characters > max_instruction_chars" in line and "... (100000 characters)'" in line for line in log)
    assert max(len(line) for line in log) < 1000, max(len(line) for line in log)


def test_a_failing_step_of_the_worker_is_counted_and_the_worker_goes_on(policy_graph):
    node, probe = policy_graph
    real, failed = node.worker.next_job, []

    def next_job_failing_once(timeout_s: float = 0.1):
        if not failed:
            failed.append(1)
            raise RuntimeError("injected: next_job failed")
        return real(timeout_s)

    node.worker.next_job = next_job_failing_once
    try:
        helpers.wait_for(lambda: failed, TIMEOUT, "the injected failure")
        n = probe.count()
        helpers.wait_for(lambda: probe.count() >= n + 3, TIMEOUT, "chunks after the failure")
        assert node._thread.is_alive() and node.worker.errors >= 1  # noqa: SLF001
        helpers.wait_for(lambda: int(probe.diag(POLICY)[2].get("errors", 0)) >= 1, TIMEOUT, "errors in diagnostics")
        values = probe.diag(POLICY)[2]
        assert float(values["s since last chunk"]) < 5.0 and values["worker alive"] == "True"
    finally:
        node.worker.next_job = real


def test_an_inference_running_too_long_shows_in_diagnostics(policy_graph):
    node, probe = policy_graph
    policy, real = node.policy, node.policy.infer

    def slow_infer(obs, **kw):
        time.sleep(2.5)
        return real(obs, **kw)

    policy.infer = slow_infer
    try:
        def warned() -> bool:
            level, message, values = probe.diag(POLICY)
            return level == 1 and "has run for" in message and float(values.get("inference running s", 0)) > 0.5

        helpers.wait_for(warned, TIMEOUT, "a WARN for the slow inference")
    finally:
        policy.infer = real
    helpers.wait_for(lambda: probe.diag(POLICY)[0] == 0 or probe.diag(POLICY)[1].endswith("inference errors"), TIMEOUT, "OK again")


def test_nonfinite_joint_states_are_counted_and_named(policy_graph):
    node, probe = policy_graph
    probe.positions = [float("nan")] * len(START)
    try:
        helpers.wait_for(lambda: node.drops.counts.get("nonfinite_joint_state", 0) >= 3, TIMEOUT, "NaN joint states to be dropped")
        with node.worker.lock:  # forget the finite readings: only NaN arrives from now on
            node.worker.state.reset()
        helpers.wait_for(lambda: "not finite" in node.worker.state.last_reject, TIMEOUT, "the reject to say why")
        assert "no joint states yet" not in node.worker.state.last_reject
    finally:
        probe.positions = list(START)
    n = probe.count()
    helpers.wait_for(lambda: probe.count() >= n + 2, TIMEOUT, "chunks once the joint states are finite again")


# NaN / inf, and values finite as float64 but not in the policy's float32 state (the 2 of 250 that
# reached inference before issue 45: the per-value NaN check let 1e39 through, float32 made it inf).
STORM = (float("nan"), float("inf"), float("-inf"), 1e39, -3.5e38, 1e308)
USED = (0, 1, 2, 3, 4, 5, 7)  # in ARM: the six arm joints and left_finger, which the gripper state reads


def _moved(now, then) -> bool:
    return all(a > b for a, b in zip(now, then))


def test_a_storm_of_nonfinite_joint_states_never_reaches_inference(policy_graph, ros_params_file):
    """250 joint-state messages with one non-finite (or float32-overflowing) joint each, among
    the probe's finite ones: the policy node and the controller refuse every one they receive
    where it arrives, the policy keeps inferring (on finite states), none fails, and the
    controller's measured state never holds a non-finite value."""
    node, probe = policy_graph
    ctl = _controller(node.context, ros_params_file)
    storm = Node("storm", context=node.context)
    pubs = [storm.create_publisher(JointState, f"/follower_{s}/joint_states", qos.RELIABLE) for s in ("left", "right")]
    errors0, chunks0 = node.worker.errors, probe.count()

    def refused() -> tuple[int, int]:
        return node.drops.counts.get("nonfinite_joint_state", 0), ctl.drops.counts.get("nonfinite_joint_state", 0)

    before = refused()
    with spinning(node.context, ctl, storm):
        helpers.wait_for(lambda: ctl.state.state() is not None, TIMEOUT, "the controller's first state")
        helpers.wait_for(lambda: all(p.get_subscription_count() >= 2 for p in pubs), TIMEOUT, "both readers of each topic")
        states = []
        for k in range(250):  # at most 50 per second, as fast as the probe's finite ones
            positions = list(START)
            positions[USED[k % len(USED)]] = STORM[k % len(STORM)]
            msg = JointState(header=header(storm.get_clock().now().nanoseconds), name=ARM, position=positions)
            sent, n = time.monotonic(), refused()
            pubs[k % 2].publish(msg)
            # Paced by the refusals: the nodes read joint states best effort, keep last 5, so a storm
            # sent blind is partly lost whenever a busy process delays their executors (143 of 250
            # arrived once in a full suite on 2 cores). Waiting for both counts to move, or 0.5 s,
            # keeps a message from being pushed out by the next ones.
            while time.monotonic() - sent < 0.5 and (time.monotonic() - sent < 0.02 or not _moved(refused(), n)):
                time.sleep(0.002)
            with ctl._lock:  # noqa: SLF001 - the state the next tick would use
                states.append(ctl.state.state())
        helpers.wait_for(lambda: probe.count() >= chunks0 + 3, TIMEOUT, "chunks after the storm")
        counted = [a - b for a, b in zip(refused(), before)]
    assert node.worker.errors == errors0, f"{node.worker.errors - errors0} inference errors: {node.drops.snapshot()}"
    assert all(np.isfinite(st[0]).all() for st in states if st is not None)
    # Each one that arrives is refused by name; best effort may still lose a few past the 0.5 s.
    assert counted[0] >= 240, (counted, node.drops.snapshot())
    assert counted[1] >= 240, (counted, ctl.drops.snapshot())


def test_a_dead_worker_turns_diagnostics_to_error(policy_graph):
    """Last: the worker of this module's node does not come back."""
    node, probe = policy_graph

    class Fatal(BaseException):
        pass

    def next_job_fatal(timeout_s: float = 0.1):
        raise Fatal("injected: the worker thread ends")

    node.worker.next_job = next_job_fatal
    helpers.wait_for(lambda: not node._thread.is_alive(), TIMEOUT, "the worker to end")  # noqa: SLF001

    def error() -> bool:
        level, message, values = probe.diag(POLICY)
        return level == 2 and "worker stopped" in message and values.get("worker alive") == "False"

    helpers.wait_for(error, TIMEOUT, "diagnostics at ERROR")


# -- the action controller on its own ---------------------------------------------------------------
def _controller(context, params_file, **overrides):
    from vla_accel_ros.ros.action_controller_node import ActionControllerNode

    return ActionControllerNode(
        context=context, cli_args=["--ros-args", "--params-file", str(params_file)],
        parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()],
    )  # fmt: skip


def _chunk_msg(stamp_ns: int, rows: int = 50) -> ActionChunk:
    from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES

    pose = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 0.5] * 2, np.float32)
    msg = ActionChunk(header=header(stamp_ns), chunk_id=1, horizon=rows, action_dim=14, dt=0.02)
    msg.joint_names = list(ALOHA_JOINT_NAMES)
    msg.actions = np.repeat(pose[None], rows, axis=0).reshape(-1)
    return msg


def test_an_estop_arriving_during_a_tick_stops_that_ticks_command(ros_context, ros_params_file):
    ctl = _controller(ros_context, ros_params_file)
    probe = RobotProbe(ros_context)
    probe.streaming = False
    commands: list[JointState] = []
    probe.create_subscription(JointState, "joint_commands", commands.append, qos.COMMANDS)
    chunk_pub = probe.create_publisher(ActionChunk, graph.ACTION_CHUNK, qos.RELIABLE)
    with spinning(ros_context, ctl, probe):

        def commanding() -> bool:
            chunk_pub.publish(_chunk_msg(probe.get_clock().now().nanoseconds))
            return len(commands) >= 5

        helpers.wait_for(commanding, TIMEOUT, "commands")
        real_tick, injected = ctl.control.tick, []

        def tick_then_estop(*args, **kwargs):
            sent = ctl.control.commands  # (a tick counts its command; send uncounts it if withheld)
            out = real_tick(*args, **kwargs)  # the tick computed its command ...
            if out.command is not None and not injected:
                injected.append(sent)
                ctl._on_estop(Bool(data=True))  # noqa: SLF001 - ... and the e-stop callback runs now
            return out

        ctl.control.tick = tick_then_estop
        helpers.wait_for(lambda: len(injected) == 1, TIMEOUT, "a tick with an e-stop inside it")
        tick = ctl.control.tick_count
        helpers.wait_for(lambda: ctl.control.tick_count >= tick + 10, TIMEOUT, "ten more ticks")
        # Counted where they leave: a command of an earlier tick may still be on the wire when
        # the e-stop lands, so the probe's count at that moment is no bound.
        assert ctl.control.commands == injected[0] and ctl.control.withheld == 1
        time.sleep(0.2)  # whatever was on the wire has arrived; nothing more comes
        n = len(commands)
        time.sleep(0.3)
        assert len(commands) == n and n <= injected[0]
        ctl.control.tick = real_tick


def test_chunks_beyond_the_inbox_are_counted(ros_context, ros_params_file):
    ctl = _controller(ros_context, ros_params_file)
    try:
        # No executor: no tick drains the inbox while 40 chunks arrive through the callback.
        for k in range(40):
            ctl._on_chunk(_chunk_msg(10**9 + k))  # noqa: SLF001
        assert ctl.drops.counts["inbox_full"] == 40 - ctl._inbox.maxlen  # noqa: SLF001
    finally:
        ctl.destroy_node()


def test_diagnostics_read_drop_counts_while_callbacks_write_them(ros_context):
    """Callbacks on several threads drop frames for new reasons while the diagnostics timer
    reads the counts; reading a copy taken under the lock, it never sees the dict change."""
    from vla_accel_ros.ros.camera_node import CameraNode

    cam = CameraNode(context=ros_context)
    stop, errors = threading.Event(), []

    def writer(k: int) -> None:
        i = 0
        while not stop.is_set():
            cam.drops.drop(f"reason_{k}_{i}", "x")
            i += 1

    from rclpy.logging import LoggingSeverity

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    cam.get_logger().set_level(LoggingSeverity.ERROR)  # every new reason would log a warning
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                cam._publish_diagnostics()  # noqa: SLF001
            except RuntimeError as e:  # "dictionary changed size during iteration"
                errors.append(str(e))
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
        cam.destroy_node()
    assert not errors, errors


def test_node_processes_return_freed_frames_to_the_system():
    """Every node's main (spin_node) and bringup fix glibc's mmap threshold: frames decoded and
    freed on several callback threads go back to the system instead of staying in the heap
    arenas (a storm of frames took a camera node from 81 to 413 MB for good; with the fix it
    settled at 152 MB, which is Fast DDS keeping one buffer of the largest frame per topic).
    Here 8 threads decode-and-resize like the camera node's callbacks: without the fix ~80 MB
    stay, with it none."""
    import subprocess
    import sys

    code = (
        "import threading, numpy as np\n"
        "from vla_accel_ros.ros.process_tuning import return_freed_frames_to_the_system\n"
        "assert return_freed_frames_to_the_system()\n"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024\n"
        "keep = []\n"
        "def callback_thread():\n"
        "    for _ in range(60):\n"
        "        frame = np.ones(1080 * 1920 * 3, np.uint8)  # decoded\n"
        "        small = np.ones(224 * 224 * 3, np.uint8)  # resized\n"
        "        keep.append(bytearray(200))  # something small that stays\n"
        "        del frame, small\n"
        "base = rss()\n"
        "threads = [threading.Thread(target=callback_thread) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(rss() - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 20  # MB


def test_ctrl_c_on_a_standalone_policy_node_during_inference_ends_it_cleanly(tiny_bundles, ros_params_file, ros_context, tmp_path):
    """The node's own process (python -m ...policy_node), inferring back to back; Ctrl-C lands
    during an inference: the worker stops before the context, no RCLError, exit code 0."""
    import os
    import signal
    import subprocess
    import sys

    import yaml

    mine = tmp_path / "policy.yaml"  # a node's section wins over -p: a second file
    mine.write_text(yaml.safe_dump({"policy_node": {"ros__parameters": {"bundle": str(tiny_bundles["flow"]), "trigger": "continuous"}}}))
    cmd = [sys.executable, "-m", "vla_accel_ros.ros.policy_node", "--ros-args", "--params-file", str(ros_params_file),
           "--params-file", str(mine)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    probe = RobotProbe(ros_context)
    try:
        with spinning(ros_context, probe):
            helpers.wait_for(lambda: probe.count() >= 5, 120.0, "chunks from the policy process")
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "RCLError" not in out, out[-3000:]


def test_ctrl_c_while_a_node_starts_ends_it_without_a_traceback(ros_params_file):
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "vla_accel_ros.ros.camera_node", "--ros-args", "--params-file", str(ros_params_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    line = proc.stdout.readline()  # the node's first log line: it is being built
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, line + out


def test_a_recorder_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    """A script's background job inherits SIGINT ignored; the recorder must still end (and
    close its bag) on the SIGINT a launcher or the user sends."""
    import os
    import random
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "vla_accel_ros.cli", "record", "--out", str(tmp_path / "bag"),
           "--domain-id", str(random.SystemRandom().randint(1, 100))]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    line = proc.stdout.readline()  # "recording N topics ...": it spins
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "recording" in line and "nothing was recorded" in out and "Traceback" not in out, line + out
    assert (tmp_path / "bag" / "metadata.yaml").is_file()  # closed in order


def test_a_recorder_hands_itself_over_before_its_constructor_returns(ros_context, tmp_path):
    """The record command holds the node from ``on_built`` on, so a Ctrl-C between the
    constructor's return and the assignment still leaves it a node to close (before, the bag
    stayed open without metadata). An interrupt right after the hand-over: the constructor
    closes the bag, and the caller's close of the node it holds is harmless."""
    from rclpy.parameter import Parameter

    from vla_accel_ros.ros.recorder import RecorderNode

    out = tmp_path / "bag"
    overrides = [Parameter("out", value=str(out)), Parameter("topics", value=["/a"])]
    built = []
    node = RecorderNode(context=ros_context, parameter_overrides=overrides, on_built=built.append)
    assert built == [node]
    node.close()
    node.destroy_node()
    assert (out / "metadata.yaml").is_file()

    def interrupted(n):
        built.append(n)
        raise KeyboardInterrupt

    out2 = tmp_path / "bag2"
    overrides = [Parameter("out", value=str(out2)), Parameter("topics", value=["/a"])]
    with pytest.raises(KeyboardInterrupt):
        RecorderNode(context=ros_context, parameter_overrides=overrides, on_built=interrupted)
    assert (out2 / "metadata.yaml").is_file()
    built[-1].close()  # what the command's cleanup does with the node it holds
    built[-1].destroy_node()


def test_a_recorder_interrupted_while_it_is_built_closes_its_bag(ros_context, tmp_path):
    """A Ctrl-C that lands after the bag is opened but before the node exists leaves the caller
    nothing to close: the constructor closes the bag itself (metadata written, no message)."""
    from rclpy.parameter import Parameter

    from vla_accel_ros.ros.recorder import RecorderNode

    class InterruptedRecorder(RecorderNode):  # the interrupt lands in the last step of the build
        def create_timer(self, *args, **kwargs):
            raise KeyboardInterrupt

    out = tmp_path / "bag"
    overrides = [Parameter("out", value=str(out)), Parameter("topics", value=["/a"])]
    with pytest.raises(KeyboardInterrupt):
        InterruptedRecorder(context=ros_context, parameter_overrides=overrides)
    assert (out / "metadata.yaml").is_file()


# A node spun by spin_node in a process of its own (the tests below): the tests' code is the child's.
_SPUN_NODE = """
import os, signal, sys, threading
from rclpy.node import Node
from vla_accel_ros.ros import spin
from vla_accel_ros.ros.spin import spin_node
spin.SHUTDOWN_DEADLINE_S = {deadline_s}

class Spun(Node):
    def __init__(self):
        super().__init__("spun")
        self.ticks, self.raised = 0, []
        self.create_timer(0.001, self.tick)
    def close(self):
        print("closed", self.ticks, self.raised, flush=True)
{body}
spin_node(Spun, ["spun"], threads={threads})
print("returned", flush=True)
"""


def _spin_in_a_process(body: str, *, threads: int = 4, deadline_s: float = 10.0):
    """``_SPUN_NODE`` with ``body`` (its callbacks) in a process of its own, on the test's domain
    (the ros_domain fixture's environment), spun on ``threads`` threads, ended at the latest
    ``deadline_s`` after a stop signal."""
    import os
    import subprocess
    import sys

    code = _SPUN_NODE.format(body=body, threads=threads, deadline_s=deadline_s)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))


def test_ctrl_c_while_a_node_spins_only_asks_its_loop_to_stop(ros_domain):
    """Once spin_node spins, SIGINT and SIGTERM set a flag its loop reads; their handlers do not
    raise. A KeyboardInterrupt raised wherever the spinning thread is can land in the
    executor's dispatch (ThreadPoolExecutor.submit's idle semaphore, a pure-Python Condition)
    with that lock taken: every pool thread then blocks on it after its callback and the drain
    waits forever (the recorder under ros2 launch, killed after SIGTERM). Here a callback, while
    callbacks run back to back, calls the handlers as the signals would, then sends a real
    SIGINT: no handler raised, the node closed, spin_node returned, exit 0."""
    body = """
    def tick(self):
        self.ticks += 1
        if self.ticks == 50:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    signal.getsignal(sig)(sig, None)
                except KeyboardInterrupt:
                    self.raised.append(signal.Signals(sig).name)
            os.kill(os.getpid(), signal.SIGINT)
"""
    proc = _spin_in_a_process(body)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    closed = [line for line in out.splitlines() if line.startswith("closed")]
    assert closed and closed[0].endswith(" []"), out[-3000:]  # no handler raised
    assert out.rstrip().endswith("returned"), out[-3000:]


_STUCK_TICK = """
    def tick(self):
        self.ticks += 1
        if self.ticks == 1:
            print("stuck", flush=True)
            threading.Event().wait()
"""


def _stuck_then_interrupted(threads: int, deadline_s: float = 10.0, before=None) -> tuple[int, str, float]:
    """A node whose first callback never returns, spun on ``threads`` threads; once it is stuck,
    ``before(proc)``, then SIGINT: (exit status, output, seconds from SIGINT to the exit)."""
    import signal
    import time

    proc = _spin_in_a_process(_STUCK_TICK, threads=threads, deadline_s=deadline_s)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "stuck", line + proc.stdout.read()
        if before is not None:
            before(proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        return proc.returncode, out, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_callback_still_running_after_ctrl_c_is_named_and_the_process_still_ends(ros_domain):
    """A callback that never returns: spin_node waits DRAIN_TIMEOUT_S for it, logs where it is,
    and ends the process (status 1) instead of waiting for it forever, as the interpreter's exit
    would (it joins the executor's threads), until ros2 launch's SIGKILL."""
    from vla_accel_ros.ros.spin import DRAIN_TIMEOUT_S

    code, out, seconds = _stuck_then_interrupted(threads=4)
    assert code == 1, out[-3000:]
    assert "still running" in out and " tick" in out, out[-3000:]  # the callback, by name
    assert "returned" not in out and seconds < DRAIN_TIMEOUT_S + 3.0, (seconds, out[-3000:])


def test_a_callback_stuck_in_a_single_threaded_nodes_loop_meets_the_stop_deadline(ros_domain):
    """On one thread (the controller's executor) the callback runs in the spinning thread, so
    its loop never reads the stop flag and no drain can help: SIGINT and then SIGTERM were
    ignored until ros2 launch's SIGKILL. From the first stop signal, SHUTDOWN_DEADLINE_S ends
    the process (status 1) with every thread's stack, the stuck callback's among them."""
    import signal
    import time

    deadline_s = 1.0

    def reset_is_not_a_stop(proc) -> None:  # SIGUSR1 (reset_stats) must not arm the deadline
        proc.send_signal(signal.SIGUSR1)
        time.sleep(deadline_s + 1.5)
        assert proc.poll() is None, proc.stdout.read()

    code, out, seconds = _stuck_then_interrupted(threads=1, deadline_s=deadline_s, before=reset_is_not_a_stop)
    assert code == 1, out[-3000:]
    assert "Timeout" in out and "in tick" in out, out[-3000:]  # faulthandler's dump names the callback
    assert "closed" not in out and deadline_s <= seconds < deadline_s + 3.0, (seconds, out[-3000:])


@pytest.mark.slow
def test_ctrl_c_at_any_moment_of_a_busy_executors_dispatch_ends_spin_node(ros_domain):
    """The failure itself, by chance: spin_node cycles on a node whose executor dispatches
    without a pause (100 timers at 1 ms), each ended by a SIGINT at a random moment. With the
    KeyboardInterrupt raised inside the dispatch, a cycle hung in the drain (every pool thread
    in the idle semaphore's release) or lost the Ctrl-C in a finalizer within 18 to 80 cycles
    (4 runs of 100 on 2 cores); each cycle must end, and all of them, within 10 s each."""
    import os
    import subprocess
    import sys

    cycles = 150
    code = f"""
import faulthandler, os, random, signal, threading
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from vla_accel_ros.ros.spin import spin_node

rng = random.Random(0)

class Busy(Node):
    def __init__(self):
        super().__init__("busy")
        group = ReentrantCallbackGroup()
        for _ in range(100):
            self.create_timer(0.001, lambda: None, callback_group=group)
        self.arm = self.create_timer(0.001, self.sigint_soon)  # its own (exclusive) group: once
    def sigint_soon(self):
        self.arm.cancel()  # it spins: one SIGINT a moment later
        threading.Timer(rng.uniform(0.02, 0.3), os.kill, (os.getpid(), signal.SIGINT)).start()

for i in range({cycles}):
    faulthandler.dump_traceback_later(10, exit=True)  # a cycle that hangs: every thread's stack
    spin_node(Busy, ["busy"])
    faulthandler.cancel_dump_traceback_later()
print("cycles", i + 1, flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == f"cycles {cycles}", out.stdout[-2000:] + out.stderr[-6000:]
