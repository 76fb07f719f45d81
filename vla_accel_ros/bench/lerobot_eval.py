"""LeRobot's own runtime as a mode of ``vla-accel eval`` (``--modes ...,lerobot``).

The policy the mode runs is LeRobot's (its saved checkpoint, its pre- and post-processors,
``predict_action_chunk``) in LeRobot's side venv, the worker ``vla-accel bench lerobot`` uses;
here it sits where our policy sits in the closed loop: the same simulator, observation rule,
chunk scheduler and safety filter, the same seeds and the same noise per chunk. It is the
success (and latency) reference every other mode is judged against: what a user who ran the
checkpoint with LeRobot would get on this machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vla_accel_ros.bench.modes import Mode, ModeRun
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.types import ActionChunk

LEROBOT = "lerobot"
DOC = "LeRobot's own runtime (its checkpoint, processors and predict_action_chunk, in its side venv)"


class LeRobotProxy:
    """The policy interface the closed loop calls, answered by LeRobot's worker process."""

    def __init__(self, spec, worker, cameras: dict[str, str], noise_shape: tuple[int, int], noise_scale: float = 1.0) -> None:
        self.spec, self.worker, self.cameras, self.noise_shape = spec, worker, cameras, noise_shape
        self.noise_scale = noise_scale  # our policies' flow_noise_scale, applied to the noise LeRobot is given
        self._chunk_id = 0

    def infer(self, obs, *, noise: np.ndarray | None = None, guidance=None) -> ActionChunk:
        if guidance is not None:
            raise ConfigError("the lerobot mode takes no Real-Time Chunking guidance (LeRobot's predict_action_chunk "
                              "has none here): evaluate it with the scheduler's rtc off")  # fmt: skip
        if noise is None:
            noise = np.random.default_rng().standard_normal(self.noise_shape).astype(np.float32)
        noise = np.asarray(noise, np.float32) * np.float32(self.noise_scale)
        actions, ms, stages = self.worker.run(obs, self.cameras, noise)
        self._chunk_id += 1
        return ActionChunk(
            actions=np.asarray(actions, np.float32), stamp_ns=obs.stamp_ns, dt=self.spec.dt, chunk_id=self._chunk_id,
            joint_names=self.spec.joint_names, timings_ms={**stages, "total": ms}, stats={"mode": LEROBOT},
        )  # fmt: skip

    def set_motion_mode(self, mode: str) -> None:
        """LeRobot's runtime has no motion-aware planning."""

    def reset(self) -> None:
        """The worker resets LeRobot's policy before every chunk."""

    def close(self) -> None:
        self.worker.close()


def lerobot_run(bundle_path: Path, spec, lerobot: Path, python: Path, threads: int, noise_scale: float = 1.0) -> ModeRun:
    """The ``lerobot`` mode's run over LeRobot's checkpoint ``lerobot`` (the bundle's, e.g. its
    ``bundle export-lerobot``), LeRobot started in ``python``."""
    from vla_accel_ros.bench.lerobot_bench import LeRobotWorker, camera_map
    from vla_accel_ros.models.lerobot_compat import LeRobotOptions

    cameras = camera_map(lerobot, Path(bundle_path), spec)
    worker = LeRobotWorker(python, lerobot, threads or 1)
    # The noise is drawn over the model's padded action width, as LeRobot draws it.
    width = (spec.options or {}).get("max_action_dim", LeRobotOptions().max_action_dim)
    shape = (spec.chunk_size, int(width))
    config = {"lerobot": str(lerobot), "python": str(python), "threads": threads or 1, **worker.info}
    if noise_scale != 1.0:
        config["noise_scale"] = noise_scale
    return ModeRun(LEROBOT, Mode({}, doc=DOC), LeRobotProxy(spec, worker, cameras, shape, noise_scale), config)
