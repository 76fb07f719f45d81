"""Two robots on one ROS domain (issue 45): robot r1 started with ``ros2 launch ...
namespace:=r1`` from a colcon install space, robot r2 with ``vla-accel bringup --namespace r2``
and a parameter file of its own (control at 25 Hz instead of 50), both with the synthetic camera
and arm and the tiny flow bundle, over real DDS. A probe node in the root namespace watches the
graph. The module's tests run in order on the one pair of graphs; the last one stops both.

Checked: no topic carries data between the two (every topic a robot's node uses lies in its
namespace, /diagnostics and ROS's own topics aside), each closes its loop at its own rate, each
one's parameters apply to it alone, an e-stop on one stops only that one, and a stray publisher
from /r2 on an /r1 sensor topic is refused by r1 and shown on /diagnostics.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time

import numpy as np
import pytest
import yaml

import ros2_cli
from vla_accel_ros.core.params_file import node_section
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY

pytestmark = [pytest.mark.ros, pytest.mark.skipif(bool(ros2_cli.missing()), reason=ros2_cli.missing() or "-")]
rclpy = pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.parameter_client import AsyncParameterClient  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Bool  # noqa: E402
from std_srvs.srv import SetBool  # noqa: E402

from vla_accel_ros.msg import ActionChunk  # noqa: E402
from vla_accel_ros.ros import qos  # noqa: E402
from vla_accel_ros.ros.conversions import header, rgb_to_image  # noqa: E402
import helpers  # noqa: E402  (test/helpers.py)

TIMEOUT = 60.0
RATES = {"r1": 50.0, "r2": 25.0}  # scheduler.control_rate_hz: the shipped file's, and r2's own file's
JS = "/r1/follower_left/joint_states"
SHARED = ("/diagnostics", "/rosout", "/parameter_events")  # one per domain by design (ROS's own, and named statuses)


class Plain:
    """What ros2_cli.Launched needs of ros2_cli.Ros2, for a command run as it is (the venv's
    `vla-accel bringup`, no install space sourced), on the same domain."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def argv(self, command: str) -> list[str]:
        return shlex.split(command)


class Probe(Node):
    """In the root namespace: commands, chunks and /diagnostics of both robots."""

    def __init__(self, context) -> None:
        super().__init__("probe", context=context)
        self.lock = threading.Lock()
        self.commands: dict[str, list[int]] = {ns: [] for ns in RATES}  # header stamps (ns): the controller's tick times
        self.chunks: dict[str, int] = {ns: 0 for ns in RATES}
        self.status: dict[str, tuple[int, str, dict[str, str]]] = {}
        for ns in RATES:
            self.create_subscription(JointState, f"/{ns}/joint_commands", lambda m, ns=ns: self._command(ns, m), qos.COMMANDS)
            self.create_subscription(ActionChunk, f"/{ns}/action_chunk", lambda m, ns=ns: self._chunk(ns), qos.RELIABLE)
        self.create_subscription(DiagnosticArray, "/diagnostics", self._diagnostics, qos.RELIABLE)

    def _command(self, ns: str, msg: JointState) -> None:
        with self.lock:
            self.commands[ns].append(msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec)

    def _chunk(self, ns: str) -> None:
        with self.lock:
            self.chunks[ns] += 1

    def _diagnostics(self, msg: DiagnosticArray) -> None:
        with self.lock:
            for st in msg.status:
                level = int.from_bytes(st.level, "little") if isinstance(st.level, bytes) else int(st.level)
                self.status[st.name] = (level, st.message, {kv.key: kv.value for kv in st.values})

    def n_commands(self, ns: str) -> int:
        with self.lock:
            return len(self.commands[ns])

    def n_chunks(self, ns: str) -> int:
        with self.lock:
            return self.chunks[ns]

    def diag(self, ns: str, node: str, component: str) -> tuple[int, str, dict[str, str]]:
        with self.lock:
            return self.status.get(f"{ns}/{node}: {component}", (-1, "", {}))


def _call(future, what: str):
    helpers.wait_for(future.done, TIMEOUT, what)
    return future.result()


@pytest.fixture(scope="module")
def robots(colcon_install, tiny_bundles, ros_params_file, tmp_path_factory):
    """r1 (`ros2 launch`) and r2 (`vla-accel bringup`, its own parameter file) on one domain,
    both ready, and the probe; stopped by the last test, or here."""
    tmp = tmp_path_factory.mktemp("robots")
    params = yaml.safe_load(ros_params_file.read_text())
    node_section(params, CONTROLLER)["scheduler"]["control_rate_hz"] = RATES["r2"]
    r2_params = tmp / "r2.yaml"
    r2_params.write_text(yaml.safe_dump(params))
    bundle = tiny_bundles["flow"]
    ros2 = ros2_cli.Ros2(colcon_install)
    r1 = ros2.launch(f"bundle:={bundle} params_file:={ros_params_file} synthetic_camera:=true namespace:=r1")
    r2 = ros2_cli.Launched(
        Plain(ros2.env),  # the same domain, kept on this machine
        f"{sys.executable} -m vla_accel_ros.cli bringup --bundle {bundle} --params {r2_params} --synthetic-camera "
        f"--namespace r2 --domain-id {ros2.domain} --json {tmp / 'r2.json'}",
    )  # fmt: skip
    try:
        r1.wait_for(r"policy_node\]: ready:", 300)
        r2.wait_for(r"policy ready after", 300)
        with helpers.module_ros_context(ros2.domain) as ctx:
            probe = Probe(ctx)
            with helpers.spinning(ctx, probe):
                yield {"r1": r1, "r2": r2, "probe": probe, "summary": tmp / "r2.json"}
    finally:
        r1.kill()
        r2.kill()


