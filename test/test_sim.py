"""The ROS-free ALOHA simulator and its scripted demonstrations, on the real MuJoCo scenes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")

from vla_accel_ros.core.errors import ConfigError  # noqa: E402
from vla_accel_ros.sim import (  # noqa: E402
    DT,
    ActionNoise,
    AlohaSim,
    Detour,
    ScriptedExpert,
    SimConfig,
    SimError,
    sample_object_qpos,
    scripted_episode_frames,
    scripted_trajectory,
)

START_ARM = np.array([0.0, -0.96, 1.16, 0.0, -0.3, 0.0])
H, W = 48, 64  # small renders keep the suite fast on a CPU


@pytest.fixture(scope="module")
def cube_sim() -> AlohaSim:
    return AlohaSim(SimConfig(task="transfer_cube", cameras=("top",), height=H, width=W))


def test_reset_observation_layout(cube_sim: AlohaSim) -> None:
    obs = cube_sim.reset(seed=3)
    assert set(obs.images) == {"top"}
    img = obs.images["top"]
    assert img.shape == (H, W, 3) and img.dtype == np.uint8 and img.std() > 0  # a real picture
    assert obs.qpos.shape == (14,) and obs.qvel.shape == (14,)
    np.testing.assert_allclose(obs.qpos[0:6], START_ARM, atol=1e-6)
    np.testing.assert_allclose(obs.qpos[7:13], START_ARM, atol=1e-6)
    assert 0.0 <= obs.qpos[6] <= 1.0 and 0.0 <= obs.qpos[13] <= 1.0  # normalized grippers
    assert obs.time == 0.0 and obs.step == 0 and obs.reward == 0.0 and not obs.success


def test_step_renders_only_requested_cameras(cube_sim: AlohaSim) -> None:
    obs = cube_sim.reset(seed=0)
    hold = obs.qpos.copy()
    obs = cube_sim.step(hold)
    assert set(obs.images) == {"top"}  # the config's default
    obs = cube_sim.step(hold, cameras=())
    assert obs.images == {}  # nobody subscribed: nothing rendered
    obs = cube_sim.step(hold, cameras=("left_wrist", "angle"))
    assert set(obs.images) == {"left_wrist", "angle"}
    assert obs.step == 3 and obs.time == pytest.approx(3 * DT)
    # Holding the start pose keeps the arms (nearly) there.
    np.testing.assert_allclose(obs.qpos[0:6], START_ARM, atol=0.05)


def test_seeded_placement_matches_gym_aloha(cube_sim: AlohaSim) -> None:
    from gym_aloha.utils import sample_box_pose

    cube_sim.reset(seed=7, cameras=())
    a = cube_sim.object_qpos.copy()
    np.testing.assert_array_equal(a, sample_box_pose(7))  # before any step: exactly the sample
    cube_sim.reset(seed=7, cameras=())
    np.testing.assert_array_equal(cube_sim.object_qpos, a)
    cube_sim.reset(seed=8, cameras=())
    assert not np.allclose(cube_sim.object_qpos[:2], a[:2])
    assert sample_object_qpos("insertion", 7).shape == (14,)
    cube_sim.reset(seed=None, cameras=())
    assert isinstance(cube_sim.seed, int)  # a fresh seed is still recorded


def test_object_range_is_where_gym_aloha_draws() -> None:
    """TaskSpec.object_range (the bins of `bench outcomes --by`) spans gym-aloha's draws of the first object."""
    from vla_accel_ros.sim.aloha import TASKS

    for task, spec in TASKS.items():
        xy = np.array([sample_object_qpos(task, s)[:2] for s in range(400)])
        for col, axis in enumerate("xy"):
            lo, hi = spec.object_range[axis]
            assert lo <= xy[:, col].min() < lo + 0.02 * (hi - lo) and hi - 0.02 * (hi - lo) < xy[:, col].max() <= hi, (task, axis)


def test_misuse_raises_typed_errors(cube_sim: AlohaSim) -> None:
    fresh = AlohaSim(SimConfig(cameras=(), height=H, width=W))
    with pytest.raises(SimError, match="reset"):
        fresh.step(np.zeros(14))
    cube_sim.reset(seed=0, cameras=())
    with pytest.raises(SimError, match="shape"):
        cube_sim.step(np.zeros(13))
    with pytest.raises(SimError, match="non-finite"):
        cube_sim.step(np.full(14, np.nan))
    with pytest.raises(SimError, match="unknown camera"):
        cube_sim.observe(cameras=("cam_high",))
    with pytest.raises(SimError, match="seed"):
        cube_sim.reset(seed=-1)
    with pytest.raises(ConfigError):
        SimConfig(height=1000)
    with pytest.raises(ConfigError):
        SimConfig(task="stack_blocks")
    with pytest.raises(ConfigError):
        SimConfig(cameras=("nope",))


