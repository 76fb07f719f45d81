"""An analytic FLOPs estimate of one inference, from the bundle config and the token counts
the policy actually computed that frame.

Why analytic: counting with a profiler would time the counter, not the policy, and the replay
benchmark times every frame. The estimate counts the matrix products only (one multiply-add =
2 FLOPs); norms, activations, softmax, RoPE and the KV-cache copies are left out, so it is a
lower bound of the real work and a fair yardstick between modes of one bundle, not a
hardware counter.
"""

from __future__ import annotations

from typing import Any, Mapping

from vla_accel_ros.models.family import get_family
from vla_accel_ros.models.flops import FrameWork, decoder_layer_flops, vision_flops  # noqa: F401  (re-exported)

FORMULA = """\
FLOPs estimate (matrix products only, 1 multiply-add = 2 FLOPs; an estimate, not a counter)
  vision tower, per camera run (N = grid^2 patches, d_v hidden, f_v MLP, L_v layers, p patch):
      2*N*3*p^2*d_v + L_v * (8*N*d_v^2 + 4*N^2*d_v + 4*N*d_v*f_v)
  projector, per camera run: 2*N*(d_v*d + d^2)
  LM / VLM prefix, per layer l with n_l rows computed that frame (d hidden, f MLP, hq/hkv heads,
  hd head size), each row attending to K visible keys:
      n_l * (2*d*hd*(2*hq + 2*hkv) + 6*d*f) + 4*hq*hd * n_l*K
      K = P (bidirectional, flow) or (P+1)/2 on average (causal, ar; exact for a full prefill)
  ar decode, per generated token i = 1..A-1 (A = action_dim*chunk): the LM layers above for one
      row with K = P+i (with an action draft: its decode rows, K = P+A/2 on average; its rows
      in the prefill are among the prefix rows); head 2*d*bins per scored row (engine: the
      last prefix row, draft rows, decode rows) or 2*d*V per row for every prefix row and token
      (transformers computes the full-vocabulary logits)
  flow denoise, per Euler step (H = chunk rows, expert width d_e, f_e, hq_e): the layer formula
      with n = H, K = P+H, plus the suffix MLPs 2*H*(D*d_e + 3*d_e^2 + d_e*D); times T steps
  cameras run through the vision tower: every camera with any image row computed at layer 0
      (counted as all cameras whenever one is, an upper bound with several cameras)"""


def work_from_stats(spec, stats: Mapping[str, Any], prefix_len: int, reference: bool) -> FrameWork:
    """A FrameWork from an ActionChunk's stats; the transformers path reports none and computes
    everything."""
    layers = int(spec.lm["num_hidden_layers"])
    cams = len(spec.cameras)
    if "reasoning_tokens" in stats:
        n = len(stats["reasoning_tokens"])
        validated = bool(stats.get("reasoning_validated"))
        regen = int(stats.get("reasoning_regenerated", n))
        kept_all = validated and regen == 0 and not stats.get("reasoning_refresh")
        extra = {"reason_rows": n + 1 if validated else 0, "reason_steps": 0 if kept_all else regen + 1}
    else:
        extra = {}
    if "decode_rows" in stats:
        extra.update(decode_rows=int(stats["decode_rows"]), draft_rows=int(stats.get("draft_rows", 0)))
    if reference or "recomputed_per_layer" not in stats:
        return FrameWork(prefix_len, [prefix_len] * layers, cams, reference, **extra)
    img0 = stats.get("image_recomputed_per_layer", [1])[0]
    return FrameWork(
        int(stats.get("tokens_total", prefix_len)),
        [int(n) for n in stats["recomputed_per_layer"]],
        cams if img0 > 0 else 0,
        reference,
        **extra,
    )


def estimate_flops(spec, work: FrameWork, *, flow_steps: int) -> dict[str, float]:
    """FLOPs of one inference by component (see FORMULA); ``total`` is their sum. Each family
    prices its own parts (``Family.flops``) from the shared per-module formulas."""
    out = get_family(spec.family).flops(spec, work, flow_steps=flow_steps)
    out["total"] = sum(out.values())
    return out
