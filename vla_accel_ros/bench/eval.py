"""Closed-loop evaluation in the simulator: task success per acceleration mode, same seeds.

Each mode (the replay benchmark's modes: ``baseline``, ``cache``, presets, ...) gets its own
policy built like the policy node builds it (:func:`load_policy` with the mode's
:class:`PolicyConfig`, parity gate included; every mode shares one copy of the weights) and
runs the same episodes (object placements from the same seeds). An episode is the live graph
without ROS, on simulated time:

* the simulator renders the bundle's cameras when an observation is needed, and publishes its
  joints in the robot's units; the package's one observation rule
  (:class:`~vla_accel_ros.core.robot.observation.ObservationBuilder`, the camera node's and the
  policy node's halves end to end) turns them into the :class:`Observation` the policy sees;
* the controller's chunk scheduler and safety filter (``config/aloha.yaml``'s
  ``action_controller_node`` section) turn chunks into one joint command per 20 ms tick;
* inference costs no sim time by default (``latency="zero"``: the simulator waits for the
  chunk, as ``aloha_sim_node``'s ``policy_sync``), so modes are compared on fidelity alone;
  ``latency="measured"`` lets each chunk arrive its measured wall latency later while the arm
  keeps executing, which is what a robot on this CPU would experience.

Open-loop error: the policy's chunks against the scripted expert's next actions along
held-out demonstrations (expert trajectories for the first evaluation seeds), every
``open_loop_stride`` steps.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vla_accel_ros.bench.lerobot_eval import LEROBOT
from vla_accel_ros.bench.outcomes import paired_vs_baseline, stage_summary, wilson_interval
from vla_accel_ros.bench.reasoning import reasoning_summary, truth_words
from vla_accel_ros.bench.machine import machine_info
from vla_accel_ros.bench.modes import BASELINE, build_runs, check_overrides, mode_of, parse_modes, policy_config
from vla_accel_ros.bench.stats import distribution
from vla_accel_ros.core.config import flatten, unflatten
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.params_file import default_params_file, load_params, node_config, node_section
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import CameraConfig, ControllerConfig, PolicyNodeConfig, SyncConfig
from vla_accel_ros.core.robot.control_loop import ControlLoop
from vla_accel_ros.core.robot.motion import FINE, MODE_NAMES
from vla_accel_ros.core.robot.observation import ObservationBuilder
from vla_accel_ros.core.robot.safety import default_limits
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.core.types import ActionChunk
from vla_accel_ros.models.factory import load_bundle
from vla_accel_ros.sim.aloha import CAMERA_NAMES, TASK_NAMES, AlohaSim, SimConfig
from vla_accel_ros.sim.live import DT_NS
from vla_accel_ros.sim.robot_io import check_robot, joint_state_messages
from vla_accel_ros.sim.scripted import ScriptedExpert

SCHEMA = "vla_accel_ros.eval/1"
LATENCY_MODELS = ("zero", "measured")

# The policy's noise in the episode of seed s comes from the stream (NOISE_KEY, s): an episode
# replays with the same noise whatever seed its run started at (a run of seeds 100050.. repeats
# the episodes of a run of 100000..). The key is the default first seed, the noise every run
# from the default start has always drawn.
NOISE_KEY = 100_000
GATE_TICKS = 30  # the parity gate's second frame: this many control ticks after the first
# The gate's scene, whatever seed the run starts at: a gate on a run's own first seed could
# resolve precision auto differently in two halves of one evaluation (seen: 100000.. and 100050..).
GATE_SEED = NOISE_KEY


@dataclass
class EvalConfig:
    bundle: Path
    task: str = "transfer_cube"
    episodes: int = 20
    modes: tuple[str, ...] = ("baseline", "cache")
    seed: int = 100_000  # episode i places the objects with seed + i (demonstrations use 0, 1, ...)
    steps: int = 300  # control steps per episode (gym-aloha: 300 = 6 s)
    latency: str = "zero"
    open_loop_episodes: int = 2
    open_loop_stride: int = 10
    params: Path | None = None  # the graph's parameter file (default: the package's config/aloha.yaml)
    parity_check: bool = True
    num_threads: int = 0
    flow_steps: int = 0
    noise_scale: float = -1.0  # flow: PolicyConfig.flow_noise_scale of every mode, lerobot's too (-1: the bundle's)
    cache_overrides: dict[str, Any] = field(default_factory=dict)
    prune_overrides: dict[str, Any] = field(default_factory=dict)
    precision_overrides: dict[str, Any] = field(default_factory=dict)  # gate limits of the @precision modes
    scheduler_overrides: dict[str, Any] = field(default_factory=dict)  # the controller's SchedulerConfig fields
    height: int = 480
    width: int = 640
    pipeline_depth: int = 4  # pipelined modes: frames in flight (the decode steps per frame follow)
    pipeline_steps: int = 0
    stream_every: int = 1  # pipelined modes: ticks between two observations pushed
    # Also through the ROS graph (vla-accel eval --through-ros): per mode, modes.<mode>.ros_graph.
    through_ros: bool = False
    ros_one_process: bool = False  # every node in one process (bringup --one-process) instead of one each
    ros_domain_id: int | None = None
    ros_startup_timeout_s: float = 300.0
    ros_episode_timeout_s: float = 600.0
    # The lerobot mode: LeRobot's checkpoint of the bundle and the Python of LeRobot's side venv.
    lerobot: Path | None = None
    lerobot_python: Path | None = None
    # False: the baseline's episodes are not run (an earlier report holds them on the same seeds:
    # `vla-accel bench outcomes` pairs across reports), which halves a one-mode evaluation.
    run_baseline: bool = True

    def validate(self) -> None:
        if self.task not in TASK_NAMES:
            raise ConfigError(f"--task {self.task!r} is not one of {', '.join(TASK_NAMES)}")
        if self.episodes < 1:
            raise ConfigError(f"--episodes must be >= 1, got {self.episodes}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.latency not in LATENCY_MODELS:
            raise ConfigError(f"--latency {self.latency!r} is not one of {', '.join(LATENCY_MODELS)}")
        if self.stream_every < 1 or self.pipeline_depth < 0 or self.pipeline_steps < 0:
            raise ConfigError("--stream-every must be >= 1 and --pipeline-depth / --pipeline-steps >= 0")
        try:
            PolicyConfig(flow_noise_scale=self.noise_scale)  # its range, named as the flag
        except ConfigError as e:
            raise ConfigError(f"--noise-scale: {e}") from None
        if self.open_loop_episodes < 0 or self.open_loop_stride < 1:
            raise ConfigError("--open-loop-episodes must be >= 0 and --open-loop-stride >= 1")
        if not Path(self.bundle).exists():
            raise ConfigError(f"--bundle {self.bundle} does not exist")
        names = eval_modes(list(self.modes))
        if not self.run_baseline and names == [BASELINE]:
            raise ConfigError("--no-baseline leaves no mode to run: list one in --modes besides baseline")
        check_overrides(self)
        GraphConfigs.load(self.params, self.scheduler_overrides)  # ConfigError: a bad file or --scheduler value
        if LEROBOT in names:
            if self.lerobot_python is None or not Path(self.lerobot_python).is_file():
                raise ConfigError(f"mode {LEROBOT} runs LeRobot in its own Python: --lerobot-python {self.lerobot_python} "
                                  "is not a file (../shared/tools/lerobot-reference/install_lerobot_venv.sh makes one)")  # fmt: skip
            if self.lerobot is not None and not (Path(self.lerobot) / "config.json").is_file():
                raise ConfigError(f"--lerobot {self.lerobot}: no config.json (LeRobot's saved policy directory)")
            if self.through_ros:
                raise ConfigError(f"mode {LEROBOT} cannot run through the ROS graph (the policy node runs the engine)")
        if self.through_ros:
            for name in names:
                graph_params(name, self)  # ConfigError: a mode the graph cannot run


def eval_modes(text) -> list[str]:
    """The evaluation's modes in run order: the replay's (:func:`parse_modes`, baseline first)
    and ``lerobot``, LeRobot's own runtime, where it is listed."""
    names = [m.strip() for m in text.split(",")] if isinstance(text, str) else [m.strip() for m in text]
    engine = parse_modes([m for m in names if m and m != LEROBOT] or [BASELINE])  # `lerobot` alone: the baseline is added
    if LEROBOT not in names:
        return engine
    if names.count(LEROBOT) > 1:
        raise ConfigError(f"--modes lists {LEROBOT} twice")
    before = [m for m in names[: names.index(LEROBOT)] if m]
    at = len(before) + (BASELINE not in names)  # after the modes listed before it (and an added baseline)
    return [*engine[:at], LEROBOT, *engine[at:]]


