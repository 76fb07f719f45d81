"""``pi0``: LeRobot's pi0 (PaliGemma and a Gemma action expert) as a model family
(configuration_pi0: its options; modeling_pi0: the modules, the policy and the plug-in;
lerobot_import: LeRobot pi0 checkpoints to bundles)."""

from vla_accel_ros.models.pi0.modeling_pi0 import FAMILY

__all__ = ["FAMILY"]
