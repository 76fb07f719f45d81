"""The simulated ALOHA on the ROS graph (issue 6): aloha_sim_node, `vla-accel record`, and the
simulated closed loop `vla-accel bringup --sim`.

The ROS-free pieces (command decoding per backend, joint states in the robot's units, pacing,
recording order) are checked directly; the node runs for real (MuJoCo, small frames, rclpy
over DDS on a random domain) and the closed loop runs as the CLI runs it, with the tiny flow
bundle, while `vla-accel record` records it from a second process. Every wait is a condition
with a timeout.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.params_file import node_section
from vla_accel_ros.core.robot.config import RobotConfig
from vla_accel_ros.io.recording import ClockReadings, ReorderBuffer, header_stamp_ns
from vla_accel_ros.core.robot.state import StateAssembler, to_robot_units
from vla_accel_ros.sim.live import DT_NS, LatencyTracker, Pacer, render_every
from vla_accel_ros.sim.robot_io import CommandDecoder, CommandError, joint_state_messages
import helpers  # test/helpers.py

ROBOT = RobotConfig()
START = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 0.1] * 2)
TIMEOUT = 60.0


def wait_for(cond, timeout: float = TIMEOUT, what: str = "condition") -> None:
    helpers.wait_for(cond, timeout, what)


# -- ROS-free: the robot's topics <-> the simulator's layout -------------------------------------
def test_joint_states_read_back_to_the_simulator_state():
    """What the sim publishes (gripper joint angle + finger opening) is what the policy and the
    controller reassemble: exactly the simulator's normalized state."""
    q = START.copy()
    q[6], q[13] = 0.25, 0.9
    msgs = joint_state_messages(ROBOT, q, np.arange(14) * 0.01)
    assert len(msgs) == 2
    names, pos, vel = msgs[0]
    assert names == ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper", "left_finger"]
    g = ROBOT.gripper
    assert pos[6] == pytest.approx(g.joint_close + 0.25 * (g.joint_open - g.joint_close))  # rad, as Interbotix
    assert pos[7] == pytest.approx(g.finger_close + 0.25 * (g.finger_open - g.finger_close))  # m
    st = StateAssembler(ROBOT)
    for i, (n, p, _) in enumerate(msgs):
        st.update(i, n, p, 1)
    state, _ = st.state()
    np.testing.assert_allclose(state, q, atol=1e-6)


