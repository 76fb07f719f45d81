"""ros2 launch vla_accel_ros aloha.launch.py [bundle:=PATH] [params_file:=F] [sim:=true]
[record:=true] [namespace:=NS] [use_sim_time:=true] [synthetic_camera:=true]

Starts the graph that ``vla_accel_ros.ros.graph.describe`` returns, the same description
``vla-accel bringup`` starts without launch_ros, from the same parameter file
(``config/aloha.yaml`` by default). Each node runs in its own process; observations travel
camera -> policy on the ``observation`` topic. ``record:=true`` adds ``ros2 bag record -s mcap``
of the graph's recording list (``vla_accel_ros.ros.graph.record_topics``, the same list
``vla-accel record`` records by default); where rosbag2 is not installed (no ``ros2 bag``), the
package's own recorder node records the same topics into an MCAP bag that rosbag2 reads.
"""

import importlib.util
import os
import time

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, LogInfo, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from vla_accel_ros.ros.graph import PACKAGE, RECORDER, describe

ARGUMENTS = (
    ("params_file", "", "ROS 2 parameter file (empty: the package's config/aloha.yaml)"),
    ("bundle", "", "model bundle for policy_node (fits the camera node to its cameras and image size)"),
    ("sim", "false", "also start the simulated ALOHA (aloha_sim_node) and enable command output"),
    ("synthetic_camera", "false", "also start a synthetic camera + perfect arm (no robot, no simulator)"),
    ("record", "false", "record the graph's topics with ros2 bag record -s mcap (without rosbag2: the package's recorder)"),
    ("record_output", "", "bag directory to create (empty: rosbag2's default name)"),
    ("namespace", "", "namespace of every node and of the graph's relative topics"),
    ("use_sim_time", "false", "nodes follow /clock"),
)


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _launch_graph(context, *args, **kwargs):
    def arg(name: str) -> str:
        return LaunchConfiguration(name).perform(context)

    graph = describe(
        params_file=arg("params_file") or None,
        bundle=arg("bundle") or None,
        sim=_flag(arg("sim")),
        synthetic_camera=_flag(arg("synthetic_camera")),
        record=_flag(arg("record")),
        namespace=arg("namespace"),
        use_sim_time=_flag(arg("use_sim_time")),
        shared_observations=False,  # one process per node: observations go over the topic
    )
    actions = [LogInfo(msg=f"vla_accel_ros: {note}") for note in graph.notes]
    for spec in graph.nodes:
        if spec.optional and not spec.available():
            actions.append(LogInfo(msg=f"vla_accel_ros: skipping {spec.name}: {spec.module} is not installed"))
            continue
        actions.append(
            Node(
                package=PACKAGE,
                executable=spec.executable,
                name=spec.name,
                namespace=graph.namespace,
                parameters=[graph.params_file, {**spec.parameters, "use_sim_time": graph.use_sim_time}],
                remappings=list(spec.remappings),
                output="screen",
                emulate_tty=True,
            )
        )
    if graph.record:
        actions += _recording(graph, arg("record_output"))
    return actions


def _recording(graph, out: str) -> list:
    """``ros2 bag record`` of the recording list, or without rosbag2 the package's recorder node
    (same topics, MCAP): never a ``ros2 bag`` that fails while the graph runs on unrecorded."""
    topics = graph.resolved_record_topics()
    if importlib.util.find_spec("ros2bag") is not None:
        cmd = ["ros2", "bag", "record", "-s", "mcap", *(["-o", out] if out else [])]
        if graph.use_sim_time:
            cmd.append("--use-sim-time")
        return [ExecuteProcess(cmd=[*cmd, *topics], output="screen")]
    out = os.path.abspath(out or time.strftime("rosbag2_%Y_%m_%d-%H_%M_%S"))  # rosbag2's default name
    return [
        LogInfo(msg=f"vla_accel_ros: ros2 bag is not installed (no rosbag2): recording {len(topics)} topics with "
                    f"the package's recorder ({RECORDER}) to {out} (MCAP)"),  # fmt: skip
        Node(
            package=PACKAGE,
            executable="recorder",
            name=RECORDER,
            namespace=graph.namespace,
            parameters=[{**graph.recorder_parameters(out), "use_sim_time": graph.use_sim_time}],
            remappings=list(graph.remappings),
            output="screen",
            emulate_tty=True,
        ),
    ]


def generate_launch_description() -> LaunchDescription:
    declared = [DeclareLaunchArgument(name, default_value=default, description=doc) for name, default, doc in ARGUMENTS]
    return LaunchDescription([*declared, OpaqueFunction(function=_launch_graph)])