# ---------------------------------------------------------------------------------- the graph


@dataclass
class GraphConfigs:
    """The parts of the graph's parameter file an episode runs with."""

    robot: Any
    camera: Any
    policy_node: Any
    controller: Any  # ControllerConfig, output enabled

    @property
    def scheduler(self):
        return self.controller.scheduler

    @property
    def safety(self):
        return self.controller.safety

    def sync(self, image_size: int):
        """The observation rule's limits as the camera and policy nodes hold them."""
        c = self.camera
        return SyncConfig(max_age_ms=c.max_age_ms, max_skew_ms=c.max_skew_ms,
                          max_state_age_ms=self.policy_node.max_state_age_ms, image_size=image_size)  # fmt: skip

    @classmethod
    def load(cls, path: Path | None, scheduler: dict[str, Any] | None = None) -> "GraphConfigs":
        """From the graph's ROS 2 parameter file (default: the package's config/aloha.yaml), with
        ``scheduler`` fields (``--scheduler``) over the controller's scheduler section."""
        params = load_params(path or default_params_file())
        controller = node_config(params, "action_controller_node", ControllerConfig)
        camera = node_config(params, "camera_node", CameraConfig)
        policy_node = node_config(params, "policy_node", PolicyNodeConfig)
        # A simulated arm needs no enable call: output starts enabled.
        controller = controller.replace(safety=controller.safety.replace(start_enabled=True))
        if scheduler:
            try:
                controller = controller.replace(scheduler=controller.scheduler.replace(**scheduler))
            except ConfigError as e:
                raise ConfigError(f"--scheduler {', '.join(f'{k}={v}' for k, v in scheduler.items())}: {e}") from None
        return cls(robot=controller.robot, camera=camera, policy_node=policy_node, controller=controller)


