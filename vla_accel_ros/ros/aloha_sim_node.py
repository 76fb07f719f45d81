"""aloha_sim_node: the simulated bimanual ALOHA (gym-aloha's MuJoCo scenes) as a robot on the graph.

It stands where the real arm and cameras stand, on the topics of the parameter file:

    <camera_topics[i]>             sensor_msgs/Image rgb8    rendered only while subscribed, at camera_rate_hz
    robot.joint_state_topics       sensor_msgs/JointState    per arm, the real robot's names and units
    command.topic (per backend)    controller -> sim         joint_state | float64_multi_array |
                                                             joint_trajectory | interbotix
    /clock                         rosgraph_msgs/Clock       sim time (publish_clock; <namespace>/clock
                                                             under a namespace, remapped by the graph)
    action/joint_command           sensor_msgs/JointState    the 14-D action each step executed (sim units)
    episode, episode/success       std_msgs/Int32, Bool      at an episode's first / last step

(relative names: ``/action/joint_command`` ... in the root namespace, as ``sim record`` writes them).
    instruction                    std_msgs/String           the task's instruction (transient local)

Services: ``~/reset`` (std_srvs/Trigger) starts a new episode. At every new episode it calls
``policy_node/reset_episode`` (``reset_policy``).

Time. The simulator steps 20 ms of sim time per step (50 Hz) and publishes ``/clock``; the
whole graph runs with ``use_sim_time`` (``vla-accel bringup --sim`` and ``aloha.launch.py
sim:=true`` set it on every node), so the controller's 50 Hz timer fires once per step and
every stamp, age and latency in the graph is sim time. ``real_time_factor`` caps how fast sim
time may run against the wall clock (1: real time; 0: as fast as the machine allows).
``lockstep`` makes each step wait (up to ``command_timeout_ms`` of wall time) for the
controller's command of that tick, so the controller sees every step however fast or slow the
simulator runs; rendering (~50 ms a frame on a CPU) then sets the pace, and the policy's
inference costs sim time in proportion (measured on both clocks in :meth:`summary`).
``policy_sync`` also holds sim time while a chunk request is unanswered: inference then costs
no sim time at all (an evaluation of the policy, not of its speed). ``wait_for_policy`` keeps
sim time at 0 until ``policy_node/ready``, so no episode runs out while the bundle loads.

The loop itself (pause, lockstep, policy sync, episodes, pacing) is
:class:`~vla_accel_ros.sim.runner.SimRunner`, with its physics thread; this node declares the
parameters (:class:`~vla_accel_ros.sim.runner.LiveSimConfig`), hands the runner the graph's
inputs and publishes what it produces.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from rosgraph_msgs.msg import Clock as ClockMsg
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Bool, Float64MultiArray, Int32, String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.backends import interbotix_messages, interbotix_topics
from vla_accel_ros.ros.conversions import header, ns_to_stamp, rgb_to_image, stamp_to_ns
from vla_accel_ros.ros.diagnostics import ERROR, OK, WARN, diagnostics, status, status_name
from vla_accel_ros.ros.drops import DropCounter
from vla_accel_ros.ros.spin import spin_node
from vla_accel_ros.ros.params import ConfigParameters
from vla_accel_ros.sim.robot_io import SIM_JOINTS, CommandDecoder, CommandError, joint_state_messages
from vla_accel_ros.sim.runner import LiveSimConfig, SimRunner


class AlohaSimNode(Node):
    def __init__(self, node_name: str = "aloha_sim_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, LiveSimConfig, read_only=())
        cfg: LiveSimConfig = self.params.config
        self.cfg = cfg
        self.layout = TopicLayout()
        self.drops = DropCounter(self, "command", 2.0)
        wall = Clock(clock_type=ClockType.STEADY_TIME)  # paused sim time must not stop these timers

        # -- outputs -------------------------------------------------------------------------
        topics = cfg.camera_topics or tuple(graph.relative(self.layout.image_topic(self.layout.ros_camera(c))) for c in cfg.cameras)
        self._cams = [
            (cam, f"{self.layout.camera_of_topic(t).strip('/').replace('/', '_')}_color_optical_frame",
             self.create_publisher(Image, t, qos.RELIABLE))  # fmt: skip
            for cam, t in zip(cfg.cameras, topics)
        ]
        # Reliable publishers (as camera drivers and the Interbotix SDK offer): sensor-data
        # subscribers (camera node, controller) still match, and a recorder loses no frame.
        self._js_pubs = [self.create_publisher(JointState, t, qos.RELIABLE) for t in cfg.robot.joint_state_topics]
        self._clock_pub = self.create_publisher(ClockMsg, "/clock", qos.RELIABLE) if cfg.publish_clock else None
        # The bag layout's topics, relative: under the graph's namespace, as every topic of one robot.
        self._action_pub = self.create_publisher(JointState, graph.relative(self.layout.action_topic), qos.RELIABLE)
        self._episode_pub = self.create_publisher(Int32, graph.relative(self.layout.episode_topic), qos.LATCHED)
        self._success_pub = self.create_publisher(Bool, graph.relative(self.layout.success_topic), qos.RELIABLE)
        self._instruction_pub = self.create_publisher(String, graph.INSTRUCTION, qos.LATCHED)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)

        # -- the loop, and the inputs it takes -------------------------------------------------------
        self.runner = SimRunner(cfg, self, take_config=self.params.take_pending)
        inputs = MutuallyExclusiveCallbackGroup()
        self._subscribe_commands(cfg, inputs)
        self.create_subscription(Bool, f"{graph.POLICY}/ready", lambda m: self.runner.set_ready(m.data), qos.LATCHED, callback_group=inputs)
        self.create_subscription(
            ChunkRequest, graph.CHUNK_REQUEST, lambda m: self.runner.requested(m.request_id), qos.RELIABLE, callback_group=inputs
        )
        self.create_subscription(
            ActionChunkMsg, graph.ACTION_CHUNK, lambda m: self.runner.answered(m.request_id, stamp_to_ns(m.header.stamp)),
            qos.RELIABLE, callback_group=inputs,
        )  # fmt: skip
        self.create_service(Trigger, "~/reset", self._on_reset, callback_group=inputs)
        self._policy_reset = self.create_client(Trigger, f"{graph.POLICY}/reset_episode", callback_group=inputs)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup(), clock=wall)
        self.runner.start(name=f"{node_name}-physics")
        self.get_logger().info(
            f"{cfg.task}: cameras {', '.join(f'{c} -> {p.topic_name}' for c, _, p in self._cams)} "
            f"({cfg.width}x{cfg.height}, {cfg.camera_rate_hz:g} Hz); commands {cfg.command.backend} on "
            f"{', '.join(self._command_topics)}; {'sim time on /clock' if cfg.publish_clock else 'node clock'}, "
            f"real-time factor {cfg.real_time_factor:g}{', lockstep' if cfg.lockstep else ''}"
            f"{', waiting for policy_node/ready' if cfg.wait_for_policy else ''}"
        )

    # -- commands -------------------------------------------------------------------------------
    def _subscribe_commands(self, cfg: LiveSimConfig, group: MutuallyExclusiveCallbackGroup) -> None:
        backend = cfg.command.backend
        self._command_topics: list[str] = []

        def sub(msg_type, topic, callback):
            s = self.create_subscription(msg_type, topic, callback, qos.COMMANDS, callback_group=group)
            self._command_topics.append(s.topic_name)

        if backend == "joint_state":
            sub(JointState, cfg.command.topic, self._on_joint_state_command)
        elif backend == "float64_multi_array":
            sub(Float64MultiArray, cfg.command.topic, lambda m: self._command(lambda d: d.from_array(m.data)))
        elif backend == "joint_trajectory":
            sub(JointTrajectory, cfg.command.topic, self._on_trajectory)
        elif backend == "interbotix":
            JointGroupCommand, JointSingleCommand = interbotix_messages()
            for arm, ns in zip(cfg.robot.arms, cfg.command.interbotix_namespaces):
                group_topic, single_topic = interbotix_topics(ns)
                sub(JointGroupCommand, group_topic,
                    lambda m, arm=arm: self._command(lambda d: d.from_interbotix_group(arm, m.cmd)))  # fmt: skip
                sub(JointSingleCommand, single_topic,
                    lambda m, arm=arm: self._command(lambda d: d.from_interbotix_single(arm, m.name, m.cmd)))  # fmt: skip
        else:  # validate() refuses the others; keep the message if a backend is added there
            raise ConfigError(f"command.backend={backend} cannot drive the simulator")

    def _command(self, apply: Callable[[CommandDecoder], object], stamp_ns: int = -1) -> None:
        try:
            self.runner.command(apply, stamp_ns)
        except CommandError as e:
            self.drops.drop("bad_command", str(e))

    def _on_joint_state_command(self, msg: JointState) -> None:
        self._command(lambda d: d.from_joint_state(msg.name, msg.position), stamp_to_ns(msg.header.stamp))

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        start = stamp_to_ns(msg.header.stamp) or self.runner.sim_now  # stamp 0: "start now"
        times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points]
        points = [list(p.positions) for p in msg.points]
        self._command(lambda d: d.from_trajectory(msg.joint_names, times, points, start))

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        self.runner.request_reset()
        response.success, response.message = True, "a new episode starts at the next step"
        return response

    # -- what the runner publishes (SimOutputs), on its thread ---------------------------------------
    def frames(self, images: dict[str, np.ndarray], stamp: int) -> None:
        for cam, frame_id, pub in self._cams:
            img = images.get(cam)
            if img is not None:
                pub.publish(rgb_to_image(img, stamp, frame_id))

    def joint_states(self, qpos: np.ndarray, qvel: np.ndarray, stamp: int) -> None:
        for (names, pos, vel), pub in zip(joint_state_messages(self.cfg.robot, qpos, qvel), self._js_pubs):
            pub.publish(JointState(header=header(stamp), name=names, position=pos, velocity=vel))

    def clock(self, t_ns: int) -> None:
        self._clock_pub.publish(ClockMsg(clock=ns_to_stamp(t_ns)))

    def action(self, target: np.ndarray, stamp: int) -> None:
        self._action_pub.publish(JointState(header=header(stamp), name=list(SIM_JOINTS), position=[float(x) for x in target]))

    def episode_marker(self, episode: int) -> None:
        self._episode_pub.publish(Int32(data=episode))

    def instruction(self, text: str) -> None:
        self._instruction_pub.publish(String(data=text))

    def outcome(self, success: bool) -> None:
        self._success_pub.publish(Bool(data=success))

    def reset_policy(self) -> None:
        if self._policy_reset.service_is_ready():
            self._policy_reset.call_async(Trigger.Request())

    def watched_cameras(self) -> list[str]:
        return [c for c, _, pub in self._cams if pub.get_subscription_count() > 0]

    def now(self) -> int:
        return self.get_clock().now().nanoseconds

    def log(self, level: str, text: str) -> None:
        logger = self.get_logger()
        {"info": logger.info, "warning": logger.warning, "error": logger.error}[level](text)

    # -- diagnostics and summary ----------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        s = self.summary()
        level, message = OK, "stepping"
        if self.runner.failure:
            level, message = ERROR, f"stopped: {self.runner.failure}"
        elif self.runner.waiting_for_policy:
            level, message = WARN, "holding sim time until policy_node/ready"
        elif s["lockstep_timeouts"] and s["steps"] and s["lockstep_timeouts"] > 0.5 * s["steps"]:
            level, message = WARN, "most steps went on without a command (is the controller commanding?)"
        values = dict(s)
        values.pop("episode_results")  # grows with every episode; the counts above say enough
        values.update({f"dropped {k}": v for k, v in self.drops.snapshot().items()})
        self._diag_pub.publish(diagnostics(self, [status(status_name(self, "simulator"), level, message, values)]))

    def reset_stats(self) -> None:
        self.runner.reset_stats()
        self.drops.clear()

    def summary(self) -> dict[str, object]:
        return self.runner.summary()

    def close(self) -> None:
        self.runner.close()


def main(args: list[str] | None = None) -> None:
    spin_node(AlohaSimNode, args)


if __name__ == "__main__":
    main()
