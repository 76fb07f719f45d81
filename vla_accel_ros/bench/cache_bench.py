"""Token cache (VLA-Cache) vs full recompute, end to end, on a moving-arm frame sequence.

Every contender runs the same frames in the same process, interleaved per frame (the order
rotates from frame to frame so none always runs first), after a warm-up that is excluded
from the statistics but still processed so each cache follows the sequence. The latency is
the ActionChunk's ``timings_ms["total"]``: observation in to actions out, token selection
included. Deviation is measured against the full recompute of the same frame (flow: the same
noise for both), so it is the error a robot would actually see, accumulated reuse included.

The cached contenders share the full policy's weights (one model in memory); each has its
own KV cache and planner, and each passes the parity gate before timing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from vla_accel_ros.bench.stats import action_deviation, action_std, percentile
from vla_accel_ros.core.cache import CacheConfig
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.policy_config import PolicyConfig

# Named cache configurations a run can put side by side (overrides of CacheConfig()).
PRESETS: dict[str, dict[str, Any]] = {
    # What a user gets without touching anything.
    "default": {},
    # The lever's ceiling on this scene: every static token reused from the first reuse layer.
    "max-reuse": {"topk_reuse": 256, "relevance_mode": "off"},
    # The public code's numbers: reuse cap 140 of 256, evict the 100 most attended.
    "public-code": {"topk_reuse": 140, "relevance_mode": "topk", "relevance_topk": 100},
    # The paper's entropy schedule (reuses almost nothing when attention is flat, e.g. random weights).
    "entropy": {"layer_schedule": "entropy", "relevance_mode": "off", "topk_reuse": 256},
    # The paper's static rule alone: raw-pixel cosine, no intensity test, no scene cut.
    "paper-rule": {"max_relative_change": 1e6, "scene_cut_fraction": 0.0},
    # The vision tower's work reused too (only the recomputed patches go through the encoder).
    "vision": {"reuse_vision": True},
    # Only the vision tower's work reused, of bit-identical patches: the decoder recomputes every
    # token at every layer (the depth exceeds any decoder's). On the trained SmolVLA a patch
    # whose pixels moved a little (cosine 0.996) and kept its features moved the chunk by up
    # to 2 action std; bit-identical ones, under the scene cut, by 0.15 (docs/methods/token-cache.md).
    "vision-only": {"reuse_vision": True, "force_recompute_layers": 1024, "topk_reuse": 256, "relevance_mode": "off",
                    "max_relative_change": 0.0},
}

STAGES = ("preprocess", "select", "vision", "prefill", "reason", "decode", "denoise", "postprocess", "total")


@dataclass
class Contender:
    name: str
    policy: Any
    cache: dict[str, Any] | None  # the CacheConfig as a dict; None for the full recompute
    timings: list[dict[str, float]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    kv_err: list[dict[str, float]] = field(default_factory=list)

    def stage(self, name: str) -> list[float]:
        return [t.get(name, 0.0) for t in self.timings]


def cache_config(preset: str, overrides: dict[str, Any]) -> CacheConfig:
    if preset not in PRESETS:
        raise ConfigError(f"cache preset {preset!r} is not one of {', '.join(PRESETS)}")
    return CacheConfig.from_dict({**PRESETS[preset], **overrides})


def run_cache_bench(
    bundle,
    *,
    presets: tuple[str, ...] = ("default", "max-reuse"),
    overrides: dict[str, Any] | None = None,
    frames: int = 40,
    warmup: int = 3,
    seed: int = 0,
    speed: float = 1.0,
    noise: float = 1.0,
    parity_check: bool = True,
    on_frame: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Every preset and the full recompute on the same frames; ``on_frame(i)`` after frame i (progress)."""
    from vla_accel_ros.sim.synthetic import synthetic_observations
    from vla_accel_ros.core.bundle import Bundle
    from vla_accel_ros.models.factory import load_bundle
    from vla_accel_ros.models.factory import load_policy, sibling_policy

    configs = {name: cache_config(name, overrides or {}) for name in presets}  # fail before loading
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    full = load_policy(bundle, PolicyConfig(accel="none", parity_check=parity_check))
    contenders = [Contender("full", full, None)]
    for name, cfg in configs.items():
        pol = sibling_policy(full, PolicyConfig(accel="cache", cache=cfg, parity_check=parity_check))
        contenders.append(Contender(name, pol, cfg.to_dict()))
    for c in contenders:
        c.policy.reset()

    spec = full.spec
    observations = synthetic_observations(spec, warmup + frames, seed=seed, speed=speed, noise=noise)
    rng = np.random.default_rng(seed)
    for i, obs in enumerate(observations):
        chunk_noise = rng.standard_normal(full.noise_shape or (spec.chunk_size, spec.action_dim)).astype(np.float32)
        k = i % len(contenders)
        for c in contenders[k:] + contenders[:k]:  # rotate who runs first
            out = c.policy.infer(obs, noise=chunk_noise)
            if i < warmup:
                continue
            c.timings.append(dict(out.timings_ms))
            c.stats.append(out.stats)
            c.actions.append(out.actions)
            if "action_tokens" in out.stats:
                c.tokens.append(list(out.stats["action_tokens"]))
        if i >= warmup:
            for c in contenders[1:]:
                c.kv_err.append(_kv_error(c.policy, full, obs))
        if on_frame is not None:
            on_frame(i)
    return summarize(contenders, spec, dict(frames=frames, warmup=warmup, seed=seed, speed=speed, noise=noise))