def test_each_robot_closes_its_loop_at_its_own_rate(robots):
    probe = robots["probe"]
    helpers.wait_for(lambda: all(probe.n_chunks(ns) >= 2 and probe.n_commands(ns) >= 50 for ns in RATES), TIMEOUT,
                     "chunks and commands from both robots")  # fmt: skip
    start = {ns: probe.n_commands(ns) for ns in RATES}
    time.sleep(4.0)
    for ns, rate in RATES.items():
        with probe.lock:
            t = probe.commands[ns][start[ns]:]
        # The median period, from the controller's own stamps: what its timer runs at. With two
        # robots' inference on a 2-core machine, a late tick is skipped (rclpy does not queue
        # missed periods), which pulls the mean rate down (36 Hz for 50 once on CI) but not this.
        period_s = float(np.median(np.diff(t))) / 1e9
        assert abs(1.0 / period_s - rate) < 0.2 * rate, f"/{ns}/joint_commands every {period_s * 1e3:.1f} ms, configured {rate} Hz"
        assert len(t) >= 0.5 * 4.0 * rate, f"/{ns}: {len(t)} commands in 4 s at {rate} Hz"  # the loop runs, not one tick a while


def test_no_topic_carries_data_between_the_two(robots):
    """Every publisher and subscriber of a robot's nodes is on a topic in its own namespace (the
    cameras and joint states included), so no topic joins the two; and neither refused a thing."""
    probe = robots["probe"]
    names = {f"/{ns}/{n}" for ns in RATES for n in (CAMERA, POLICY, CONTROLLER, "synthetic_sensors_node")}
    helpers.wait_for(lambda: names <= {f"{ns.rstrip('/')}/{n}" for n, ns in probe.get_node_names_and_namespaces()},
                     TIMEOUT, "both graphs' nodes")  # fmt: skip
    used: dict[str, set[str]] = {ns: set() for ns in RATES}
    for topic, _ in probe.get_topic_names_and_types():
        if topic in SHARED:
            continue
        for e in [*probe.get_publishers_info_by_topic(topic), *probe.get_subscriptions_info_by_topic(topic)]:
            robot = e.node_namespace.strip("/").split("/")[0]
            if robot in used:
                used[robot].add(topic)
    for ns, topics in used.items():
        assert {f"/{ns}/cam_high/camera/color/image_rect_raw", f"/{ns}/follower_left/joint_states"} <= topics, sorted(topics)
        outside = sorted(t for t in topics if not t.startswith(f"/{ns}/"))
        assert not outside, f"/{ns}'s nodes use topics outside /{ns}: {outside}"
    for ns in RATES:
        for node, component in ((CAMERA, "cameras"), (POLICY, "policy"), (CONTROLLER, "control")):
            helpers.wait_for(lambda: probe.diag(ns, node, component)[0] >= 0, TIMEOUT, f"/{ns}/{node}'s diagnostics")
            level, message, values = probe.diag(ns, node, component)
            assert "unexpected publisher" not in message and not any(k.startswith("dropped unexpected") for k in values), (
                ns, node, message, values)  # fmt: skip


def test_each_robots_parameters_apply_to_it_alone(robots):
    probe = robots["probe"]
    clients = {ns: AsyncParameterClient(probe, f"/{ns}/{CONTROLLER}") for ns in RATES}
    policies = {ns: AsyncParameterClient(probe, f"/{ns}/{POLICY}") for ns in RATES}
    for c in [*clients.values(), *policies.values()]:
        assert c.wait_for_services(timeout_sec=TIMEOUT)
    for ns, rate in RATES.items():  # from each one's parameter file
        got = _call(clients[ns].get_parameters(["scheduler.control_rate_hz"]), f"/{ns} control rate")
        assert got.values[0].double_value == rate
    name = "policy.cache.sim_threshold"
    result = _call(policies["r1"].set_parameters([Parameter(name, value=0.95)]), "the set on /r1")
    assert result.results[0].successful, result.results[0].reason
    values = {ns: _call(policies[ns].get_parameters([name]), f"/{ns} {name}").values[0].double_value for ns in RATES}
    assert values == {"r1": 0.95, "r2": 0.996}


