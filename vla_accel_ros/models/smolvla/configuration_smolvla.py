"""The options of a ``smolvla`` bundle: what LeRobot's ``SmolVLAConfig`` says about the forward
pass, validated, and the per-layer plan of the action expert derived from it.

A bundle keeps LeRobot's own option values (``options`` in its config.json) so that it says
what the checkpoint was trained with; :meth:`SmolVLAOptions.layer_plan` turns them into what
each VLM layer does while denoising, by LeRobot's rules:

* the VLM keeps its first ``num_vlm_layers`` layers (the bundle's ``lm`` has exactly those);
* the expert has ``num_expert_layers`` layers (<= 0: as many as the VLM); with fewer, expert
  layer ``j`` runs beside VLM layer ``j * m`` (``m`` = VLM layers / expert layers) and the VLM
  layers in between pass the action tokens through unchanged;
* with an ``attention_mode`` containing ``cross``, VLM layer ``i`` is a self-attention layer
  when ``self_attn_every_n_layers`` > 0 and ``i`` is a multiple of it (the action tokens attend
  to the cached prefix K/V and to each other, causally), else a cross-attention layer (they
  attend to the prefix only, through the expert's own K/V maps applied to the VLM's cached
  keys and values); otherwise every layer is a self-attention layer;
* the expert layers LeRobot builds with VLM-width K/V maps are those whose own index is not a
  multiple of ``self_attn_every_n_layers`` (all of them when it is <= 0), in cross mode.

A combination LeRobot itself cannot run (a self-attention layer with no expert layer beside
it, K/V maps whose input size is not what the layer feeds them) is refused naming the options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from vla_accel_ros.core.config import param
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.models.lerobot.reader import ImportOptions
from vla_accel_ros.models.lerobot_compat import LeRobotOptions


@dataclass(frozen=True)
class SmolVLAImport(ImportOptions):
    """What importing a LeRobot SmolVLA checkpoint takes besides every family's options."""

    vlm: str | None = param(None, doc="the SmolVLM directory (None: vlm_model_name as a path, beside the checkpoint, or in the local Hugging Face cache)")


class LayerStep(NamedTuple):
    """What VLM layer ``vlm_layer`` does to the action tokens while denoising."""

    vlm_layer: int
    expert_layer: int  # -1: none (the tokens pass through this layer unchanged)
    kind: str  # "self" | "cross" | "skip"


@dataclass(frozen=True)
class SmolVLAOptions(LeRobotOptions):
    """LeRobot SmolVLAConfig fields that change the forward pass, as a bundle stores them."""

    import_options: ClassVar[type[ImportOptions]] = SmolVLAImport  # what `bundle import --lerobot` takes

    attention_mode: str = param("cross_attn", doc="LeRobot attention_mode: containing 'cross', the expert interleaves cross-attention layers")
    self_attn_every_n_layers: int = param(2, doc="in cross mode, VLM layers that are multiples of this are self-attention layers (<= 0: none)", range=(-1, 1024))
    num_expert_layers: int = param(-1, doc="expert depth (<= 0: the VLM's)", range=(-1, 1024))
    add_image_special_tokens: bool = param(False, doc="<fake_token_around_image><global-img> before and <fake_token_around_image> after each camera's image tokens")
    fake_image_token_id: int = param(-1, doc="id of <fake_token_around_image> (from the tokenizer; -1: none)", range=(-1, 10_000_000))
    global_image_token_id: int = param(-1, doc="id of <global-img> (from the tokenizer; -1: none)", range=(-1, 10_000_000))
    min_period: float = param(4e-3, doc="shortest period of the flow time's sine-cosine embedding", range=(1e-9, 1e9))
    max_period: float = param(4.0, doc="longest period of the flow time's sine-cosine embedding", range=(1e-9, 1e9))

    def validate(self) -> None:
        if self.min_period >= self.max_period:
            raise ConfigError(f"SmolVLAOptions.min_period={self.min_period} must be below max_period={self.max_period}")
        if self.add_image_special_tokens and min(self.fake_image_token_id, self.global_image_token_id) < 0:
            raise ConfigError("SmolVLAOptions.add_image_special_tokens needs fake_image_token_id and global_image_token_id")

    @property
    def cross(self) -> bool:
        return "cross" in self.attention_mode

    def expert_depth(self, vlm_layers: int) -> int:
        return self.num_expert_layers if self.num_expert_layers > 0 else vlm_layers

    def vlm_width_kv(self, vlm_layers: int) -> tuple[bool, ...]:
        """Per expert layer: its K/V maps read the VLM's keys (VLM K/V width in), as LeRobot builds them."""
        n = self.self_attn_every_n_layers
        return tuple(self.cross and not (n > 0 and j % n == 0) for j in range(self.expert_depth(vlm_layers)))

    def layer_plan(self, vlm_layers: int) -> list[LayerStep]:
        """What each VLM layer does while denoising (see the module docstring)."""
        experts = self.expert_depth(vlm_layers)
        if self.num_expert_layers > 0 and vlm_layers % experts:
            raise ConfigError(
                f"num_expert_layers={experts} must divide the VLM's {vlm_layers} layers (num_vlm_layers), as LeRobot requires"
            )
        m = vlm_layers // experts
        n = self.self_attn_every_n_layers
        plan = []
        for i in range(vlm_layers):
            j = -1 if (m > 0 and i > 0 and i % m) else (i // m if m > 0 else i)
            self_attn = not self.cross or (n > 0 and i % n == 0)
            if j < 0 and self_attn:
                raise ConfigError(
                    f"num_expert_layers={experts} with self_attn_every_n_layers={n}: VLM layer {i} is a self-attention "
                    "layer with no expert layer beside it (LeRobot cannot run this either)"
                )
            plan.append(LayerStep(i, j, "skip" if j < 0 else ("self" if self_attn else "cross")))
        return plan

    def check_kv_widths(self, vlm_layers: int, expert_hidden: int, vlm_kv_width: int) -> None:
        """Each expert layer's K/V maps take what its kind feeds them: the expert's hidden state
        (self-attention) or the VLM's keys and values (cross-attention)."""
        wide = self.vlm_width_kv(vlm_layers)
        for step in self.layer_plan(vlm_layers):
            if step.kind == "skip":
                continue
            takes = vlm_kv_width if wide[step.expert_layer] else expert_hidden
            needs = vlm_kv_width if step.kind == "cross" else expert_hidden
            if takes != needs:
                raise ConfigError(
                    f"attention_mode={self.attention_mode!r}, self_attn_every_n_layers={self.self_attn_every_n_layers}, "
                    f"num_expert_layers={self.num_expert_layers}: expert layer {step.expert_layer} runs {step.kind}-attention "
                    f"at VLM layer {step.vlm_layer} but its K/V maps take {takes} inputs, not {needs} (LeRobot cannot run this either)"
                )
