"""Every knob of image-token pruning (SpecPrune-VLA), validated in one place.

The ROS layer mirrors these as ``policy.prune.<name>`` parameters. Token counts are given per
256 image tokens of a camera (OpenVLA's 16 x 16 grid) and scale with a bundle's grid, like the
token cache's. Layer positions of the dynamic pruning are fractions of the decoder's depth, so
one setting means the same on a 4-layer and a 32-layer model (SpecPrune prunes at layers 5,
10, 15, 20 of 32: about 0.16, 0.31, 0.47, 0.63).

Static pruning (once per inference, after the first ``spec_layers`` layers ran over every image
token) keeps the union of

* global: the ``keep_global`` tokens the previous inference found most important (its
  layer-level importance after the last layer; the paper's previous-step attention);
* dynamic: up to ``keep_dynamic`` tokens whose patch changed most against a reference frame,
  those below ``dynamic_threshold`` cosine; the reference is ``reference_lag`` processed frames
  back in coarse motion and ``reference_lag_fine`` in fine motion (a slowly moving arm changes
  little from one frame to the next);
* local: the ``keep_local`` tokens the speculative layers' text queries attend to most;

and drops the rest for the remaining layers (the paper: 50-70% of the image tokens; the default
counts keep 80 of 256 on the small demo ar bundle, the aggressive end). In fine motion every
keep count is multiplied by ``fine_scale`` (fine manipulation is pruning-sensitive: keep more).

Layer-level pruning then keeps ``dynamic_keep`` of the remaining image tokens at each of
``dynamic_layers`` (``dynamic_keep_fine`` in fine motion), ranked by an EMA over layers of a
per-layer score: rank weight (a sigmoid of the token's attention rank) times the layer's
confidence (how peaked its attention is: std / mean of the text-to-image attention).

Over the token cache (``cache+prune``) only tokens the frame computes are dropped: reused ones
cost no row and stay (they count toward ``min_keep``), and ``dynamic_keep`` applies to the
computed ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError


@dataclass(frozen=True)
class PruneConfig(Config):
    spec_layers: int = param(
        2, doc="layers run over every image token before static pruning (self-speculation); the paper uses 1-2",
        range=(1, 1023),
    )  # fmt: skip
    keep_global: int = param(48, doc="tokens kept for their importance in the previous inference, per 256", range=(0, 256))
    keep_local: int = param(48, doc="tokens kept for the speculative layers' attention, per 256", range=(0, 256))
    keep_dynamic: int = param(24, doc="at most this many changed tokens kept, per 256", range=(0, 256))
    min_keep: int = param(16, doc="never keep fewer image tokens than this per camera, per 256", range=(1, 256))
    dynamic_threshold: float = param(
        0.986, doc="a patch whose raw-pixel cosine to the reference frame is below this counts as changed "
        "(SpecPrune's code: 0.986)", range=(0.0, 1.0),
    )  # fmt: skip
    reference_lag: int = param(1, doc="coarse motion: the reference frame is this many processed frames back", range=(1, 64))
    reference_lag_fine: int = param(
        4, doc="fine motion: the reference frame is this many processed frames back (the arm moves little)", range=(1, 64)
    )
    fine_scale: float = param(1.5, doc="fine motion multiplies every static keep count by this", range=(1.0, 16.0))
    dynamic_layers: tuple[float, ...] = param(
        (0.16, 0.31, 0.47, 0.63),
        doc="layer-level pruning at these fractions of the depth (empty: off), ascending; SpecPrune's layers",
        range=(0.0, 1.0),
    )
    dynamic_keep: float = param(0.85, doc="layer-level pruning keeps this fraction of the remaining image tokens", range=(0.05, 1.0))
    dynamic_keep_fine: float = param(1.0, doc="... in fine motion (1: no layer-level pruning)", range=(0.05, 1.0))
    ema: float = param(0.5, doc="weight of the newest layer in the importance EMA", range=(0.01, 1.0))
    rank_sharpness: float = param(
        8.0, doc="slope of the sigmoid that turns a token's attention rank into its weight", range=(0.0, 1000.0)
    )

    def validate(self) -> None:
        d = self.dynamic_layers
        if any(b <= a for a, b in zip(d, d[1:])):
            raise ConfigError(f"PruneConfig.dynamic_layers={list(d)} must be strictly ascending")
        if self.dynamic_keep_fine < self.dynamic_keep:
            raise ConfigError(
                f"PruneConfig.dynamic_keep_fine={self.dynamic_keep_fine} is below dynamic_keep={self.dynamic_keep}: "
                "fine motion must keep at least as many tokens as coarse"
            )
        if self.reference_lag_fine < self.reference_lag:
            raise ConfigError(
                f"PruneConfig.reference_lag_fine={self.reference_lag_fine} is below reference_lag={self.reference_lag}: "
                "the reference frame is taken further back when the arm moves little"
            )

    def check_layers(self, num_layers: int) -> None:
        """Checks that need the model's depth; raises ConfigError naming the field."""
        if self.spec_layers >= num_layers:
            raise ConfigError(
                f"PruneConfig.spec_layers={self.spec_layers} leaves no layer to prune: the model has {num_layers} layers"
            )

    def prune_layers(self, num_layers: int) -> list[int]:
        """Layers after which layer-level pruning drops tokens (from the next layer on)."""
        out = []
        for f in self.dynamic_layers:
            layer = min(num_layers - 2, max(self.spec_layers, int(round(f * num_layers)) - 1))
            if layer not in out and layer >= self.spec_layers:
                out.append(layer)
        return out
