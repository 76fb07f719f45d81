"""``pi05``: LeRobot's pi0.5 (PaliGemma and a Gemma action expert with adaptive norms) as a model
family (configuration_pi05: its options; adarms: the expert's adaptive RMSNorm; modeling_pi05:
the modules, the policy and the plug-in; lerobot_import: LeRobot pi05 checkpoints to bundles).
What it shares with pi0 is in :mod:`vla_accel_ros.models.pi0.paligemma`."""

from vla_accel_ros.models.pi05.modeling_pi05 import FAMILY

__all__ = ["FAMILY"]
