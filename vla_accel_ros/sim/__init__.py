"""The simulated bimanual ALOHA without ROS: gym-aloha's MuJoCo scenes as plain numpy.

* :class:`AlohaSim` - reset(seed) / step(action [14]) / observe(), rendering only the cameras
  asked for; what a ROS simulator node wraps.
* :class:`ScriptedExpert`, :func:`scripted_trajectory` - seeded waypoint demonstrations for
  ``transfer_cube`` and ``insertion``.
* :func:`scripted_frames` - per-step frames (images, joint state, action, time) to record.
* ``synthetic`` - a synthetic camera stream (a two-link arm over a textured table), no MuJoCo:
  the cache benchmark's frames and the synthetic robot node's cameras.
* ``live``, ``robot_io``, ``runner`` - the live simulator without ROS: pacing, latency, the
  robot's joint states and commands, and :class:`~vla_accel_ros.sim.runner.SimRunner`, the
  loop (pause, lockstep, policy sync, episodes) ``aloha_sim_node`` runs.

dm_control and gym-aloha (requirements-sim.txt) are imported on first use, not here.
"""

from vla_accel_ros.sim.aloha import (
    ACTION_DIM,
    CAMERA_NAMES,
    DT,
    EPISODE_STEPS,
    JOINT_NAMES,
    SUCCESS_REWARD,
    TASK_NAMES,
    TASKS,
    AlohaSim,
    EpisodeResult,
    MocapSim,
    SimConfig,
    SimError,
    SimObservation,
    sample_object_qpos,
)
from vla_accel_ros.sim.episodes import ActionNoise, Detour, Frame, ScriptedTrajectory, scripted_episode_frames, scripted_frames, scripted_trajectory
from vla_accel_ros.sim.scripted import ScriptedExpert

__all__ = [
    "ACTION_DIM",
    "CAMERA_NAMES",
    "DT",
    "EPISODE_STEPS",
    "JOINT_NAMES",
    "SUCCESS_REWARD",
    "TASK_NAMES",
    "TASKS",
    "ActionNoise",
    "AlohaSim",
    "Detour",
    "EpisodeResult",
    "Frame",
    "MocapSim",
    "ScriptedExpert",
    "ScriptedTrajectory",
    "SimConfig",
    "SimError",
    "SimObservation",
    "sample_object_qpos",
    "scripted_episode_frames",
    "scripted_frames",
    "scripted_trajectory",
]
