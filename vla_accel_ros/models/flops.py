"""Analytic FLOPs of the modules a policy runs (matrix products only, 1 multiply-add = 2 FLOPs):
the per-module formulas every family prices its inferences with (``Family.flops``;
:mod:`vla_accel_ros.bench.flops` has the whole formula and how the benchmarks use it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vla_accel_ros.models.common import CONV_STEM


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
    p, size = int(vision["patch_size"]), int(vision["image_size"])
    n = (size // p) ** 2
    stem, c = 0.0, 3  # the optional conv stem: 2 x 2 stride-2 stages, then the patch embedding on its map
    for ch in vision.get(CONV_STEM) or ():
        size, p = size // 2, p // 2
        stem += 2.0 * size * size * 4 * c * int(ch)
        c = int(ch)
    embed = stem + 2.0 * n * c * p * p * d
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


def prefix_flops(spec, work: FrameWork, *, causal: bool) -> dict[str, float]:
    """The SigLIP tower, the 2-layer projector and the prefix's decoder layers (ar and flow):
    ``causal`` rows see (P + 1) / 2 keys on average, bidirectional ones P."""
    lm = spec.lm
    d, p = int(lm["hidden_size"]), work.prefix_len
    dv = int(spec.vision["hidden_size"])
    keys = (p + 1) / 2.0 if causal else float(p)
    return {
        "vision": work.cameras_encoded * vision_flops(spec.vision),
        "projector": work.cameras_encoded * 2.0 * spec.grid * spec.grid * (dv * d + d * d),
        "prefill": sum(decoder_layer_flops(lm, n, n * keys) for n in work.rows_per_layer),
    }


def denoise_step_flops(expert: Mapping[str, Any], h: int, p: int, action_dim: int, key_rows: float | None = None) -> float:
    """One Euler step of a flow expert: every layer over the ``h`` chunk rows, each seeing the
    prefix's ``p`` keys and the chunk's (``key_rows``: another total of visible keys), plus the
    suffix MLPs (action in, time MLP, action out)."""
    de, layers = int(expert["hidden_size"]), int(expert["num_hidden_layers"])
    step = layers * decoder_layer_flops(expert, h, h * (p + h) if key_rows is None else key_rows)
    return step + 2.0 * h * (action_dim * de + 3 * de * de + de * action_dim)
