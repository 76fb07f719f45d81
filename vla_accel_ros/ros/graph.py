"""The ROS graph, described once: which nodes run, with which parameters, on which topics.

``launch/aloha.launch.py`` (launch_ros) and ``vla-accel bringup`` (plain rclpy, one process)
both call :func:`describe` and start exactly what it returns, from the same parameter file
(``config/aloha.yaml``), so the two cannot drift. This module imports neither rclpy nor
launch: the description is data.

Topics (relative names, so a launch ``namespace`` moves the whole graph):

    observation        vla_accel_ros/Observation   camera_node -> policy_node (topic transport)
    observation_stamp  std_msgs/Header             policy_node -> controller: observations it holds
    chunk_request      vla_accel_ros/ChunkRequest  controller -> policy_node (RTC guidance)
    action_chunk       vla_accel_ros/ActionChunk   policy_node -> controller
    inference_stats    vla_accel_ros/InferenceStats
    motion_state       vla_accel_ros/MotionState   controller -> policy_node (coarse | fine)
    instruction        std_msgs/String             (transient local) -> policy_node
    estop              std_msgs/Bool               (transient local) -> controller
    joint_commands     per command.backend         controller -> robot (parameter command.topic)
    /diagnostics       diagnostic_msgs/DiagnosticArray

Services: ``policy_node/reset_episode`` (std_srvs/Trigger), ``action_controller_node/enable``
(std_srvs/SetBool). ``policy_node/ready`` (std_msgs/Bool, transient local) says the bundle is
loaded. Robot-side topics (cameras, joint states, Interbotix and end-effector commands) come
from the parameter file, relative by default (``cam_high/camera/color/image_rect_raw``,
``follower_left/joint_states``): under a namespace they resolve beneath it like the graph's own,
so two robots on one ROS domain share nothing. An absolute name there is shared by every graph
on the domain; :func:`describe` says so in its notes when a namespace is given, and the nodes
refuse the messages of a sensor topic with another robot's publisher
(:mod:`vla_accel_ros.core.robot.sources`). With the simulator under a namespace every node's
``/clock`` is remapped to ``<namespace>/clock``: two simulated robots keep their own time.

Contract for ``aloha_sim_node`` (issue 6): module ``vla_accel_ros.ros.aloha_sim_node`` with a
``Node`` subclass ``AlohaSimNode(node_name="aloha_sim_node", **node_kwargs)``; it reads its
section of the same parameter file, publishes the cameras and joint states the real robot
would (topics from the file) and executes the controller's commands. ``describe(sim=True)``
hands it the camera node's cameras (mapped to scene cameras through the ``sim record`` layout)
and the controller's ``command.*`` parameters, so the two always agree, and turns on
``use_sim_time`` for every node when the simulator publishes ``/clock``.

Recording: :func:`record_topics` is the one list of topics a recording of the graph holds
(``aloha.launch.py record:=true`` and ``vla-accel record``): the graph's topics plus the layout
``vla-accel sim record`` writes (cameras, joint states, ``/action/joint_command``, ``/episode``,
``/instruction``, ``/episode/success``; :class:`~vla_accel_ros.core.robot.topics.TopicLayout`),
so ``vla-accel replay`` reads either.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping


PACKAGE = "vla_accel_ros"

# -- graph topics and services (relative: the namespace applies) ---------------------------------
OBSERVATION = "observation"
OBSERVATION_STAMP = "observation_stamp"
CHUNK_REQUEST = "chunk_request"
ACTION_CHUNK = "action_chunk"
INFERENCE_STATS = "inference_stats"
REASONING = "~/reasoning"  # std_msgs/String: what a reasoning bundle wrote before each chunk's actions
MOTION_STATE = "motion_state"
INSTRUCTION = "instruction"
ESTOP = "estop"
DIAGNOSTICS = "/diagnostics"
READY = "~/ready"
RESET_EPISODE = "~/reset_episode"
ENABLE = "~/enable"

# The package's recorder (``vla_accel_ros.ros.recorder``, executable ``recorder``): rosbag2's MCAP
# format without rosbag2.
RECORDER = "vla_recorder"
RECORDER_MODULE = f"{PACKAGE}.ros.recorder"

CAMERA, POLICY, CONTROLLER, SIM, SYNTHETIC = (
    "camera_node",
    "policy_node",
    "action_controller_node",
    "aloha_sim_node",
    "synthetic_sensors_node",
)


@dataclass(frozen=True)
class NodeSpec:
    name: str  # node name = its section in the parameter file
    executable: str  # `ros2 run vla_accel_ros <executable>` / console script
    module: str  # python module holding the node class and main()
    node_class: str
    parameters: dict[str, Any] = field(default_factory=dict)  # on top of the parameter file
    remappings: tuple[tuple[str, str], ...] = ()
    optional: bool = False  # start only if the module is importable (the simulator)

    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


@dataclass(frozen=True)
class Graph:
    nodes: tuple[NodeSpec, ...]
    params_file: str
    namespace: str
    use_sim_time: bool
    record: bool
    record_topics: tuple[str, ...]
    notes: tuple[str, ...] = ()  # what the description decided and why (printed by starters)
    remappings: tuple[tuple[str, str], ...] = ()  # of every node of the graph, the recorder too

    def resolved_record_topics(self) -> list[str]:
        """Absolute names of ``record_topics`` (relative ones live under the namespace), once each."""
        ns = f"/{self.namespace}" if self.namespace else ""
        return list(dict.fromkeys(t if t.startswith("/") else f"{ns}/{t}" for t in self.record_topics))

    def recorder_parameters(self, out: str | os.PathLike) -> dict[str, Any]:
        """Parameters of the package's recorder node (:data:`RECORDER`) for this graph: the
        recording list into the bag ``out``, on the graph's clock. ``vla-accel bringup --record``
        starts it, and ``aloha.launch.py record:=true`` where ``ros2 bag`` is not installed."""
        return {"out": str(out), "topics": self.resolved_record_topics(), "clock": "sim" if self.use_sim_time else "wall"}

    def with_parameters(self, overrides: Mapping[str, Mapping[str, Any]]) -> "Graph":
        """A copy with extra parameters per node name (e.g. from a test or a CLI flag)."""
        unknown = set(overrides) - {n.name for n in self.nodes}
        if unknown:
            raise KeyError(f"no node(s) {', '.join(sorted(unknown))} in the graph")
        nodes = tuple(
            replace(n, parameters={**n.parameters, **overrides.get(n.name, {})}) for n in self.nodes
        )
        return replace(self, nodes=nodes)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def _spec(name: str, cls: str, parameters: dict[str, Any], **kw: Any) -> NodeSpec:
    return NodeSpec(name=name, executable=name, module=f"{PACKAGE}.ros.{name}", node_class=cls, parameters=parameters, **kw)


# The parameter file, read the way rcl reads it: ROS-free, so the evaluation reads it too.
from vla_accel_ros.core.params_file import (  # noqa: E402
    default_params_file,
    fully_qualified_name,
    load_params,
    node_parameters,
    unmatched_sections,
)


# -- the description --------------------------------------------------------------------------------
def describe(
    *,
    params_file: str | os.PathLike | None = None,
    bundle: str | os.PathLike | None = None,
    sim: bool = False,
    synthetic_camera: bool = False,
    record: bool = False,
    namespace: str = "",
    use_sim_time: bool = False,
    shared_observations: bool = False,
) -> Graph:
    """The nodes to start. ``bundle`` (a path) sets the policy's bundle and fits the camera
    node to the bundle's cameras and image size. ``sim`` adds the simulator and
    ``synthetic_camera`` a synthetic camera + robot; both enable command output at start (a real
    arm starts disabled and waits for ``action_controller_node/enable``).
    ``shared_observations`` (one process only) hands observations over in memory."""
    if sim and synthetic_camera:
        from vla_accel_ros.core.errors import ConfigError  # noqa: PLC0415

        raise ConfigError("the simulator and the synthetic camera would both play the robot (same topics); choose one")
    params_path = Path(params_file) if params_file else default_params_file()
    params = load_params(params_path)
    notes: list[str] = []
    cam_file = node_parameters(params, CAMERA, namespace)
    ctl_file = node_parameters(params, CONTROLLER, namespace)

    camera: dict[str, Any] = {}
    policy: dict[str, Any] = {}
    controller: dict[str, Any] = {}
    transport = "shared" if shared_observations else "topic"
    camera["observation_transport"] = policy["observation_transport"] = transport

    cameras = list(cam_file.get("cameras", []))
    topics = list(cam_file.get("topics", []))
    transports = list(cam_file.get("transports", ["raw"]))
    if bundle:
        from vla_accel_ros.core.bundle import read_spec  # noqa: PLC0415 - JSON only, no torch

        spec = read_spec(bundle)
        policy["bundle"] = str(Path(bundle).resolve())
        camera["image_size"] = int(spec.frame_size)  # 0: frames keep their size, the policy resizes them
        by_name = dict(zip(cameras, topics))
        tr = dict(zip(cameras, transports if len(transports) == len(cameras) else transports * len(cameras)))
        new_topics = []
        for cam in spec.cameras:
            if cam not in by_name:
                notes.append(f"camera {cam} (from the bundle) is not in {params_path.name}; using the ALOHA topic layout")
            new_topics.append(by_name[cam] if cam in by_name else _aloha_image_topic(cam))
        cameras, topics = list(spec.cameras), new_topics
        camera.update(cameras=cameras, topics=topics, transports=[tr.get(c, transports[0] if transports else "raw") for c in cameras])
        if tuple(spec.joint_names) != tuple(ctl_file.get("robot.joint_names", spec.joint_names)):
            notes.append("the bundle's joint_names differ from robot.joint_names in the parameter file; the policy will refuse it")
    if sim or synthetic_camera:
        controller["safety.start_enabled"] = True
    for name in (CAMERA, POLICY, CONTROLLER, *((SIM,) if sim else ()), *((SYNTHETIC,) if synthetic_camera else ())):
        for section in unmatched_sections(params, name, namespace):
            notes.append(
                f"{params_path.name}: section {section!r} does not apply to {fully_qualified_name(name, namespace)} "
                f"(rcl reads it as an absolute name); name it '/**/{name}' to apply it in any namespace"
            )

    if namespace.strip("/"):
        shared = _absolute_robot_topics(topics, ctl_file)
        if shared:
            notes.append(
                f"{params_path.name}: {', '.join(shared)} {'is an absolute name' if len(shared) == 1 else 'are absolute names'}: "
                f"every robot on this ROS domain shares {'it' if len(shared) == 1 else 'them'}, namespace "
                f"/{namespace.strip('/')} or not (relative names resolve under it; docs/ros2-interface.md#several-robots)"
            )

    nodes = [
        _spec(CAMERA, "CameraNode", camera),
        _spec(POLICY, "PolicyNode", policy),
        _spec(CONTROLLER, "ActionControllerNode", controller),
    ]
    if sim:
        sim_params, sim_clock = _sim_parameters(params, namespace, cameras, topics, ctl_file, notes)
        if any(t != "raw" for t in camera.get("transports", transports)):
            camera["transports"] = ["raw"]
            notes.append("simulator: it publishes raw sensor_msgs/Image, so the camera node subscribes raw images")
        nodes.append(_spec(SIM, "AlohaSimNode", sim_params, optional=True))
        if sim_clock and not use_sim_time:
            use_sim_time = True
            notes.append("simulator: every node follows its /clock (use_sim_time)")
    if synthetic_camera:
        # The synthetic robot reads robot.* from the file's /** section like the other nodes.
        syn: dict[str, Any] = {
            "camera_topics": topics or [_aloha_image_topic(c) for c in cameras],
            "command_topic": str(ctl_file.get("command.topic", "joint_commands")),
        }
        if bundle:
            syn["image_size"] = int(spec.image_size)
        if ctl_file.get("command.backend", "joint_state") != "joint_state":
            notes.append("synthetic robot: command.backend is not joint_state, so the fake arm holds its start pose")
        nodes.append(_spec(SYNTHETIC, "SyntheticSensorsNode", syn))

    remappings: tuple[tuple[str, str], ...] = ()
    if sim and namespace.strip("/"):
        # rclpy's time source reads the absolute /clock: two simulators under two namespaces
        # would both drive every node's clock. The simulator publishes, and the nodes follow,
        # <namespace>/clock instead.
        remappings = (("/clock", "clock"),)
        nodes = [replace(n, remappings=(*n.remappings, *remappings)) for n in nodes]
        notes.append(f"simulator: /clock is remapped to /{namespace.strip('/')}/clock for every node of the graph")
    return Graph(
        nodes=tuple(nodes),
        params_file=str(params_path),
        namespace=namespace.strip("/"),
        use_sim_time=bool(use_sim_time),
        record=bool(record),
        record_topics=record_topics(topics, ctl_file),
        notes=tuple(notes),
        remappings=remappings,
    )


def _absolute_robot_topics(camera_topics: list[str], controller: Mapping[str, Any]) -> list[str]:
    """The robot-side topics (and Interbotix namespaces) the parameter file names absolutely."""
    names = [*camera_topics, *controller.get("robot.joint_state_topics", [])]
    backend = controller.get("command.backend", "joint_state")
    if backend in ("ee_pose", "ee_twist"):
        names += controller.get("command.ee_topics", [])
    if backend == "interbotix":
        names += controller.get("command.interbotix_namespaces", [])
    if backend != "interbotix":
        names.append(controller.get("command.topic", "joint_commands"))
    return [str(n) for n in dict.fromkeys(names) if str(n).startswith("/")]


def _aloha_image_topic(camera: str) -> str:
    """The ALOHA topic of a camera, as the simulator and bags name it."""
    from vla_accel_ros.core.robot.topics import image_topic  # noqa: PLC0415

    return image_topic(camera)


def record_topics(camera_topics: list[str], controller: Mapping[str, Any]) -> tuple[str, ...]:
    """What a recording of the graph holds, relative names under the namespace: the graph's
    own topics, the cameras and joint states, the command topic, and the rest of the layout
    ``vla-accel sim record`` writes, so ``vla-accel replay`` reads a live recording too."""
    from vla_accel_ros.core.robot.topics import JOINT_STATE_TOPICS, TopicLayout  # noqa: PLC0415

    lay = TopicLayout()
    out = [OBSERVATION_STAMP, CHUNK_REQUEST, ACTION_CHUNK, INFERENCE_STATS, MOTION_STATE, INSTRUCTION, ESTOP, DIAGNOSTICS]
    out += list(camera_topics)
    out += list(controller.get("robot.joint_state_topics", list(JOINT_STATE_TOPICS)))
    out.append(str(controller.get("command.topic", "joint_commands")))
    # As the simulator publishes them: relative, under the namespace (in the root one, the bag layout).
    out += [relative(t) for t in (lay.action_topic, lay.episode_topic, lay.instruction_topic, lay.success_topic)]
    return tuple(dict.fromkeys(out))


def relative(topic: str) -> str:
    """``/episode/success`` -> ``episode/success``: a bag layout name as a graph publishes it, so a
    graph in the root namespace writes the layout and one in ``r1`` its own ``/r1/...`` topics."""
    return topic.lstrip("/")


def _sim_parameters(
    params: Mapping[str, Any],
    namespace: str,
    cameras: list[str],
    topics: list[str],
    controller: Mapping[str, Any],
    notes: list[str],
) -> tuple[dict[str, Any], bool]:
    """The simulator's overrides: the camera node's cameras as scene cameras (through the
    ``sim record`` layout: cam_high <- top, ...), the controller's command backend and topic,
    no instruction of its own when the policy's section sets one. Returns (overrides,
    whether it publishes /clock)."""
    from vla_accel_ros.core.robot.topics import TopicLayout  # noqa: PLC0415
    from vla_accel_ros.sim.aloha import CAMERA_NAMES  # noqa: PLC0415 - no dm_control at import

    lay = TopicLayout()
    scene = {lay.ros_camera(c): c for c in CAMERA_NAMES}  # ROS camera name -> scene camera
    sim_cams, sim_topics = [], []
    for cam, topic in zip(cameras, topics):
        if cam in scene:
            sim_cams.append(scene[cam])
            sim_topics.append(topic)
        else:
            notes.append(
                f"simulator: camera {cam} has no counterpart in the scene (it has {', '.join(CAMERA_NAMES)}); "
                f"nothing publishes {topic}"
            )
    out: dict[str, Any] = {k: v for k, v in controller.items() if k.startswith("command.")}
    if sim_cams:  # (an empty list would reach ROS as an untyped parameter)
        out.update(cameras=sim_cams, camera_topics=sim_topics)
    if str(node_parameters(params, POLICY, namespace).get("instruction", "")):
        out["publish_instruction"] = False
        notes.append("simulator: policy_node has an instruction in the parameter file; the task's is not published")
    return out, bool(node_parameters(params, SIM, namespace).get("publish_clock", True))
