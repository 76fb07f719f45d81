"""Scripted episodes as a stream of per-step frames, the unit a recorder writes.

A frame is what a robot logger sees at one control tick: the observation taken at ``time``
(images, joint state) and the action commanded from it; ``reward``/``success`` describe the
state after that action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from vla_accel_ros.sim.aloha import DT, EPISODE_STEPS, AlohaSim, EpisodeResult, SimConfig, SimError
from vla_accel_ros.sim.scripted import ScriptedExpert


@dataclass
class Frame:
    """One control tick of a scripted episode.

    images: camera -> [H, W, 3] uint8 (sim camera names); qpos, qvel, action: [14] float64.
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


def scripted_episode_frames(
    sim: AlohaSim,
    seed: int,
    steps: int = EPISODE_STEPS,
    cameras: Sequence[str] | None = None,
    episode: int = 0,
    render_every: int = 1,
) -> Iterator[Frame]:
    """Reset ``sim`` with ``seed`` and yield ``steps`` frames of the task's scripted expert.

    cameras: rendered per frame (None: the sim config's). Rendering dominates the cost
    (~15 frames/s for one 640x480 camera on a CPU); the expert itself is ~1 ms a step.
    ``render_every`` > 1 renders only every that many ticks (the others carry no images, but
    their joint states and actions); the phase shifts with ``episode`` so that a recording
    covers every tick modulo ``render_every``.
    """
    if steps < 1:
        raise SimError(f"steps must be >= 1, got {steps}")
    if render_every < 1:
        raise SimError(f"render_every must be >= 1, got {render_every}")
    phase = episode % render_every

    def cams_at(t: int) -> Sequence[str] | None:
        return cameras if t < steps and (t - phase) % render_every == 0 else ()

    obs = sim.reset(seed, cameras=cams_at(0))
    expert = ScriptedExpert(sim.config.task, sim.seed, sim.object_qpos)
    for t in range(steps):
        action = expert.act(t, sim.object_qpos)
        nxt = sim.step(action, cameras=cams_at(t + 1))
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
) -> Iterator[Frame]:
    """Frames of ``episodes`` scripted episodes, episode i seeded ``seed + i`` (images every
    ``render_every`` ticks, see :func:`scripted_episode_frames`)."""
    if episodes < 1:
        raise SimError(f"episodes must be >= 1, got {episodes}")
    sim = AlohaSim(SimConfig(task=task, cameras=tuple(cameras), height=height, width=width))
    for i in range(episodes):
        yield from scripted_episode_frames(sim, seed + i, steps, cameras=None, episode=i, render_every=render_every)


__all__ = ["DT", "Frame", "ScriptedTrajectory", "scripted_episode_frames", "scripted_frames", "scripted_trajectory"]