def test_an_estop_on_one_robot_stops_only_that_one(robots):
    probe = robots["probe"]
    estop = probe.create_publisher(Bool, "/r1/estop", qos.LATCHED)
    enable = probe.create_client(SetBool, "/r1/action_controller_node/enable")
    try:
        estop.publish(Bool(data=True))
        helpers.wait_for(lambda: probe.diag("r1", CONTROLLER, "control")[1] == "E-STOP active", TIMEOUT, "r1's e-stop")
        time.sleep(0.3)  # commands sent before the e-stop have arrived
        n1, n2 = probe.n_commands("r1"), probe.n_commands("r2")
        time.sleep(1.5)
        assert probe.n_commands("r1") == n1, "r1 commanded during its e-stop"
        assert probe.n_commands("r2") >= n2 + 0.5 * 1.5 * RATES["r2"], "r2 stopped with r1's e-stop"
        assert probe.diag("r2", CONTROLLER, "control")[1] != "E-STOP active"
        estop.publish(Bool(data=False))  # released, r1 stays disabled until ~/enable
        helpers.wait_for(lambda: probe.diag("r1", CONTROLLER, "control")[1] != "E-STOP active", TIMEOUT, "the release")
        assert enable.wait_for_service(timeout_sec=TIMEOUT)
        assert _call(enable.call_async(SetBool.Request(data=True)), "/r1 enable").success
        n1 = probe.n_commands("r1")
        helpers.wait_for(lambda: probe.n_commands("r1") >= n1 + 20, TIMEOUT, "r1 commanding again")
    finally:
        probe.destroy_publisher(estop)
        probe.destroy_client(enable)


def test_a_stray_publisher_from_the_other_namespace_is_refused_and_shown(robots):
    """A node in /r2 publishing into r1's joint states and camera: r1 refuses those topics' messages
    while it is there and says so on /diagnostics (ERROR, naming it); r2 is untouched. A joint
    state naming none of the topic's joints (from the root namespace, a trusted one) is refused by
    its names. Once the stray node is gone, r1 takes its inputs again and infers."""
    probe = robots["probe"]
    stray = Node("stray_driver", namespace="r2", context=probe.context)
    js = stray.create_publisher(JointState, JS, qos.RELIABLE)
    cam = stray.create_publisher(Image, "/r1/cam_high/camera/color/image_rect_raw", qos.RELIABLE)
    names = probe.create_publisher(JointState, "/r1/follower_right/joint_states", qos.RELIABLE)
    frame = np.zeros((224, 224, 3), np.uint8)
    try:
        def shown() -> bool:
            now = stray.get_clock().now().nanoseconds
            js.publish(JointState(header=header(now), name=helpers.ARM, position=helpers.START))
            cam.publish(rgb_to_image(frame, now, "stray"))
            names.publish(JointState(header=header(now), name=["r2_waist"], position=[0.0]))
            time.sleep(0.05)
            ctl, camera = probe.diag("r1", CONTROLLER, "control"), probe.diag("r1", CAMERA, "cameras")
            policy = probe.diag("r1", POLICY, "policy")
            return (ctl[0] == 2 and "/r2/stray_driver" in ctl[1] and camera[0] == 2 and "/r2/stray_driver" in camera[1]
                    and policy[0] == 2 and f"{JS} has an unexpected publisher: /r2/stray_driver (in namespace /r2" in policy[1]
                    and int(ctl[2].get("dropped unexpected_publisher", 0)) > 0
                    and int(ctl[2].get("dropped unexpected_joint_names", 0)) > 0
                    and int(policy[2].get("dropped unexpected_publisher", 0)) > 0
                    and int(camera[2].get("dropped unexpected_publisher", 0)) > 0)  # fmt: skip

        helpers.wait_for(shown, TIMEOUT, "r1 to refuse the stray publisher and show it on /diagnostics")
        for node, component in ((CAMERA, "cameras"), (POLICY, "policy"), (CONTROLLER, "control")):
            assert "stray_driver" not in probe.diag("r2", node, component)[1]
    finally:
        stray.destroy_node()
        probe.destroy_publisher(names)
    helpers.wait_for(lambda: "unexpected publisher" not in probe.diag("r1", CONTROLLER, "control")[1], TIMEOUT,
                     "r1's diagnostics once the stray node is gone")  # fmt: skip
    n = probe.n_chunks("r1")
    helpers.wait_for(lambda: probe.n_chunks("r1") >= n + 2, TIMEOUT, "r1's chunks once the stray node is gone")


def test_both_stop_cleanly_and_r2_never_refused_a_thing(robots):
    code, _ = robots["r1"].interrupt()
    assert code == 0, robots["r1"].output[-3000:]
    code, _ = robots["r2"].interrupt()
    assert code == 0, robots["r2"].output[-3000:]
    summary = json.loads(robots["summary"].read_text())
    assert summary[POLICY]["errors"] == 0 and summary[CONTROLLER]["commands"] > 0
    for node in (CAMERA, POLICY, CONTROLLER):
        dropped = summary[node].get("dropped", {})
        assert not isinstance(dropped, dict) or not any(k.startswith("unexpected") for k in dropped), (node, dropped)