class SimRobot:
    """The simulator as the graph sees it: frames of the bundle's cameras (by ROS name) and joint
    states in the robot's units, made into observations by the one observation rule; commands
    in the action layout."""

    def __init__(self, task: str, cameras: tuple[str, ...], robot, sync, height: int, width: int) -> None:
        check_robot(robot)
        layout = TopicLayout()
        ros_to_sim = {layout.ros_camera(c): c for c in CAMERA_NAMES}
        missing = [c for c in cameras if c not in ros_to_sim]
        if missing:
            raise ConfigError(f"the simulator has no camera(s) {', '.join(missing)}; it has {', '.join(sorted(ros_to_sim))}")
        self.cameras = {c: ros_to_sim[c] for c in cameras}  # ROS name -> scene camera
        self.robot = robot
        self.sim = AlohaSim(SimConfig(task=task, cameras=(), height=height, width=width))
        self.builder = ObservationBuilder(tuple(cameras), sync, robot)
        self._episode = 0

    def reset(self, seed: int) -> None:
        self.sim.reset(seed, cameras=())
        self._episode += 1
        self.builder.begin_episode(self._episode)
        self.builder.set_instruction(self.sim.instruction)

    def publish_state(self, stamp_ns: int) -> None:
        """The joint states of this instant, as the robot's topics carry them."""
        for k, (names, pos, _vel) in enumerate(joint_state_messages(self.robot, self.sim.qpos(), self.sim.qvel())):
            self.builder.joint_state(k, names, pos, stamp_ns)

    def measured(self) -> np.ndarray:
        """The state [D] as the controller assembles it (grippers normalized)."""
        st = self.builder.state.assembler.state()
        assert st is not None, "publish_state() first"
        return st[0]

    def observe(self, stamp_ns: int):
        """Render every camera now and return the observation the rule makes of it (or None)."""
        obs = None
        h, w = self.sim.config.height, self.sim.config.width
        for ros, scene in self.cameras.items():
            obs = self.builder.frame(ros, self.sim.render(scene, h, w), stamp_ns, stamp_ns)
        return obs

    def step(self, command: np.ndarray) -> None:
        self.sim.step(command, cameras=())

    @property
    def reward(self) -> float:
        return self.sim.max_reward

    @property
    def success(self) -> bool:
        return self.sim.success

    @property
    def instruction(self) -> str:
        return self.sim.instruction


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    max_reward: float
    inferences: int
    latency_ms: list[float]
    holding_fraction: float
    fine_fraction: float  # control ticks the controller's motion switch spent in fine mode
    # per inference: the motion mode the policy was told, and its prefix statistics' image-token shares
    prefix: list[tuple[str, float, float]] = field(default_factory=list)  # (mode, kept, reused)
    # reasoning bundles: each inference's stats and the ground-truth reasoning of its frame
    reasoning_stats: list = field(default_factory=list)
    reasoning_truths: list = field(default_factory=list)


