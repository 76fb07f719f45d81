"""The live simulator loop without ROS: what ``aloha_sim_node`` runs on its physics thread.

:class:`SimRunner` steps the simulated ALOHA on sim time and decides when sim time may move:

* pause: sim time holds at its start until the policy is ready (``wait_for_policy``), and at an
  episode's end when ``auto_reset`` is off, until a reset is asked for; while paused the robot
  state goes out every ``PAUSED_PUBLISH_S`` so the graph still sees a robot;
* lockstep: each step waits (up to ``command_timeout_ms`` of wall time) for the controller's
  command of the current tick;
* policy sync: sim time also holds while a chunk request is unanswered (``policy_sync``);
* episodes: ``episode_steps`` steps each, seeds ``seed + i``, the outcome at the last tick,
  the next episode's marker and instruction after its first state;
* pacing: at most ``real_time_factor`` sim seconds per wall second.

It publishes nothing itself: the node hands it a :class:`SimOutputs` (publish callbacks) and
feeds it the graph's inputs (commands through :meth:`SimRunner.command`, readiness, chunk
requests and answers, resets). The physics and rendering run on the runner's own thread (the
OpenGL context belongs to the thread that created it); the input methods only record.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import CommandConfig, RobotConfig
from vla_accel_ros.sim.aloha import ACTION_DIM, CAMERA_NAMES, EPISODE_STEPS, MAX_HEIGHT, MAX_WIDTH, TASK_NAMES, SimError
from vla_accel_ros.sim.live import DT_NS, EpisodeStats, LatencyTracker, Pacer, place_arms, render_every
from vla_accel_ros.sim.robot_io import SIM_BACKENDS, CommandDecoder

PAUSED_PUBLISH_S = 0.2  # while paused: clock and joint states this often, so the graph sees a robot


@dataclass(frozen=True)
class LiveSimConfig(Config):
    task: str = param("transfer_cube", doc="simulated task", choices=TASK_NAMES, read_only=True)
    seed: int = param(0, doc="object placement of the first episode; episode i uses seed + i", range=(0, 2**31 - 1))
    cameras: tuple[str, ...] = param(
        ("top",), doc="scene cameras to publish (the scene's names)", choices=CAMERA_NAMES, read_only=True
    )
    camera_topics: tuple[str, ...] = param(
        (), doc="one sensor_msgs/Image topic per camera; empty: the ALOHA layout of `sim record` "
        "(top -> cam_high/camera/color/image_rect_raw, ..., under the node's namespace)", read_only=True,
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
            raise ConfigError(f"LiveSimConfig.cameras must be unique and non-empty, got {list(self.cameras)}")
        if self.camera_topics and len(self.camera_topics) != len(self.cameras):
            raise ConfigError(f"camera_topics has {len(self.camera_topics)} entries for {len(self.cameras)} cameras")
        if self.start_pose and len(self.start_pose) != ACTION_DIM:
            raise ConfigError(f"start_pose needs {ACTION_DIM} values or none, got {len(self.start_pose)}")
        if self.command.backend not in SIM_BACKENDS:
            raise ConfigError(
                f"command.backend={self.command.backend} cannot drive the simulator (it needs inverse kinematics); "
                f"use one of {', '.join(SIM_BACKENDS)}"
            )

    @property
    def messages_per_tick(self) -> int:
        """Command messages the controller sends per tick (interbotix: a group and a single per arm)."""
        return 2 * len(self.robot.arms) if self.command.backend == "interbotix" else 1


class SimOutputs(Protocol):
    """What the runner publishes, through the node. ``stamp``: the header stamp (sim time, or
    the node's clock without ``publish_clock``); ``t_ns``: sim time."""

    def frames(self, images: dict[str, np.ndarray], stamp: int) -> None: ...
    def joint_states(self, qpos: np.ndarray, qvel: np.ndarray, stamp: int) -> None: ...
    def clock(self, t_ns: int) -> None: ...
    def action(self, target: np.ndarray, stamp: int) -> None: ...
    def episode_marker(self, episode: int) -> None: ...
    def instruction(self, text: str) -> None: ...
    def outcome(self, success: bool) -> None: ...
    def reset_policy(self) -> None: ...
    def watched_cameras(self) -> list[str]: ...  # cameras someone subscribes to (rendering is costly)
    def now(self) -> int: ...  # the node's clock, ns (stamps without publish_clock)
    def log(self, level: str, text: str) -> None: ...  # level: info | warning | error


def _aloha_sim(cfg: LiveSimConfig) -> Any:
    from vla_accel_ros.sim.aloha import AlohaSim, SimConfig  # noqa: PLC0415 - dm_control loads here

    return AlohaSim(SimConfig(task=cfg.task, cameras=cfg.cameras, height=cfg.height, width=cfg.width))


class SimRunner:
    def __init__(
        self,
        config: LiveSimConfig,
        outputs: SimOutputs,
        *,
        take_config: Callable[[], LiveSimConfig | None] = lambda: None,
        make_sim: Callable[[LiveSimConfig], Any] = _aloha_sim,
    ) -> None:
        """``take_config``: an accepted parameter change, or None (asked once per loop);
        ``make_sim``: builds the simulator on the runner's thread (the GL context lives there)."""
        self.cfg = config
        self.out = outputs
        self._take_config, self._make_sim = take_config, make_sim
        self.decoder = CommandDecoder(config.robot)  # ConfigError: a robot the sim does not have
        # -- inputs: the node's callbacks record; the loop reads under _cond --------------------
        self._cond = threading.Condition()
        self._commands = 0  # command messages applied
        self._cmd_stamp = -1  # newest stamped command (joint_state backend)
        self._ready = False
        self._requested = 0  # newest chunk request id seen
        self._answered = 0  # newest request id a chunk answered
        self._reset_requested = False
        self._sim_now = 0  # newest published sim time, ns
        self._lockstep_mark = 0  # commands applied when the current tick was published
        self._task_instruction = ""
        self.latency = LatencyTracker()
        # -- statistics (the loop writes, summary reads) ------------------------------------------
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
        self._thread: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self, name: str = "sim-physics", timeout_s: float = 300.0) -> None:
        """Start the physics thread; returns once the first episode's state is out, or raises
        what stopped the simulator from starting."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout=timeout_s):
            self.close()
            raise SimError(f"the simulator did not start within {timeout_s:g} s")
        if self._start_error is not None:
            self._thread.join(timeout=10.0)
            raise self._start_error

    def close(self) -> None:
        """Stop the physics thread (it frees its GL context on the way out)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        t = self._thread
        if t is not None and t.is_alive() and threading.current_thread() is not t:
            t.join(timeout=10.0)

    # -- inputs (any thread) ------------------------------------------------------------------------
    def command(self, apply: Callable[[CommandDecoder], object], stamp_ns: int = -1) -> None:
        """One command message, applied to the held target by ``apply(decoder)``; a malformed one
        raises :class:`~vla_accel_ros.sim.robot_io.CommandError` and changes nothing."""
        with self._cond:
            apply(self.decoder)
            self._commands += 1
            if stamp_ns > 0:
                self._cmd_stamp = max(self._cmd_stamp, stamp_ns)
            self._cond.notify_all()

    @property
    def sim_now(self) -> int:
        return self._sim_now

    def set_ready(self, ready: bool) -> None:
        with self._cond:
            self._ready = bool(ready)
            self._cond.notify_all()

    def requested(self, request_id: int) -> None:
        with self._cond:
            self._requested = max(self._requested, int(request_id))
            self._cond.notify_all()

    def answered(self, request_id: int, stamp_ns: int) -> None:
        """A chunk arrived for the request ``request_id``, computed from the frame ``stamp_ns``."""
        self.latency.chunk(stamp_ns, self._sim_now, time.monotonic_ns())
        with self._cond:
            self._answered = max(self._answered, int(request_id))
            self._cond.notify_all()

    def request_reset(self) -> None:
        with self._cond:
            self._reset_requested = True
            self._cond.notify_all()

    @property
    def waiting_for_policy(self) -> bool:
        return self.cfg.wait_for_policy and not self._ready

    # -- the physics thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            sim = self._make_sim(self.cfg)
        except BaseException as e:  # noqa: BLE001 - not swallowed: start() raises it in the caller's thread
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
            self._start_error = error  # start() raises it: the node does not start
        self.failure = str(error)
        self.out.log("error", f"the simulator stopped: {text}")

    def _loop(self, sim: Any) -> None:
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
            cfg = self._apply_config(pacer)
            ended = bool(cfg.episode_steps) and self.episodes.step >= cfg.episode_steps
            if ended and episode_open:  # its outcome goes out at its last tick
                self._end_episode()
                episode_open = False
            with self._cond:
                ready, reset_asked = self._ready, self._reset_requested
            if (cfg.wait_for_policy and not ready) or (ended and not cfg.auto_reset and not reset_asked):
                if not waiting_logged and not ended:
                    waiting_logged = True
                    self.out.log("info", "holding sim time until policy_node/ready (wait_for_policy)")
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
                if episode_open:  # a reset during an episode ends it
                    self._end_episode()
                t += DT_NS  # the reset takes one tick: every published state has its own stamp
                obs = self._begin_episode(sim, t)
                self._publish_state(obs, t)
                self._announce_episode()
                episode_open = True
                continue
            with self._cond:
                target = self.decoder.target_at(t + DT_NS)
            self.out.action(target, self._stamp(t))
            every = render_every(cfg.camera_rate_hz)
            cams = [c for c in self.out.watched_cameras() if (self.steps + 1) % every == 0]
            obs = sim.step(target, cameras=cams)
            t += DT_NS
            self.steps += 1
            self.episodes.after_step(obs.reward, obs.success)
            self._publish_state(obs, t)
            pacer.wait(t / 1e9, self._stop)

    def _apply_config(self, pacer: Pacer) -> LiveSimConfig:
        new = self._take_config()
        if new is not None:
            self.cfg = new
            pacer.set_rate(new.real_time_factor)
            if new.publish_instruction:
                self.out.instruction(self._instruction_text)
            self.out.log("info", "parameters applied")
        return self.cfg

    def _wait_for_graph(self, cfg: LiveSimConfig, t: int) -> None:
        """Lockstep: wait for the controller's command of tick ``t``; policy sync: for the chunk
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
            mark, per_tick = self._lockstep_mark, cfg.messages_per_tick
            done = (lambda: self._cmd_stamp >= t) if stamped else (lambda: self._commands >= mark + per_tick)
            if self._cond.wait_for(lambda: done() or self._stop.is_set(), cfg.command_timeout_ms / 1e3):
                self.commands_at_step += 1
            else:
                self.lockstep_timeouts += 1

    # -- episodes -----------------------------------------------------------------------------------
    @property
    def _instruction_text(self) -> str:
        return self.cfg.instruction or self._task_instruction

    def _begin_episode(self, sim: Any, t: int, first: bool = False) -> Any:
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
        if cfg.reset_policy and not first:
            self.out.reset_policy()  # the policy clears its caches before the next inference
        self.out.log("info", f"episode {index} (seed {seed}) at sim time {t / 1e9:.2f} s")
        cams = self.out.watched_cameras()
        return sim.observe(cameras=cams) if cams else obs

    def _announce_episode(self) -> None:
        """The episode marker and the instruction, after the episode's first state and clock:
        a recorder dates them (no header) by its sim clock, which then reads the first tick."""
        self.out.episode_marker(self.episodes.episode)
        if self.cfg.publish_instruction:
            self.out.instruction(self._instruction_text)

    def _end_episode(self) -> None:
        e = self.episodes
        self.out.outcome(bool(e.success))
        e.end()
        self.out.log(
            "info",
            f"episode {e.episode} ended after {e.step} steps: {'success' if e.success else 'no success'} "
            f"(best reward {e.max_reward:g})",
        )

    # -- publishing -----------------------------------------------------------------------------------
    def _stamp(self, t: int) -> int:
        return t if self.cfg.publish_clock else self.out.now()

    def _publish_state(self, obs: Any, t: int, render: bool = True) -> None:
        """Frames, joint states, then the clock: a node woken by the clock finds the state of
        that tick already delivered."""
        stamp = self._stamp(t)
        if render and obs.images:
            self.latency.published(stamp, time.monotonic_ns())
            self.out.frames(obs.images, stamp)
            self.frames += len(obs.images)
            self.frames_by_camera.update(obs.images.keys())
        self.out.joint_states(obs.qpos, obs.qvel, stamp)
        with self._cond:
            self._sim_now = t
            self._lockstep_mark = self._commands
        if self.cfg.publish_clock:
            self.out.clock(t)

    # -- statistics -----------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        with self._cond:
            self._stats0 = (self.steps, self._sim_now, time.monotonic(), self._commands)
        self.frames = self.commands_at_step = self.lockstep_timeouts = self.policy_waits = 0
        self.frames_by_camera.clear()
        self.latency.reset()
        self.episodes.reset_counts()

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
            "episode_results": list(e.results),
            "failure": self.failure,
        }
