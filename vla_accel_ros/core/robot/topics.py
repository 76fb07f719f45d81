"""The ALOHA topic conventions, in one place: what the real robot, the simulator, the graph's
recorder and bags on disk call their topics.

::

  <cam>/camera/color/image_rect_raw   sensor_msgs/Image, one per camera (realsense2_camera >= 4.55)
  follower_left/joint_states          sensor_msgs/JointState per arm, in the real robot's units
  follower_right/joint_states           (:class:`~vla_accel_ros.core.robot.config.RobotConfig`)
  /action/joint_command               sensor_msgs/JointState, the 14-D action of each tick (policy units)
  /episode                            std_msgs/Int32, episode index, once at its first tick
  /instruction                        std_msgs/String, the task instruction, once per episode
  /episode/success                    std_msgs/Bool, once at the episode's last tick

The nodes read the sensor topics by relative names (:data:`CAMERA_TOPIC`,
:data:`JOINT_STATE_TOPICS`), as ROS 2 drivers publish them: they resolve under the graph's
namespace, so two robots started with ``namespace:=r1`` and ``namespace:=r2`` never read each
other's cameras or arms. A bag holds the names a graph in the root namespace resolves
(``/cam_high/camera/color/image_rect_raw``): :class:`TopicLayout`.

The robot and camera configs take their defaults from here; the simulator node publishes,
``vla-accel sim record`` writes and ``BagReader`` reads this layout; ``ros/graph.py`` records it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError

# Relative: a node resolves them under its namespace (``/r1/follower_left/joint_states``).
CAMERA_TOPIC = "{camera}/camera/color/image_rect_raw"
JOINT_STATE_TOPICS = ("follower_left/joint_states", "follower_right/joint_states")
# Scene camera of the simulator = ROS camera name of the real ALOHA.
SIM_CAMERA_NAMES = ("top=cam_high", "left_wrist=cam_left_wrist", "right_wrist=cam_right_wrist")


def root_name(topic: str) -> str:
    """A topic as a node in the root namespace resolves it (``follower_left/joint_states`` ->
    ``/follower_left/joint_states``): the name a bag recorded there holds."""
    return topic if topic.startswith("/") else "/" + topic


def image_topic(camera: str, template: str = CAMERA_TOPIC) -> str:
    """The image topic of a ROS camera name (``cam_high`` -> ``cam_high/camera/color/image_rect_raw``)."""
    return template.replace("{camera}", camera)


@dataclass(frozen=True)
class TopicLayout(Config):
    """The topics of a bag: absolute names, as a graph in the root namespace resolves them."""

    camera_topic: str = param(
        "/" + CAMERA_TOPIC, doc="image topic template; {camera} is the ROS camera name (realsense2_camera >= 4.55)"
    )
    camera_names: tuple[str, ...] = param(
        SIM_CAMERA_NAMES, doc="sim camera=ROS camera name; sim cameras not listed keep their own name"
    )
    left_joint_states: str = param("/" + JOINT_STATE_TOPICS[0], doc="left arm JointState topic")
    right_joint_states: str = param("/" + JOINT_STATE_TOPICS[1], doc="right arm JointState topic")
    action_topic: str = param("/action/joint_command", doc="commanded 14-D action (JointState)")
    instruction_topic: str = param("/instruction", doc="task instruction (String), once per episode")
    episode_topic: str = param("/episode", doc="episode index (Int32) at each episode's first tick")
    success_topic: str = param("/episode/success", doc="episode outcome (Bool) at its last tick")

    def validate(self) -> None:
        if self.camera_topic.count("{camera}") != 1:
            raise ConfigError(
                f"TopicLayout.camera_topic must contain {{camera}} once, got {self.camera_topic!r}"
            )
        for entry in self.camera_names:
            if entry.count("=") != 1 or not all(entry.split("=")):
                raise ConfigError(f"TopicLayout.camera_names entries are sim=ros, got {entry!r}")

    @property
    def joint_state_topics(self) -> tuple[str, str]:
        return self.left_joint_states, self.right_joint_states

    def ros_camera(self, sim_camera: str) -> str:
        return dict(e.split("=") for e in self.camera_names).get(sim_camera, sim_camera)

    def image_topic(self, ros_camera: str) -> str:
        return image_topic(ros_camera, self.camera_topic)

    def camera_of_topic(self, topic: str) -> str:
        """The camera name in an image topic, absolute or relative (as the graph's nodes name it);
        topics off the template are named by themselves."""
        prefix, suffix = self.camera_topic.lstrip("/").split("{camera}")
        name = topic.lstrip("/")
        if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
            return name[len(prefix) : len(name) - len(suffix)]
        return topic