def test_scripted_trajectory_replays_exactly() -> None:
    """The expert's actions are a plain joint trajectory: replayed from the same seed in a
    fresh simulator they reproduce the episode bit for bit."""
    steps = 60
    traj = scripted_trajectory("transfer_cube", seed=2, steps=steps)
    assert traj.actions.shape == (steps, 14) and np.all(np.isfinite(traj.actions))
    again = scripted_trajectory("transfer_cube", seed=2, steps=steps)
    np.testing.assert_array_equal(traj.actions, again.actions)

    sim = AlohaSim(SimConfig(cameras=()))
    sim.reset(seed=2)
    expert = ScriptedExpert("transfer_cube", 2, sim.object_qpos)
    replay = AlohaSim(SimConfig(cameras=()))
    replay.reset(seed=2)
    for t in range(steps):
        a = expert.act(t, sim.object_qpos)
        np.testing.assert_array_equal(a, traj.actions[t])
        o1, o2 = sim.step(a), replay.step(traj.actions[t])
        np.testing.assert_array_equal(o1.qpos, o2.qpos)
    # By step 60 the right arm has left the start pose towards the cube, gripper opening.
    assert np.abs(o1.qpos[7:13] - START_ARM).max() > 0.2
    assert o1.qpos[13] > 0.5


def test_episode_frames_stream() -> None:
    sim = AlohaSim(SimConfig(task="insertion", cameras=("top",), height=H, width=W))
    frames = list(scripted_episode_frames(sim, seed=1, steps=5, episode=4))
    assert [f.step for f in frames] == [0, 1, 2, 3, 4]
    assert [f.done for f in frames] == [False] * 4 + [True]
    for k, f in enumerate(frames):
        assert f.episode == 4 and f.seed == 1
        assert f.time == pytest.approx(k * DT)
        assert set(f.images) == {"top"} and f.images["top"].shape == (H, W, 3)
        assert f.action.shape == (14,) and f.qpos.shape == (14,) and f.qvel.shape == (14,)
        assert "peg" in f.instruction
    # Frame k's observation is the state after action k-1.
    assert not np.array_equal(frames[0].qpos, frames[4].qpos)


def test_episode_frames_render_every_few_ticks() -> None:
    """Images every N ticks (phase shifted by the episode), joint states and actions at all."""
    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top",), height=H, width=W))
    frames = list(scripted_episode_frames(sim, seed=1, steps=7, episode=4, render_every=3))
    assert [f.step for f in frames] == list(range(7))
    assert [bool(f.images) for f in frames] == [k % 3 == 1 for k in range(7)]  # phase 4 % 3
    assert all(f.action.shape == (14,) for f in frames)
    with pytest.raises(SimError, match="renders nothing"):
        next(scripted_episode_frames(sim, seed=1, steps=7, render_every=0))
    # render_first: also every tick before it (the frames where the arm has not moved yet)
    first = list(scripted_episode_frames(sim, seed=1, steps=9, episode=4, render_every=3, render_first=3))
    assert [bool(f.images) for f in first] == [k < 3 or k % 3 == 1 for k in range(9)]
    with pytest.raises(SimError, match="render_first"):
        next(scripted_episode_frames(sim, seed=1, steps=7, render_first=-1))
    # render_every 0: the ticks before render_first alone, whatever the episode's phase would be
    for episode in (0, 4):
        only0 = list(scripted_episode_frames(sim, seed=1, steps=7, episode=episode, render_every=0, render_first=1))
        assert [bool(f.images) for f in only0] == [k == 0 for k in range(7)]
        assert len(only0) == 7  # the actions after the frame are all there: the chunk's label


def test_transfer_cube_scripted_success() -> None:
    """A whole episode without rendering takes well under a second: cheap enough here."""
    traj = scripted_trajectory("transfer_cube", seed=0)
    assert traj.result.success, traj.result.max_reward
    assert traj.result.final_reward == 4  # still holding the cube at the end


@pytest.mark.slow
@pytest.mark.parametrize("task", ["transfer_cube", "insertion"])
def test_scripted_success_rate(task: str) -> None:
    results = [scripted_trajectory(task, seed=s).result for s in range(5)]
    rate = sum(r.success for r in results) / len(results)
    assert rate >= 0.8, [(r.seed, r.max_reward) for r in results]


@pytest.mark.slow
def test_rendered_episode_matches_blind_one() -> None:
    """Rendering does not change the physics: a rendered scripted episode succeeds like the
    blind one and ends in the same state."""
    traj = scripted_trajectory("insertion", seed=0)
    sim = AlohaSim(SimConfig(task="insertion", cameras=("top",), height=H, width=W))
    *_, last = scripted_episode_frames(sim, seed=0)
    assert last.success == traj.result.success
    np.testing.assert_array_equal(last.action, traj.actions[-1])


def test_action_noise_offsets_are_held_arm_joint_offsets_of_the_seed() -> None:
    noise = ActionNoise(std=0.02, hold=25)
    held = noise.offsets(seed=0, attempt=0, steps=300)
    assert held.shape == (300, 14) and not held[:, [6, 13]].any()  # grippers: none
    assert (held[:25] == held[0]).all() and (held[25] != held[0]).any()
    assert 0.01 < held[:, [0, 1, 2, 7, 8, 9]].std() < 0.03
    np.testing.assert_array_equal(noise.offsets(0, 0, 300), held)
    assert (noise.offsets(0, 1, 300) != held).any()
    with pytest.raises(ConfigError, match="std"):
        ActionNoise(std=-0.01)
    with pytest.raises(ConfigError, match="hold"):
        ActionNoise(std=0.01, hold=0)


