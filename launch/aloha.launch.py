"""ros2 launch vla_accel_ros aloha.launch.py [bundle:=PATH] [params_file:=F] [sim:=true]
[record:=true] [namespace:=NS] [use_sim_time:=true] [synthetic_camera:=true]

Starts the graph that ``vla_accel_ros.ros.graph.describe`` returns, the same description
``vla-accel bringup`` starts without launch_ros, from the same parameter file
(``config/aloha.yaml`` by default). Each node runs in its own process; observations travel
camera -> policy on the ``observation`` topic. ``record:=true`` adds ``ros2 bag record -s mcap``
of the graph's recording list (``vla_accel_ros.ros.graph.record_topics``, the same list
``vla-accel record`` records by default).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, LogInfo, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from vla_accel_ros.ros.graph import PACKAGE, describe

ARGUMENTS = (
    ("params_file", "", "ROS 2 parameter file (empty: the package's config/aloha.yaml)"),
    ("bundle", "", "model bundle for policy_node (fits the camera node to its cameras and image size)"),
    ("sim", "false", "also start the simulated ALOHA (aloha_sim_node) and enable command output"),
    ("synthetic_camera", "false", "also start a synthetic camera + perfect arm (no robot, no simulator)"),
    ("record", "false", "record the graph's topics with ros2 bag record -s mcap"),
    ("record_output", "", "ros2 bag output directory (empty: rosbag2's default name)"),
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
        # The topic list is graph.record_topics, the one `vla-accel record` uses by default.
        out = arg("record_output")
        cmd = ["ros2", "bag", "record", "-s", "mcap", *(["-o", out] if out else [])]
        if graph.use_sim_time:
            cmd.append("--use-sim-time")
        actions.append(ExecuteProcess(cmd=[*cmd, *graph.resolved_record_topics()], output="screen"))
    return actions


def generate_launch_description() -> LaunchDescription:
    declared = [DeclareLaunchArgument(name, default_value=default, description=doc) for name, default, doc in ARGUMENTS]
    return LaunchDescription([*declared, OpaqueFunction(function=_launch_graph)])
