"""The per-frame token cache (VLA-Cache): reuse the K/V of image tokens that did not change.

``TokenCachePlanner`` is a :class:`~vla_accel_ros.core.prefix.PrefixPlanner` for both model
families; ``CacheConfig`` holds every knob (mirrored as ``cache.*`` ROS parameters).

The planner is imported lazily: ``PolicyConfig`` (and the ROS parameter layer) import the
config from here and must not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vla_accel_ros.core.cache.config import CacheConfig

if TYPE_CHECKING:
    from vla_accel_ros.core.cache.planner import Selection, TokenCachePlanner

__all__ = ["CacheConfig", "Selection", "TokenCachePlanner"]


def __getattr__(name: str) -> Any:
    if name in ("TokenCachePlanner", "Selection"):
        from vla_accel_ros.core.cache import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
