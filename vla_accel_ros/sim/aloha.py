"""The simulated bimanual ALOHA (gym-aloha's MuJoCo scenes) as plain numpy, without ROS.

gym-aloha's own ``AlohaEnv`` renders three 640x480 cameras on every step (its task's
``get_observation``) and places the objects through a module-global pose. This wrapper reuses
only what is worth reusing from it (the scene XML, the task's action mapping and its reward)
and owns the rest: a seeded reset, a step loop that renders only the cameras asked for, and
observations in the 14-D action layout.

Layout of qpos / qvel / action (the ALOHA convention)::

    [left waist, shoulder, elbow, forearm_roll, wrist_angle, wrist_rotate, left gripper,
     right waist, shoulder, elbow, forearm_roll, wrist_angle, wrist_rotate, right gripper]

Arm joints are radians; grippers are normalized finger positions, 0 closed and 1 open
(gym-aloha's ``PUPPET_GRIPPER_POSITION_*`` constants map them to metres).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import VlaAccelError
from vla_accel_ros.core.robot.config import ARM_JOINTS

# Headless CPU machines have no display; EGL renders offscreen. dm_control reads this when
# it is first imported, so it must be set before the lazy import in _sim_modules().
os.environ.setdefault("MUJOCO_GL", "egl")

TASK_NAMES = ("transfer_cube", "insertion")
# Cameras defined by the scene XML; gym-aloha itself only ever shows "top".
CAMERA_NAMES = ("top", "angle", "front_close", "left_pillar", "right_pillar", "left_wrist", "right_wrist")
JOINT_NAMES = (*ARM_JOINTS, "gripper")  # one arm, in the simulator's qpos order
ACTION_DIM = 14
DT = 0.02  # control period in seconds (50 Hz), the rate ALOHA records and acts at
EPISODE_STEPS = 300  # gym-aloha's episode length (6 s)
SUCCESS_REWARD = 4  # both tasks grade 0..4; 4 is a completed transfer / insertion
# The offscreen framebuffer the scene XML allows; larger renders fail inside MuJoCo.
MAX_HEIGHT, MAX_WIDTH = 480, 640


class SimError(VlaAccelError):
    """The simulator cannot be built or was used wrongly (unknown camera, bad action)."""


@dataclass(frozen=True)
class TaskSpec:
    name: str
    xml: str  # joint-position scene
    ee_xml: str  # end-effector (mocap) scene used to script demonstrations
    instruction: str
    object_joints: tuple[str, ...]  # free joints of the objects, in qpos order
    # Where gym-aloha's reset draws the first object (the cube, the peg), uniformly: (low, high)
    # in metres of x (along the line between the arms) and y (away from the right arm's base).
    object_range: dict[str, tuple[float, float]]


TASKS: dict[str, TaskSpec] = {
    "transfer_cube": TaskSpec(
        name="transfer_cube",
        xml="bimanual_viperx_transfer_cube.xml",
        ee_xml="bimanual_viperx_end_effector_transfer_cube.xml",
        instruction="Pick up the red cube with the right arm and hand it over to the left arm.",
        object_joints=("red_box_joint",),
        object_range={"x": (0.0, 0.2), "y": (0.4, 0.6)},
    ),
    "insertion": TaskSpec(
        name="insertion",
        xml="bimanual_viperx_insertion.xml",
        ee_xml="bimanual_viperx_end_effector_insertion.xml",
        instruction="Pick up the red peg and the blue socket and insert the peg into the socket.",
        object_joints=("red_peg_joint", "blue_socket_joint"),
        object_range={"x": (0.1, 0.2), "y": (0.4, 0.6)},
    ),
}


def task_of_instruction(instruction: str) -> str:
    """The simulator task whose instruction this is ('' when none is)."""
    for name, spec in TASKS.items():
        if spec.instruction == instruction:
            return name
    return ""


@dataclass(frozen=True)
class SimConfig(Config):
    task: str = param("transfer_cube", doc="simulated task", choices=TASK_NAMES)
    cameras: tuple[str, ...] = param(
        ("top",), doc="cameras rendered on every step unless a step names others", choices=CAMERA_NAMES
    )
    height: int = param(480, doc="rendered image height in pixels", range=(8, MAX_HEIGHT))
    width: int = param(640, doc="rendered image width in pixels", range=(8, MAX_WIDTH))


@dataclass
class SimObservation:
    """What the robot would report after a step (or a reset).

    images: camera -> [H, W, 3] uint8, only the cameras rendered for this step.
    qpos, qvel: [14] float64 in the action layout (grippers normalized).
    time: simulated seconds since reset; step: control steps since reset.
    reward: the task's grade after this step (0..4); success: the episode reached 4 so far.
    """

    images: dict[str, np.ndarray]
    qpos: np.ndarray
    qvel: np.ndarray
    time: float
    step: int
    reward: float = 0.0
    success: bool = False


def _sim_modules() -> Any:
    """Import dm_control and gym-aloha lazily: they are optional (requirements-sim.txt) and
    heavy, and MUJOCO_GL must be settled before the first import."""
    try:
        import mujoco as mj
        from dm_control import mujoco
        from dm_control.rl.control import PhysicsError
        from gym_aloha import constants, utils
        from gym_aloha.tasks import sim, sim_end_effector
    except ImportError as e:
        raise SimError(
            f"the ALOHA simulator needs gym-aloha and dm_control ({e}); "
            "install them with `pip install -r requirements-sim.txt`"
        ) from e
    import types

    return types.SimpleNamespace(
        mj=mj,
        mujoco=mujoco,
        PhysicsError=PhysicsError,
        constants=constants,
        utils=utils,
        sim=sim,
        sim_end_effector=sim_end_effector,
    )


def sample_object_qpos(task: str, seed: int) -> np.ndarray:
    """The task's seeded object placement, [7 * n_objects] (x, y, z, qw, qx, qy, qz each).

    Same sampler and seed semantics as gym-aloha's ``AlohaEnv.reset(seed)``, so an episode
    here and one there with the same seed start from the same scene."""
    m = _sim_modules()
    if task == "transfer_cube":
        return np.asarray(m.utils.sample_box_pose(seed), dtype=np.float64)
    if task == "insertion":
        peg, socket = m.utils.sample_insertion_pose(seed)
        return np.concatenate([peg, socket]).astype(np.float64)
    raise SimError(f"unknown task {task!r}; choose one of {', '.join(TASK_NAMES)}")


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise SimError(f"unknown task {task!r}; choose one of {', '.join(TASK_NAMES)}")
    return TASKS[task]


class _MujocoScene:
    """What the joint-space and the mocap scenes share: physics, seeded reset, rendering."""

    def __init__(self, xml: str, task_obj: Any, spec: TaskSpec) -> None:
        m = _sim_modules()
        self._m = m
        self.spec = spec
        self.physics = m.mujoco.Physics.from_xml_path(str(m.constants.ASSETS_DIR / xml))
        self._task = task_obj
        # dm_control's control.Environment would do the same sub-stepping; we call it directly
        # so that no observation (and no rendering) is computed that nobody asked for.
        self.n_substeps = int(round(DT / self.physics.timestep()))
        self.seed: int | None = None
        self.step_count = 0
        self.reward = 0.0
        self.max_reward = 0.0

    def _reset_objects(self, seed: int) -> None:
        obj = sample_object_qpos(self.spec.name, seed)
        for i, joint in enumerate(self.spec.object_joints):
            self.physics.named.data.qpos[joint] = obj[7 * i : 7 * (i + 1)]

    @property
    def time(self) -> float:
        """Simulated seconds since the last reset."""
        return self.step_count * DT

    @property
    def object_qpos(self) -> np.ndarray:
        """[7 * n_objects] current object poses."""
        return np.concatenate([self.physics.named.data.qpos[j] for j in self.spec.object_joints])

    def qpos(self) -> np.ndarray:
        return self._task.get_qpos(self.physics)  # [14]

    def qvel(self) -> np.ndarray:
        return self._task.get_qvel(self.physics)  # [14]

    def _advance(self, env_action: np.ndarray) -> None:
        self._task.before_step(env_action, self.physics)
        try:
            self.physics.step(self.n_substeps)
        except self._m.PhysicsError as e:  # diverged (e.g. a wild action): say so, typed
            raise SimError(f"{self.spec.name}: physics diverged at step {self.step_count + 1}: {e}") from e
        self._task.after_step(self.physics)
        self.step_count += 1
        self.reward = float(self._task.get_reward(self.physics))
        self.max_reward = max(self.max_reward, self.reward)

    def render(self, camera: str, height: int = MAX_HEIGHT, width: int = MAX_WIDTH) -> np.ndarray:
        """[H, W, 3] uint8 from one of CAMERA_NAMES."""
        if camera not in CAMERA_NAMES:
            raise SimError(f"unknown camera {camera!r}; the scene has {', '.join(CAMERA_NAMES)}")
        if not (0 < height <= MAX_HEIGHT and 0 < width <= MAX_WIDTH):
            raise SimError(f"render size {height}x{width} exceeds the scene's {MAX_HEIGHT}x{MAX_WIDTH}")
        return self.physics.render(height=height, width=width, camera_id=camera)

    @property
    def success(self) -> bool:
        return self.max_reward >= SUCCESS_REWARD


def _seed_or_fresh(seed: int | None) -> int:
    if seed is None:
        # Record a concrete seed even when none was given, so every episode can be replayed.
        return int(np.random.SeedSequence().generate_state(1)[0])
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SimError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


class AlohaSim(_MujocoScene):
    """The joint-position ALOHA task: reset(seed) -> obs, step(action [14]) -> obs.

    Example::

        sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top",)))
        obs = sim.reset(seed=0)
        obs = sim.step(obs.qpos)               # hold still; renders "top" only
        obs = sim.step(obs.qpos, cameras=())   # nobody subscribed: no rendering at all
    """

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        spec = _spec(self.config.task)
        m = _sim_modules()
        task_cls = {"transfer_cube": m.sim.TransferCubeTask, "insertion": m.sim.InsertionTask}[spec.name]
        super().__init__(spec.xml, task_cls(), spec)

    @property
    def instruction(self) -> str:
        return self.spec.instruction

    def reset(self, seed: int | None = None, cameras: Sequence[str] | None = None) -> SimObservation:
        """Arms at the start pose, objects placed by ``seed``; returns the first observation.

        gym-aloha's task reset reads a module-global pose, so the state is set here instead."""
        self.seed = _seed_or_fresh(seed)
        start = np.asarray(self._m.constants.START_ARM_POSE, dtype=np.float64)  # [16] incl. fingers
        with self.physics.reset_context():
            self.physics.data.qpos[:16] = start
            self.physics.data.ctrl[:] = start
            self._reset_objects(self.seed)
        self.step_count = 0
        self.reward = 0.0
        self.max_reward = 0.0
        return self.observe(cameras)

    def step(self, action: np.ndarray, cameras: Sequence[str] | None = None) -> SimObservation:
        """Advance one control period (DT) towards joint positions ``action`` [14].

        ``cameras``: which cameras to render after the step (None: the config's; () : none),
        so a ROS node renders only what is subscribed."""
        if self.seed is None:
            raise SimError("call reset() before step()")
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (ACTION_DIM,):
            raise SimError(f"action must have shape ({ACTION_DIM},), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise SimError(f"action has non-finite values: {a}")
        self._advance(a)
        return self.observe(cameras)

    def observe(self, cameras: Sequence[str] | None = None) -> SimObservation:
        """The current state, rendering ``cameras`` (None: the config's) without stepping."""
        names = self.config.cameras if cameras is None else tuple(cameras)
        images = {c: self.render(c, self.config.height, self.config.width) for c in names}
        return SimObservation(
            images=images,
            qpos=self.qpos(),
            qvel=self.qvel(),
            time=self.time,
            step=self.step_count,
            reward=self.reward,
            success=self.success,
        )


WELD_SOLIMP = (0.95, 0.99, 0.001)
WELD_SOLREF = (0.02, 1.0)


class MocapSim(_MujocoScene):
    """The end-effector scene: each arm's gripper is welded to a mocap body that the action
    moves, so a script can think in Cartesian waypoints. Used to record joint trajectories.

    Action [16]: per arm (left, right) xyz [3], quaternion wxyz [4], gripper 0..1 [1].
    With ``ghost_objects`` (what the scripted expert uses) the scene has no contacts, so its
    reward means nothing; the joint task it drives grades the episode.
    """

    def __init__(self, task: str, ghost_objects: bool = True) -> None:
        spec = _spec(task)
        m = _sim_modules()
        se = m.sim_end_effector
        task_cls = {
            "transfer_cube": se.TransferCubeEndEffectorTask,
            "insertion": se.InsertionEndEffectorTask,
        }[spec.name]
        super().__init__(spec.ee_xml, task_cls(), spec)
        # The scene's welds are soft (impedance 0.25): with the arms' joint friction the grippers
        # trail their targets by centimetres for a second or more, too loose to place fingers
        # around a 4 cm cube. A stiffer weld makes the script's waypoints mean what they say;
        # only this scripting scene is changed, the joint task keeps gym-aloha's dynamics.
        self.physics.model.eq_solimp[:, :3] = WELD_SOLIMP
        self.physics.model.eq_solref[:] = WELD_SOLREF
        if ghost_objects:
            self._ghost_objects()
        self.gripper_command = np.zeros(2)  # last commanded normalized gripper per arm

    def _ghost_objects(self) -> None:
        """No contacts and floating objects: the scene becomes a pure inverse-kinematics device
        for the arms, while a script perceives the objects of the joint task it drives. Two
        worlds with contacts drift apart (a cube in one, none in the other) and then push the
        arms differently; contacts belong to the joint task alone."""
        model = self.physics.model
        model.opt.disableflags |= int(self._m.mj.mjtDisableBit.mjDSBL_CONTACT)
        for j in self.spec.object_joints:
            model.body_gravcomp[int(model.jnt_bodyid[model.name2id(j, "joint")])] = 1.0

    def reset(self, seed: int | None = None) -> None:
        # gym-aloha's mocap task samples the objects with an unseeded RNG; place them here.
        self.seed = _seed_or_fresh(seed)
        with self.physics.reset_context():
            self._task.initialize_robots(self.physics)  # arms, mocap bodies, closed grippers
            self._reset_objects(self.seed)
        self.step_count = 0
        self.reward = 0.0
        self.max_reward = 0.0
        self.gripper_command = np.zeros(2)

    @property
    def mocap_pose(self) -> np.ndarray:
        """[2, 7] current mocap xyz + quaternion (wxyz) of the left and right arm."""
        d = self.physics.data
        return np.concatenate([d.mocap_pos, d.mocap_quat], axis=1).copy()

    def step(self, ee_action: np.ndarray) -> None:
        a = np.asarray(ee_action, dtype=np.float64)
        if a.shape != (16,):
            raise SimError(f"end-effector action must have shape (16,), got {a.shape}")
        self.gripper_command = a[[7, 15]].copy()
        self._advance(a)

    def joint_command(self) -> np.ndarray:
        """[14] the joint-space action that reproduces the current state: measured arm joints
        with the commanded (not the measured) gripper, so grasps keep squeezing on replay."""
        q = self.qpos()
        q[6], q[13] = self.gripper_command
        return q


@dataclass
class EpisodeResult:
    task: str
    seed: int
    steps: int
    max_reward: float
    final_reward: float
    rewards: list[float] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return self.max_reward >= SUCCESS_REWARD