def _kv_error(policy, full, obs) -> dict[str, float]:
    """Relative error of the prefix K/V at the last layer, cached vs full recompute of the same
    frame: on the image rows (what reuse approximates) and on the prompt / state rows (what the
    action is read from). Sensitive even where a random-weight model's actions are not."""
    import torch

    layout, _ = policy.layout_of(obs)
    rows = {"image": layout.image_slots(), "text": layout.text_slots()}
    if layout.state_slot is not None:
        rows["text"] = torch.cat([rows["text"], torch.tensor([layout.state_slot])])
    got, ref = policy.prefix_engine.cache, full.prefix_engine.cache
    out = {}
    for name, r in rows.items():
        a = torch.cat([got.k[-1][..., r, :], got.v[-1][..., r, :]])  # [2B, Hkv, n, D]
        b = torch.cat([ref.k[-1][..., r, :], ref.v[-1][..., r, :]])
        out[name] = float((a - b).norm() / b.norm().clamp_min(1e-12))
    return out


def _deviation(c: Contender, ref: Contender, spec, std: np.ndarray) -> dict[str, float]:
    dev = action_deviation(c.actions, ref.actions, std, *((c.tokens, ref.tokens) if ref.tokens else ()))
    out = {
        "max_abs_delta": max(dev.max_abs),
        "max_delta_over_std": max(dev.max_over_std),
        "p50_frame_max_delta_over_std": float(statistics.median(dev.max_over_std)),
        "kv_rel_err_image_max": max(e["image"] for e in c.kv_err),
        "kv_rel_err_image_p50": float(statistics.median(e["image"] for e in c.kv_err)),
        "kv_rel_err_text_max": max(e["text"] for e in c.kv_err),
        "kv_rel_err_text_p50": float(statistics.median(e["text"] for e in c.kv_err)),
    }
    if ref.tokens:
        out["identical_token_share"] = float(np.mean(dev.token_share)) if dev.token_share else 0.0
        out["identical_chunk_share"] = dev.identical_chunks if dev.identical_chunks is not None else 0.0
    return out


