"""aloha_sim_node: the simulated bimanual ALOHA (gym-aloha's MuJoCo scenes) as a robot on the graph.

It stands where the real arm and cameras stand, on the topics of the parameter file:

    <camera_topics[i]>             sensor_msgs/Image rgb8    rendered only while subscribed, at camera_rate_hz
    robot.joint_state_topics       sensor_msgs/JointState    per arm, the real robot's names and units
    command.topic (per backend)    controller -> sim         joint_state | float64_multi_array |
                                                             joint_trajectory | interbotix
    /clock                         rosgraph_msgs/Clock       sim time (publish_clock)
    /action/joint_command          sensor_msgs/JointState    the 14-D action each step executed (sim units)
    /episode, /episode/success     std_msgs/Int32, Bool      at an episode's first / last step
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

The physics and rendering run on one worker thread (the OpenGL context belongs to the thread
that created it); ROS callbacks only record commands and flags.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

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

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import CommandConfig, RobotConfig
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.backends import interbotix_messages, interbotix_topics
from vla_accel_ros.ros.common import ERROR, OK, WARN, DropCounter, diagnostics, spin_node, status
from vla_accel_ros.ros.conversions import header, ns_to_stamp, rgb_to_image, stamp_to_ns
from vla_accel_ros.ros.params import ConfigParameters
from vla_accel_ros.sim.aloha import ACTION_DIM, CAMERA_NAMES, EPISODE_STEPS, MAX_HEIGHT, MAX_WIDTH, TASK_NAMES, SimError
from vla_accel_ros.sim.live import DT_NS, EpisodeStats, LatencyTracker, Pacer, place_arms, render_every
from vla_accel_ros.sim.robot_io import SIM_BACKENDS, SIM_JOINTS, CommandDecoder, CommandError, joint_state_messages

PAUSED_PUBLISH_S = 0.2  # while paused: clock and joint states this often, so the graph sees a robot


@dataclass(frozen=True)
class AlohaSimNodeConfig(Config):
    task: str = param("transfer_cube", doc="simulated task", choices=TASK_NAMES, read_only=True)
    seed: int = param(0, doc="object placement of the first episode; episode i uses seed + i", range=(0, 2**31 - 1))
    cameras: tuple[str, ...] = param(
        ("top",), doc="scene cameras to publish (the scene's names)", choices=CAMERA_NAMES, read_only=True
    )
    camera_topics: tuple[str, ...] = param(
        (), doc="one sensor_msgs/Image topic per camera; empty: the ALOHA layout of `sim record` "
        "(top -> /cam_high/camera/color/image_rect_raw, ...)", read_only=True,
    )  # fmt: skip
    height: int = param(480, doc="rendered image height, pixels", range=(8, MAX_HEIGHT), read_only=True)
    width: int = param(640, doc="rendered image width, pixels", range=(8, MAX_WIDTH), read_only=True)
    camera_rate_hz: float = param(
        50.0, doc="frames per second of sim time per camera (rendered every round(50 / rate) steps)", range=(0.1, 50.0)
    )
    real_time_factor: float = param(
        1.0, doc="sim seconds per wall second at most: 1 real time, 0 as fast as the machine allows", range=(0.0, 1000.0)
    )
    publish_clock: bool = param(
        True, doc="publish /clock and stamp everything with sim time (run the graph with use_sim_time); "
        "false: stamps from this node's clock", read_only=True,
    )  # fmt: skip
    lockstep: bool = param(
        True, doc="before each step wait for the controller's command of the current tick (up to command_timeout_ms)"
    )
    command_timeout_ms: float = param(
        100.0, doc="lockstep: wall time a step waits for the controller before it holds the last command", range=(0.0, 60_000.0)
    )
    wait_for_policy: bool = param(True, doc="hold sim time at its start until policy_node/ready is true")
    policy_sync: bool = param(
        False, doc="hold sim time while a chunk request is unanswered (inference costs no sim time: policy evaluation)"
    )
    policy_timeout_ms: float = param(
        10_000.0, doc="policy_sync: wall time a step waits for the chunk before it goes on", range=(0.0, 600_000.0)
    )
    episode_steps: int = param(EPISODE_STEPS, doc="steps per episode (50 per second of sim time); 0: one endless episode", range=(0, 2**31 - 1))
    auto_reset: bool = param(True, doc="start the next episode when one ends (else hold sim time)")
    reset_policy: bool = param(True, doc="call policy_node/reset_episode at every new episode")
    start_pose: tuple[float, ...] = param(
        (), doc="14 start positions (arm rad, grippers normalized 0..1) in the action layout; empty: the scene's",
        range=(-10.0, 10.0),
    )  # fmt: skip
    instruction: str = param("", doc="instruction published on `instruction` ('' = the task's)")
    publish_instruction: bool = param(True, doc="publish the instruction (off when the graph provides one)")
    robot: RobotConfig = param(RobotConfig(), doc="action / state layout and joint state topics (the file's /** section)")
    command: CommandConfig = param(CommandConfig(), doc="the controller's command backend and topic (copied from its section)")

    def validate(self) -> None:
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(f"AlohaSimNodeConfig.cameras must be unique and non-empty, got {list(self.cameras)}")
        if self.camera_topics and len(self.camera_topics) != len(self.cameras):
            raise ConfigError(f"camera_topics has {len(self.camera_topics)} entries for {len(self.cameras)} cameras")
        if self.start_pose and len(self.start_pose) != ACTION_DIM:
            raise ConfigError(f"start_pose needs {ACTION_DIM} values or none, got {len(self.start_pose)}")
        if self.command.backend not in SIM_BACKENDS:
            raise ConfigError(
                f"command.backend={self.command.backend} cannot drive the simulator (it needs inverse kinematics); "
                f"use one of {', '.join(SIM_BACKENDS)}"
            )


class AlohaSimNode(Node):
    def __init__(self, node_name: str = "aloha_sim_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, AlohaSimNodeConfig, read_only=())
        cfg: AlohaSimNodeConfig = self.params.config
        self.cfg = cfg
        self.layout = TopicLayout()
        self.decoder = CommandDecoder(cfg.robot)  # ConfigError: a robot the sim does not have
        self.drops = DropCounter(self, "command", 2.0)
        wall = Clock(clock_type=ClockType.STEADY_TIME)  # paused sim time must not stop these timers

        # -- outputs -------------------------------------------------------------------------
        topics = cfg.camera_topics or tuple(self.layout.image_topic(self.layout.ros_camera(c)) for c in cfg.cameras)
        self._cams = [
            (cam, f"{self.layout.camera_of_topic(t).strip('/').replace('/', '_')}_color_optical_frame",
             self.create_publisher(Image, t, qos.RELIABLE))  # fmt: skip
            for cam, t in zip(cfg.cameras, topics)
        ]
        # Reliable publishers (as camera drivers and the Interbotix SDK offer): sensor-data
        # subscribers (camera node, controller) still match, and a recorder loses no frame.
        self._js_pubs = [self.create_publisher(JointState, t, qos.RELIABLE) for t in cfg.robot.joint_state_topics]
        self._clock_pub = self.create_publisher(ClockMsg, "/clock", qos.RELIABLE) if cfg.publish_clock else None
        self._action_pub = self.create_publisher(JointState, self.layout.action_topic, qos.RELIABLE)
        self._episode_pub = self.create_publisher(Int32, self.layout.episode_topic, qos.LATCHED)
        self._success_pub = self.create_publisher(Bool, self.layout.success_topic, qos.RELIABLE)
        self._instruction_pub = self.create_publisher(String, graph.INSTRUCTION, qos.LATCHED)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)

        # -- inputs: callbacks only record; the worker reads under _cond -----------------------
        self._cond = threading.Condition()
        self._commands = 0  # command messages applied
        self._cmd_stamp = -1  # newest stamped command (joint_state backend)
        self._per_tick = 1  # messages the controller sends per tick
        self._ready = False
        self._requested = 0  # newest chunk request id seen
        self._answered = 0  # newest request id a chunk answered
        self._reset_requested = False
        self._sim_now = 0  # newest published sim time, ns
        self._lockstep_mark = 0  # commands applied when the current tick was published
        self._task_instruction = ""
        self.latency = LatencyTracker()
        inputs = MutuallyExclusiveCallbackGroup()
        self._subscribe_commands(cfg, inputs)
        self.create_subscription(Bool, f"{graph.POLICY}/ready", self._on_ready, qos.LATCHED, callback_group=inputs)
        self.create_subscription(ChunkRequest, graph.CHUNK_REQUEST, self._on_request, qos.RELIABLE, callback_group=inputs)
        self.create_subscription(ActionChunkMsg, graph.ACTION_CHUNK, self._on_chunk, qos.RELIABLE, callback_group=inputs)
        self.create_service(Trigger, "~/reset", self._on_reset, callback_group=inputs)
        self._policy_reset = self.create_client(Trigger, f"{graph.POLICY}/reset_episode", callback_group=inputs)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup(), clock=wall)

        # -- statistics (worker writes, summary reads) -------------------------------------------
        self.episodes = EpisodeStats()
        self.steps = 0
        self.frames = 0
        self.frames_by_camera: Counter[str] = Counter()
        self.commands_at_step = 0  # steps whose command arrived in lockstep
        self.lockstep_timeouts = 0
        self.policy_waits = 0
        self.failure = ""
        self._stats0 = (0, 0, time.monotonic(), 0)  # (steps, sim ns, wall s, commands) at reset_stats

        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name=f"{node_name}-physics", daemon=True)
        self._worker.start()
        if not self._started.wait(timeout=300.0):
            self.close()
            raise SimError("the simulator did not start within 300 s")
        if self._start_error is not None:
            self._worker.join(timeout=10.0)
            raise self._start_error
        self.get_logger().info(
            f"{cfg.task}: cameras {', '.join(f'{c} -> {p.topic_name}' for c, _, p in self._cams)} "
            f"({cfg.width}x{cfg.height}, {cfg.camera_rate_hz:g} Hz); commands {cfg.command.backend} on "
            f"{', '.join(self._command_topics)}; {'sim time on /clock' if cfg.publish_clock else 'node clock'}, "
            f"real-time factor {cfg.real_time_factor:g}{', lockstep' if cfg.lockstep else ''}"
            f"{', waiting for policy_node/ready' if cfg.wait_for_policy else ''}"
        )

    # -- commands -------------------------------------------------------------------------------
    def _subscribe_commands(self, cfg: AlohaSimNodeConfig, group: MutuallyExclusiveCallbackGroup) -> None:
        backend = cfg.command.backend
        self._command_topics: list[str] = []

        def sub(msg_type, topic, callback):
            s = self.create_subscription(msg_type, topic, callback, qos.COMMANDS, callback_group=group)
            self._command_topics.append(s.topic_name)

        if backend == "joint_state":
            sub(JointState, cfg.command.topic, self._on_joint_state_command)
        elif backend == "float64_multi_array":
            sub(Float64MultiArray, cfg.command.topic, lambda m: self._command(lambda: self.decoder.from_array(m.data)))
        elif backend == "joint_trajectory":
            sub(JointTrajectory, cfg.command.topic, self._on_trajectory)
        elif backend == "interbotix":
            JointGroupCommand, JointSingleCommand = interbotix_messages()
            for arm, ns in zip(cfg.robot.arms, cfg.command.interbotix_namespaces):
                group_topic, single_topic = interbotix_topics(ns)
                sub(JointGroupCommand, group_topic,
                    lambda m, arm=arm: self._command(lambda: self.decoder.from_interbotix_group(arm, m.cmd)))  # fmt: skip
                sub(JointSingleCommand, single_topic,
                    lambda m, arm=arm: self._command(lambda: self.decoder.from_interbotix_single(arm, m.name, m.cmd)))  # fmt: skip
            self._per_tick = 2 * len(cfg.robot.arms)
        else:  # validate() refuses the others; keep the message if a backend is added there
            raise ConfigError(f"command.backend={backend} cannot drive the simulator")

    def _command(self, apply, stamp_ns: int = -1) -> None:
        with self._cond:
            try:
                apply()
            except CommandError as e:
                self.drops.drop("bad_command", str(e))
                return
            self._commands += 1
            if stamp_ns > 0:
                self._cmd_stamp = max(self._cmd_stamp, stamp_ns)
            self._cond.notify_all()

    def _on_joint_state_command(self, msg: JointState) -> None:
        self._command(lambda: self.decoder.from_joint_state(msg.name, msg.position), stamp_to_ns(msg.header.stamp))

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        start = stamp_to_ns(msg.header.stamp) or self._sim_now  # stamp 0: "start now"
        times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points]
        points = [list(p.positions) for p in msg.points]
        self._command(lambda: self.decoder.from_trajectory(msg.joint_names, times, points, start))

    # -- other inputs ---------------------------------------------------------------------------
    def _on_ready(self, msg: Bool) -> None:
        with self._cond:
            self._ready = bool(msg.data)
            self._cond.notify_all()

    def _on_request(self, msg: ChunkRequest) -> None:
        with self._cond:
            self._requested = max(self._requested, int(msg.request_id))
            self._cond.notify_all()

    def _on_chunk(self, msg: ActionChunkMsg) -> None:
        self.latency.chunk(stamp_to_ns(msg.header.stamp), self._sim_now, time.monotonic_ns())
        with self._cond:
            self._answered = max(self._answered, int(msg.request_id))
            self._cond.notify_all()

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._cond:
            self._reset_requested = True
            self._cond.notify_all()
        response.success, response.message = True, "a new episode starts at the next step"
        return response

    # -- the physics thread ----------------------------------------------------------------------
    def _run(self) -> None:
        from vla_accel_ros.sim.aloha import AlohaSim, SimConfig  # noqa: PLC0415 - dm_control loads here

        cfg = self.cfg
        try:
            sim = AlohaSim(SimConfig(task=cfg.task, cameras=cfg.cameras, height=cfg.height, width=cfg.width))
        except BaseException as e:  # noqa: BLE001 - not swallowed: __init__ raises it in the caller's thread
            self._start_error = e
            self._started.set()
            return
        try:
            self._loop(sim)
        except SimError as e:  # e.g. the physics diverged: say so, stop stepping, keep the node up
            self._fail(e, str(e))
        except BaseException as e:
            self._fail(e, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            raise
        finally:
            self._started.set()
            sim.physics.free()  # the GL context belongs to this thread: free it here, not at exit

    def _fail(self, error: BaseException, text: str) -> None:
        if not self._started.is_set():
            self._start_error = error  # __init__ raises it: the node does not start
        self.failure = str(error)
        self.get_logger().error(f"the simulator stopped: {text}")

    def _loop(self, sim) -> None:
        pacer = Pacer(self.cfg.real_time_factor)
        t = DT_NS  # sim time starts one tick in: a zero stamp reads as "unstamped" in ROS
        obs = self._begin_episode(sim, t, first=True)
        self._publish_state(obs, t)
        self._announce_episode()
        self._started.set()
        episode_open = True
        waiting_logged = False
        last_paused_publish = time.monotonic()
        while not self._stop.is_set():
            cfg = self._apply_parameters(pacer)
            ended = bool(cfg.episode_steps) and self.episodes.step >= cfg.episode_steps
            if ended and episode_open:  # its outcome goes out at its last tick
                self._end_episode()
                episode_open = False
            with self._cond:
                ready, reset_asked = self._ready, self._reset_requested
            if (cfg.wait_for_policy and not ready) or (ended and not cfg.auto_reset and not reset_asked):
                if not waiting_logged and not ended:
                    waiting_logged = True
                    self.get_logger().info("holding sim time until policy_node/ready (wait_for_policy)")
                if time.monotonic() - last_paused_publish >= PAUSED_PUBLISH_S:
                    last_paused_publish = time.monotonic()
                    self._publish_state(obs, t, render=False)
                pacer.restart()
                # Frames published before the pause would measure the pause as wall latency.
                self.latency.forget()
                with self._cond:
                    self._cond.wait(0.05)
                continue
            self._wait_for_graph(cfg, t)
            with self._cond:
                reset, self._reset_requested = self._reset_requested, False
            if reset or ended:
                if episode_open:  # ~/reset during an episode ends it
                    self._end_episode()
                t += DT_NS  # the reset takes one tick: every published state has its own stamp
                obs = self._begin_episode(sim, t)
                self._publish_state(obs, t)
                self._announce_episode()
                episode_open = True
                continue
            with self._cond:
                target = self.decoder.target_at(t + DT_NS)
            self._publish_action(target, t)
            cams = [c for c, _, pub in self._cams if self._render_due(pub, cfg)]
            obs = sim.step(target, cameras=cams)
            t += DT_NS
            self.steps += 1
            self.episodes.after_step(obs.reward, obs.success)
            self._publish_state(obs, t)
            pacer.wait(t / 1e9, self._stop)

    def _apply_parameters(self, pacer: Pacer) -> AlohaSimNodeConfig:
        new = self.params.take_pending()
        if new is not None:
            self.cfg = new
            pacer.set_rate(new.real_time_factor)
            if new.publish_instruction:
                self._instruction_pub.publish(String(data=self._instruction_text))
            self.get_logger().info("parameters applied")
        return self.cfg

    def _render_due(self, pub, cfg: AlohaSimNodeConfig) -> bool:
        # Rendering is most of a step's cost: only cameras someone listens to, at their rate.
        return (self.steps + 1) % render_every(cfg.camera_rate_hz) == 0 and pub.get_subscription_count() > 0

    def _wait_for_graph(self, cfg: AlohaSimNodeConfig, t: int) -> None:
        """Lockstep: wait for the controller's command of tick ``t``; policy_sync: for the chunk
        it asked for. Both give up after their timeouts (wall) and the step holds the last command."""
        with self._cond:
            if cfg.policy_sync and self._requested > self._answered:
                self.policy_waits += 1
                self._cond.wait_for(
                    lambda: self._answered >= self._requested or self._stop.is_set(), cfg.policy_timeout_ms / 1e3
                )
            if not cfg.lockstep:
                return
            # A stamped command (joint_state) names its tick; other backends are counted per tick.
            stamped = cfg.command.backend == "joint_state"
            mark = self._lockstep_mark
            done = (lambda: self._cmd_stamp >= t) if stamped else (lambda: self._commands >= mark + self._per_tick)
            if self._cond.wait_for(lambda: done() or self._stop.is_set(), cfg.command_timeout_ms / 1e3):
                self.commands_at_step += 1
            else:
                self.lockstep_timeouts += 1

    # -- episodes -------------------------------------------------------------------------------
    @property
    def _instruction_text(self) -> str:
        return self.cfg.instruction or self._task_instruction

    def _begin_episode(self, sim, t: int, first: bool = False):
        cfg = self.cfg
        index = self.episodes.episode + 1
        seed = cfg.seed + index
        obs = sim.reset(seed=seed, cameras=())
        if cfg.start_pose:
            place_arms(sim, np.asarray(cfg.start_pose))
            obs = sim.observe(cameras=())
        self._task_instruction = sim.instruction
        with self._cond:
            self.decoder.hold(obs.qpos)  # hold the start pose until the controller commands
        self.episodes.begin(index, seed)
        if cfg.reset_policy and not first and self._policy_reset.service_is_ready():
            self._policy_reset.call_async(Trigger.Request())  # the policy clears its caches before the next inference
        self.get_logger().info(f"episode {index} (seed {seed}) at sim time {t / 1e9:.2f} s")
        cams = [c for c, _, pub in self._cams if pub.get_subscription_count() > 0]
        return sim.observe(cameras=cams) if cams else obs

    def _announce_episode(self) -> None:
        """The episode marker and the instruction, after the episode's first state and clock:
        a recorder dates them (no header) by its sim clock, which then reads the first tick."""
        self._episode_pub.publish(Int32(data=self.episodes.episode))
        if self.cfg.publish_instruction:
            self._instruction_pub.publish(String(data=self._instruction_text))

    def _end_episode(self) -> None:
        e = self.episodes
        self._success_pub.publish(Bool(data=bool(e.success)))
        e.end()
        self.get_logger().info(
            f"episode {e.episode} ended after {e.step} steps: {'success' if e.success else 'no success'} "
            f"(best reward {e.max_reward:g})"
        )

    # -- publishing -----------------------------------------------------------------------------
    def _stamp(self, t: int) -> int:
        return t if self.cfg.publish_clock else self.get_clock().now().nanoseconds

    def _publish_action(self, target: np.ndarray, t: int) -> None:
        msg = JointState(header=header(self._stamp(t)), name=list(SIM_JOINTS), position=[float(x) for x in target])
        self._action_pub.publish(msg)

    def _publish_state(self, obs, t: int, render: bool = True) -> None:
        """Frames, joint states, then the clock: a node woken by the clock finds the state of
        that tick already delivered."""
        stamp = self._stamp(t)
        if render and obs.images:
            self.latency.published(stamp, time.monotonic_ns())
            for cam, frame_id, pub in self._cams:
                img = obs.images.get(cam)
                if img is not None:
                    pub.publish(rgb_to_image(img, stamp, frame_id))
                    self.frames += 1
                    self.frames_by_camera[cam] += 1
        for (names, pos, vel), pub in zip(joint_state_messages(self.cfg.robot, obs.qpos, obs.qvel), self._js_pubs):
            pub.publish(JointState(header=header(stamp), name=names, position=pos, velocity=vel))
        with self._cond:
            self._sim_now = t
            self._lockstep_mark = self._commands
        if self._clock_pub is not None:
            self._clock_pub.publish(ClockMsg(clock=ns_to_stamp(t)))

    # -- diagnostics and summary ----------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        s = self.summary()
        level, message = OK, "stepping"
        if self.failure:
            level, message = ERROR, f"stopped: {self.failure}"
        elif self.cfg.wait_for_policy and not self._ready:
            level, message = WARN, "holding sim time until policy_node/ready"
        elif s["lockstep_timeouts"] and s["steps"] and s["lockstep_timeouts"] > 0.5 * s["steps"]:
            level, message = WARN, "most steps went on without a command (is the controller commanding?)"
        values = dict(s)
        values.update({f"dropped {k}": v for k, v in self.drops.counts.items()})
        self._diag_pub.publish(diagnostics(self, [status(f"{self.get_name()}: simulator", level, message, values)]))

    def reset_stats(self) -> None:
        with self._cond:
            self._stats0 = (self.steps, self._sim_now, time.monotonic(), self._commands)
        self.frames = self.commands_at_step = self.lockstep_timeouts = self.policy_waits = 0
        self.frames_by_camera.clear()
        self.latency.reset()
        self.episodes.reset_counts()
        self.drops.counts.clear()

    def summary(self) -> dict[str, object]:
        with self._cond:
            steps0, sim0, wall0, cmds0 = self._stats0
            sim_s = (self._sim_now - sim0) / 1e9
            commands = self._commands - cmds0
        wall_s = time.monotonic() - wall0
        e = self.episodes
        return {
            "steps": self.steps - steps0,
            "sim_s": round(sim_s, 3),
            "wall_s": round(wall_s, 3),
            "real_time_factor": round(sim_s / wall_s, 3) if wall_s > 0 else 0.0,
            "commands": commands,
            "command_rate_sim_hz": round(commands / sim_s, 2) if sim_s > 0 else 0.0,
            "command_rate_wall_hz": round(commands / wall_s, 2) if wall_s > 0 else 0.0,
            "lockstep_timeouts": self.lockstep_timeouts,
            "policy_waits": self.policy_waits,
            "frames": self.frames,
            "obs_to_chunk_sim_p50_ms": round(self.latency.sim_ms.get(50), 1),
            "obs_to_chunk_sim_p95_ms": round(self.latency.sim_ms.get(95), 1),
            "obs_to_chunk_wall_p50_ms": round(self.latency.wall_ms.get(50), 1),
            "obs_to_chunk_wall_p95_ms": round(self.latency.wall_ms.get(95), 1),
            "chunks_measured": self.latency.sim_ms.count,
            "episode": e.episode,
            "episode_step": e.step,
            "episodes_finished": e.finished,
            "successes": e.successes,
            "reward": e.reward,
            "best_reward": e.best_reward,
            "failure": self.failure,
        }

    def close(self) -> None:
        """Stop the physics thread (it frees its GL context on the way out)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join(timeout=10.0)


def main(args: list[str] | None = None) -> None:
    spin_node(AlohaSimNode, args)


if __name__ == "__main__":
    main()