def landing_ns(latency_model: str, now_ns: int, stamp_ns: int, latency_ms: float) -> int:
    """When a chunk computed at ``now_ns`` reaches the controller, on simulated time: ``zero``,
    the next tick; ``measured``, ``latency_ms`` after its observation's stamp (never before the
    next tick)."""
    if latency_model == "zero":
        return now_ns + 1
    return max(stamp_ns + int(latency_ms * 1e6), now_ns + 1)


def warm_up(robot: SimRobot, run, seed: int) -> None:
    """One untimed inference on ``seed``'s first frame, then a reset: a mode's first call pays
    for lazy work (compiled graphs, oneDNN's weight packing, allocations) that would otherwise
    land in its first episode's latency (and, with ``--latency measured``, delay its first chunk)."""
    robot.reset(seed)
    run.reset()
    robot.publish_state(DT_NS)
    obs = robot.observe(DT_NS)
    if obs is not None:
        if run.pipeline is not None:
            run.pipeline.push(obs)
            run.pipeline.flush()
        else:
            shape = run.policy.noise_shape
            run.policy.infer(obs, noise=None if shape is None else np.zeros(shape, np.float32))
    run.reset()


@dataclass
class _EpisodeLog:
    """What an episode records of its chunks."""

    latencies: list[float] = field(default_factory=list)
    prefix: list[tuple[str, float, float]] = field(default_factory=list)  # (motion mode, kept, reused)
    reasoning: list[dict] = field(default_factory=list)
    truths: list = field(default_factory=list)

    def chunk(self, chunk: ActionChunk, motion_mode: str) -> float:
        """Records a chunk the controller will receive; returns its latency (ms): its compute,
        or a pipelined chunk's compute while its frame was in flight."""
        st = chunk.stats
        ms = float(st.get("staleness_busy_ms", chunk.timings_ms["total"]))
        self.latencies.append(ms)
        self.prefix.append((str(st.get("motion_mode", motion_mode)), float(st.get("tokens_kept_fraction", 1.0)),
                            float(st.get("reuse_fraction", 0.0))))  # fmt: skip
        return ms


def _chunks_now(robot: SimRobot, run, loop: ControlLoop, request, tick: int, now: int, cfg: EvalConfig, rng, log: _EpisodeLog) -> list:
    """The chunks computed at this tick: a pipelined mode pushes an observation every
    ``cfg.stream_every`` ticks (and gets the chunks it completes); any other mode infers once
    when the controller requests a chunk (``request``, the tick's output)."""
    policy, pipe = run.policy, run.pipeline
    if not (tick % cfg.stream_every == 0 if pipe is not None else request is not None):
        return []
    obs = robot.observe(now)
    if obs is None:
        return []
    policy.set_motion_mode(MODE_NAMES[loop.motion.mode])
    if pipe is not None:
        return pipe.push(obs)
    spec = policy.spec
    noise = rng.standard_normal(policy.noise_shape or (spec.chunk_size, spec.action_dim)).astype(np.float32)
    chunk = policy.infer(obs, noise=noise, guidance=request.guidance)
    if "reasoning_text" in chunk.stats:
        log.reasoning.append(chunk.stats)
        log.truths.append(truth_words(cfg.task, tick, obs.state))
    return [chunk]


def run_episode(robot: SimRobot, run, graph: GraphConfigs, seed: int, cfg: EvalConfig) -> EpisodeResult:
    """One closed-loop episode on simulated time, the graph's tick order: the controller's tick
    (:class:`ControlLoop`: scheduler, safety filter, motion switch, request gating) at every
    20 ms step; a requested observation is rendered at that instant (the camera node would have
    announced it); its chunk reaches the controller at the next tick it has arrived by. A
    pipelined mode streams instead (the policy node's ``trigger: pipelined``): every
    ``cfg.stream_every`` ticks an observation goes into the pipeline, and the chunks it completes
    reach the controller like any other (their stale actions are dropped by time)."""
    robot.reset(seed)
    run.reset()
    controller = graph.controller if run.pipeline is None else graph.controller.replace(request_chunks=False)
    loop = ControlLoop(controller)
    now = DT_NS  # as aloha_sim_node: sim time starts one tick in
    robot.publish_state(now)
    target = robot.measured()  # the simulator holds its start pose until commanded
    rng = np.random.default_rng((NOISE_KEY, seed))
    in_flight: list[tuple[int, ActionChunk]] = []  # (arrival time, chunk)
    log = _EpisodeLog()
    fine = 0
    for tick in range(cfg.steps):
        robot.publish_state(now)
        arrived = [c for t, c in in_flight if t <= now]
        in_flight = [(t, c) for t, c in in_flight if t > now]
        out = loop.tick(now, measured=robot.measured(), chunks=arrived, obs_stamp_ns=now)
        fine += loop.motion.mode == FINE
        if out.command is not None:
            target = out.command
        for chunk in _chunks_now(robot, run, loop, out.request, tick, now, cfg, rng, log):
            ms = log.chunk(chunk, MODE_NAMES[loop.motion.mode])
            # zero: the simulator waits for the chunk (aloha_sim_node's policy_sync), so it is in
            # the controller's inbox at the next tick; measured: its observation-to-action latency
            # after its frame (a pipelined chunk: the compute its frame saw while in flight), the
            # renderer's time left out (the simulator's cost, not the policy's).
            in_flight.append((landing_ns(cfg.latency, now, int(chunk.stamp_ns), ms), chunk))
        robot.step(target)
        now += DT_NS
    return EpisodeResult(
        seed, robot.success, robot.reward, len(log.latencies), log.latencies, loop.holding_fraction(), fine / cfg.steps,
        reasoning_stats=log.reasoning, reasoning_truths=log.truths, prefix=log.prefix,
    )  # fmt: skip


