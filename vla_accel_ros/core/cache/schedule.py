"""Layer-adaptive reuse: alpha_l, the fraction of the reusable set reused at layer l.

Both schedules return a non-decreasing alpha (the reused set only grows with depth: a token
recomputed at layer l was recomputed at every layer before, so its hidden state at l is the
current frame's), zero on the first ``force_recompute_layers`` layers, and constant between
the layers where the set may grow.

* fixed: alpha reaches 1 at the first growth layer; with several ``reuse_layers`` it steps
  evenly (2, 6, 9, 11 -> 1/4, 1/2, 3/4, 1). Predictable: the reuse depends on the scene only.
* entropy (the paper, eq. 11-12): R_l = (H_{l-1} - H_l) / H_{l-1} from the previous step's
  text-to-image attention entropy H_l, alpha_l = min(k * sum_{j<=l} R_j, 1), clipped at 0.
"""

from __future__ import annotations

from vla_accel_ros.core.cache.config import CacheConfig


def growth_layers(cfg: CacheConfig, num_layers: int) -> list[int]:
    if cfg.reuse_layers:
        return [l for l in cfg.reuse_layers if l < num_layers]
    if cfg.layer_schedule == "fixed":
        return [cfg.force_recompute_layers] if cfg.force_recompute_layers < num_layers else []
    return list(range(cfg.force_recompute_layers, num_layers))


def fixed_alpha(cfg: CacheConfig, num_layers: int) -> list[float]:
    alpha = [0.0] * num_layers
    grow = growth_layers(cfg, num_layers)
    for i, g in enumerate(grow):
        for l in range(g, num_layers):
            alpha[l] = (i + 1) / len(grow)
    return alpha


def entropy_ratios(entropy: list[float]) -> list[float]:
    """R_l = (H_{l-1} - H_l) / H_{l-1}; R_0 = 0 (no layer before it)."""
    r = [0.0]
    for prev, cur in zip(entropy, entropy[1:]):
        r.append((prev - cur) / prev if prev > 0 else 0.0)
    return r


def entropy_alpha(cfg: CacheConfig, entropy: list[float] | None, num_layers: int) -> list[float]:
    """The paper's schedule from per-layer entropies; all zeros when none were measured."""
    alpha = [0.0] * num_layers
    if entropy is None or len(entropy) != num_layers:
        return alpha
    raw, cum = [], 0.0
    for r in entropy_ratios(entropy):
        cum += r
        raw.append(min(max(cfg.entropy_k * cum, 0.0), 1.0))
    grow = set(growth_layers(cfg, num_layers))
    held = 0.0
    for l in range(num_layers):
        if l in grow:
            held = max(held, raw[l])  # never shrink: the reused set is nested across layers
        alpha[l] = held
    return alpha


def layer_alpha(cfg: CacheConfig, entropy: list[float] | None, num_layers: int) -> list[float]:
    if cfg.layer_schedule == "fixed":
        return fixed_alpha(cfg, num_layers)
    return entropy_alpha(cfg, entropy, num_layers)
