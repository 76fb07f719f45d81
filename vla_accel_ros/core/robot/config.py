"""The configs the ROS nodes mirror as parameters (one parameter per field, dotted names for
nested configs: ``safety.max_step``, ``policy.cache.sim_threshold``).

``config/aloha.yaml`` is the source of truth for deployed values; the defaults here are the
ALOHA conventions so a node started without a parameter file still talks to an ALOHA.
Fields marked ``read_only`` change shapes, topics or threads and are fixed at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.images import MAX_PIXELS, MAX_SIDE
from vla_accel_ros.core.robot.sources import check_accept
from vla_accel_ros.core.robot.topics import JOINT_STATE_TOPICS, image_topic
from vla_accel_ros.core.scheduling.config import SchedulerConfig

ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")
ALOHA_ARMS = ("left", "right")
ALOHA_JOINT_NAMES = tuple(f"{a}_{j}" for a in ALOHA_ARMS for j in (*ARM_JOINTS, "gripper"))
ALOHA_GRIPPERS = tuple(i for i, n in enumerate(ALOHA_JOINT_NAMES) if n.endswith("_gripper"))  # (6, 13)
ALOHA_CAMERAS = ("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist")
ALOHA_START_ARM = (0.0, -0.96, 1.16, 0.0, -0.3, 0.0)  # one arm's start pose, ARM_JOINTS order (rad)

BACKENDS = ("joint_state", "float64_multi_array", "joint_trajectory", "interbotix", "ee_pose", "ee_twist")


@dataclass(frozen=True)
class GripperConfig(Config):
    """Normalized gripper [0 closed, 1 open] <-> the robot's units (Interbotix constants).

    Read-only at run time: the nodes build their state and command maps from it at start-up."""

    state_source: str = param(
        "finger",
        doc="where the gripper state comes from: finger (finger position in m, e.g. left_finger), "
        "joint (gripper joint angle in rad) or normalized (already in [0, 1])",
        choices=("finger", "joint", "normalized"),
        read_only=True,
    )
    command_units: str = param(
        "joint", doc="units of gripper commands: joint (rad, via joint_open/close) or normalized", choices=("joint", "normalized"),
        read_only=True,
    )
    finger_joint: str = param("left_finger", doc="joint_states name whose position is the finger opening (m)", read_only=True)
    gripper_joint: str = param("gripper", doc="joint_states / command name of the gripper joint", read_only=True)
    finger_open: float = param(0.0579, doc="finger position when open, m", range=(-1.0, 1.0), read_only=True)
    finger_close: float = param(0.0440, doc="finger position when closed, m", range=(-1.0, 1.0), read_only=True)
    joint_open: float = param(1.6214, doc="gripper joint command when open, rad", range=(-6.3, 6.3), read_only=True)
    joint_close: float = param(0.6197, doc="gripper joint command when closed, rad", range=(-6.3, 6.3), read_only=True)

    def validate(self) -> None:
        if self.finger_open == self.finger_close:
            raise ConfigError("GripperConfig.finger_open and finger_close must differ (the map divides by their difference)")
        if self.joint_open == self.joint_close:
            raise ConfigError("GripperConfig.joint_open and joint_close must differ")


def _accept_publishers() -> tuple[str, ...]:
    return param(
        (), doc="namespaces (absolute, e.g. /drivers) whose nodes may publish this node's sensor topics besides the "
        "robot's own; a topic with any other publisher has its messages refused (docs/ros2-interface.md#several-robots)",
    )  # fmt: skip


@dataclass(frozen=True)
class RobotConfig(Config):
    """The action / state layout and where joint states come from."""

    joint_names: tuple[str, ...] = param(
        ALOHA_JOINT_NAMES, doc="one name per action dimension (the bundle's joint_names)", read_only=True
    )
    arms: tuple[str, ...] = param(
        ALOHA_ARMS, doc="arm prefixes: joint '<arm>_<joint>' belongs to arm <arm>", read_only=True
    )
    joint_state_topics: tuple[str, ...] = param(
        JOINT_STATE_TOPICS,
        doc="sensor_msgs/JointState topics the state is read from (relative names resolve under the node's namespace)",
        read_only=True,
    )
    joint_state_prefixes: tuple[str, ...] = param(
        ("left_", "right_"), doc="per topic: prefix that turns a joint_states name into a joint_names entry", read_only=True
    )
    grippers: tuple[str, ...] = param(
        ("left_gripper", "right_gripper"), doc="joint_names entries that are normalized grippers", read_only=True
    )
    gripper: GripperConfig = param(GripperConfig(), doc="gripper maps")
    accept_publishers: tuple[str, ...] = _accept_publishers()

    def validate(self) -> None:
        check_accept("robot.accept_publishers", self.accept_publishers)
        if len(set(self.joint_names)) != len(self.joint_names) or not self.joint_names:
            raise ConfigError(f"RobotConfig.joint_names must be unique and non-empty, got {list(self.joint_names)}")
        if len(self.joint_state_prefixes) != len(self.joint_state_topics):
            raise ConfigError(
                f"RobotConfig.joint_state_prefixes has {len(self.joint_state_prefixes)} entries, "
                f"joint_state_topics {len(self.joint_state_topics)}: give one prefix per topic ('' for none)"
            )
        unknown = [g for g in self.grippers if g not in self.joint_names]
        if unknown:
            raise ConfigError(f"RobotConfig.grippers {unknown} are not in joint_names")

    @property
    def dim(self) -> int:
        return len(self.joint_names)


# The observation rule's limits (core/robot/observation.py), declared once: the camera node
# and the policy node split them (CameraConfig, PolicyNodeConfig), replay and evaluation take
# them together (SyncConfig).
def _max_age_ms() -> float:
    return param(
        100.0,
        doc="an observation's oldest frame may be at most this old when it is assembled (camera node), when a chunk "
        "is requested for it (controller) and when its inference starts (policy node); keep the nodes' values equal",
        range=(1.0, 60_000.0),
    )


def _max_skew_ms() -> float:
    return param(40.0, doc="the frames of one observation must lie within this span", range=(0.0, 60_000.0))


def _max_future_ms() -> float:
    return param(
        500.0,
        doc="a stamp more than this ahead of the node's clock is dropped and counted (a wrong clock must not date "
        "observations, chunks or joint states in the future)",
        range=(0.0, 60_000.0),
    )


def _max_state_age_ms() -> float:
    return param(
        500.0, doc="joint states older than this at observation time are not used (no inference)", range=(1.0, 600_000.0)
    )


@dataclass(frozen=True)
class CameraConfig(Config):
    cameras: tuple[str, ...] = param(ALOHA_CAMERAS, doc="camera names, in the policy's camera order", read_only=True)
    topics: tuple[str, ...] = param(
        tuple(image_topic(c) for c in ALOHA_CAMERAS),
        doc="one image topic per camera (realsense2_camera >= 4.55 layout; relative names resolve under the node's "
        "namespace)",
        read_only=True,
    )
    transports: tuple[str, ...] = param(
        ("raw",), doc="per camera (or one for all): raw (sensor_msgs/Image) or compressed (CompressedImage)",
        choices=("raw", "compressed"), read_only=True,
    )  # fmt: skip
    max_age_ms: float = _max_age_ms()
    max_skew_ms: float = _max_skew_ms()
    max_future_ms: float = _max_future_ms()
    image_size: int = param(224, doc="square size frames are resized to (the bundle's image_size; 0: keep)", range=(0, 4096), read_only=True)
    observation_transport: str = param(
        "topic", doc="topic (vla_accel_ros/Observation) or shared (latest-only buffer, nodes in one process)",
        choices=("topic", "shared"), read_only=True,
    )  # fmt: skip
    shared_channel: str = param("observations", doc="name of the shared buffer (observation_transport=shared)", read_only=True)
    converter: str = param(
        "auto", doc="image conversion: cv_bridge, numpy, or auto (cv_bridge when installed)",
        choices=("auto", "cv_bridge", "numpy"), read_only=True,
    )  # fmt: skip
    max_pixels: int = param(
        MAX_PIXELS, doc="largest frame (width x height) decoded; compressed frames are measured from their header, "
        "before decoding", range=(1, MAX_SIDE * MAX_SIDE),
    )  # fmt: skip
    warn_throttle_s: float = param(2.0, doc="at most one warning per reason per this many seconds", range=(0.0, 3600.0))
    silent_error_s: float = param(
        3.0, doc="/diagnostics: ERROR for a camera that has sent no new frame (a newer stamp) for this long; WARN from "
        "max_age_ms on (ERROR never before WARN)", range=(0.01, 3600.0),
    )  # fmt: skip
    accept_publishers: tuple[str, ...] = _accept_publishers()

    def validate(self) -> None:
        check_accept("accept_publishers", self.accept_publishers)
        if len(set(self.cameras)) != len(self.cameras) or not self.cameras:
            raise ConfigError(f"CameraConfig.cameras must be unique and non-empty, got {list(self.cameras)}")
        if len(self.topics) != len(self.cameras):
            raise ConfigError(f"CameraConfig.topics has {len(self.topics)} entries for {len(self.cameras)} cameras")
        if len(self.transports) not in (1, len(self.cameras)):
            raise ConfigError(f"CameraConfig.transports needs 1 or {len(self.cameras)} entries, got {len(self.transports)}")

    def transport(self, i: int) -> str:
        return self.transports[0] if len(self.transports) == 1 else self.transports[i]


@dataclass(frozen=True)
class SyncConfig(Config):
    """The observation rule outside the graph (replay, evaluation, training data): the camera
    node's limits and the policy node's state age in one config, with the same defaults."""

    cameras: tuple[str, ...] = param((), doc="cameras an observation carries, in order (empty: every camera there is)")
    max_age_ms: float = _max_age_ms()
    max_skew_ms: float = _max_skew_ms()
    max_future_ms: float = _max_future_ms()
    max_state_age_ms: float = _max_state_age_ms()
    image_size: int = param(
        0, doc="square size frames are resized to (0: keep; the policy resizes with the same function)", range=(0, 4096)
    )

    def validate(self) -> None:
        if len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(f"SyncConfig.cameras must be unique, got {list(self.cameras)}")


@dataclass(frozen=True)
class PolicyNodeConfig(Config):
    bundle: str = param("", doc="path of the model bundle to load", read_only=True)
    instruction: str = param("", doc="instruction used until one arrives on the instruction topic ('' = the bundle's)")
    max_instruction_chars: int = param(
        1000, doc="a longer instruction (topic or parameter) is refused before it is tokenized", range=(1, 1_000_000)
    )
    trigger: str = param(
        "request",
        doc="request: infer when the controller asks (ChunkRequest, carries RTC guidance); "
        "continuous: infer back to back on the newest observation; pipelined (ar bundles): stream the newest "
        "observations through ActionFlow's pipelined decode, publishing each chunk when its decode completes",
        choices=("request", "continuous", "pipelined"),
    )
    pipeline_depth: int = param(
        4, doc="pipelined: frames in flight (a chunk comes out depth - 1 frames after its observation)",
        range=(1, 1024), read_only=True,
    )  # fmt: skip
    pipeline_steps: int = param(
        0, doc="pipelined: decode steps per frame (0: what the depth needs, ceil(action tokens / depth))",
        range=(0, 100_000), read_only=True,
    )  # fmt: skip
    max_age_ms: float = _max_age_ms()
    max_state_age_ms: float = _max_state_age_ms()
    max_future_ms: float = _max_future_ms()
    request_wait_ms: float = param(
        100.0, doc="how long a request waits for the observation it names before using the newest (and, when the one "
        "it names is older than max_age_ms at inference start, for a fresh one)", range=(0.0, 10_000.0),
    )  # fmt: skip
    observation_transport: str = param(
        "topic", doc="topic or shared (must match the camera node)", choices=("topic", "shared"), read_only=True
    )
    shared_channel: str = param("observations", doc="name of the shared buffer (observation_transport=shared)", read_only=True)
    warmup: bool = param(True, doc="run one inference on a blank observation before reporting ready", read_only=True)
    gate_bag: str = param(
        "", doc="a rosbag of the task (this robot's, or `vla-accel sim record`): the start-up parity gate checks the "
        "accelerated path on its first observation and its 11th instead of a synthetic pair ('' = the synthetic "
        "pair; pruning's bound, policy.parity_tolerance_prune, is meaningful only on the task's frames)",
        read_only=True,
    )  # fmt: skip
    worker_nice: int = param(
        10, doc="niceness of the inference thread and the torch threads it starts (0: as the node); the "
        "control loop, the camera and every node's DDS callbacks then come first on a busy CPU", range=(0, 19),
        read_only=True,
    )  # fmt: skip
    slow_inference_s: float = param(
        5.0, doc="/diagnostics warn while one inference has run longer than this", range=(0.01, 3600.0)
    )
    robot: RobotConfig = param(RobotConfig(), doc="action / state layout")
    policy: PolicyConfig = param(PolicyConfig(), doc="the policy's run-time options")

    def validate(self) -> None:
        if len(self.instruction) > self.max_instruction_chars:
            raise ConfigError(
                f"PolicyNodeConfig.instruction has {len(self.instruction)} characters, more than "
                f"max_instruction_chars={self.max_instruction_chars}"
            )


@dataclass(frozen=True)
class SafetyConfig(Config):
    lower: tuple[float, ...] = param(
        (), doc="lower limit per action dimension (empty: the ViperX 300 s limits by joint name, grippers 0)", range=(-1e6, 1e6)
    )
    upper: tuple[float, ...] = param(
        (), doc="upper limit per action dimension (empty: the ViperX 300 s limits by joint name, grippers 1)", range=(-1e6, 1e6)
    )
    max_step: tuple[float, ...] = param(
        (0.05,), doc="largest change of a command per control period, one value for all or one per dimension "
        "(LeRobot's max_relative_target; rad or normalized gripper units)", range=(1e-6, 1e6),
    )  # fmt: skip
    watchdog_periods: int = param(
        50, doc="hold position after this many control periods of time without a fresh chunk (periods / "
        "control_rate_hz seconds, measured on the clock, not counted in ticks)", range=(1, 1_000_000),
    )  # fmt: skip
    start_enabled: bool = param(False, doc="command output enabled at start-up (else call ~/enable)")
    require_reference: bool = param(
        True,
        doc="publish nothing until the per-step clamp has a reference: the measured joint state or a previous "
        "command (turn off only for action spaces the joint states do not describe, e.g. ee_pose)",
    )
    estop_requires_enable: bool = param(True, doc="after an e-stop is released, stay disabled until ~/enable is called")


@dataclass(frozen=True)
class MotionConfig(Config):
    """SpecPrune-VLA's action-aware switch: FINE when the end effector moves slowly.

    The rule is the reference code's (enter on a slow overall speed, or slow in xy and z; leave
    on z or rotation speed, here also on overall speed), with the rotation bound required for
    entering in both cases so the enter region lies inside the stay region (no chatter), and
    thresholds in SI units of the end-effector speed estimated from the commanded joints. The paper's code thresholds
    (0.4 / 0.1 / 0.1 / 0.2, leave 0.2 / 0.3) are in LIBERO's normalized delta-action units
    and do not carry over to m/s.
    """

    enter_speed: float = param(0.04, doc="enter fine when |v| < this (m/s) and rot < enter_rot", range=(0.0, 100.0))
    enter_xy: float = param(0.02, doc="... or when xy < enter_xy and z < enter_z and rot < enter_rot (m/s)", range=(0.0, 100.0))
    enter_z: float = param(0.02, doc="see enter_xy (m/s)", range=(0.0, 100.0))
    enter_rot: float = param(0.2, doc="entering fine needs rotation speed < this (rad/s)", range=(0.0, 1000.0))
    leave_z: float = param(0.05, doc="leave fine when |v_z| > this (m/s)", range=(0.0, 100.0))
    leave_rot: float = param(0.3, doc="... or rotation speed > this (rad/s)", range=(0.0, 1000.0))
    leave_speed: float = param(0.08, doc="... or |v| > this (m/s); large values give the reference rule", range=(0.0, 100.0))
    smoothing: float = param(0.3, doc="EMA weight of the newest speed sample (1: no smoothing)", range=(0.01, 1.0))
    min_dwell_steps: int = param(5, doc="control steps a mode is kept before it may switch again", range=(0, 100_000))
    replan_on_fine: bool = param(True, doc="entering fine mode mid-chunk requests a new chunk at once")
    publish_every: int = param(5, doc="publish MotionState every N control steps (and on every switch)", range=(1, 100_000))

    def validate(self) -> None:
        if self.leave_z < self.enter_z or self.leave_rot < self.enter_rot or self.leave_speed < self.enter_speed:
            raise ConfigError(
                "MotionConfig: leave thresholds must not be below the matching enter thresholds "
                f"(z {self.enter_z}/{self.leave_z}, rot {self.enter_rot}/{self.leave_rot}, "
                f"speed {self.enter_speed}/{self.leave_speed}), or the switch chatters"
            )
        # Every motion that enters must also stay: |v| < enter_speed bounds v_z by it too, and
        # xy < enter_xy with z < enter_z bounds |v| by their hypotenuse.
        corner = math.hypot(self.enter_xy, self.enter_z)
        if self.enter_speed > self.leave_z:
            raise ConfigError(
                f"MotionConfig.enter_speed={self.enter_speed} > leave_z={self.leave_z}: a motion entering fine on its "
                "speed could leave at once on its z speed; keep enter_speed <= leave_z, or the switch chatters"
            )
        if corner > self.leave_speed:
            raise ConfigError(
                f"MotionConfig: enter_xy={self.enter_xy} and enter_z={self.enter_z} admit speeds up to {corner:.4g} m/s "
                f"> leave_speed={self.leave_speed}: such a motion would enter and leave fine in turn; keep "
                "hypot(enter_xy, enter_z) <= leave_speed"
            )


@dataclass(frozen=True)
class CommandConfig(Config):
    backend: str = param(
        "joint_state",
        doc="joint_state (sensor_msgs/JointState), float64_multi_array (ros2_control forward command), "
        "joint_trajectory (trajectory_msgs/JointTrajectory), interbotix (JointGroupCommand + JointSingleCommand), "
        "ee_pose (geometry_msgs/PoseStamped per arm) or ee_twist (TwistStamped per arm)",
        choices=BACKENDS,
        read_only=True,
    )
    topic: str = param(
        "joint_commands", doc="command topic of joint_state / float64_multi_array / joint_trajectory", read_only=True
    )
    interbotix_namespaces: tuple[str, ...] = param(
        ("follower_left", "follower_right"), doc="interbotix: robot namespace per arm (commands/joint_group, joint_single; "
        "relative ones lie under the node's namespace)",
        read_only=True,
    )  # fmt: skip
    arm_group: str = param("arm", doc="interbotix: JointGroupCommand.name", read_only=True)
    ee_topics: tuple[str, ...] = param(
        ("follower_left/ee_command", "follower_right/ee_command"), doc="ee_pose / ee_twist: one topic per arm", read_only=True
    )
    ee_frame_ids: tuple[str, ...] = param(
        ("follower_left/base_link", "follower_right/base_link"), doc="ee_pose / ee_twist: header.frame_id per arm",
        read_only=True,
    )  # fmt: skip
    trajectory_lookahead_s: float = param(
        0.0, doc="joint_trajectory: time_from_start of the point (0: one control period)", range=(0.0, 10.0),
        read_only=True,
    )  # fmt: skip


@dataclass(frozen=True)
class ControllerConfig(Config):
    request_chunks: bool = param(True, doc="send ChunkRequests (with RTC guidance) when the scheduler wants a chunk")
    diagnostics_period_s: float = param(1.0, doc="period of /diagnostics", range=(0.05, 3600.0), read_only=True)
    max_age_ms: float = _max_age_ms()
    max_future_ms: float = _max_future_ms()
    realtime_priority: int = param(
        0, doc="SCHED_FIFO priority (1-99) of the control loop's threads, so nothing else on the machine delays a "
        "tick (needs CAP_SYS_NICE or an rtprio limit; refused with a warning otherwise); 0: the normal scheduler",
        range=(0, 99), read_only=True,
    )  # fmt: skip
    stale_chunks: str = param(
        "drop",
        doc="a chunk whose every action is already past (e.g. a 1-action chunk from an autoregressive policy "
        "slower than one period) while nothing is planned: drop it (honest timing; the arm holds, counted as "
        "stale_chunk; it does not refresh the watchdog) or "
        "execute_last (command its last action at the next tick, late; counted in /diagnostics)",
        choices=("drop", "execute_last"),
    )
    robot: RobotConfig = param(RobotConfig(), doc="action / state layout")
    scheduler: SchedulerConfig = param(SchedulerConfig(), doc="action-chunk scheduling")
    safety: SafetyConfig = param(SafetyConfig(), doc="limits, clamp, watchdog, e-stop")
    motion: MotionConfig = param(MotionConfig(), doc="coarse / fine switch from the end-effector speed")
    command: CommandConfig = param(CommandConfig(), doc="how commands leave the controller")

    def validate(self) -> None:
        n = self.robot.dim
        s = self.safety
        for name, values in (("lower", s.lower), ("upper", s.upper)):
            if values and len(values) != n:
                raise ConfigError(f"safety.{name} has {len(values)} values for {n} joints; give {n} or none")
        for i, (lo, hi) in enumerate(zip(s.lower, s.upper)):
            if lo > hi:
                raise ConfigError(
                    f"safety.lower[{i}]={lo} exceeds safety.upper[{i}]={hi} ({self.robot.joint_names[i]}): "
                    "each lower limit must be <= its upper limit"
                )
        if len(s.max_step) not in (1, n):
            raise ConfigError(f"safety.max_step needs 1 or {n} values, got {len(s.max_step)}")
        arms = len(self.robot.arms)
        c = self.command
        if c.backend == "interbotix" and len(c.interbotix_namespaces) != arms:
            raise ConfigError(
                f"command.interbotix_namespaces={list(c.interbotix_namespaces)} needs one namespace per arm ({arms})"
            )
        if c.backend in ("ee_pose", "ee_twist") and (len(c.ee_topics) != arms or len(c.ee_frame_ids) != arms):
            raise ConfigError(
                f"command.ee_topics={list(c.ee_topics)} and ee_frame_ids={list(c.ee_frame_ids)} need one entry per arm ({arms})"
            )
