"""An analytic FLOPs estimate of one inference, from the bundle config and the token counts
the policy actually computed that frame.

Why analytic: counting with a profiler would time the counter, not the policy, and the replay
benchmark times every frame. The estimate counts the matrix products only (one multiply-add =
2 FLOPs); norms, activations, softmax, RoPE and the KV-cache copies are left out, so it is a
lower bound of the real work and a fair yardstick between modes of one bundle, not a
hardware counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

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


def _heads(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    hq = int(cfg["num_attention_heads"])
    hkv = int(cfg.get("num_key_value_heads") or hq)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq)
    return hq, hkv, hd


def decoder_layer_flops(cfg: Mapping[str, Any], rows: float, key_rows: float) -> float:
    """One Llama/Qwen2 layer: ``rows`` query rows, ``key_rows`` = sum over rows of visible keys."""
    d, f = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    hq, hkv, hd = _heads(cfg)
    proj = 2.0 * rows * d * hd * (2 * hq + 2 * hkv)  # q and o: hq heads; k and v: hkv heads
    mlp = 6.0 * rows * d * f  # gate, up, down
    attn = 4.0 * hq * hd * key_rows  # QK^T and AV
    return proj + mlp + attn


def vision_flops(vision: Mapping[str, Any]) -> float:
    """SigLIP tower on one camera frame (no pooling head)."""
    d, f, layers = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["num_hidden_layers"])
    p = int(vision["patch_size"])
    n = (int(vision["image_size"]) // p) ** 2
    embed = 2.0 * n * 3 * p * p * d
    per_layer = 8.0 * n * d * d + 4.0 * n * n * d + 4.0 * n * d * f
    return embed + layers * per_layer


@dataclass
class FrameWork:
    """What one inference computed: enough to price it."""

    prefix_len: int  # P
    rows_per_layer: list[int]  # prefix rows computed at each LM layer
    cameras_encoded: int  # cameras run through the vision tower
    reference: bool = False  # the transformers path (full-vocabulary logits on every row)
    reason_rows: int = 0  # reasoning bundles: previous reasoning + <act> rows validated in the prefill
    reason_steps: int = 0  # ... and single-token steps decoding reasoning (and <act>)
    # ar action decode: rows of the forwards after the prefill (None: A - 1 single-token steps;
    # with an action draft, its window rows) and the draft's rows in the prefill (among
    # rows_per_layer too); both get action logits
    decode_rows: int | None = None
    draft_rows: int = 0


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
    """FLOPs of one inference by component (see FORMULA); ``total`` is their sum."""
    lm = spec.lm
    d = int(lm["hidden_size"])
    p = work.prefix_len
    n_img = spec.grid * spec.grid
    causal = spec.family == "ar"
    out: dict[str, float] = {}
    dv = int(spec.vision["hidden_size"])
    out["vision"] = work.cameras_encoded * vision_flops(spec.vision)
    out["projector"] = work.cameras_encoded * 2.0 * n_img * (dv * d + d * d)
    keys = (p + 1) / 2.0 if causal else float(p)
    out["prefill"] = sum(decoder_layer_flops(lm, n, n * keys) for n in work.rows_per_layer)
    if spec.family == "ar":
        a = spec.action_dim * spec.chunk_size
        layers = int(lm["num_hidden_layers"])
        r = work.reason_rows
        if r or work.reason_steps:  # approximate: the rows at the end of the prefix, then steps
            out["reason"] = layers * (
                decoder_layer_flops(lm, r, r * (p + r / 2.0)) + work.reason_steps * decoder_layer_flops(lm, 1, p + r)
            )
        rows = a - 1 if work.decode_rows is None else work.decode_rows
        # a decode row sees P + i keys, i = 1..A-1: P + A/2 on average (exact for plain decoding)
        out["decode"] = layers * decoder_layer_flops(lm, rows, rows * (p + a / 2.0))
        vocab = int(lm["vocab_size"])
        # The engine scores the action bins of the last row only; transformers' causal LM
        # head scores the whole vocabulary on every prefix row and every decoded token.
        scored = 1 + work.draft_rows + rows  # the prefill's last row, draft rows, decode rows
        out["head"] = 2.0 * d * vocab * (p + a - 1) if work.reference else 2.0 * d * spec.action_bins * scored
    else:
        ex = spec.expert
        h, dim = spec.chunk_size, spec.action_dim
        de = int(ex["hidden_size"])
        layers = int(ex["num_hidden_layers"])
        step = layers * decoder_layer_flops(ex, h, h * (p + h))
        suffix = 2.0 * h * (dim * de + 3 * de * de + de * dim)  # action_in, time MLP, action_out
        out["denoise"] = flow_steps * (step + suffix)
        out["state"] = 2.0 * spec.state_dim * d  # the state token's projection
    out["total"] = sum(out.values())
    return out
