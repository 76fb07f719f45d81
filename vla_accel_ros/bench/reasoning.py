"""Reasoning metrics of replay and eval: reuse, agreement with full regeneration and with the
simulator's ground truth (:mod:`vla_accel_ros.core.reasoning.template`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.reasoning.template import template_for
from vla_accel_ros.core.text import words_of


def word_agreement(a: Sequence[str], b: Sequence[str]) -> float:
    """Share of word positions where ``a`` and ``b`` agree, over the longer of the two (1: the
    same text; a missing or extra word counts as a disagreement)."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    return sum(x == y for x, y in zip(a, b)) / n


def truth_words(task: str, step: int, state) -> list[str] | None:
    """The template's reasoning at ``step`` with ``state`` (None: no template for the task)."""
    try:
        template = template_for(task)
    except ConfigError:  # a task without a template: nothing to compare with
        return None
    if state is None:
        return None
    return words_of(template.text(step, np.asarray(state)))


def reasoning_summary(stats: list[dict[str, Any]], truths: list[list[str] | None], reference: list[list[str]] | None) -> dict[str, Any]:
    """Per mode: reuse, regeneration, refreshes and agreement. ``truths``: the ground truth of
    each frame (None where unknown); ``reference``: the full regeneration's words per frame
    (the baseline's, same frames) or None."""
    words = [s.get("reasoning_text", "").split() for s in stats]
    reused = [float(s.get("reasoning_reused_fraction", 0.0)) for s in stats]
    out: dict[str, Any] = {
        "reasoning_reused_fraction": {"mean": float(np.mean(reused)), "min": float(np.min(reused)), "max": float(np.max(reused))},
        "reasoning_tokens_mean": float(np.mean([s.get("reasoning_len", 0) for s in stats])),
        "reasoning_reused_tokens_mean": float(np.mean([s.get("reasoning_reused", 0) for s in stats])),
        "reasoning_regenerated_tokens_mean": float(np.mean([s.get("reasoning_regenerated", 0) for s in stats])),
        "reasoning_refresh_share": float(np.mean([bool(s.get("reasoning_refresh")) for s in stats])),
        "memo_adaptations": int(max([s.get("memo_adaptations", 0) for s in stats] or [0])),
    }
    pairs = [(w, t) for w, t in zip(words, truths) if t is not None]
    if pairs:
        agree = [word_agreement(w, t) for w, t in pairs]
        out["reasoning_truth_agreement"] = {"mean": float(np.mean(agree)), "identical_share": float(np.mean([a == 1.0 for a in agree]))}
    if reference is not None and len(reference) == len(words):
        agree = [word_agreement(w, r) for w, r in zip(words, reference)]
        out["reasoning_agreement_vs_baseline"] = {
            "mean": float(np.mean(agree)), "identical_share": float(np.mean([a == 1.0 for a in agree])),
        }  # fmt: skip
    return out