def test_detour_draws_a_decoy_off_the_cube_and_a_switch_tick_of_the_seed() -> None:
    detour = Detour(first=10, last=45)
    cube = np.array([0.1, 0.5])
    draws = [detour.draw(seed=s, attempt=0, cube_xy=cube) for s in range(50)]
    for decoy, switch in draws:
        assert 10 <= switch <= 45
        assert 0.0 <= decoy[0] <= 0.2 and 0.4 <= decoy[1] <= 0.6  # the cube's own range
        assert np.linalg.norm(decoy - cube) >= detour.min_offset
    assert len({s for _, s in draws}) > 10  # the switch varies by seed
    again, other = detour.draw(seed=3, attempt=0, cube_xy=cube), detour.draw(seed=3, attempt=1, cube_xy=cube)
    np.testing.assert_array_equal(again[0], draws[3][0])
    assert again[1] == draws[3][1] and (other[0] != again[0]).any()
    assert not Detour().enabled and detour.enabled
    for first, last in ((0, 5), (20, 10), (10, 46)):
        with pytest.raises(ConfigError, match="first|last"):
            Detour(first=first, last=last)
    with pytest.raises(SimError, match="transfer_cube only"):
        ScriptedExpert("insertion", seed=0, object_qpos=sample_object_qpos("insertion", 0), detour=(cube, 20))


def test_detour_renders_from_the_switch_the_arm_off_the_cube_turning_to_it() -> None:
    """Recovery demonstrations: before the switch the right arm heads for the decoy and nothing
    is rendered (those actions must not be learnt); from the switch the frames show the arm off
    the clean path and the actions bring it to the cube; the episode succeeds."""
    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top",), height=H, width=W))
    detour = Detour(first=20, last=20)
    clean = list(scripted_episode_frames(sim, seed=2, render_every=100))
    frames = list(scripted_episode_frames(sim, seed=2, render_every=10, detour=detour, episode=3))
    assert frames[-1].success and len(frames) == 300
    rendered = [f.step for f in frames if f.images]
    assert rendered == list(range(23, 300, 10))  # from the switch, the episode's phase (3) after it
    def off(t: int, what: str) -> float:  # the right arm's largest joint difference to the clean episode
        return float(np.abs(getattr(frames[t], what)[7:13] - getattr(clean[t], what)[7:13]).max())

    assert off(20, "qpos") > 0.3  # heading for the decoy until the switch
    assert off(60, "action") > 0.05  # turning back...
    assert off(90, "action") < 0.01  # ...over the cube by the grasp (a switch at 20 needs no delay)
    first = list(scripted_episode_frames(sim, seed=2, render_every=0, render_first=2, detour=detour))
    assert [f.step for f in first if f.images] == [20, 21]  # render_first counts from the switch too
    with pytest.raises(SimError, match="either"):
        next(scripted_episode_frames(sim, seed=2, noise=ActionNoise(std=0.01), detour=detour))


@pytest.mark.slow
def test_action_noise_moves_the_arm_off_the_path_and_records_the_experts_action() -> None:
    """DART demonstrations: the executed commands carry a held offset, the recorded actions stay
    the expert's, the episode still succeeds, a seed gives the same episode twice, and a draw
    the expert cannot complete is replaced by none."""
    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top",), height=H, width=W))
    arm = [i for i in range(14) if i not in (6, 13)]

    def off_path(frames) -> float:  # mean |state after a command - the recorded action|, arm joints
        return float(np.mean([np.abs(b.qpos - a.action)[arm] for a, b in zip(frames, frames[1:])]))

    noise = ActionNoise(std=0.02, hold=25)
    clean = list(scripted_episode_frames(sim, seed=0, render_every=100))
    noisy = list(scripted_episode_frames(sim, seed=0, render_every=100, noise=noise))
    assert noisy[-1].success
    assert off_path(noisy) > 1.5 * off_path(clean), (off_path(noisy), off_path(clean))
    # Before the left arm aims at the cube (tick 150) the script follows time alone: the labels
    # are the noiseless episode's to the bit, whatever the arm did.
    np.testing.assert_array_equal([f.action for f in noisy[:150]], [f.action for f in clean[:150]])
    again = list(scripted_episode_frames(sim, seed=0, render_every=100, noise=noise))
    np.testing.assert_array_equal(again[-1].qpos, noisy[-1].qpos)
    # One draw of 0.1 rad loses the cube on this seed: the episode is recorded without noise.
    fallback = list(scripted_episode_frames(sim, seed=0, render_every=100, noise=ActionNoise(std=0.1, attempts=1)))
    np.testing.assert_array_equal(fallback[-1].qpos, clean[-1].qpos)