def summarize(contenders: list[Contender], spec, meta: dict[str, Any]) -> dict[str, Any]:
    ref = contenders[0]
    std = action_std(spec)
    base_total = ref.stage("total")
    rows = []
    for c in contenders:
        total = c.stage("total")
        row: dict[str, Any] = {
            "name": c.name,
            "cache": c.cache,
            "total_ms": {"p50": percentile(total, 50), "p95": percentile(total, 95), "mean": float(np.mean(total))},
            "stages_p50_ms": {s: percentile(c.stage(s), 50) for s in STAGES if any(s in t for t in c.timings)},
            "speedup_p50": percentile(base_total, 50) / percentile(total, 50),
            # Per frame, full / cached on the same observation, then the median: robust to a
            # neighbour stealing the CPU for a few frames.
            "speedup_paired_median": float(np.median(np.asarray(base_total) / np.asarray(total))),
        }
        if c.cache is not None:
            st = c.stats
            row["reuse_fraction_mean"] = float(np.mean([s["reuse_fraction"] for s in st]))
            row["reuse_fraction_min"] = float(np.min([s["reuse_fraction"] for s in st]))
            row["select_ms"] = {"p50": percentile(c.stage("select"), 50), "p95": percentile(c.stage("select"), 95)}
            row["resets"] = sum(bool(s["reset_reason"]) for s in st)
            for key in ("static_tokens", "evicted_tokens", "capped_tokens", "max_age_recomputed", "reused_tokens"):
                row[f"{key}_mean"] = float(np.mean([s[key] for s in st]))
            row["scene_cuts"] = sum(bool(s["scene_cut"]) for s in st)
            row["image_recomputed_per_layer_mean"] = [
                round(float(x), 1) for x in np.mean([s["image_recomputed_per_layer"] for s in st], axis=0)
            ]
            row["alpha_per_layer_mean"] = [round(float(x), 4) for x in np.mean([s["alpha_per_layer"] for s in st], axis=0)]
            row["deviation"] = _deviation(c, ref, spec, std)
        rows.append(row)
    return {"meta": {**meta, "family": spec.family, "bundle": spec.name}, "rows": rows}


def format_report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"{'contender':<12} {'p50 ms':>8} {'p95 ms':>8} {'speedup':>8} {'paired':>7} {'reuse':>6} {'select p50':>10} "
        f"{'resets':>6}  deviation vs full",
    ]
    for r in rows:
        if r["cache"] is None:
            lines.append(
                f"{r['name']:<12} {r['total_ms']['p50']:8.1f} {r['total_ms']['p95']:8.1f} {'1.00x':>8} {'':>7} "
                f"{'0%':>6} {r['stages_p50_ms'].get('select', 0.0):8.2f}ms {'':>6}  (reference)"
            )
            continue
        d = r["deviation"]
        dev = (
            f"tokens identical {100 * d['identical_token_share']:.1f}%, max |delta| {d['max_abs_delta']:.4f} "
            f"({d['max_delta_over_std']:.3f} std)"
            if "identical_token_share" in d
            else f"max |delta|/std {d['max_delta_over_std']:.4f} (p50 frame {d['p50_frame_max_delta_over_std']:.4f})"
        )
        lines.append(
            f"{r['name']:<12} {r['total_ms']['p50']:8.1f} {r['total_ms']['p95']:8.1f} {r['speedup_p50']:7.2f}x "
            f"{r['speedup_paired_median']:6.2f}x {100 * r['reuse_fraction_mean']:5.1f}% {r['select_ms']['p50']:8.2f}ms "
            f"{r['resets']:>6}  {dev}"
        )
    stages = [s for s in STAGES if any(s in r["stages_p50_ms"] for r in rows)]
    lines += ["", "per-stage p50 ms  " + "".join(f"{r['name']:>12}" for r in rows)]
    for s in stages:
        lines.append(f"  {s:<15} " + "".join(f"{r['stages_p50_ms'].get(s, 0.0):12.1f}" for r in rows))
    lines.append("")
    defaults = CacheConfig().to_dict()
    for r in rows[1:]:
        lines.append(
            f"{r['name']}: static {r['static_tokens_mean']:.0f}, evicted {r['evicted_tokens_mean']:.0f}, capped "
            f"{r['capped_tokens_mean']:.0f}, aged {r['max_age_recomputed_mean']:.1f}, reused {r['reused_tokens_mean']:.0f} "
            f"image tokens/frame (mean); scene cuts {r['scene_cuts']}"
        )
        d = r["deviation"]
        lines.append(
            f"  last-layer K/V relative error vs full: image rows p50 {d['kv_rel_err_image_p50']:.2e} max "
            f"{d['kv_rel_err_image_max']:.2e}; prompt/state rows p50 "
            f"{d['kv_rel_err_text_p50']:.2e} max {d['kv_rel_err_text_max']:.2e}"
        )
        lines.append(f"  image tokens computed per layer (mean): {r['image_recomputed_per_layer_mean']}")
        lines.append(f"  alpha per layer (mean): {r['alpha_per_layer_mean']}")
        changed = {k: v for k, v in r["cache"].items() if defaults.get(k) != v}
        lines.append(f"  cache config (non-default): {changed or 'defaults'}")
    return "\n".join(lines)
