"""The per-frame token cache (VLA-Cache) as a :class:`PrefixPlanner`, for both families.

Per camera, the new preprocessed frame is compared patch by patch (raw-pixel cosine, on the
image-token grid) with the *reference* patch of each token: the patch whose K/V the cache
holds. Static tokens, minus task-relevant ones (previous step's text-to-image attention) and
tokens at their maximum reuse age, capped at the top-k most similar, form the reusable set;
the layer schedule reuses a growing, nested part of it from the first reuse layer on. Rows
that leave the computed set keep the K/V already in the cache (the engine's reuse).

Reference bookkeeping (the paper's code compares a frame with itself; ours must not): a
token's reference patch is replaced only when the token was computed at *every* layer this
step. A token reused at some layer keeps its old reference, because its deep-layer K/V still
come from that frame (or from frames that were themselves within threshold of it). So slow
drift is measured against what is cached and cannot accumulate unseen, and the max reuse age
bounds how old any cached K/V can get. Pruning (``cache+prune``) cuts a token's K/V short at
the layer it drops it: the cache keeps each token's depth and reuses such a token below it
only, absent above (``PrefixPlan.absent``).

What is exact and what is not: ``ar`` (causal) image tokens only see BOS and earlier image
tokens, so reusing an unchanged prefix is exact and BOS is always reusable once computed; the
prompt after the images is recomputed at every layer. ``flow`` (bidirectional) image tokens
see the whole prefix, so any reuse is an approximation; the prompt and state are always
recomputed and the benchmark measures the deviation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vla_accel_ros.core.cache import selection as sel
from vla_accel_ros.core.cache.config import CacheConfig
from vla_accel_ros.core.cache.schedule import layer_alpha
from vla_accel_ros.core.engine import TapResult, TapSpec
from vla_accel_ros.core.errors import PlanError
from vla_accel_ros.core.prefix import PrefixContext, PrefixLayout, PrefixPlan


@dataclass
class Selection:
    """What one plan decided, per camera and token ([C, T]); kept for tests and debugging."""

    similarity: torch.Tensor  # [C, T] cosine vs the reference patch (1 on a reset frame)
    static: torch.Tensor  # [C, T] bool: similarity >= threshold
    scene_cut: torch.Tensor  # [C] bool
    aged: torch.Tensor  # [C, T] bool: static but at max reuse age -> recomputed
    evicted: torch.Tensor  # [C, T] bool: static but task-relevant -> recomputed
    capped: torch.Tensor  # [C, T] bool: reusable but beyond the top-k cap -> recomputed
    reuse_start: torch.Tensor  # [C, T] int64: first layer the token is reused at (L: never)
    alpha: list[float]
    kept: torch.Tensor  # [C, T] bool: the reusable set (static, not aged, evicted or capped)

    @property
    def reused(self) -> torch.Tensor:
        return self.reuse_start < len(self.alpha)  # [C, T] bool


@dataclass
class _Pending:
    """A plan waiting for its update(): what update() needs to advance the state."""

    plan: PrefixPlan
    patches: torch.Tensor  # [C, T, D] float32
    norms: torch.Tensor  # [C, T]
    reuse_start: torch.Tensor  # [C, T]
    scene_cut: torch.Tensor  # [C] bool
    reset: bool


@dataclass(frozen=True)
class _Key:
    """What must not change between two frames for the cached K/V to stay meaningful."""

    source: str
    episode: int
    instruction: str
    layout: PrefixLayout
    frame_shape: tuple[int, ...]


class TokenCachePlanner:
    """VLA-Cache: reuse the K/V of static image tokens across consecutive frames.

    A frame recomputes everything (``PrefixPlan.reset_reason``) after: ``initial`` (new
    planner), ``explicit`` (``reset()``, e.g. ``policy.reset()``), ``episode``,
    ``instruction``, ``cameras``, ``resolution``, ``bundle`` (another model / KV cache, or a
    layout of another shape), ``scene_cut`` (every camera below ``scene_cut_fraction``
    static), ``incomplete step`` (a plan whose forward never reported back) and
    ``external prefix write`` (the policy wrote prefix K/V outside ``infer``). A scene cut of
    only some cameras recomputes those cameras.
    """

    name = "cache"

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.last: Selection | None = None
        self._pending: _Pending | None = None
        self.reset("initial")

    # -- lifecycle ----------------------------------------------------------------------------
    def reset(self, reason: str = "explicit") -> None:
        """Forget every cached reference; the next plan recomputes everything and reports why."""
        self._reason = reason or "explicit"
        self._key: _Key | None = None
        self._ref: torch.Tensor | None = None  # [C, T, D] reference patches (whose K/V is cached)
        self._ref_norm: torch.Tensor | None = None  # [C, T]
        self._age: torch.Tensor | None = None  # [C, T] consecutive frames reused
        # [C, T] the layers [0, depth) hold the token's K/V (L: all; less once pruning dropped it)
        self._depth: torch.Tensor | None = None
        self._relevance: torch.Tensor | None = None  # [C, T] previous step's text-to-image attention
        self._entropy: list[float] | None = None  # previous step's per-layer attention entropy
        self._pending = None

    def _key_of(self, ctx: PrefixContext) -> _Key:
        return _Key(getattr(ctx, "source", ""), ctx.episode, ctx.instruction, ctx.layout, tuple(ctx.frames.shape))

    def _trigger(self, key: _Key) -> str:
        """Why this frame must recompute everything ("" when the cache may be used)."""
        if self._pending is not None:
            # The previous plan never got its update (its forward raised): the cache may hold
            # a half-written frame.
            return "incomplete step"
        old = self._key
        if self._ref is None or old is None:
            return self._reason
        a, b = old.layout, key.layout
        if key.source != old.source:
            return "bundle"
        if key.episode != old.episode:
            return "episode"
        if a.cameras != b.cameras:
            return "cameras"
        if a.image_size != b.image_size or old.frame_shape != key.frame_shape:
            return "resolution"
        if (a.grid, a.patch_size, a.num_layers, a.attention, a.image_start, a.fixed_slots) != (
            b.grid, b.patch_size, b.num_layers, b.attention, b.image_start, b.fixed_slots,
        ):  # fmt: skip
            return "bundle"
        if key.instruction != old.instruction or a != b:
            return "instruction"
        return ""

    # -- planning -----------------------------------------------------------------------------
    def plan(self, ctx: PrefixContext, recompute: torch.Tensor | None = None) -> PrefixPlan:
        """``recompute``: [C, T] bool, tokens not to reuse this frame (pruning wants back tokens
        it dropped earlier)."""
        cfg, lay = self.config, ctx.layout
        L, C, T = lay.num_layers, len(lay.cameras), lay.tokens_per_camera
        cfg.check_layers(L)
        frames = ctx.frames
        if frames.dtype != torch.uint8 or tuple(frames.shape) != (C, lay.image_size, lay.image_size, 3):
            raise PlanError(
                f"frames must be uint8 [{C}, {lay.image_size}, {lay.image_size}, 3], got {frames.dtype} {list(frames.shape)}"
            )
        if lay.grid * lay.patch_size != lay.image_size:
            raise PlanError(f"grid {lay.grid} x patch {lay.patch_size} != image size {lay.image_size}")
        key = self._key_of(ctx)
        reason = self._trigger(key)
        if reason:
            self.reset(reason)
        self._key = key
        patches = sel.patchify(frames, lay.patch_size, lay.static_patch)  # [C, T, p*p*3]
        norms = sel.patch_norms(patches)  # [C, T]
        taps = self._taps(lay)
        never = torch.full((C, T), L, dtype=torch.long)

        s = None if reason else self._select(lay, patches, norms, recompute)
        if s is not None and bool(s.scene_cut.all()):
            reason = "scene_cut"  # every camera changed: recompute everything, refresh all references
        if reason:
            slots = lay.all_slots()
            plan = PrefixPlan(layer_slots=[slots] * L, taps=taps, full=True, reset_reason=reason)
            no = torch.zeros(C, T, dtype=torch.bool)
            if s is None:
                s = Selection(torch.ones(C, T), no, torch.zeros(C, dtype=torch.bool), no, no, no, never, [0.0] * L, no)
            else:
                s = Selection(s.similarity, s.static, s.scene_cut, no, no, no, never, [0.0] * L, no)
            self.last = s
            plan.stats = self._stats(s, fixed_reused=0)
            if cfg.reuse_vision:  # every patch through the tower, its state cached for the next frames
                plan.vision_fresh = torch.ones(C, T, dtype=torch.bool)
                plan.stats["vision_reused"] = 0
            self._pending = _Pending(plan, patches, norms, never, torch.ones(C, dtype=torch.bool), reset=True)
            return plan

        start = torch.full((lay.length,), L, dtype=torch.long)  # [P] first reused layer per slot
        start[lay.image_slots()] = s.reuse_start.reshape(-1)
        fixed = self._reusable_fixed(lay)
        if fixed.numel():
            start[fixed] = 0  # context-free K/V (BOS under a causal mask): exact at every layer
        layer_slots: list[torch.Tensor] = []
        changes = set(start.tolist())  # the rows only shrink at layers where some slot's reuse starts
        for l in range(L):
            if layer_slots and l not in changes:
                layer_slots.append(layer_slots[-1])  # same set: the engine skips re-indexing on identity
                continue
            rows = torch.nonzero(start > l).flatten()
            if layer_slots and rows.numel() == layer_slots[-1].numel():
                rows = layer_slots[-1]
            layer_slots.append(rows)
        full = all(r.numel() == lay.length for r in layer_slots)
        plan = PrefixPlan(layer_slots=layer_slots, taps=taps, full=full, absent=self._absent(lay, s))
        plan.stats = self._stats(s, fixed_reused=int(fixed.numel()))
        if cfg.reuse_vision:
            # The reusable set keeps its vision features: the frame whose K/V a reused token
            # carries computed them. Where the layer schedule reuses a kept token at no decoder
            # layer (force_recompute_layers >= the depth: only the tower's work is reused), the
            # decoder recomputes it from those features.
            plan.vision_fresh = ~s.kept
            plan.stats["vision_reused"] = int(s.kept.sum())
        self.last = s
        self._pending = _Pending(plan, patches, norms, s.reuse_start, s.scene_cut, reset=False)
        return plan

    def _select(self, lay: PrefixLayout, patches: torch.Tensor, norms: torch.Tensor, recompute: torch.Tensor | None) -> Selection:
        cfg, L, T = self.config, lay.num_layers, lay.tokens_per_camera
        if lay.static_patch and lay.static_patch < lay.patch_size:
            # A token of several vision patches: each patch compared, the token as its least
            # similar patch (static only when every one of them is).
            new = sel.sub_patches(patches, lay.patch_size, lay.static_patch)
            ref = sel.sub_patches(self._ref, lay.patch_size, lay.static_patch)
            ref_norm = sel.patch_norms(ref)
            sim, change = sel.compare(new, sel.patch_norms(new), ref, ref_norm)
            sim, change = sim.amin(-1), change.amax(-1)  # [C, T]
        else:
            sim, change = sel.compare(patches, norms, self._ref, self._ref_norm)  # [C, T]
        # Static means the pixels did not change: the cosine alone is blind to a change of scale
        # (exposure, gain), so the relative change must be small too.
        static = (sim >= cfg.sim_threshold) & (change <= cfg.max_relative_change)
        cut = static.float().mean(-1) < cfg.scene_cut_fraction  # [C]
        # A token pruning dropped at layer d still has K/V below d: reused there, it is absent
        # from d on (as the frame that dropped it left it) and costs no row at all.
        static = static & (self._depth > 0)
        cand = static & ~cut[:, None]
        if recompute is not None:
            cand = cand & ~recompute
        aged = cand & (self._age >= cfg.max_reuse_age)
        cand = cand & ~aged
        evicted = torch.zeros_like(cand)
        if cfg.relevance_mode != "off" and self._relevance is not None:
            k = sel.scaled_count(cfg.relevance_topk, T)
            evicted = cand & sel.relevant_tokens(self._relevance, cfg.relevance_mode, cfg.relevance_threshold, k)
            cand = cand & ~evicted
        # One ranking serves the cap and the layer schedule: a kept token's rank among the
        # candidates is its rank among the kept ones (everything ranked above it is kept too).
        rank = sel.rank_within(sim, cand)  # [C, T]
        keep = cand & (rank < sel.scaled_count(cfg.topk_reuse, T))
        rank = torch.where(keep, rank, torch.full_like(rank, T))
        capped = cand & ~keep
        # Layer schedule: the alpha_l * n most similar reusable tokens are reused at layer l;
        # alpha is non-decreasing, so each token's reuse starts at one layer and lasts.
        alpha = layer_alpha(cfg, self._entropy, L)
        n = keep.sum(-1).tolist()  # [C]
        counts = torch.tensor([[math.floor(a * c + 1e-9) for c in n] for a in alpha], dtype=torch.long)  # [L, C]
        reused_at = counts[:, :, None] > rank[None]  # [L, C, T], monotone in l
        reuse_start = L - reused_at.sum(0)  # [C, T]
        return Selection(sim, static, cut, aged, evicted, capped, reuse_start, alpha, keep)

    def _absent(self, lay: PrefixLayout, s: Selection) -> dict[int, torch.Tensor]:
        """Layer -> the reused image slots whose K/V end there (see PrefixPlan.absent)."""
        L = lay.num_layers
        end = torch.where(s.reused, torch.maximum(self._depth, s.reuse_start), L).reshape(-1)  # [C*T]
        slots = lay.image_slots()
        return {int(l): slots[end == l] for l in torch.unique(end[end < L]).tolist()}

    def _reusable_fixed(self, lay: PrefixLayout) -> torch.Tensor:
        """Fixed slots whose K/V depend on nothing else: causal, before every other token."""
        if lay.attention != "causal" or not lay.fixed_slots:
            return torch.zeros(0, dtype=torch.long)
        first_other = min(lay.image_start, lay.text_start)
        if max(lay.fixed_slots) >= first_other or sorted(lay.fixed_slots) != list(range(len(lay.fixed_slots))):
            return torch.zeros(0, dtype=torch.long)
        return torch.tensor(lay.fixed_slots, dtype=torch.long)

    def _taps(self, lay: PrefixLayout) -> TapSpec | None:
        cfg = self.config
        layers: set[int] = set()
        if cfg.relevance_mode != "off":
            layers.add(cfg.tap_layer(lay.num_layers))
        if cfg.layer_schedule == "entropy":
            layers.update(range(lay.num_layers))
        if not layers or lay.text_len == 0:
            return None
        return TapSpec(
            layers=tuple(sorted(layers)), query_slots=lay.text_slots(), key_slots=lay.image_slots(),
            entropy=False,  # the entropy schedule computes its own from the probabilities
        )  # fmt: skip

    def _stats(self, s: Selection, fixed_reused: int) -> dict:
        return {
            "static_tokens": int(s.static.sum()),
            # static tokens of cameras without a scene cut: what the eviction, age and cap choose from
            "candidate_tokens": int((s.static & ~s.scene_cut[:, None]).sum()),
            "evicted_tokens": int(s.evicted.sum()),
            "capped_tokens": int(s.capped.sum()),
            "max_age_recomputed": int(s.aged.sum()),
            "reused_tokens": int(s.reused.sum()),
            "fixed_reused": fixed_reused,
            "scene_cut": bool(s.scene_cut.any()),
            "scene_cut_cameras": int(s.scene_cut.sum()),
            "alpha_per_layer": [round(a, 4) for a in s.alpha],
            "layer_schedule": self.config.layer_schedule,
            "relevance_available": self._relevance is not None,
        }

    def truncate(self, drop_layer: torch.Tensor) -> None:
        """After :meth:`update`: pruning dropped token (c, t) from layer ``drop_layer[c, t]`` on
        ([C, T] int64; the depth for tokens not dropped): its K/V ends there. Reused later, it
        stays absent from that layer on; recomputed at every layer, it is whole again."""
        if self._depth is not None:
            self._depth = torch.minimum(self._depth, drop_layer)

    # -- after the forward --------------------------------------------------------------------
    def update(self, ctx: PrefixContext, plan: PrefixPlan, taps: TapResult | None) -> None:
        pend = self._pending
        if pend is None or plan is not pend.plan:
            raise PlanError("TokenCachePlanner.update() got a plan it did not just make")
        self._pending = None
        cfg, lay = self.config, ctx.layout
        L, C, T = lay.num_layers, len(lay.cameras), lay.tokens_per_camera
        # Tokens computed at every layer hold this frame's K/V throughout: their patch becomes
        # the reference. Reused tokens keep the reference whose K/V (under reuse_vision: whose
        # vision features, a superset) they still carry, and age.
        fresh = pend.plan.vision_fresh if cfg.reuse_vision else pend.reuse_start >= L  # [C, T]
        offsets = (torch.arange(T) % cfg.max_reuse_age) if cfg.stagger_refresh else torch.zeros(T, dtype=torch.long)
        offsets = offsets.expand(C, T)
        if pend.reset:
            self._ref, self._ref_norm = pend.patches, pend.norms
            self._age = offsets.clone()
            self._depth = torch.full((C, T), L, dtype=torch.long)
        else:
            # Computed at every layer: whole. Reused from layer r: this frame wrote its K/V below r.
            self._depth = torch.where(fresh, L, torch.maximum(self._depth, pend.reuse_start))
            self._ref = torch.where(fresh[..., None], pend.patches, self._ref)
            self._ref_norm = torch.where(fresh, pend.norms, self._ref_norm)
            # A camera refreshed wholesale (scene cut) is staggered again like after a reset.
            restart = torch.where(pend.scene_cut[:, None], offsets, torch.zeros_like(offsets))
            self._age = torch.where(fresh, restart, self._age + 1)
        self._reason = ""
        self._relevance, self._entropy = None, None
        if taps is not None and plan.taps is not None:
            tap = cfg.tap_layer(L)
            if cfg.relevance_mode != "off" and tap in taps.attn:
                self._relevance = sel.relevance_from_attention(taps.attn[tap], C)
            if cfg.layer_schedule == "entropy" and all(l in taps.attn for l in range(L)):
                self._entropy = [sel.attention_entropy(taps.attn[l]) for l in range(L)]
