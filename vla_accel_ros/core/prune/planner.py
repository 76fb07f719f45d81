"""SpecPrune-VLA as a :class:`PrefixPlanner`: static and layer-level image-token pruning, alone
or on top of the token cache (``accel: cache+prune``), for both families.

One planner decides, per image token and per layer, whether it is recomputed, reused (the
token cache's K/V from an earlier frame) or dropped: the wrapped :class:`TokenCachePlanner`
(when there is one) gives the nested computed sets, and the pruning hook this planner hands
the engine drops tokens during the forward, from the attention the engine taps at every
layer (text queries over image keys):

* after layer ``spec_layers - 1`` (static pruning): every image token not in global (previous
  inference's importance) | dynamic (changed since the reference frame) | local (attended to
  by the speculative layers) is dropped for the remaining layers;
* after each layer-level pruning layer: the least important of the remaining tokens.

A dropped token's K/V is invalid from its drop layer on (no later layer, no decode step and no
flow expert step attends to it); its RoPE position and the K/V of earlier layers are kept. The
token cache is told which tokens lost their deep K/V, so it never reuses them next frame.

Over the token cache, pruning drops only tokens the frame computes at every layer (reused at
none): a reused token costs no row, so dropping it would save little this frame and cost its
reuse in the next ones. The keep counts rank every token (reused ones included); the
layer-level ratio applies to the computed ones, and ``min_keep`` counts the reused ones. A
token dropped at layer d keeps its K/V below d, and while its patch stays static the cache
reuses it there: absent from d on, it costs no row in the next frames either (the pruning
decision carried over with the K/V), until its pixels change, its reuse age runs out, or the
speculative layers of a frame rank it among their local tokens (it still has K/V there),
which brings it back, recomputed, the next frame.

Exactness: with ``keep`` counts of 256 (nothing dropped) the plan equals the wrapped planner's
(or the full recompute); any drop is an approximation, measured by the parity gate and the
benchmarks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from vla_accel_ros.core.cache import selection as sel
from vla_accel_ros.core.engine import TapResult, TapSpec
from vla_accel_ros.core.prefix import PrefixContext, PrefixLayout, PrefixPlan
from vla_accel_ros.core.prune.config import PruneConfig


class _PruneHook:
    """The engine's :class:`~vla_accel_ros.core.engine.PruneHook` for one forward."""

    def __init__(
        self, cfg: PruneConfig, lay: PrefixLayout, keep_static: torch.Tensor, fine: bool,
        computed: torch.Tensor | None = None, absent: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        L, C, T = lay.num_layers, len(lay.cameras), lay.tokens_per_camera
        self.cfg, self.C, self.T = cfg, C, T
        self.slots = lay.image_slots().reshape(C, T)
        self.static_layer = cfg.spec_layers - 1
        self.prune_layers = cfg.prune_layers(L)
        self.layers = frozenset(range(L - 1))  # every layer feeds the importance EMA
        self.fine = fine
        scale = cfg.fine_scale if fine else 1.0
        self.k_local = min(T, math.ceil(sel.scaled_count(cfg.keep_local, T) * scale))
        self.k_min = min(T, math.ceil(sel.scaled_count(cfg.min_keep, T) * scale))
        self.keep_static = keep_static  # [C, T] bool: global | dynamic, decided before the forward
        # [C, T] still computed / attended; tokens reused with no K/V at the last layer (a pruned
        # frame cut theirs short) start dropped
        self.absent = torch.zeros(C, T, dtype=torch.bool) if absent is None else absent
        self.kept = ~self.absent
        self.recall = torch.zeros(C, T, dtype=torch.bool)  # absent tokens the speculative layers asked for
        self.drop_layer = torch.full((C, T), L, dtype=torch.long)  # [C, T] first layer without the token
        self.score = torch.zeros(C, T)  # [C, T] layer-level importance (EMA)
        self.spec_attn = torch.zeros(C, T)  # [C, T] attention summed over the speculative layers
        self.local = torch.zeros(C, T, dtype=torch.bool)
        # [C, T] bool: the image tokens the plan computes at every layer (None: all of them)
        self.computed = computed

    def droppable(self) -> torch.Tensor:
        """[C, T] bool: the kept tokens a drop may take (none the plan reuses at any layer)."""
        return self.kept if self.computed is None else self.kept & self.computed

    def observe(self, attn: torch.Tensor) -> torch.Tensor:
        """Fold one layer's text-to-image attention [nq, C*T] into the importance EMA."""
        a = attn.float().mean(0).reshape(self.C, self.T)  # [C, T]
        k = self.kept
        n = k.sum(-1, keepdim=True).clamp_min(1)  # [C, 1]
        rank = sel.rank_within(a, k).float()  # 0 = most attended
        u = rank / (n - 1).clamp_min(1)
        w_rank = torch.sigmoid(self.cfg.rank_sharpness * (0.5 - u))
        kf = k.float()
        mean = (a * kf).sum(-1, keepdim=True) / n
        std = (((a - mean) ** 2) * kf).sum(-1, keepdim=True).div(n).sqrt()
        conf = std / mean.clamp_min(1e-12)  # [C, 1]: a peaked layer says more than a flat one
        b = self.cfg.ema
        self.score = torch.where(k, (1 - b) * self.score + b * w_rank * conf, self.score)
        return a

    def __call__(self, layer: int, attn: torch.Tensor) -> torch.Tensor | None:
        a = self.observe(attn)
        if layer <= self.static_layer:
            self.spec_attn += a
        if layer == self.static_layer:
            # Absent tokens still have K/V in the speculative layers: ranked with the others,
            # the ones that make the local set come back next frame (recomputed).
            self.local = sel.topk_mask(self.spec_attn, self.kept | self.absent, self.k_local)
            self.recall = self.local & self.absent
            keep = self.keep_static | self.local | sel.topk_mask(self.spec_attn, self.kept, self.k_min)
            return self._drop(~keep & self.droppable(), layer)
        if layer in self.prune_layers:
            ratio = self.cfg.dynamic_keep_fine if self.fine else self.cfg.dynamic_keep
            if ratio >= 1.0:
                return None
            cand = self.droppable()
            n, fixed = cand.sum(-1), (self.kept & ~cand).sum(-1)  # [C]: computed / reused kept tokens
            keep_n = [
                max(min(int(x), self.k_min - int(f)), math.ceil(ratio * int(x))) for x, f in zip(n, fixed)
            ]  # fmt: skip
            keep = torch.stack([sel.topk_mask(self.score[c], cand[c], keep_n[c]) for c in range(self.C)])
            return self._drop(cand & ~keep, layer)
        return None

    def _drop(self, mask: torch.Tensor, layer: int) -> torch.Tensor | None:
        if not bool(mask.any()):
            return None
        self.kept &= ~mask
        self.drop_layer[mask] = layer + 1
        return self.slots[mask]  # ascending: camera-major, row-major


def _computed_everywhere(lay: PrefixLayout, plan: PrefixPlan) -> torch.Tensor | None:
    """[C, T] bool: the image tokens ``plan`` computes at every layer (its sets are nested, so
    the last layer's); None when it computes everything."""
    if plan.full:
        return None
    return torch.isin(lay.image_slots(), plan.layer_slots[-1]).reshape(len(lay.cameras), lay.tokens_per_camera)


@dataclass
class _Pending:
    plan: PrefixPlan
    hook: _PruneHook
    patches: torch.Tensor  # [C, T, D]
    norms: torch.Tensor  # [C, T]


class PrunePlanner:
    """Image-token pruning, optionally over a token cache (``reuse``); see the module docstring.

    History (reference frames, the previous importance) is forgotten on the token cache's reset
    triggers: a new planner, ``reset()``, another episode, instruction, camera set, resolution or
    model.
    """

    def __init__(self, config: PruneConfig | None = None, reuse=None) -> None:
        self.config = config or PruneConfig()
        self.reuse = reuse
        self.name = "cache+prune" if reuse is not None else "prune"
        self.reset("initial")

    def reset(self, reason: str = "explicit") -> None:
        self._key = None
        self._history: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=self.config.reference_lag_fine)
        self._importance: torch.Tensor | None = None  # [C, T] from the previous inference
        self._pending: _Pending | None = None
        self._recall: torch.Tensor | None = None  # [C, T] tokens the last frame's local set wants back
        self.last_kept: torch.Tensor | None = None
        self.last_drop_layer: torch.Tensor | None = None
        if self.reuse is not None:
            self.reuse.reset(reason)

    def _key_of(self, ctx: PrefixContext) -> tuple:
        return (ctx.source, ctx.episode, ctx.instruction, ctx.layout, tuple(ctx.frames.shape))

    def plan(self, ctx: PrefixContext) -> PrefixPlan:
        cfg, lay = self.config, ctx.layout
        L, C, T = lay.num_layers, len(lay.cameras), lay.tokens_per_camera
        cfg.check_layers(L)
        key = self._key_of(ctx)
        if key != self._key or self._pending is not None:
            self._history.clear()
            self._importance = None
            self._recall = None
        self._key = key
        if self.reuse is not None:
            plan = self.reuse.plan(ctx, recompute=self._recall)
        else:
            slots = lay.all_slots()
            plan = PrefixPlan(layer_slots=[slots] * L, full=True)
        fine = ctx.motion_mode == "fine"
        scale = cfg.fine_scale if fine else 1.0
        patches = sel.patchify(ctx.frames, lay.patch_size)  # [C, T, p*p*3]
        norms = sel.patch_norms(patches)
        dynamic = torch.zeros(C, T, dtype=torch.bool)
        if self._history:
            lag = min(len(self._history), cfg.reference_lag_fine if fine else cfg.reference_lag)
            ref, ref_norm = self._history[-lag]
            sim = sel.cosine(patches, norms, ref, ref_norm)  # [C, T]
            k = min(T, math.ceil(sel.scaled_count(cfg.keep_dynamic, T) * scale))
            dynamic = sel.topk_mask(-sim, sim < cfg.dynamic_threshold, k)
        glob = torch.zeros(C, T, dtype=torch.bool)
        if self._importance is not None:
            k = min(T, math.ceil(sel.scaled_count(cfg.keep_global, T) * scale))
            glob = sel.topk_mask(self._importance, torch.ones_like(glob), k)
        absent = None
        if plan.absent:
            absent = torch.isin(lay.image_slots(), torch.cat(list(plan.absent.values()))).reshape(C, T)
        hook = _PruneHook(cfg, lay, glob | dynamic, fine, _computed_everywhere(lay, plan), absent)
        layers = set(range(L)) | (set(plan.taps.layers) if plan.taps is not None else set())
        plan.taps = TapSpec(
            layers=tuple(sorted(layers)), query_slots=lay.text_slots(), key_slots=lay.image_slots(),
            entropy=False,
        )  # fmt: skip
        plan.prune = hook
        plan.full = False
        plan.stats = {
            **plan.stats,
            "motion_mode": ctx.motion_mode,
            "prune_global": int(glob.sum()),
            "prune_dynamic": int(dynamic.sum()),
            "prune_absent": 0 if absent is None else int(absent.sum()),
        }
        self._pending = _Pending(plan, hook, patches, norms)
        return plan

    def update(self, ctx: PrefixContext, plan: PrefixPlan, taps: TapResult | None) -> None:
        pend = self._pending
        if pend is None or plan is not pend.plan:
            from vla_accel_ros.core.errors import PlanError

            raise PlanError("PrunePlanner.update() got a plan it did not just make")
        self._pending = None
        hook = pend.hook
        last = ctx.layout.num_layers - 1
        if taps is not None and last in taps.attn:
            hook.observe(taps.attn[last])
        self._importance = hook.score.clone()
        self.last_kept = hook.kept.clone()  # [C, T] not dropped at any layer (for tests and debugging)
        self.last_drop_layer = hook.drop_layer.clone()  # [C, T] where this frame's forward dropped each (L: not)
        self._recall = hook.recall if bool(hook.recall.any()) else None
        plan.stats["prune_recalled"] = int(hook.recall.sum())
        self._history.append((pend.patches, pend.norms))
        plan.stats["prune_local"] = int(hook.local.sum())
        if self.reuse is not None:
            self.reuse.update(ctx, plan, taps)
            self.reuse.truncate(hook.drop_layer)  # dropped tokens have no K/V from their drop layer on
