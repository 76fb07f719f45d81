"""MEMO-VLM: reuse the still-valid prefix of a policy's own reasoning across frames.

A reasoning policy writes ``<reasoning> <act> <actions>``. For a new frame the previous
frame's reasoning is a hypothesis: ONE prefill over [prefix_t, previous reasoning, <act>]
yields, at every reasoning row, the probability the model now gives the word it wrote last
time. :func:`decide` accepts them all when each clears its threshold; otherwise the reasoning
is truncated at the first failing word and only the suffix is regenerated, from the K/V of the
kept prefix, which that same prefill already wrote; two consecutive failing words mean the
scene moved on, and the reasoning is regenerated whole (a refresh).

Thresholds (:class:`Thresholds`), per word:

* ``calibrated``: the lowest probability the model gave that word whenever greedy decoding
  wrote it over a calibration set (``vla-accel calibrate-reasoning``), scaled by how much
  the word attends to the image relative to the average reasoning word (a word read off the
  image must be surer to be reused), times ``threshold_scale``; lowered online when a
  regeneration writes a rejected word again unchanged (a false rejection);
* ``exact``: the word must be the model's argmax at its row. Then the reasoning and actions
  equal full greedy decoding: every kept word is what greedy decoding writes given the same
  prefix, and every other word is decoded greedily.

No public code exists for MEMO-VLM; this follows the paper's description.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError

MEMO_MODES = ("off", "calibrated", "exact")
CALIBRATION_FILE = "reasoning_calibration.json"
CALIBRATION_SCHEMA = "vla_accel_ros.reasoning_calibration/1"
# ``<act>``: the word that ends the reasoning (the tokenizer's EOS id).
ACT = "<act>"


@dataclass(frozen=True)
class MemoConfig(Config):
    mode: str = param(
        "off", doc="reasoning reuse: off (regenerate every frame), calibrated (MEMO-VLM thresholds) or exact "
        "(a reused word must be the argmax: equals greedy decoding)", choices=MEMO_MODES,
    )  # fmt: skip
    calibration: str = param(
        "", doc=f"calibration JSON of `vla-accel calibrate-reasoning` ('': the bundle's {CALIBRATION_FILE})"
    )
    threshold_scale: float = param(1.0, doc="multiplies every calibrated threshold (< 1 reuses more)", range=(0.0, 10.0))
    attention_scaling: bool = param(True, doc="scale each word's threshold by its relative attention to the image")
    adapt: bool = param(True, doc="lower a word's threshold when a regeneration rewrites it unchanged")
    adapt_margin: float = param(0.9, doc="an adapted threshold is the observed probability times this", range=(0.0, 1.0))
    max_threshold: float = param(0.999, doc="no calibrated threshold above this", range=(0.0, 1.0))
    refresh_every: int = param(0, doc="regenerate the whole reasoning every N frames regardless (0: never)", range=(0, 1_000_000))

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass
class Calibration:
    """What ``vla-accel calibrate-reasoning`` measured, per word (``<act>`` included)."""

    min_prob: dict[str, float]  # lowest probability of the word where greedy decoding wrote it
    image_attention: dict[str, float]  # its mean attention to the image / the mean over all words
    frames: int = 0
    source: str = ""

    def to_json(self) -> dict:
        return {"schema": CALIBRATION_SCHEMA, "frames": self.frames, "source": self.source,
                "min_prob": self.min_prob, "image_attention": self.image_attention}  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, words: tuple[str, ...]) -> "Calibration":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"memo.calibration: {path} does not exist; run `vla-accel calibrate-reasoning --bundle <bundle> --bag <bag>` "
                "or use memo.mode=exact (needs no calibration)"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"memo.calibration: {path} is not JSON ({e})") from None
        if d.get("schema") != CALIBRATION_SCHEMA:
            raise ConfigError(f"memo.calibration: {path} has schema {d.get('schema')!r}, expected {CALIBRATION_SCHEMA}")
        unknown = sorted(set(d["min_prob"]) - set(words) - {ACT})
        if unknown:
            raise ConfigError(f"memo.calibration: {path} calibrates words the bundle does not write: {', '.join(unknown[:8])}")
        for w, p in d["min_prob"].items():
            if not 0.0 <= float(p) <= 1.0:
                raise ConfigError(f"memo.calibration: {path}: min_prob[{w!r}]={p} is not a probability")
        return cls({k: float(v) for k, v in d["min_prob"].items()},
                   {k: float(v) for k, v in d.get("image_attention", {}).items()},
                   int(d.get("frames", 0)), str(d.get("source", "")))  # fmt: skip

    @classmethod
    def from_trace(cls, words: list[list[str]], probs: list[list[float]], image_mass: list[list[float]], source: str = "") -> "Calibration":
        """From greedy decodes: per frame the words written, their probabilities and their
        attention mass on the image tokens."""
        min_prob: dict[str, float] = {}
        mass: dict[str, list[float]] = {}
        for ws, ps, ms in zip(words, probs, image_mass, strict=True):
            for w, p, m in zip(ws, ps, ms, strict=True):
                min_prob[w] = min(min_prob.get(w, 1.0), float(p))
                mass.setdefault(w, []).append(float(m))
        overall = float(np.mean([m for ms in mass.values() for m in ms])) if mass else 1.0
        ratio = {w: float(np.mean(ms)) / max(overall, 1e-12) for w, ms in mass.items()}
        return cls(min_prob, ratio, len(words), source)


class Thresholds:
    """Per word class (the bundle's reasoning words, then ``<act>``): the probability a reused
    word must reach. Runtime state: adapted thresholds last until :meth:`reset`."""

    def __init__(self, words: tuple[str, ...], config: MemoConfig, calibration: Calibration | None) -> None:
        self.words = tuple(words) + (ACT,)
        self.config = config
        base = np.ones(len(self.words))
        if calibration is not None:
            known = [calibration.min_prob[w] for w in self.words if w in calibration.min_prob]
            fallback = float(np.median(known)) if known else 1.0  # a word calibration never saw
            for i, w in enumerate(self.words):
                t = calibration.min_prob.get(w, fallback)
                if config.attention_scaling:
                    t *= calibration.image_attention.get(w, 1.0)
                base[i] = min(config.max_threshold, t * config.threshold_scale)
        self.calibrated = base
        self.current = base.copy()
        self.adaptations = 0

    def reset(self) -> None:
        self.current = self.calibrated.copy()
        self.adaptations = 0

    def of(self, classes: np.ndarray) -> np.ndarray:
        return self.current[classes]

    def adapt(self, classes: np.ndarray, probs: np.ndarray) -> None:
        """Words rejected at ``probs`` that a regeneration wrote again: accept them there next time."""
        if not self.config.adapt:
            return
        for c, p in zip(classes.tolist(), probs.tolist()):
            lowered = p * self.config.adapt_margin
            if lowered < self.current[c]:
                self.current[c] = lowered
                self.adaptations += 1


@dataclass
class Decision:
    keep: int  # words of the previous reasoning kept (== its length + 1: everything, <act> too)
    refresh: bool  # two consecutive failures: regenerate all
    failed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # positions that failed


def decide(ok: np.ndarray, *, force_refresh: bool = False) -> Decision:
    """``ok`` [n] bool: which previous words (``<act>`` last) passed. Keep up to the first
    failure; two consecutive failures (or ``force_refresh``) regenerate everything."""
    failed = np.flatnonzero(~ok)
    if force_refresh:
        return Decision(0, True, failed)
    if failed.size == 0:
        return Decision(int(ok.size), False, failed)
    j = int(failed[0])
    if j + 1 < ok.size and not ok[j + 1]:
        return Decision(0, True, failed)
    return Decision(j, False, failed)


@dataclass
class MemoState:
    """The previous frame's reasoning (word classes, ``<act>`` excluded) and where it held."""

    classes: list[int] = field(default_factory=list)
    key: tuple = ()  # (episode, instruction): reasoning is never carried across either
    frames_since_refresh: int = 0

    def reset(self) -> None:
        self.classes = []
        self.key = ()
        self.frames_since_refresh = 0


def calibrate(policy, observations, *, source: str = "", on_frame=None) -> Calibration:
    """Greedy reasoning of each observation (``policy.reasoning_trace``: words, probabilities,
    image attention), then per word its lowest probability and relative image attention."""
    words, probs, mass = [], [], []
    for obs in observations:
        w, p, m = policy.reasoning_trace(obs)
        words.append(w)
        probs.append(p)
        mass.append(m)
        if on_frame is not None:
            on_frame()
    if not words:
        raise ConfigError("calibration needs at least one observation")
    return Calibration.from_trace(words, probs, mass, source)