# ------------------------------------------------------------------------- through the ROS graph

ROS_GRAPH = "ros_graph"  # report.json: modes.<mode>.ros_graph holds the mode's run through the graph


def graph_params(name: str, cfg: EvalConfig) -> dict[str, Any]:
    """The graph's parameter file (``cfg.params`` or config/aloha.yaml) with the policy node's
    ``policy`` section replaced by mode ``name``'s configuration as the ROS-free path builds it
    (defaults and the mode's fields, not the file's section). ConfigError for a mode the graph
    cannot run."""
    mode = mode_of(name)
    if mode.reference:
        raise ConfigError(
            f"mode {name!r} cannot run through the ROS graph: the policy node runs the engine, not transformers' "
            "reference forward; evaluate it without --through-ros"
        )
    if mode.pipelined:
        raise ConfigError(
            f"mode {name!r} cannot run through the ROS graph here: --through-ros runs request-triggered modes "
            "(the policy node's trigger: request); evaluate pipelined modes without --through-ros"
        )
    defaults = flatten(PolicyConfig())
    policy: dict[str, Any] = {}
    for key, value in flatten(policy_config(mode, cfg)).items():
        if isinstance(value, (list, tuple)) and not value:
            # rcl reads [] as a byte array, so an empty list stays out of the file and the node
            # falls back to the field's default: right only when that default is empty too.
            if defaults[key]:
                raise ConfigError(
                    f"mode {name!r} sets policy.{key} to an empty list, which a ROS parameter file cannot carry "
                    f"(the node would run {list(defaults[key])}); evaluate it without --through-ros"
                )
            continue
        policy[key] = list(value) if isinstance(value, tuple) else value
    params = copy.deepcopy(load_params(cfg.params or default_params_file()))
    section = node_section(params, "policy_node")
    section["policy"] = unflatten(policy)
    if cfg.scheduler_overrides:
        controller = node_section(params, "action_controller_node")
        controller["scheduler"] = {**controller.get("scheduler", {}), **cfg.scheduler_overrides}
    return params


def graph_sim_parameters(cfg: EvalConfig) -> dict[str, Any]:
    """aloha_sim_node's parameters for the evaluation's episodes: same task, seeds, length and
    render size as the ROS-free path. Lockstep with the file's ``command_timeout_ms``: before
    the first chunk the controller holds and commands nothing, so a long timeout would only
    stall those steps (missed ticks are counted in ``lockstep_timeouts``). ``latency="zero"``:
    sim time also holds while a chunk is computed (``policy_sync``), else it runs in real time
    while the policy infers."""
    zero = cfg.latency == "zero"
    return {
        "task": cfg.task, "seed": cfg.seed, "episode_steps": cfg.steps, "height": cfg.height, "width": cfg.width,
        "lockstep": True, "wait_for_policy": True, "auto_reset": True,
        "reset_policy": True, "policy_sync": zero, "policy_timeout_ms": 600_000.0,
        "real_time_factor": 0.0 if zero else 1.0,
    }  # fmt: skip


