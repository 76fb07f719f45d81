"""``smolvla``: LeRobot's SmolVLA as a model family (configuration_smolvla: its options;
modeling_smolvla: the modules, the policy and the plug-in; expert: the action expert's loop;
lerobot_import: LeRobot checkpoints to bundles)."""

from vla_accel_ros.models.smolvla.modeling_smolvla import FAMILY

__all__ = ["FAMILY"]
