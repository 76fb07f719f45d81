"""One description of the graph, two starters: launch/aloha.launch.py and `vla-accel bringup`.

launch and launch_ros are not installable from PyPI, so the launch file is compiled, checked
for the shared description, and executed against minimal stand-ins of the four launch classes
it uses (they only record their arguments): the nodes it would start must be exactly the
description's."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from vla_accel_ros.core.config import unflatten
from vla_accel_ros.core.params_file import load_params, node_section
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, RECORDER, SIM, SYNTHETIC, describe, node_parameters

pytestmark = pytest.mark.ros

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "aloha.launch.py"
REQUIRED_ARGS = {"params_file", "bundle", "sim", "record", "namespace", "use_sim_time"}


def test_launch_file_compiles_and_uses_the_shared_description():
    src = LAUNCH.read_text()
    tree = ast.parse(src)
    compile(tree, str(LAUNCH), "exec")
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("vla_accel_ros.ros.graph", "describe") in imports
    assert ("launch_ros.actions", "Node") in imports
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"describe", "Node", "generate_launch_description"} & calls >= {"describe", "Node"}
    declared = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ARGUMENTS")
    names = {elt.elts[0].value for elt in declared.value.elts}
    assert REQUIRED_ARGS <= names


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _fake_launch(monkeypatch):
    """Stand-ins for the launch classes the file uses; they record what they are given."""

    class LaunchConfiguration:
        def __init__(self, name):
            self.name = name

        def perform(self, context):
            return context[self.name]

    mods = {
        "launch": types.ModuleType("launch"),
        "launch.actions": types.ModuleType("launch.actions"),
        "launch.substitutions": types.ModuleType("launch.substitutions"),
        "launch_ros": types.ModuleType("launch_ros"),
        "launch_ros.actions": types.ModuleType("launch_ros.actions"),
    }
    mods["launch"].LaunchDescription = type("LaunchDescription", (_Recorder,), {})
    for name in ("DeclareLaunchArgument", "ExecuteProcess", "LogInfo", "OpaqueFunction"):
        setattr(mods["launch.actions"], name, type(name, (_Recorder,), {}))
    mods["launch.substitutions"].LaunchConfiguration = LaunchConfiguration
    mods["launch_ros.actions"].Node = type("Node", (_Recorder,), {})
    for k, m in mods.items():
        monkeypatch.setitem(sys.modules, k, m)


def _run_launch(monkeypatch, **args):
    _fake_launch(monkeypatch)
    ns: dict = {}
    exec(compile(LAUNCH.read_text(), str(LAUNCH), "exec"), ns)  # noqa: S102 - our own launch file
    ld = ns["generate_launch_description"]()
    entities = ld.args[0]
    declared = {e.args[0]: e.kwargs["default_value"] for e in entities if type(e).__name__ == "DeclareLaunchArgument"}
    context = {**declared, **args}
    opaque = next(e for e in entities if type(e).__name__ == "OpaqueFunction")
    return declared, opaque.kwargs["function"](context)


def test_launch_starts_exactly_the_described_nodes(monkeypatch, tiny_bundles):
    bundle = str(tiny_bundles["flow"])
    declared, actions = _run_launch(monkeypatch, bundle=bundle, namespace="vla", record="true")
    assert REQUIRED_ARGS <= set(declared)
    graph = describe(bundle=bundle, namespace="vla", record=True)
    nodes = [a for a in actions if type(a).__name__ == "Node" and a.kwargs["name"] != RECORDER]
    assert [n.kwargs["name"] for n in nodes] == [s.name for s in graph.nodes] == [CAMERA, POLICY, CONTROLLER]
    for n, spec in zip(nodes, graph.nodes):
        assert n.kwargs["executable"] == spec.executable and n.kwargs["package"] == "vla_accel_ros"
        assert n.kwargs["namespace"] == "vla"
        params_file, overrides = n.kwargs["parameters"]
        assert params_file == graph.params_file and Path(params_file).name == "aloha.yaml"
        assert overrides == {**spec.parameters, "use_sim_time": False}
    assert nodes[1].kwargs["parameters"][1]["bundle"] == str(Path(bundle).resolve())
    assert nodes[0].kwargs["parameters"][1]["observation_transport"] == "topic"  # separate processes
    if importlib.util.find_spec("ros2bag") is not None:
        bag = next(a for a in actions if type(a).__name__ == "ExecuteProcess")
        cmd = bag.kwargs["cmd"]
        assert cmd[:3] == ["ros2", "bag", "record"] and "/vla/action_chunk" in cmd and "/diagnostics" in cmd
    else:  # no rosbag2: the package's recorder, same topics, and the log says why
        rec = next(a for a in actions if type(a).__name__ == "Node" and a.kwargs["name"] == RECORDER)
        assert rec.kwargs["executable"] == "recorder" and rec.kwargs["namespace"] == "vla"
        assert rec.kwargs["parameters"][0]["topics"] == graph.resolved_record_topics()
        assert "/vla/action_chunk" in graph.resolved_record_topics() and "/diagnostics" in graph.resolved_record_topics()
        assert any("ros2 bag is not installed" in a.kwargs["msg"] for a in actions if type(a).__name__ == "LogInfo")
        assert not any(type(a).__name__ == "ExecuteProcess" for a in actions)

def test_sim_switch_adds_the_simulator_or_says_why_not(monkeypatch):
    graph = describe(sim=True)
    sim = graph.node(SIM)
    assert sim.optional and sim.module == "vla_accel_ros.ros.aloha_sim_node"
    assert graph.node(CONTROLLER).parameters["safety.start_enabled"] is True  # a real arm starts disabled
    assert "safety.start_enabled" not in describe().node(CONTROLLER).parameters
    _, actions = _run_launch(monkeypatch, sim="true")
    names = [a.kwargs["name"] for a in actions if type(a).__name__ == "Node"]
    if sim.available():
        assert SIM in names
    else:
        assert SIM not in names
        assert any("skipping aloha_sim_node" in a.kwargs["msg"] for a in actions if type(a).__name__ == "LogInfo")


def test_description_fits_cameras_to_the_bundle_and_reads_the_file_like_rcl(tmp_path, tiny_bundles):
    g = describe(bundle=tiny_bundles["flow"], synthetic_camera=True, shared_observations=True)
    cam = g.node(CAMERA).parameters
    assert cam["cameras"] == ["cam_high"] and cam["topics"] == ["cam_high/camera/color/image_rect_raw"]  # relative
    assert cam["image_size"] == 224 and cam["observation_transport"] == "shared"
    assert g.node(SYNTHETIC).parameters["camera_topics"] == cam["topics"]
    params = yaml.safe_load((ROOT / "config" / "aloha.yaml").read_text())
    flat = node_parameters(params, CONTROLLER)
    assert flat["scheduler.control_rate_hz"] == 50.0 and flat["robot.gripper.joint_open"] == 1.6214  # /** applies
    assert "cameras" not in flat
    custom = {"/**": {"ros__parameters": {"a": 1}}, "/vla/policy_node": {"ros__parameters": {"a": 2, "b": {"c": 3}}}}
    assert node_parameters(custom, POLICY, "vla") == {"a": 2, "b.c": 3}
    assert node_parameters(custom, POLICY) == {"a": 1}



def test_robot_topics_are_relative_and_absolute_ones_are_named_under_a_namespace(tmp_path):
    """The shipped file isolates robots by namespace: its robot-side topics are relative and the
    recording resolves them under the namespace. A file with absolute ones is named in the notes."""
    g = describe(namespace="r1")
    assert not g.notes
    rec = g.resolved_record_topics()
    assert {"/r1/cam_high/camera/color/image_rect_raw", "/r1/follower_left/joint_states", "/r1/joint_commands",
            "/r1/episode/success", "/r1/action/joint_command"} <= set(rec)  # fmt: skip
    assert not [t for t in rec if not t.startswith("/r1/") and t != "/diagnostics"], rec
    params = yaml.safe_load((ROOT / "config" / "aloha.yaml").read_text())
    params["/**"]["ros__parameters"]["robot"]["joint_state_topics"] = ["/follower_left/joint_states", "follower_right/joint_states"]
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(yaml.safe_dump(params))
    (note,) = describe(params_file=legacy, namespace="r1").notes
    assert "/follower_left/joint_states is an absolute name: every robot on this ROS domain shares it" in note
    assert "follower_right" not in note and not describe(params_file=legacy).notes  # the root graph: nothing to say


def test_two_simulators_keep_their_own_clock(monkeypatch):
    """Under a namespace the simulator's /clock, and every node's (the recorder's too), is
    <namespace>/clock; in the root namespace nothing is remapped."""
    g = describe(sim=True, namespace="r1", record=True)
    assert g.remappings == (("/clock", "clock"),) and all(("/clock", "clock") in n.remappings for n in g.nodes)
    assert not describe(sim=True).remappings and not describe(namespace="r1").remappings
    _, actions = _run_launch(monkeypatch, sim="true", namespace="r1", record="true")
    nodes = [a for a in actions if type(a).__name__ == "Node"]
    assert nodes and all(("/clock", "clock") in a.kwargs["remappings"] for a in nodes)


# Sections in file order, with every spelling rcl accepts: bare names, nested namespaces, wildcards.
RULE_FILE = """
/r1/n: {ros__parameters: {a: full_abs, f: full_abs}}
/**: {ros__parameters: {a: all, b: all, g: all}}
n: {ros__parameters: {a: bare, c: bare}}
/**/n: {ros__parameters: {a: starstar_n, d: starstar_n, g: starstar_n}}
r1: {n: {ros__parameters: {e: nested}}}
/*/n: {ros__parameters: {h: one_token}}
/r1/*: {ros__parameters: {i: r1_any}}
"""


def test_the_parameter_file_is_read_by_rcls_rule(ros_context, tmp_path):
    """node_parameters() gives what rclpy itself gives a node from the same file, in the root
    namespace, one namespace and two: a bare ``n:`` is ``/n`` only, ``/**/n`` applies everywhere,
    ``/*`` is one token, and a later matching section wins. config/aloha.yaml's node sections
    apply in any namespace, and a file whose sections would not is named in the notes."""
    from rclpy.node import Node

    path = tmp_path / "rule.yaml"
    path.write_text(RULE_FILE)
    params = load_params(path)
    for ns in ("", "r1", "r1/sub"):
        node = Node("n", namespace=ns or None, context=ros_context, cli_args=["--ros-args", "--params-file", str(path)],
                    automatically_declare_parameters_from_overrides=True)  # fmt: skip
        try:
            held = {k: p.value for k, p in node._parameters.items() if k not in ("use_sim_time", "start_type_description_service")}  # noqa: SLF001
        finally:
            node.destroy_node()
        assert held == node_parameters(params, "n", ns), ns
    shipped = load_params(ROOT / "config" / "aloha.yaml")
    for node in (CAMERA, POLICY, CONTROLLER, SIM, SYNTHETIC):
        assert len(node_parameters(shipped, node, "r1/sub")) > len(node_parameters(shipped, "other_node")), node
        assert node_parameters(shipped, node, "r1") == node_parameters(shipped, node), node
    assert not describe(namespace="r1").notes
    legacy = tmp_path / "legacy.yaml"  # plain node names, as the file had them before
    legacy.write_text(yaml.safe_dump({"policy_node": {"ros__parameters": {"trigger": "continuous"}}}))
    assert not describe(params_file=legacy).notes
    assert any("'/policy_node' does not apply to /r1/policy_node" in n for n in describe(params_file=legacy, namespace="r1").notes)
    copy = load_params(legacy)
    node_section(copy, POLICY)["warmup"] = False  # edits the file's own section
    assert copy == {"policy_node": {"ros__parameters": {"trigger": "continuous", "warmup": False}}}

def test_the_description_and_the_core_import_without_rclpy(tmp_path):
    code = (
        "import sys, vla_accel_ros.ros.graph as g, vla_accel_ros.core.robot.safety, vla_accel_ros.core.robot.motion, "
        "vla_accel_ros.core.robot.images, vla_accel_ros.core.robot.observation; g.describe(); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('rclpy', 'launch', 'launch_ros')]; "
        "assert not bad, bad; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_every_key_in_the_parameter_file_is_a_declared_parameter():
    """ROS silently ignores a parameter-file key no node declares: a typo would never apply."""
    from vla_accel_ros.core.robot.config import CameraConfig, ControllerConfig, PolicyNodeConfig
    from vla_accel_ros.ros.params import leaf_specs
    from vla_accel_ros.ros.synthetic_sensors_node import SyntheticConfig

    params = yaml.safe_load((ROOT / "config" / "aloha.yaml").read_text())
    configs = {CAMERA: CameraConfig, POLICY: PolicyNodeConfig, CONTROLLER: ControllerConfig, SYNTHETIC: SyntheticConfig}
    for node, cls in configs.items():
        declared = {s.name for s in leaf_specs(cls)} | {"use_sim_time"}
        keys = set(node_parameters(params, node))
        if node == CAMERA:
            keys = {k for k in keys if not k.startswith("robot.")}  # /** is for the nodes that declare robot.*
        assert keys <= declared, f"{node}: {sorted(keys - declared)} are not parameters of {cls.__name__}"
        values = {k: v for k, v in node_parameters(params, node).items() if k in declared and k != "use_sim_time"}
        cls.from_dict(unflatten(values))  # and the values build a valid config