def summarize_graph_mode(
    episodes: int, summary: dict[str, Any], outcomes: list[bool], inference_ms: list[float], startup_s: float, wall_s: float
) -> dict[str, Any]:
    """``modes.<mode>.ros_graph``: the outcomes the simulator published, its per-episode record
    (seed, best grade) and the policy node's InferenceStats."""
    sim = summary.get("aloha_sim_node") or {}
    pol = summary.get("policy_node") or {}
    per_episode = list(sim.get("episode_results") or [])[:episodes]
    ok = sum(bool(x) for x in outcomes)
    n = len(outcomes)
    return {
        "episodes": n,
        "successes": ok,
        "success_rate": ok / n if n else float("nan"),
        "success_ci95": list(wilson_interval(ok, n)),
        "mean_reward": float(np.mean([e["max_reward"] for e in per_episode])) if per_episode else None,
        # What the policy node computed per chunk (InferenceStats.total_ms): the measure of the
        # ROS-free path's latency_ms; obs_to_chunk_wall_ms adds the graph (camera, request, DDS).
        "latency_ms": distribution(inference_ms) if inference_ms else {"p50": float("nan"), "p95": float("nan")},
        "obs_to_chunk_wall_ms": {"p50": sim.get("obs_to_chunk_wall_p50_ms"), "p95": sim.get("obs_to_chunk_wall_p95_ms")},
        "chunks": len(inference_ms),
        "policy_errors": pol.get("errors"),
        "sim_steps": sim.get("steps"),
        "lockstep_timeouts": sim.get("lockstep_timeouts"),
        "startup_s": round(startup_s, 1),
        "wall_s": round(wall_s, 1),
        "per_episode": per_episode,
    }


# ------------------------------------------------------------------------------ open loop


@dataclass
class Demo:
    seed: int
    frames: list[tuple[int, Any]]  # (step, Observation)
    actions: np.ndarray  # [T, D] the expert's actions


def gate_frames_from_sim(robot: SimRobot, task: str, seed: int) -> tuple[Any, Any] | None:
    """The parity gate's two frames from the task itself: the scene of ``seed`` (GATE_SEED in a
    run) and the scripted expert's frame about GATE_TICKS later (synthetic frames understate what pruning does to a
    trained policy); None when the sim delivered fewer than two."""
    frames = record_demos(robot, task, [seed], 2 * GATE_TICKS + 1, GATE_TICKS)[0].frames
    return (frames[0][1], frames[1][1]) if len(frames) >= 2 else None


def record_demos(robot: SimRobot, task: str, seeds: list[int], steps: int, stride: int) -> list[Demo]:
    """The scripted expert on ``seeds``, rendering every ``stride``-th step only."""
    demos = []
    for seed in seeds:
        robot.reset(seed)
        sim = robot.sim
        expert = ScriptedExpert(task, sim.seed, sim.object_qpos)
        frames, actions = [], []
        for t in range(steps):
            now = (t + 1) * DT_NS
            robot.publish_state(now)
            obs = robot.observe(now) if t % stride == 0 else None
            if obs is not None:
                frames.append((t, obs))
            a = expert.act(t, sim.object_qpos)
            actions.append(a)
            robot.step(a)
        demos.append(Demo(seed, frames, np.asarray(actions, np.float32)))
    return demos


def open_loop_error(policy, demos: list[Demo], lower: np.ndarray, upper: np.ndarray) -> dict[str, Any]:
    """Mean |chunk - expert| over the valid part of every chunk: in the action's units (rad for
    arm joints, normalized for grippers) and as a fraction of each joint's range."""
    errs, firsts = [], []  # firsts: (policy, expert) chunk at each demonstration's first frame
    shape = policy.noise_shape or (policy.spec.chunk_size, policy.spec.action_dim)  # token decoding ignores it
    for demo in demos:
        policy.reset()
        # No controller runs here: the closed loop's last motion mode must not choose how much
        # a pruning mode keeps along the expert's demonstration.
        policy.set_motion_mode("coarse")
        for step, obs in demo.frames:
            noise = np.random.default_rng((demo.seed, step)).standard_normal(shape)
            chunk = policy.infer(obs, noise=noise.astype(np.float32))
            n = min(chunk.horizon, demo.actions.shape[0] - step)
            errs.append(np.abs(chunk.actions[:n] - demo.actions[step : step + n]))  # [n, D]
        if demo.frames and demo.frames[0][0] == 0:
            # The first frame again, with one noise for every demonstration: only the image differs.
            policy.reset()
            same = policy.infer(demo.frames[0][1], noise=np.random.default_rng(0).standard_normal(shape).astype(np.float32))
            n = min(same.horizon, demo.actions.shape[0])
            firsts.append((same.actions[:n], demo.actions[:n]))
    if not errs:
        return {}
    e = np.concatenate(errs)  # [N, D]
    span = np.where(np.isfinite(upper - lower), upper - lower, 1.0)
    per_joint = e.mean(0)
    return {
        "mean_abs_rad": float(per_joint.mean()),
        "mean_abs_range_fraction": float((per_joint / span).mean()),
        "first_action_mean_abs": float(np.mean([x[0].mean() for x in errs])),
        "per_joint_mean_abs": [round(float(x), 5) for x in per_joint],
        "chunks": len(errs),
        "first_chunk": _first_chunk_spread(firsts),
        "note": "grippers in normalized units (0 closed, 1 open); arm joints in rad",
    }


