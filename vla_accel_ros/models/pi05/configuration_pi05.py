"""The options of a ``pi05`` bundle: what LeRobot's ``PI05Config`` (0.4.4) and its pre-processor
say about the forward pass, as a bundle stores it. The architecture itself (SigLIP, Gemma, the
Gemma expert with adaptive norms) is in the bundle's ``vision`` / ``lm`` / ``expert`` sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vla_accel_ros.core.config import param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.models.lerobot.paligemma import PaliGemmaImport
from vla_accel_ros.models.lerobot_compat import NORM_MODES, LeRobotOptions


@dataclass(frozen=True)
class Pi05Options(LeRobotOptions):
    """LeRobot pi05's input and output handling. The state enters the prompt: normalized, padded
    to ``max_state_dim`` (the pre-processor's state step; 32 when it saved none, as LeRobot then
    rebuilds it), discretized into 256 bins over [-1, 1]."""

    import_options: ClassVar[type[PaliGemmaImport]] = PaliGemmaImport  # what `bundle import --lerobot` takes

    max_state_dim: int = param(32, doc="the normalized state is zero-padded to this size before it is discretized into the prompt", range=(1, 4096))
    state_norm: str = param("QUANTILES", doc="normalization of the state before it is discretized (LeRobot NormalizationMode)", choices=NORM_MODES)
    action_norm: str = param("QUANTILES", doc="normalization of the actions (LeRobot NormalizationMode)", choices=NORM_MODES)
    min_period: float = param(4e-3, doc="the flow time's shortest sine-cosine period", range=(1e-6, 1e6))
    max_period: float = param(4.0, doc="the flow time's longest sine-cosine period", range=(1e-6, 1e6))

    def validate(self) -> None:
        if not self.min_period < self.max_period:
            raise ConfigError(f"Pi05Options.min_period={self.min_period} must be below max_period={self.max_period}")
