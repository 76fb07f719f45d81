"""`ros2 launch vla_accel_ros aloha.launch.py` for real, from a colcon install space.

What a ROS user does: ``colcon build --packages-select vla_accel_ros``, ``source
install/setup.bash``, ``ros2 launch vla_accel_ros aloha.launch.py bundle:=... synthetic_camera:=true
record:=true`` with the shipped ``config/aloha.yaml``, then ``ros2 node list``, ``ros2 topic hz``,
``ros2 topic echo``, ``ros2 param get/set/dump`` and Ctrl-C. One launched graph per namespace
(the root one and ``r1``) serves the assertions of this module, in order; the last test stops
it. The upstream launch stack comes from a sourced ROS 2 install or ../shared/ros2-jazzy (see
test/ros2_cli.py); without either the module skips, saying which is missing.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

import ros2_cli
from vla_accel_ros.core.params_file import default_params_file, flatten_parameters, load_params, node_parameters
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, SYNTHETIC, describe

pytestmark = [pytest.mark.ros, pytest.mark.skipif(bool(ros2_cli.missing()), reason=ros2_cli.missing() or "-")]

RECORDER = "vla_recorder"
HAS_ROS2_BAG = importlib.util.find_spec("ros2bag") is not None


# The namespaced launch (about 100 s) runs with `make test-slow`; test_ros_robots.py runs two
# namespaced robots on one network in the default suite.
@pytest.fixture(scope="module", params=["", pytest.param("r1", marks=pytest.mark.slow)], ids=["root", "namespace_r1"])
def graph(request, colcon_install, tiny_bundles, tmp_path_factory):
    """The launched graph: tiny flow bundle, synthetic camera + arm, recording, the shipped
    parameter file, in namespace ``request.param``; stopped by the last test, or here."""
    ns = request.param
    bag = tmp_path_factory.mktemp("launch") / "bag"
    ros2 = ros2_cli.Ros2(colcon_install)
    args = f"bundle:={tiny_bundles['flow']} synthetic_camera:=true record:=true record_output:={bag}"
    launched = ros2.launch(args + (f" namespace:={ns}" if ns else ""))
    try:
        launched.wait_for(r"policy_node\]: ready:", 300)
        yield Graph(ros2, launched, ns, bag, describe(bundle=tiny_bundles["flow"], synthetic_camera=True, namespace=ns))
    finally:
        launched.kill()


class Graph:
    def __init__(self, ros2, launched, ns, bag, description) -> None:
        self.ros2, self.launched, self.ns, self.bag, self.description = ros2, launched, ns, bag, description
        self.prefix = f"/{ns}" if ns else ""

    def name(self, node_or_topic: str) -> str:
        return f"{self.prefix}/{node_or_topic}"

    def param(self, node: str, verb: str, *args: str) -> tuple[int, str, str]:
        return self.params([(node, verb, *args)])[0]

    def params(self, calls: list[tuple[str, ...]]) -> list[tuple[int, str, str]]:
        """``ros2 param VERB NODE ARGS...`` for each (node, verb, *args), all at once."""
        commands = [f"ros2 param {verb} --no-daemon --timeout 20 {self.name(node)} {' '.join(args)}" for node, verb, *args in calls]
        return [(o.returncode, o.stdout.strip(), o.stderr.strip()) for o in self.ros2.run_all(commands)]


def test_fast_dds_log_lines_are_not_taken_for_the_cli_answer():
    """What `ros2 param get` printed on a machine whose /dev/shm held stale Fast DDS port files."""
    logged = ("\x1b[37;1m2026-11-28 19:48:11.194 \x1b[31;1m[\x1b[37;1mRTPS_TRANSPORT_SHM\x1b[31;1m Error] \x1b[37mFailed "
              "init_port fastrtps_port7004: open_and_lock_file failed\x1b[34;1m -> Function \x1b[36mopen_port_internal\x1b[m\n")  # fmt: skip
    assert ros2_cli.without_dds_log(logged + "Double value is: 0.95\n").strip() == "Double value is: 0.95"
    assert ros2_cli.without_dds_log("RTPS_TRANSPORT_SHM in an answer stays\n") == "RTPS_TRANSPORT_SHM in an answer stays\n"


def test_the_nodes_come_up(graph):
    expected = {graph.name(n) for n in (CAMERA, POLICY, CONTROLLER, SYNTHETIC, RECORDER)}
    seen = graph.ros2.node_list(expected)
    assert expected <= seen, f"ros2 node list: {sorted(seen)}"
    if not HAS_ROS2_BAG:  # record:=true falls back to the package's recorder, and says so
        assert "ros2 bag is not installed" in graph.launched.output


def test_the_parameter_file_applies_to_every_node_in_the_namespace(graph):
    """Every value config/aloha.yaml gives a node is the node's value (`ros2 param dump`),
    wherever the graph runs. rcl applies a plain `camera_node:` section only to /camera_node."""
    # The values the issue found lost under a namespace, as config/aloha.yaml sets them.
    got = graph.params([(POLICY, "get", "policy.accel"), (CONTROLLER, "get", "realtime_priority"),
                        (CONTROLLER, "get", "robot.gripper.joint_open")])  # fmt: skip
    assert [out for _, out, _ in got] == ["String value is: cache", "Integer value is: 50", "Double value is: 1.6214"], got
    params = load_params(default_params_file())
    nodes = (CAMERA, POLICY, CONTROLLER)
    for node, (code, out, err) in zip(nodes, graph.params([(node, "dump") for node in nodes])):
        assert code == 0, err
        held = flatten_parameters(yaml.safe_load(out)[graph.name(node)]["ros__parameters"])
        overridden = set(graph.description.node(node).parameters)
        expected = {k: v for k, v in node_parameters(params, node, graph.ns).items() if k not in overridden}
        if node == CAMERA:  # the /** section's robot.* is for the nodes that declare it
            expected = {k: v for k, v in expected.items() if not k.startswith("robot.")}
        wrong = {k: (v, held.get(k, "<not in ros2 param dump>")) for k, v in expected.items() if held.get(k) != v}
        assert not wrong, f"{graph.name(node)}: parameter file value != node's value: {wrong}"


def test_commands_flow_at_the_configured_rate(graph):
    rate_hz = node_parameters(load_params(default_params_file()), CONTROLLER, graph.ns)["scheduler.control_rate_hz"]
    out = graph.ros2.run_for(f"ros2 topic hz {graph.name('joint_commands')} --window 100", 8.0)
    rates = [float(r) for r in re.findall(r"average rate: ([0-9.]+)", out)]
    assert rates, out[-2000:]
    assert abs(rates[-1] - rate_hz) < 0.1 * rate_hz, f"ros2 topic hz: {rates[-1]} Hz, configured {rate_hz} Hz\n{out[-1000:]}"


def test_a_chunk_arrives(graph):
    out = graph.ros2.run(
        f"ros2 topic echo --once --no-daemon {graph.name('action_chunk')} vla_accel_ros/msg/ActionChunk --field action_dim", timeout=90
    )
    assert out.returncode == 0 and out.stdout.split()[:1] == ["14"], out.stdout[-500:] + out.stderr[-2000:]


def test_ros2_param_set_applies_a_valid_value_and_refuses_bad_ones_with_the_reason(graph):
    name = "policy.cache.sim_threshold"
    code, out, err = graph.param(POLICY, "set", name, "0.95")
    assert code == 0 and out == "Set parameter successful", out + err
    assert graph.param(POLICY, "get", name)[1] == "Double value is: 0.95"
    refused = {  # value set -> what the reason must say
        (name, "1.5"): r"policy\.cache\.sim_threshold.*1\.5",  # out of range
        (name, "-0.5"): r"policy\.cache\.sim_threshold.*-0\.5",
        (name, "abc"): r"Wrong parameter type, expected 'Type\.DOUBLE' got 'Type\.STRING'",
        ("policy.accel", "warp"): r"policy\.accel.*'none', 'cache', 'prune', 'cache\+prune'",  # unknown enum
    }
    for (param, value), (code, out, err) in zip(refused, graph.params([(POLICY, "set", *k) for k in refused])):
        assert err.startswith("Setting parameter failed: ") and re.search(refused[param, value], err), f"{param} {value}: {out} {err}"
    got = graph.params([(POLICY, "get", name), (POLICY, "get", "policy.accel")])
    assert [out for _, out, _ in got] == ["Double value is: 0.95", "String value is: cache"], got  # as they were


def test_ctrl_c_ends_every_process_cleanly_within_launchs_timeout(graph):
    code, seconds = graph.launched.interrupt()
    out = graph.launched.output
    assert code == 0, out[-4000:]
    assert "escalating to 'SIGTERM'" not in out and "process has died" not in out, out[-4000:]
    for node in (CAMERA, POLICY, CONTROLLER, SYNTHETIC):
        assert re.search(rf"\[{node}-\d+\]: process has finished cleanly", out), f"{node} did not exit 0:\n{out[-4000:]}"
    assert seconds < ros2_cli.LAUNCH_SIGINT_TIMEOUT_S, seconds
    # The recording (the package's recorder without ros2 bag): an MCAP bag rosbag2 reads.
    from vla_accel_ros.io.bag_reader import BagReader

    with BagReader(graph.bag) as bag:
        topics = bag.topics
    assert topics[graph.name("action_chunk")].count > 0 and topics[graph.name("joint_commands")].count > 0, sorted(topics)
    assert list(graph.bag.glob("*.mcap")) and (graph.bag / "metadata.yaml").is_file()

