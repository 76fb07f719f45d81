"""Image-token pruning (SpecPrune-VLA): static and layer-level, with velocity-aware strength.

``PrunePlanner`` is a :class:`~vla_accel_ros.core.prefix.PrefixPlanner` for both families, alone
or over the token cache; ``PruneConfig`` holds every knob (mirrored as ``prune.*`` ROS
parameters). The planner is imported lazily: ``PolicyConfig`` (and the ROS parameter layer)
import the config from here and must not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vla_accel_ros.core.prune.config import PruneConfig

if TYPE_CHECKING:
    from vla_accel_ros.core.prune.planner import PrunePlanner

__all__ = ["PruneConfig", "PrunePlanner"]


def __getattr__(name: str) -> Any:
    if name == "PrunePlanner":
        from vla_accel_ros.core.prune import planner

        return planner.PrunePlanner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
