"""How a policy decides which prefix tokens to compute at each layer.

The policy builds the prefix (image tokens per camera, instruction tokens, state) and asks a
:class:`PrefixPlanner` which slots to compute per layer. The default planner recomputes
everything; the token cache (VLA-Cache) and pruning planners return smaller, nested sets.
The planner sees the preprocessed frames and, after the forward, the attention taps it asked
for, so every selection cost lands inside the policy's "select" stage timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from vla_accel_ros.core.engine import PruneHook, TapResult, TapSpec


@dataclass(frozen=True)
class PrefixLayout:
    """Slot layout of one observation's prefix (for the prefix, slot == RoPE position).

    cameras[i]'s image tokens occupy ``image_slots(i)``: a row-major grid x grid block starting
    at ``camera_start(i)``; consecutive cameras are ``camera_stride`` slots apart (0: adjacent;
    more when special tokens sit around each camera's image, as SmolVLM's optional ones).
    ``fixed_slots`` hold tokens that never change within an episode (e.g. BOS).
    """

    cameras: tuple[str, ...]
    grid: int  # image tokens per side
    patch_size: int  # pixels per token side at the model's image size
    image_size: int
    image_start: int
    text_start: int
    text_len: int
    state_slot: int | None
    length: int  # P
    fixed_slots: tuple[int, ...]
    attention: Literal["causal", "bidirectional"]
    num_layers: int
    camera_stride: int = 0
    # Pixel side of the vision patches a token merges (0: the token is one patch). A token is
    # static only when each of them is (a small change inside a 64 x 64 pixel token of 16 x 16
    # patches moves that patch's features, and through it the token).
    static_patch: int = 0

    @property
    def tokens_per_camera(self) -> int:
        return self.grid * self.grid

    @property
    def num_image_tokens(self) -> int:
        return self.tokens_per_camera * len(self.cameras)

    def camera_start(self, camera_index: int) -> int:
        return self.image_start + camera_index * (self.camera_stride or self.tokens_per_camera)

    def image_slots(self, camera_index: int | None = None) -> torch.Tensor:
        """Slots of one camera's image tokens, or of every camera's in camera order."""
        if camera_index is None:
            if not self.camera_stride:
                return torch.arange(self.image_start, self.image_start + self.num_image_tokens)
            return torch.cat([self.image_slots(i) for i in range(len(self.cameras))])
        s = self.camera_start(camera_index)
        return torch.arange(s, s + self.tokens_per_camera)

    def text_slots(self) -> torch.Tensor:
        return torch.arange(self.text_start, self.text_start + self.text_len)

    def all_slots(self) -> torch.Tensor:
        return torch.arange(self.length)


@dataclass
class PrefixPlan:
    """Per layer, the ascending prefix slots computed there (nested: each a subset of the one
    before). ``layer_slots[0]`` are the rows whose embeddings the policy feeds in. A slot that
    leaves the set is reused from the cache at later layers, unless ``drop`` prunes it."""

    layer_slots: list[torch.Tensor]
    drop: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> slots pruned from it on
    # layer -> reused slots with no K/V from that layer on (an earlier frame pruned them there):
    # the engine has nothing to do for them, the statistics count them as dropped
    absent: dict[int, torch.Tensor] = field(default_factory=dict)
    taps: TapSpec | None = None
    prune: PruneHook | None = None  # drops decided during the forward (pruning planners)
    full: bool = True  # every slot computed at every layer
    reset_reason: str = ""  # why the plan is a forced full recompute ("" if not)
    stats: dict[str, Any] = field(default_factory=dict)
    # [C, T] bool: the image tokens whose vision-tower features are computed this frame, the
    # others keeping the policy's cached ones (token cache with reuse_vision); None: the whole
    # tower runs over every camera it needs, nothing cached.
    vision_fresh: torch.Tensor | None = None


@dataclass
class PrefixContext:
    """What a planner may look at for one observation."""

    layout: PrefixLayout
    # The frames [C, S, S, 3] uint8 at the model's resolution, or an object whose ``raw`` is
    # them, made on first read: the full recompute never looks (see :attr:`frames`).
    images: Any
    instruction: str
    episode: int
    stamp_ns: int
    # The model and KV cache this prefix runs on (one per policy instance): a planner that
    # carries cached state across frames resets when it changes (a bundle swap).
    source: str = ""
    # The arm's motion mode from the controller (coarse | fine; Policy.set_motion_mode), for
    # planners that prune by it; the others ignore it.
    motion_mode: str = "coarse"

    @property
    def frames(self) -> torch.Tensor:
        return self.images if isinstance(self.images, torch.Tensor) else self.images.raw


class PrefixPlanner(Protocol):
    name: str

    def plan(self, ctx: PrefixContext) -> PrefixPlan: ...

    def update(self, ctx: PrefixContext, plan: PrefixPlan, taps: TapResult | None) -> None:
        """Called after the prefix forward with the taps the plan asked for."""
        ...

    def reset(self, reason: str = "explicit") -> None: ...


class FullRecompute:
    """The baseline: every prefix token at every layer, every frame."""

    name = "baseline"

    def plan(self, ctx: PrefixContext) -> PrefixPlan:
        slots = ctx.layout.all_slots()
        return PrefixPlan(layer_slots=[slots] * ctx.layout.num_layers, full=True)

    def update(self, ctx: PrefixContext, plan: PrefixPlan, taps: TapResult | None) -> None:
        pass

    def reset(self, reason: str = "explicit") -> None:
        pass


def plan_stats(
    plan: PrefixPlan, layout: PrefixLayout, computed: list[int], mode: str, dropped: dict[int, torch.Tensor] | None = None
) -> dict:
    """The statistics every inference reports about its prefix (both families, every planner).

    ``dropped``: the engine's record of pruned slots (layer -> slots dropped from it on). Image
    tokens per layer are then computed (recomputed this frame), reused (valid K/V from an
    earlier frame) or dropped (no valid K/V); ``tokens_kept_fraction`` is the mean over layers
    of the image tokens not dropped."""
    img = layout.image_slots()
    is_img = torch.zeros(layout.length, dtype=torch.bool)
    is_img[img] = True
    n_img, L = layout.num_image_tokens, len(plan.layer_slots)
    gone = torch.zeros(layout.length, dtype=torch.bool)
    dropped_per_layer, kept_per_layer, computed_img = [], [], []
    for l, slots in enumerate(plan.layer_slots):
        for d in ((dropped or {}).get(l), plan.absent.get(l)):
            if d is not None:
                gone[d[d < layout.length]] = True
        n_gone = int((gone & is_img).sum())
        dropped_per_layer.append(n_gone)
        kept_per_layer.append(n_img - n_gone)
        s_img = slots[is_img[slots]]
        computed_img.append(int((~gone[s_img]).sum()))
    pairs = max(1, n_img * L)
    stats = {
        "mode": mode,
        "tokens_total": layout.length,
        "tokens_recomputed": int(plan.layer_slots[0].numel()),
        "recomputed_per_layer": computed,
        "image_recomputed_per_layer": computed_img,
        "image_kept_per_layer": kept_per_layer,
        # token-layers whose K/V came from an earlier frame (neither recomputed nor dropped)
        "reuse_fraction": (sum(kept_per_layer) - sum(computed_img)) / pairs,
        "tokens_kept_fraction": sum(kept_per_layer) / pairs,
        "tokens_pruned": dropped_per_layer[-1] if dropped_per_layer else 0,
        "cache_reset": bool(plan.reset_reason),
        "reset_reason": plan.reset_reason,
    }
    stats.update(plan.stats)
    return stats