def _first_chunk_spread(firsts: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Does the policy look at the scene? At an episode's first frame the arm is at its home pose
    on every seed, so only the image says where the object is: the spread of the policy's first
    chunks across demonstrations (mean |chunk - their mean|) next to the expert's. A policy that
    predicts the expert from the joint state alone (the scripted expert's shortcut) has ~0 here.

    A spread alone does not say the chunks vary the right way, so ``slope`` and ``corr`` regress
    the policy's deviations from its mean first chunk on the expert's, over every action of every
    joint: 1 when the first chunk moves with the object as the expert's does, ~0 when it goes
    where the object usually is whatever the image shows (the shipped SmolVLA bundle, whose
    closed loop then misses cubes away from the middle: docs/policy-experiments.md)."""
    n = min((len(p) for p, _ in firsts), default=0)
    if len(firsts) < 2 or n == 0:
        return {}
    pol = np.stack([p[:n] for p, _ in firsts]).astype(np.float64)
    exp = np.stack([e[:n] for _, e in firsts]).astype(np.float64)
    dp, de = pol - pol.mean(0), exp - exp.mean(0)
    cov, var_e, var_p = float((dp * de).sum()), float((de * de).sum()), float((dp * dp).sum())
    return {
        "policy_spread": float(np.abs(dp).mean()),
        "expert_spread": float(np.abs(de).mean()),
        "mean_abs": float(np.abs(pol - exp).mean()),
        "slope": cov / var_e if var_e > 0 else None,
        "corr": cov / np.sqrt(var_e * var_p) if var_e > 0 and var_p > 0 else None,
        "demos": len(firsts),
    }


# ---------------------------------------------------------------------------------- the run


def run_eval(cfg: EvalConfig, *, progress: bool = True, command: str = "") -> dict[str, Any]:
    cfg.validate()
    names = eval_modes(list(cfg.modes))
    graph = GraphConfigs.load(cfg.params, cfg.scheduler_overrides)
    bundle = load_bundle(cfg.bundle)
    spec = bundle.spec
    # The bundle's scale made explicit: the report says what ran, and LeRobot is handed the same.
    cfg = replace(cfg, noise_scale=PolicyConfig(flow_noise_scale=cfg.noise_scale).noise_scale(spec.noise_scale))
    if tuple(spec.joint_names) != tuple(graph.robot.joint_names):
        raise ConfigError(f"bundle {spec.name} joints {list(spec.joint_names)} differ from robot.joint_names")
    robot = SimRobot(cfg.task, tuple(spec.cameras), graph.robot, graph.sync(spec.frame_size), cfg.height, cfg.width)
    seeds = [cfg.seed + i for i in range(cfg.episodes)]
    gate = gate_frames_from_sim(robot, cfg.task, GATE_SEED) if cfg.parity_check else None
    refused: dict[str, str] = {}  # modes the gate refuses: reported, the others still run
    runs = build_runs(bundle, [n for n in names if n != LEROBOT], cfg, gate_observations=gate, refused=refused)
    names = [n for n in names if n not in refused and (cfg.run_baseline or n != BASELINE)]
    runs = [r for r in runs if r.name in names]  # the baseline is built all the same: the other modes share its weights
    if LEROBOT in names:
        from vla_accel_ros.bench.lerobot_eval import lerobot_run

        runs.insert(names.index(LEROBOT), lerobot_run(cfg.bundle, spec, cfg.lerobot, cfg.lerobot_python, cfg.num_threads, cfg.noise_scale))
    lo, hi = (graph.safety.lower, graph.safety.upper) if graph.safety.lower else default_limits(graph.robot)
    # The demonstrations' seeds start at the episodes' and may outnumber them: `--episodes 1
    # --open-loop-episodes 80 --open-loop-stride 300` is a minute's check of the first chunks.
    demos = record_demos(robot, cfg.task, [cfg.seed + i for i in range(cfg.open_loop_episodes)], cfg.steps, cfg.open_loop_stride)
    modes: dict[str, Any] = {}
    total = len(runs) * len(seeds)
    bar = tqdm(total=total, desc="eval", unit="episode", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        with bar:
            for r in runs:
                results = []
                warm_up(robot, r, seeds[0])
                for seed in seeds:
                    res = run_episode(robot, r, graph, seed, cfg)
                    results.append(res)
                    bar.update(1)
                    ok = sum(x.success for x in results)
                    bar.set_postfix_str(f"{r.name}: {ok}/{len(results)} success")
                ol = open_loop_error(r.policy, demos, np.asarray(lo), np.asarray(hi))
                modes[r.name] = summarize_mode(r, results, ol, cfg.task)
    finally:
        for r in runs:
            if hasattr(r.policy, "close"):
                r.policy.close()  # the lerobot mode's worker process
    base_p50 = modes[BASELINE]["latency_ms"]["p50"] if BASELINE in modes else None
    ref_p50 = modes[LEROBOT]["latency_ms"]["p50"] if LEROBOT in modes else None
    for name, m in modes.items():
        if base_p50 is not None:
            m["speedup_vs_baseline"] = float(base_p50 / m["latency_ms"]["p50"]) if m["latency_ms"]["p50"] else None
        if ref_p50:
            m["speedup_vs_lerobot"] = float(ref_p50 / m["latency_ms"]["p50"]) if m["latency_ms"]["p50"] else None
        if name != BASELINE and BASELINE in modes:
            m["paired_vs_baseline"] = paired_vs_baseline(modes[BASELINE]["per_episode"], m["per_episode"], cfg.task)
    return {
        "schema": SCHEMA,
        "command": command,
        "task": cfg.task,
        "bundle": {"name": spec.name, "path": str(cfg.bundle), "family": spec.family, "chunk_size": spec.chunk_size},
        "episodes": cfg.episodes,
        "seeds": seeds,
        "steps": cfg.steps,
        "latency_model": cfg.latency,
        "scheduler": graph.scheduler.to_dict(),
        "mode_order": names,
        "refused": refused,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine_info(),
        "modes": modes,
    }


def prefix_summary(prefix: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Image tokens kept (not pruned) and reused over a mode's inferences, overall and by the
    motion mode each inference ran in (velocity-aware pruning keeps more in fine motion); the
    means are over token-layers, as the replay's ``tokens_kept_fraction``."""
    if not prefix:
        return {}
    out: dict[str, Any] = {}
    for key, col in (("tokens_kept_fraction", 1), ("reuse_fraction", 2)):
        out[key] = {"mean": float(np.mean([p[col] for p in prefix]))}
        for motion in ("coarse", "fine"):
            vals = [p[col] for p in prefix if p[0] == motion]
            out[key][motion] = float(np.mean(vals)) if vals else None
    out["inferences_by_motion"] = {m: sum(p[0] == m for p in prefix) for m in ("coarse", "fine")}
    return out


def summarize_mode(run, results: list[EpisodeResult], open_loop: dict[str, Any], task: str) -> dict[str, Any]:
    n = len(results)
    ok = sum(r.success for r in results)
    lat = [x for r in results for x in r.latency_ms]
    precision = getattr(run.policy, "precision", None)  # what ran (auto resolved, a refused candidate passed over)
    gate = getattr(run.policy, "parity_report", None)
    return {
        "doc": run.mode.doc,
        "policy_config": run.config,
        "precision": None if precision is None else precision.label(),
        "parity_gate": None if gate is None else {"metrics": dict(gate.metrics), "notes": list(gate.notes)},
        "episodes": n,
        "successes": ok,
        "success_rate": ok / n,
        "success_ci95": list(wilson_interval(ok, n)),
        "mean_reward": float(np.mean([r.max_reward for r in results])),
        "stages": stage_summary([r.max_reward for r in results], task),
        "latency_ms": distribution(lat) if lat else {"p50": float("nan"), "p95": float("nan")},
        "inferences_per_episode": float(np.mean([r.inferences for r in results])),
        "holding_fraction": float(np.mean([r.holding_fraction for r in results])),
        "fine_fraction": float(np.mean([r.fine_fraction for r in results])),
        **prefix_summary([p for r in results for p in r.prefix]),
        "open_loop_error": open_loop,
        "per_episode": [{"seed": r.seed, "success": r.success, "max_reward": r.max_reward} for r in results],
        # reasoning bundles: reuse and agreement with the simulator's ground truth (closed loop:
        # agreement with full regeneration needs the same frames, see replay)
        **(reasoning_summary([s for r in results for s in r.reasoning_stats], [t for r in results for t in r.reasoning_truths], None)
           if any(r.reasoning_stats for r in results) else {}),
    }
