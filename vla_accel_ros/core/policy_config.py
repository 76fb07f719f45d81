"""Run-time options of a policy (what the bundle does not fix)."""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.cache.config import CacheConfig
from vla_accel_ros.core.config import Config, param


@dataclass(frozen=True)
class PolicyConfig(Config):
    accel: str = param(
        "none",
        doc="prefix acceleration: none (full recompute every frame) or cache (VLA-Cache token reuse)",
        choices=("none", "cache"),
    )
    parity_check: bool = param(True, doc="run the parity gate when the policy starts", read_only=True)
    parity_tolerance: float = param(
        1e-3, doc="max |engine - transformers| on the parity gate's fixed inputs", range=(0.0, 1.0)
    )
    num_threads: int = param(0, doc="torch CPU threads (0: leave torch's default)", range=(0, 256), read_only=True)
    flow_steps: int = param(0, doc="flow: Euler steps per chunk (0: the bundle's num_steps)", range=(0, 1000))
    seed: int = param(0, doc="seed of the flow noise when the caller passes none", range=(0, 2**31 - 1))
    cache: CacheConfig = CacheConfig()  # accel=cache: the token cache's knobs (ROS: cache.*)
