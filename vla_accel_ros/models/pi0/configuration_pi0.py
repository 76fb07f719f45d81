"""The options of a ``pi0`` bundle: what LeRobot's ``PI0Config`` (0.3.3, the self-contained
port) says about the forward pass, as a bundle stores it. The architecture itself (SigLIP,
Gemma, the Gemma expert) is in the bundle's ``vision`` / ``lm`` / ``expert`` sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vla_accel_ros.core.config import param
from vla_accel_ros.models.lerobot.paligemma import PaliGemmaImport
from vla_accel_ros.models.lerobot_compat import LeRobotOptions


@dataclass(frozen=True)
class Pi0Options(LeRobotOptions):
    """LeRobot pi0's input and output handling (its tokenizer step pads, it does not truncate)."""

    import_options: ClassVar[type[PaliGemmaImport]] = PaliGemmaImport  # what `bundle import --lerobot` takes

    truncate_text: bool = param(False, doc="pi0 pads the prompt to tokenizer_max_length and never cuts it")
