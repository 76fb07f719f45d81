"""The policy interface every part of the package speaks: observations in, action chunks out.

Kept tiny on purpose (openpi style): ``infer(obs) -> ActionChunk`` and ``reset()``. Servers,
recorders, the ROS policy node and the benchmarks all wrap a :class:`Policy`. The policies of
this package also take run-time knobs through :class:`ConfigurablePolicy`'s two methods, the
only way callers change them (nobody assigns a policy's ``config`` or ``planner``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from vla_accel_ros.core.policy_config import PolicyConfig


@dataclass
class Observation:
    """One synchronized observation.

    images: camera name -> RGB uint8 array [H, W, 3] (any size; the policy resizes to the
        bundle's image size, or skips the resize when the frame already has it).
    state: proprioceptive state [state_dim] float32, or None for policies without state.
    stamp_ns: the time the observation was taken (sensor time, nanoseconds); every action
        computed from it carries this stamp so staleness can be measured downstream.
    episode: increments on episode start; a change resets per-episode caches.
    """

    images: dict[str, np.ndarray]
    instruction: str
    stamp_ns: int
    state: np.ndarray | None = None
    episode: int = 0


@dataclass
class ChunkGuidance:
    """Real-Time Chunking request for flow policies (see core/scheduling).

    prev_actions: [H, D] the previous chunk re-indexed so that row 0 is the action that will
        execute at the new chunk's first step (rows past its end are ignored by the weights).
    frozen: d, the number of leading actions that will execute while this inference runs;
        they are reproduced exactly.
    weights: [H] per-step guidance weights in [0, 1] (1 for the frozen prefix, decaying after).
    max_guidance: the cap on the guidance gain (RTC's beta).
    """

    prev_actions: np.ndarray
    frozen: int
    weights: np.ndarray
    max_guidance: float = 10.0


@dataclass
class ActionChunk:
    """A chunk of H future actions computed from one observation.

    actions: [H, D] float32 in the robot's units (unnormalized).
    stamp_ns: stamp of the observation the chunk was computed from.
    dt: seconds between consecutive actions.
    timings_ms: per-stage wall times (preprocess, vision, select, prefill, decode, ...).
    stats: per-step statistics (tokens recomputed, reuse fraction, reset reason, ...).
    """

    actions: np.ndarray
    stamp_ns: int
    dt: float
    chunk_id: int = 0
    joint_names: tuple[str, ...] = ()
    timings_ms: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def horizon(self) -> int:
        return int(self.actions.shape[0])

    @property
    def action_dim(self) -> int:
        return int(self.actions.shape[1])

    def action_time_ns(self, i: int) -> int:
        """The time action ``i`` is meant for: the observation stamp plus i control periods."""
        return self.stamp_ns + int(round(i * self.dt * 1e9))


@runtime_checkable
class Policy(Protocol):
    def infer(
        self,
        obs: Observation,
        *,
        noise: np.ndarray | None = None,
        guidance: ChunkGuidance | None = None,
    ) -> ActionChunk:
        """Compute one action chunk. ``noise`` ([H, D]) fixes a flow policy's initial sample;
        ``guidance`` asks a flow policy for Real-Time Chunking. Other policies ignore both."""
        ...

    def reset(self) -> None:
        """Forget everything carried between calls (caches, previous frames, chunk ids)."""
        ...


@runtime_checkable
class ConfigurablePolicy(Policy, Protocol):
    def configure(self, config: PolicyConfig) -> bool:
        """Apply new run-time options (acceleration plan, cache thresholds, flow steps, ...)
        atomically after validating them against the loaded model, or raise ``ConfigError``
        and keep the old ones. Returns True when the prefix planner was rebuilt (caches empty).
        Fields fixed at build time (parity_check, num_threads, seed) are refused."""
        ...

    def set_motion_mode(self, mode: str) -> None:
        """``coarse`` | ``fine`` from the controller, for planners that prune by it."""
        ...
