"""Run-time options of a policy (what the bundle does not fix)."""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.cache.config import CacheConfig
from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.precision import PrecisionConfig
from vla_accel_ros.core.prune.config import PruneConfig
from vla_accel_ros.core.reasoning.memo import MemoConfig

ACCEL_MODES = ("none", "cache", "prune", "cache+prune")
DRAFT_MODES = ("off", "previous")


@dataclass(frozen=True)
class PolicyConfig(Config):
    accel: str = param(
        "none",
        doc="prefix acceleration: none (full recompute every frame), cache (VLA-Cache token reuse), "
        "prune (SpecPrune-VLA token pruning) or cache+prune (both in one plan)",
        choices=ACCEL_MODES,
    )
    parity_check: bool = param(
        True, doc="run the parity gate when the policy starts and before an accel change is used", read_only=True
    )
    parity_tolerance: float = param(
        1e-3, doc="max |engine - transformers| on the parity gate's fixed inputs (exact paths)", range=(0.0, 1.0)
    )
    parity_tolerance_accel: float = param(
        1.0,
        doc="mean |accelerated - full recompute| / action std on the gate's second frame (approximate paths: "
        "reuse after a change, pruning)",
        range=(0.0, 100.0),
    )
    parity_tolerance_prune: float = param(
        1.0,
        doc="flow, pruning: mean |pruned - full recompute| on the gate's first frame, in units of the policy's own "
        "sampling spread there (mean |full recompute with the gate's noise - with other noise|): pruning may move a "
        "chunk no further than drawing new noise does",
        range=(0.0, 100.0),
    )
    action_draft: str = param(
        "off",
        doc="ar, sequential decode: the previous chunk's action tokens ride along in the prefill as a draft, "
        "the tokens the model's argmax confirms are kept and the rest decoded in short windows (previous: "
        "greedy decoding's tokens with an fp32 LM, fewer steps; a bf16/hybrid LM computes the confirmed "
        "tokens on its prefill path), or every token is decoded one by one (off); flow bundles and the "
        "pipelined decode ignore it",
        choices=DRAFT_MODES,
    )
    num_threads: int = param(0, doc="torch CPU threads (0: leave torch's default)", range=(0, 256), read_only=True)
    malloc_keep_mb: int = param(
        64,
        doc="glibc: freed blocks up to this many MiB stay in the process instead of going back to the system and "
        "faulting in again at the next inference (7% of a three-camera SmolVLA chunk); process-wide (a later "
        "policy's 0 does not undo it); 0: the allocator's defaults",
        range=(0, 1024),
        read_only=True,
    )
    flow_steps: int = param(0, doc="flow: Euler steps per chunk (0: the bundle's num_steps)", range=(0, 1000))
    flow_noise_scale: float = param(
        -1.0,
        doc="flow: the integration starts from this multiple of the Gaussian noise (-1: the bundle's noise_scale; "
        "1: the trained sampler; 0: one deterministic chunk per observation, so consecutive chunks do not "
        "re-draw among the ways the policy could act)",
        range=(-1.0, 2.0),
    )
    seed: int = param(0, doc="seed of the flow noise when the caller passes none", range=(0, 2**31 - 1))
    cache: CacheConfig = CacheConfig()  # accel=cache / cache+prune: the token cache's knobs (ROS: cache.*)
    prune: PruneConfig = PruneConfig()  # accel=prune / cache+prune: the pruning knobs (ROS: prune.*)
    # Precision per component, the compile switch and the gate's precision limits (ROS:
    # precision.*; fixed once the policy is built).
    precision: PrecisionConfig = PrecisionConfig()
    memo: MemoConfig = MemoConfig()  # reasoning bundles: MEMO-VLM reuse of the reasoning (ROS: memo.*)

    @property
    def uses_cache(self) -> bool:
        return self.accel in ("cache", "cache+prune")

    @property
    def uses_prune(self) -> bool:
        return self.accel in ("prune", "cache+prune")

    def noise_scale(self, bundle_scale: float) -> float:
        """The noise scale flow chunks start from: ``flow_noise_scale``, or where it is -1 the
        bundle's (``bundle_scale``: how the policy was validated)."""
        return self.flow_noise_scale if self.flow_noise_scale >= 0 else bundle_scale

    def validate(self) -> None:
        if -1.0 < self.flow_noise_scale < 0.0:
            raise ConfigError(
                f"PolicyConfig.flow_noise_scale={self.flow_noise_scale!r} is neither -1 (the bundle's noise_scale) nor in [0, 2]"
            )
