"""Scripted episodes as a stream of per-step frames, the unit a recorder writes.

A frame is what a robot logger sees at one control tick: the observation taken at ``time``
(images, joint state) and the action commanded from it; ``reward``/``success`` describe the
state after that action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import ALOHA_GRIPPERS
from vla_accel_ros.sim.aloha import DT, EPISODE_STEPS, TASKS, AlohaSim, EpisodeResult, SimConfig, SimError, sample_object_qpos
from vla_accel_ros.sim.scripted import ScriptedExpert, TransferCubeScript


@dataclass(frozen=True)
class ActionNoise(Config):
    """Noise added to the commands a scripted recording executes, not to the actions it records.

    Behaviour cloning sees only the expert's own states, so a policy that drifts off them has
    never seen a correction (DART, Laskey et al. 2017). With ``std`` > 0 each arm joint's command
    carries an offset drawn from N(0, std) and held for ``hold`` ticks; the arm follows the noisy
    command, the cameras and joint states show it off the path, and the recorded action stays the
    expert's, which leads back to it. Grippers get none (a gripper offset drops the cube).

    A draw that makes the expert fail would teach a failed task, so each draw is first played
    without rendering (the physics is deterministic: the rendered episode is the same one) and
    the next draw is tried, up to ``attempts``; then the episode is recorded without noise.
    On transfer_cube (30 seeds each): std 0.01 keeps 30/30, 0.02 28/30, 0.03 21/30 of the draws.
    """

    std: float = param(0.0, doc="standard deviation of each arm joint's command offset in rad (0: none)", range=(0.0, 0.1))
    hold: int = param(25, doc="ticks each offset is held before the next is drawn (25 = 0.5 s)", range=(1, 10_000))
    attempts: int = param(5, doc="noise draws tried per episode before it is recorded without noise", range=(1, 100))

    def offsets(self, seed: int, attempt: int, steps: int) -> np.ndarray:
        """[steps, 14] the command offsets of one draw (a function of seed and attempt)."""
        rng = np.random.default_rng([seed, attempt])
        held = rng.normal(0.0, self.std, size=(-(-steps // self.hold), 14))
        held[:, ALOHA_GRIPPERS] = 0.0
        return np.repeat(held, self.hold, axis=0)[:steps]


@dataclass(frozen=True)
class Detour(Config):
    """Recovery demonstrations: the expert first reaches for a decoy, then turns to the cube.

    A policy that reads where its arm is going from the arm in the images reaches for where the
    cube usually is; once off, it has never seen the arm anywhere but over the cube, so nothing
    tells it to turn (docs/policy-experiments.md). With ``first`` > 0 the right arm of each
    transfer_cube episode heads for a decoy drawn from the cube's own range (at least
    ``min_offset`` from the cube) until a switch tick drawn from ``first..last``, then for the
    cube, its later schedule delayed as far as the turn needs. Nothing before the switch is
    rendered (its actions lead to the decoy and must not be learnt): each episode's frames start
    at the switch, with the arm somewhere off the cube and actions that bring it there. Like
    :class:`ActionNoise`, each draw is played without rendering first and the next is tried when
    the expert fails, up to ``attempts``; then the episode is recorded without a detour.
    """

    first: int = param(0, doc="earliest switch tick (0: no detour)", range=(0, TransferCubeScript.latest_switch))
    last: int = param(0, doc="latest switch tick (>= first)", range=(0, TransferCubeScript.latest_switch))
    min_offset: float = param(0.04, doc="least distance of the decoy from the cube in m", range=(0.0, 0.2))
    attempts: int = param(5, doc="draws tried per episode before it is recorded without a detour", range=(1, 100))

    def validate(self) -> None:
        if self.first > self.last or (self.last > 0 and self.first == 0):
            raise ConfigError(f"detour ticks first={self.first}, last={self.last}: need 1 <= first <= last "
                              f"<= {TransferCubeScript.latest_switch}, or both 0 (no detour)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.first > 0

    def draw(self, seed: int, attempt: int, cube_xy: np.ndarray) -> tuple[np.ndarray, int]:
        """(decoy xy, switch tick) of one draw, a function of seed and attempt."""
        rng = np.random.default_rng([seed, attempt, 1])
        box = TASKS["transfer_cube"].object_range
        for _ in range(1000):  # rejection sampling: the decoy's range is a 20 x 20 cm square
            decoy = np.array([rng.uniform(*box["x"]), rng.uniform(*box["y"])])
            if np.linalg.norm(decoy - cube_xy) >= self.min_offset:
                break
        return decoy, int(rng.integers(self.first, self.last + 1))


@dataclass
class Frame:
    """One control tick of a scripted episode.

    images: camera -> [H, W, 3] uint8 (sim camera names); qpos, qvel, action: [14] float64.
    action is the expert's (with :class:`ActionNoise`, the arm was sent it plus the draw's offset).
    time: sim seconds since the episode's reset; step: tick index within the episode.
    done: last frame of the episode; success: the episode reached full reward so far.
    """

    episode: int
    seed: int
    step: int
    time: float
    images: dict[str, np.ndarray]
    qpos: np.ndarray
    qvel: np.ndarray
    action: np.ndarray
    reward: float
    success: bool
    done: bool
    instruction: str


def check_rendering(render_every: int, render_first: int) -> None:
    """Refuse a rendering rule that is negative or renders nothing (see :func:`scripted_episode_frames`)."""
    if render_every < 0 or render_first < 0 or render_every == render_first == 0:
        raise SimError(
            f"render_every and render_first must be >= 0 and not both 0 (that renders nothing), got {render_every} and {render_first}"
        )


def scripted_episode_frames(
    sim: AlohaSim,
    seed: int,
    steps: int = EPISODE_STEPS,
    cameras: Sequence[str] | None = None,
    episode: int = 0,
    render_every: int = 1,
    noise: ActionNoise | None = None,
    render_first: int = 0,
    detour: Detour | None = None,
) -> Iterator[Frame]:
    """Reset ``sim`` with ``seed`` and yield ``steps`` frames of the task's scripted expert.

    ``noise`` (std > 0): the executed commands carry a draw of :class:`ActionNoise` that the
    expert still completes; each frame's ``action`` stays the expert's (the label).

    cameras: rendered per frame (None: the sim config's). Rendering dominates the cost
    (~15 frames/s for one 640x480 camera on a CPU); the expert itself is ~1 ms a step.
    ``render_every`` > 1 renders only every that many ticks (the others carry no images, but
    their joint states and actions); the phase shifts with ``episode`` so that a recording
    covers every tick modulo ``render_every``. ``render_first`` > 0 also renders every tick
    before that one; 1 renders tick 0, the arm at home on every seed, where only the object says
    where the chunk goes (the phase gives it to one episode in ``render_every``; later ticks show
    the arm's first motion, which a policy learns to follow instead: docs/policy-experiments.md).
    ``render_every`` 0 renders only the ticks before ``render_first``: with 1, one frame per
    episode, its tick 0, and the actions after it (many scenes for the cost of one render each).

    ``detour`` (enabled): the expert first reaches for a decoy (:class:`Detour`); nothing is
    rendered before its switch tick, from which both rendering rules count instead of tick 0.
    """
    if steps < 1:
        raise SimError(f"steps must be >= 1, got {steps}")
    check_rendering(render_every, render_first)
    if detour is not None and detour.enabled and noise is not None and noise.std > 0:
        raise SimError("a recording takes either command noise or detours, not both")
    offsets = _completed_draw(sim, seed, steps, noise) if noise is not None and noise.std > 0 else None
    plan = _completed_detour(sim, seed, steps, detour) if detour is not None and detour.enabled else None
    start = 0 if plan is None else plan[1]
    phase = start + (episode % render_every if render_every else 0)

    def cams_at(t: int) -> Sequence[str] | None:
        periodic = render_every > 0 and t >= start and (t - phase) % render_every == 0
        return cameras if t < steps and (start <= t < start + render_first or periodic) else ()

    obs = sim.reset(seed, cameras=cams_at(0))
    expert = ScriptedExpert(sim.config.task, sim.seed, sim.object_qpos, plan)
    for t in range(steps):
        action = expert.act(t, sim.object_qpos)
        nxt = sim.step(action if offsets is None else action + offsets[t], cameras=cams_at(t + 1))
        yield Frame(
            episode=episode,
            seed=sim.seed,
            step=t,
            time=obs.time,
            images=obs.images,
            qpos=obs.qpos,
            qvel=obs.qvel,
            action=action,
            reward=nxt.reward,
            success=nxt.success,
            done=t + 1 == steps,
            instruction=sim.instruction,
        )
        obs = nxt


def _completes(sim: AlohaSim, seed: int, steps: int, offsets: np.ndarray | None = None, plan=None) -> bool:
    """Whether the expert (with ``plan``, a detour) completes the episode with the commands
    offset by ``offsets``, played on ``sim`` without rendering (the caller resets it after)."""
    sim.reset(seed, cameras=())
    expert = ScriptedExpert(sim.config.task, sim.seed, sim.object_qpos, plan)
    try:
        for t in range(steps):
            action = expert.act(t, sim.object_qpos)
            sim.step(action if offsets is None else action + offsets[t], cameras=())
    except SimError:  # a large offset can make MuJoCo diverge: not a usable draw
        return False
    return sim.success


def _completed_draw(sim: AlohaSim, seed: int, steps: int, noise: ActionNoise) -> np.ndarray | None:
    """The first of ``noise.attempts`` draws whose episode the expert completes; None when none does."""
    draws = (noise.offsets(seed, attempt, steps) for attempt in range(noise.attempts))
    return next((offsets for offsets in draws if _completes(sim, seed, steps, offsets=offsets)), None)


def _completed_detour(sim: AlohaSim, seed: int, steps: int, detour: Detour) -> tuple[np.ndarray, int] | None:
    """The first of ``detour.attempts`` (decoy, switch) draws whose episode the expert completes; None when none does."""
    cube_xy = sample_object_qpos(sim.config.task, seed)[:2]
    plans = (detour.draw(seed, attempt, cube_xy) for attempt in range(detour.attempts))
    return next((plan for plan in plans if _completes(sim, seed, steps, plan=plan)), None)


@dataclass
class ScriptedTrajectory:
    """A scripted demonstration in joint space.

    actions: [T, 14] joint-position actions (grippers normalized); ``AlohaSim.reset(seed)``
    followed by these actions reproduces ``result``.
    """

    task: str
    seed: int
    actions: np.ndarray
    result: EpisodeResult


def scripted_trajectory(task: str, seed: int, steps: int = EPISODE_STEPS) -> ScriptedTrajectory:
    """Script one demonstration without rendering (about 0.3 s per 300 steps)."""
    sim = AlohaSim(SimConfig(task=task, cameras=()))
    frames = list(scripted_episode_frames(sim, seed, steps))
    actions = np.stack([f.action for f in frames]).astype(np.float64)  # [T, 14]
    result = EpisodeResult(task, sim.seed, steps, sim.max_reward, sim.reward, [f.reward for f in frames])
    return ScriptedTrajectory(task, sim.seed, actions, result)


def scripted_frames(
    task: str,
    episodes: int,
    seed: int = 0,
    steps: int = EPISODE_STEPS,
    cameras: Sequence[str] = ("top",),
    height: int = 480,
    width: int = 640,
    render_every: int = 1,
    noise: ActionNoise | None = None,
    render_first: int = 0,
    detour: Detour | None = None,
) -> Iterator[Frame]:
    """Frames of ``episodes`` scripted episodes, episode i seeded ``seed + i`` (images every
    ``render_every`` ticks and each before ``render_first``, commands with ``noise``, a
    ``detour`` first, see :func:`scripted_episode_frames`)."""
    if episodes < 1:
        raise SimError(f"episodes must be >= 1, got {episodes}")
    sim = AlohaSim(SimConfig(task=task, cameras=tuple(cameras), height=height, width=width))
    for i in range(episodes):
        yield from scripted_episode_frames(sim, seed + i, steps, cameras=None, episode=i, render_every=render_every, noise=noise,
                                           render_first=render_first, detour=detour)  # fmt: skip


__all__ = ["DT", "ActionNoise", "Detour", "Frame", "ScriptedTrajectory", "scripted_episode_frames", "scripted_frames", "scripted_trajectory"]
