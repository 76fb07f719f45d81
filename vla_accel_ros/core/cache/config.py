"""Every knob of the per-frame token cache (VLA-Cache), validated in one place.

The ROS layer mirrors these fields as ``cache.<name>`` parameters, so each one is a plain
scalar or tuple with a range or choices. Token counts (``topk_reuse``, ``relevance_topk``)
are given per 256 image tokens (OpenVLA's 16 x 16 grid, the paper's unit) and scale with a
bundle's grid.

Why the default layer schedule is ``fixed`` (reuse from layer 2 on), not the paper's entropy
schedule: the entropy schedule turns a model's attention statistics into reuse, so what a
user gets depends on the weights in ways they cannot see; with flat attention (random demo
weights measure H_l = ln 256 +- 0.003 nats at every layer) it reuses almost nothing, and on
a trained model k must be tuned per model. The fixed schedule makes reuse a function of the
scene only (predictable latency, which a controller cares about), matches what the public
code actually runs (layers 0-1 always recompute, full reuse after), and the entropy
schedule stays one setting away. Relevance eviction defaults to the paper's threshold mode:
when attention is uninformative (flat), relevance / max is near 1 everywhere and every
static token is evicted, so the failure mode is "no reuse", never "wrong reuse".
"""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError


@dataclass(frozen=True)
class CacheConfig(Config):
    # -- static token selection (raw-pixel patch cosine vs the frame whose K/V is cached) -------
    sim_threshold: float = param(
        0.996,
        doc="patch cosine similarity (raw pixels, vs the cached patch) at or above which a token is static; "
        "the paper uses 0.996 in simulation and 0.85 on a real camera",
        range=(0.0, 1.0),
    )
    max_relative_change: float = param(
        0.1,
        doc="and at most this relative L2 change ||new - cached|| / ||cached|| (the cosine alone calls a patch "
        "whose pixels all halved static); 1e6 disables it (the paper's rule)",
        range=(0.0, 1e6),
    )
    topk_reuse: int = param(
        100,
        doc="at most this many reused tokens per camera per 256 image tokens (the most similar win; "
        "paper: 100 of 256; 256 disables the cap)",
        range=(0, 256),
    )
    # -- task-relevance eviction (previous step's text-to-image attention) ---------------------
    relevance_mode: str = param(
        "threshold",
        doc="evict task-relevant tokens from reuse: threshold (relevance / max >= relevance_threshold), "
        "topk (the relevance_topk most attended) or off",
        choices=("threshold", "topk", "off"),
    )
    relevance_threshold: float = param(
        0.5, doc="threshold mode: recompute tokens whose relevance, normalized to the camera's max, is at least this",
        range=(0.0, 1.0),
    )
    relevance_topk: int = param(
        100, doc="topk mode: recompute the this many most attended tokens per camera per 256 image tokens",
        range=(0, 256),
    )
    relevance_layer: int = param(
        -1,
        doc="decoder layer whose text-to-image attention scores relevance (-1: the middle layer, "
        "num_layers // 2, like the public code's layer 15 of 32)",
        range=(-1, 1023),
    )
    # -- layer-adaptive reuse -------------------------------------------------------------------
    layer_schedule: str = param(
        "fixed",
        doc="fixed: reuse the whole reusable set from the first reuse layer on (stepped evenly over "
        "reuse_layers when given); entropy: the paper's alpha_l = min(k * sum_j R_j, 1) from the "
        "previous step's attention entropy",
        choices=("fixed", "entropy"),
    )
    entropy_k: float = param(
        1.0, doc="entropy schedule: the paper's k, the gain on the cumulative relative entropy drop", range=(0.0, 1000.0)
    )
    force_recompute_layers: int = param(
        2,
        doc="layers [0, n) recompute every token (the public code always recomputes layers 0-1); with cache+prune "
        "keep it >= prune.spec_layers (pruning ranks tokens in those layers: reuse there cost a trained policy)",
        range=(0, 1024),
    )
    reuse_layers: tuple[int, ...] = param(
        (),
        doc="layers at which the reused set may grow, ascending, each >= force_recompute_layers (the public "
        "code's 2, 6, 9, 11); empty: every layer from force_recompute_layers on",
        range=(0, 1023),
    )
    reuse_vision: bool = param(
        False,
        doc="also reuse the vision tower's work: only the patches of tokens outside the reusable set (changed, "
        "aged, evicted, capped) run through the vision encoder, the others keep the encoder K/V and image-token "
        "embeddings of the frame that last computed them; with force_recompute_layers >= the decoder's depth "
        "only this is reused (the decoder recomputes every token: preset vision-only)",
    )
    # -- lifecycle ------------------------------------------------------------------------------
    scene_cut_fraction: float = param(
        0.5, doc="a camera whose fraction of static patches falls below this (most patches changed: a view "
        "change, an exposure jump) is a scene cut: all its tokens are recomputed", range=(0.0, 1.0),
    )
    max_reuse_age: int = param(
        8, doc="a token reused for this many consecutive frames is recomputed, so approximation error cannot "
        "accumulate", range=(1, 10_000),
    )
    stagger_refresh: bool = param(
        True,
        doc="spread the max-age refreshes over frames (after a reset token i starts at age i mod max_reuse_age) "
        "so no single frame pays for a full refresh; no token ever exceeds max_reuse_age",
    )

    def validate(self) -> None:
        layers = self.reuse_layers
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ConfigError(f"CacheConfig.reuse_layers={list(layers)} must be strictly ascending")
        if layers and layers[0] < self.force_recompute_layers:
            raise ConfigError(
                f"CacheConfig.reuse_layers={list(layers)} starts before force_recompute_layers="
                f"{self.force_recompute_layers} (those layers recompute every token)"
            )

    def check_layers(self, num_layers: int) -> None:
        """Checks that need the model's depth; raises ConfigError naming the field."""
        if self.relevance_layer >= num_layers:
            raise ConfigError(
                f"CacheConfig.relevance_layer={self.relevance_layer} is out of range [-1, {num_layers - 1}] "
                f"for this model ({num_layers} decoder layers)"
            )
        if self.reuse_layers and self.reuse_layers[-1] >= num_layers:
            raise ConfigError(
                f"CacheConfig.reuse_layers={list(self.reuse_layers)}: each must be in [0, {num_layers - 1}] "
                f"for this model ({num_layers} decoder layers)"
            )

    def tap_layer(self, num_layers: int) -> int:
        return num_layers // 2 if self.relevance_layer < 0 else self.relevance_layer