def test_command_decoder_per_backend():
    dec = CommandDecoder(ROBOT)
    dec.hold(START)
    cmd = START.copy()
    cmd[0], cmd[6], cmd[13] = 0.3, 0.8, 0.2
    robot_units = to_robot_units(cmd, ROBOT)  # what the controller publishes: grippers in rad
    # joint_state: named, partial updates keep the rest
    assert dec.from_joint_state(["left_waist", "left_gripper", "someone_elses_joint"], [robot_units[0], robot_units[6], 9.0]) == 2
    np.testing.assert_allclose(dec.target_at(0)[[0, 6, 13]], [0.3, 0.8, 0.1])
    # float64_multi_array: all joints, robot.joint_names order
    assert dec.from_array(robot_units) == 14
    np.testing.assert_allclose(dec.target_at(0), cmd)
    with pytest.raises(CommandError):
        dec.from_array(robot_units[:7])
    with pytest.raises(CommandError):
        dec.from_joint_state(["left_waist"], [float("nan")])
    np.testing.assert_allclose(dec.target_at(0), cmd)  # a bad message changes nothing
    # joint_trajectory: interpolated in sim time from the target at its start, then held
    goal = to_robot_units(START, ROBOT)
    dec.from_trajectory(list(ROBOT.joint_names), [0.1], [goal], start_ns=1_000_000_000)
    np.testing.assert_allclose(dec.target_at(1_050_000_000), (cmd + START) / 2, atol=1e-9)
    np.testing.assert_allclose(dec.target_at(2_000_000_000), START, atol=1e-9)
    np.testing.assert_allclose(dec.target_at(1_050_000_000), START, atol=1e-9)  # finished: held
    # interbotix: six arm joints per group command, the gripper by its joint name
    dec.from_interbotix_group("right", [0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    dec.from_interbotix_single("right", "gripper", ROBOT.gripper.joint_open)
    np.testing.assert_allclose(dec.target_at(0)[7:], [0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 1.0])


def test_a_robot_the_simulator_does_not_have_is_refused():
    with pytest.raises(ConfigError, match="simulated ALOHA"):
        CommandDecoder(RobotConfig(joint_names=("a", "b"), arms=("a",), grippers=(), joint_state_topics=("/js",), joint_state_prefixes=("",)))


def test_pacing_rendering_latency_and_recording_order():
    now = [100.0]
    pacer = Pacer(1.0, clock=lambda: now[0])
    assert pacer.delay(0.0) == 0.0
    assert pacer.delay(0.02) == pytest.approx(0.02)  # real time: 20 ms of sim time per 20 ms
    now[0] += 1.0  # fell behind by a second: no burst to catch up, it goes on from here
    assert pacer.delay(0.04) == 0.0 and pacer.delay(0.06) == pytest.approx(0.02)
    assert Pacer(0.0).delay(5.0) == 0.0
    assert [render_every(r) for r in (50.0, 25.0, 10.0, 0.5)] == [1, 2, 5, 100]
    lat = LatencyTracker()
    lat.published(40 * DT_NS, 1_000_000_000)
    assert lat.chunk(40 * DT_NS, 45 * DT_NS, 1_250_000_000) and not lat.chunk(7, 0, 0)
    assert lat.sim_ms.get(50) == pytest.approx(100.0) and lat.wall_ms.get(50) == pytest.approx(250.0)
    buf = ReorderBuffer(window_ns=10)
    assert buf.push(20, "frame") == []
    assert buf.push(20, "marker", rank=-2) == [] and buf.push(31, "late") == [(20, "marker"), (20, "frame")]
    assert buf.flush() == [(31, "late")]
    # Stamps that stop advancing (a paused sim clock) cannot make it grow without bound.
    buf = ReorderBuffer(window_ns=10, max_items=100)
    out = [item for k in range(1000) for _, item in buf.push(40, k)]
    assert len(buf) == 100 and buf.overflowed == 900 and out == list(range(900))  # the oldest leave first
    assert header_stamp_ns(b"\x00\x01\x00\x00" + (3).to_bytes(4, "little") + (5).to_bytes(4, "little")) == 3_000_000_005


def test_clock_readings_date_a_wall_time_on_the_recorders_clock():
    r = ClockReadings(keep_ns=100, every_ns=5)
    assert r.at(10) is None  # nothing read yet: older than the recording
    for wall, clock in ((10, 1000), (12, 1002), (20, 1010), (30, 1020)):
        r.note(wall, clock)  # 12: within every_ns of 10, not kept
    assert (r.at(9), r.at(10), r.at(19), r.at(25), r.at(99)) == (None, 1000, 1000, 1010, 1020)
    r.note(125, 1115)  # 10 and 20 are now older than keep_ns
    assert r.at(9) == 1020  # forgotten readings: an older wall time gets the oldest kept, not None
    r.clear()
    assert r.at(200) is None


@pytest.mark.ros
def test_a_latched_message_the_recorder_subscribes_to_late_is_dated_when_it_was_published(ros_context, tmp_path):
    """A recorder that finds the episode and instruction topics after frames were recorded (a
    slow discovery round; a recording started after the robot was told its task) gets their
    latched messages from the publishers' history. Dated on arrival, they would follow those
    frames, which would then read without an instruction: dated at publication (the episode
    marker, published before the recording, at its start), every frame after it carries it."""
    from rclpy.node import Node
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Int32, String

    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.ros import qos
    from vla_accel_ros.ros.conversions import header
    from vla_accel_ros.ros.recorder import RecorderNode

    talker = Node("talker", context=ros_context)
    episode = talker.create_publisher(Int32, "/episode", qos.LATCHED)
    episode.publish(Int32(data=3))  # before the recorder exists
    frames = talker.create_publisher(JointState, "/frames", qos.RELIABLE)
    out = tmp_path / "bag"
    overrides = [Parameter("out", value=str(out)), Parameter("topics", value=["/frames", "/episode", "/instruction"]),
                 Parameter("clock", value="wall"), Parameter("discovery_period_s", value=1.5)]  # fmt: skip
    rec = RecorderNode(context=ros_context, parameter_overrides=overrides)
    sent: list[int] = []

    def frame() -> int:
        now = talker.get_clock().now().nanoseconds
        frames.publish(JointState(header=header(now), name=["j"], position=[0.0]))
        sent.append(now)
        time.sleep(0.02)
        return now

    with helpers.spinning(ros_context, rec):
        wait_for(lambda: frame() and rec.counts["/frames"] > 5, what="frames recorded")
        instruction = talker.create_publisher(String, "/instruction", qos.LATCHED)
        n_before = len(sent)
        instruction.publish(String(data="pick up the cube"))
        # (written once the reorder window passed it)
        wait_for(lambda: frame() and rec.counts["/instruction"] == 1, what="the recorder to record /instruction")
        first_after = sent[n_before]
    talker.destroy_node()
    with BagReader(out) as bag:
        dated = {m.topic: m.stamp_ns for m in bag.messages(["/episode", "/instruction"])}
        first_frame = next(m.stamp_ns for m in bag.messages(["/frames"]))
    assert dated["/episode"] <= first_frame  # older than the recording: at its start
    assert sent[n_before - 1] - 10_000_000 <= dated["/instruction"] <= first_after, (dated, sent[n_before - 1], first_after)


@pytest.mark.ros
def test_graph_wires_the_simulator_to_the_camera_and_controller_config(tiny_bundles, tmp_path):
    from vla_accel_ros.core.config import unflatten
    from vla_accel_ros.ros.graph import CAMERA, SIM, describe, node_parameters

    g = describe(bundle=tiny_bundles["flow"], sim=True)
    assert g.use_sim_time  # the simulator publishes /clock: every node follows it
    sim = g.node(SIM).parameters
    assert sim["cameras"] == ["top"] and sim["camera_topics"] == g.node(CAMERA).parameters["topics"]
    assert sim["command.backend"] == "joint_state" and sim["command.topic"] == "joint_commands"
    topics = g.resolved_record_topics()
    for t in ("/cam_high/camera/color/image_rect_raw", "/follower_left/joint_states", "/action/joint_command",
              "/episode", "/instruction", "/episode/success", "/action_chunk", "/joint_commands"):  # fmt: skip
        assert t in topics
    assert len(topics) == len(set(topics))
    params = yaml.safe_load(Path(g.params_file).read_text())
    node_section(params, "action_controller_node")["command"].update(backend="float64_multi_array", topic="/fwd/commands")
    node_section(params, "aloha_sim_node")["publish_clock"] = False
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(params))
    g2 = describe(params_file=f, sim=True)
    assert g2.node(SIM).parameters["command.backend"] == "float64_multi_array" and not g2.use_sim_time
    assert any("cam_low" in n for n in g2.notes)  # no scene camera for it: said, not hidden
    # every key of the simulator's section is a parameter it declares, and the values build
    pytest.importorskip("rclpy")
    from vla_accel_ros.sim.runner import LiveSimConfig
    from vla_accel_ros.ros.params import leaf_specs

    declared = {s.name for s in leaf_specs(LiveSimConfig)} | {"use_sim_time"}
    keys = set(node_parameters(params, SIM))
    assert keys <= declared, sorted(keys - declared)
    LiveSimConfig.from_dict(unflatten({k: v for k, v in node_parameters(params, SIM).items() if k != "use_sim_time"}))


# -- the node, in this process ---------------------------------------------------------------------
@pytest.fixture
def sim_graph(ros_context):
    """Start an aloha_sim_node (small frames, as fast as it can, no policy) plus a probe node."""
    pytest.importorskip("gym_aloha")
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from vla_accel_ros.ros.aloha_sim_node import AlohaSimNode
    from vla_accel_ros.ros.executors import drain_executor

    started = []
    executor = MultiThreadedExecutor(num_threads=4, context=ros_context)
    stop = threading.Event()

    def spin():
        while not stop.is_set() and ros_context.ok():
            executor.spin_once(timeout_sec=0.05)

    thread = threading.Thread(target=spin, daemon=True)

    def start(probe_factory, **params):
        base = dict(height=96, width=128, wait_for_policy=False, lockstep=False, real_time_factor=0.0, episode_steps=0)
        base.update(params)
        sim = AlohaSimNode(context=ros_context, parameter_overrides=[Parameter(k, value=v) for k, v in base.items()])
        probe = probe_factory(ros_context)
        started.extend([sim, probe])
        executor.add_node(sim)
        executor.add_node(probe)
        thread.start()
        return sim, probe

    yield start
    for n in started:
        close = getattr(n, "close", None)
        if close is not None:
            close()
    stop.set()
    if thread.is_alive():
        thread.join(timeout=10)
    drain_executor(executor)
    for n in started:
        n.destroy_node()


def _probe(context, command_type=None, command_topic="joint_commands"):
    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from rosgraph_msgs.msg import Clock
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Bool, Int32, String

    from vla_accel_ros.ros import qos

    class Probe(Node):
        def __init__(self):
            super().__init__("probe", context=context)
            self.lock = threading.Lock()
            self.js: dict[str, JointState] = {}
            self.images: list[Image] = []
            self.clock: list[int] = []
            self.instruction: list[str] = []
            self.episode: list[int] = []
            for side in ("left", "right"):
                self.create_subscription(JointState, f"/follower_{side}/joint_states", lambda m, s=side: self._set(s, m), qos.SENSOR)
            self.create_subscription(Clock, "/clock", lambda m: self._add(self.clock, m.clock.sec * 10**9 + m.clock.nanosec), qos.RELIABLE)
            self.create_subscription(String, "instruction", lambda m: self._add(self.instruction, m.data), qos.LATCHED)
            deep_latched = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
            self.create_subscription(Int32, "/episode", lambda m: self._add(self.episode, m.data), deep_latched)
            self.success: list[bool] = []
            self.create_subscription(Bool, "/episode/success", lambda m: self._add(self.success, m.data), qos.RELIABLE)
            self.cmd_pub = self.create_publisher(command_type, command_topic, qos.COMMANDS) if command_type else None

        def watch_images(self, topic):
            self.create_subscription(Image, topic, lambda m: self._add(self.images, m), qos.SENSOR)

        def _set(self, side, m):
            with self.lock:
                self.js[side] = m

        def _add(self, where, item):
            with self.lock:
                where.append(item)

        def position(self, side, name):
            with self.lock:
                m = self.js.get(side)
            return None if m is None else m.position[list(m.name).index(name)]

    return Probe()


@pytest.mark.ros
def test_sim_node_publishes_joint_states_clock_and_only_subscribed_cameras(sim_graph):
    sim, probe = sim_graph(_probe, cameras=["top", "left_wrist"])
    wait_for(lambda: probe.js.get("left") is not None and probe.js.get("right") is not None, what="joint states")
    wait_for(lambda: len(probe.clock) > 20, what="/clock")
    assert all(b > a for a, b in zip(probe.clock, probe.clock[1:]))  # sim time only moves forward
    assert all(c % DT_NS == 0 for c in probe.clock)  # in 20 ms steps
    m = probe.js["left"]
    assert list(m.name) == ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper", "left_finger"]
    assert len(m.velocity) == len(m.name)
    wait_for(lambda: probe.instruction and probe.episode == [0], what="instruction and episode marker (transient local)")
    assert "cube" in probe.instruction[0]
    assert sim.runner.frames == 0  # nobody watches a camera: nothing is rendered
    probe.watch_images("/cam_high/camera/color/image_rect_raw")  # top, through the sim record layout
    wait_for(lambda: len(probe.images) >= 3, what="frames of the subscribed camera")
    img = probe.images[-1]
    assert (img.encoding, img.height, img.width, img.step) == ("rgb8", 96, 128, 384)
    assert img.header.frame_id == "cam_high_color_optical_frame"
    stamp = img.header.stamp.sec * 10**9 + img.header.stamp.nanosec
    assert stamp % DT_NS == 0  # stamped with sim time: a tick /clock announces (after the frame)
    wait_for(lambda: probe.clock[-1] >= stamp, what=f"the clock to reach the frame's stamp {stamp}")
    assert sim.runner.frames_by_camera["top"] > 0 and sim.runner.frames_by_camera["left_wrist"] == 0


@pytest.mark.ros
def test_episodes_end_with_their_outcome_and_restart_on_one_clock(sim_graph):
    pose = [0.2, -0.5, 0.9, 0.0, -0.2, 0.0, 0.8] * 2
    sim, probe = sim_graph(_probe, episode_steps=15, start_pose=pose)
    wait_for(lambda: len(probe.episode) >= 3 and len(probe.success) >= 2, what="two finished episodes")
    assert probe.position("right", "waist") == pytest.approx(0.2, abs=0.01)  # every episode starts at start_pose
    assert probe.position("left", "elbow") == pytest.approx(0.9, abs=0.02)
    with probe.lock:
        episodes, success = list(probe.episode), list(probe.success)
    # markers count up (the publisher keeps only the newest, so a slow subscriber may skip one)
    assert all(b > a for a, b in zip(episodes, episodes[1:])), episodes
    assert not any(success)
    assert sim.runner.episodes.finished >= 2 and sim.runner.episodes.seed == sim.runner.episodes.episode  # episode i: seed 0 + i
    with probe.lock:
        clock = list(probe.clock)
    assert all(b > a for a, b in zip(clock, clock[1:]))  # resets never move sim time back


@pytest.mark.ros
@pytest.mark.parametrize("backend", ["joint_state", "float64_multi_array", "joint_trajectory"])
def test_sim_node_follows_the_controllers_command_backend(sim_graph, backend):
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    msg_type = {"joint_state": JointState, "float64_multi_array": Float64MultiArray, "joint_trajectory": JointTrajectory}[backend]
    sim, probe = sim_graph(lambda ctx: _probe(ctx, msg_type, "cmds"), **{"command.backend": backend, "command.topic": "cmds"})
    wait_for(lambda: probe.position("left", "waist") is not None, what="joint states")
    target = START.copy()
    target[0], target[2], target[6] = 0.4, 0.9, 0.9  # left waist, elbow, gripper nearly open
    cmd = [float(x) for x in to_robot_units(target, ROBOT)]
    if backend == "joint_state":
        msg = JointState(name=list(ROBOT.joint_names), position=cmd)
    elif backend == "float64_multi_array":
        msg = Float64MultiArray(data=cmd)
    else:
        msg = JointTrajectory(joint_names=list(ROBOT.joint_names))
        point = JointTrajectoryPoint(positions=cmd)
        point.time_from_start.nanosec = 200_000_000
        msg.points = [point]
    wait_for(lambda: probe.cmd_pub.get_subscription_count() > 0, what="the simulator's command subscription")
    probe.cmd_pub.publish(msg)  # once: the simulator holds the last command
    g = ROBOT.gripper
    wait_for(
        lambda: abs(probe.position("left", "waist") - 0.4) < 0.02 and abs(probe.position("left", "elbow") - 0.9) < 0.05,
        what=f"the left arm to reach the {backend} command",
    )
    wait_for(lambda: probe.position("left", "left_finger") > g.finger_close + 0.7 * (g.finger_open - g.finger_close), what="the gripper to open")
    assert abs(probe.position("right", "waist")) < 0.02  # the other arm held its start pose
    assert sim.drops.total == 0


# -- the closed loop, as the CLI runs it, recorded from a second process -----------------------------
@pytest.mark.ros
def test_bringup_sim_closes_the_loop_and_record_writes_a_replayable_bag(tmp_path, tiny_bundles, ros_params_file):
    pytest.importorskip("rclpy")
    pytest.importorskip("gym_aloha")
    from vla_accel_ros.io.bag_reader import BagReader

    params = yaml.safe_load(ros_params_file.read_text())
    node_section(params, "aloha_sim_node").update(height=120, width=160, camera_rate_hz=25.0)
    pfile = tmp_path / "sim.yaml"
    pfile.write_text(yaml.safe_dump(params))
    domain = str(random.SystemRandom().randint(1, 100))
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "MUJOCO_GL": "egl"}
    bag = tmp_path / "live"
    cli = [sys.executable, "-m", "vla_accel_ros.cli"]
    recorder = subprocess.Popen(
        [*cli, "record", "--out", str(bag), "--params", str(pfile), "--bundle", str(tiny_bundles["flow"]), "--domain-id", domain],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        out = tmp_path / "summary.json"
        proc = subprocess.run(
            [*cli, "bringup", "--sim", "--params", str(pfile), "--bundle", str(tiny_bundles["flow"]), "--duration", "4",
             "--domain-id", domain, "--json", str(out)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:
        recorder.send_signal(signal.SIGINT)  # Ctrl-C: the recorder flushes and closes the bag
        rec_out, _ = recorder.communicate(timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "real-time factor" in proc.stdout and "obs->chunk" in proc.stdout
    s = json.loads(out.read_text())
    sim, ctl = s["aloha_sim_node"], s["action_controller_node"]
    assert sim["steps"] > 20 and sim["sim_s"] > 0.4 and not sim["failure"]
    assert ctl["commands"] > 0 and sim["commands"] > 0 and s["policy_node"]["chunks"] > 0
    assert sim["command_rate_sim_hz"] > 30  # lockstep: (nearly) one command per 20 ms of sim time

    assert recorder.returncode == 0, rec_out[-3000:]
    with BagReader(bag) as r:
        topics = set(r.topics)
        for t in ("/cam_high/camera/color/image_rect_raw", "/follower_left/joint_states", "/follower_right/joint_states",
                  "/action/joint_command", "/episode", "/instruction", "/joint_commands", "/action_chunk"):  # fmt: skip
            assert t in topics, sorted(topics)
        samples = list(r.samples())
        assert samples and samples[0].observation.images["cam_high"].shape == (120, 160, 3)
        assert samples[0].observation.state.shape == (14,) and "cube" in samples[0].observation.instruction
        left = np.array([m.data.position[:6] for m in r.messages(["/follower_left/joint_states"])])
        right = np.array([m.data.position[:6] for m in r.messages(["/follower_right/joint_states"])])
    moved = max(np.abs(left - left[0]).max(), np.abs(right - right[0]).max())
    assert moved > 1e-3, "the arms did not move under the policy's commands"
