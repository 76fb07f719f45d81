"""The reasoning of ``ar`` reasoning bundles, with MEMO-VLM reuse across frames.

A reasoning bundle writes ``[prefix] [reasoning] <act> [actions]``. With ``memo.mode`` off the
reasoning is decoded greedily every frame. Otherwise the previous frame's reasoning is a
hypothesis: its words and ``<act>`` ride along in this frame's prefill (:meth:`ReasoningReuse.
prefill_ids`), whose rows give each previous word's probability on the new frame;
:meth:`ReasoningReuse.resolve` keeps the words the rule of :mod:`vla_accel_ros.core.reasoning.memo`
accepts (calibrated thresholds, or the exact argmax) and decodes only the rest, from the K/V of
the kept words that the prefill already wrote.

The policy calls, per frame: :meth:`~ReasoningReuse.hypothesis` (None: nothing to validate),
the prefill with :meth:`~ReasoningReuse.prefill_ids` appended, then :meth:`~ReasoningReuse.resolve`
with the prefill's rows and a function that decodes one word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

import torch

from vla_accel_ros.core.reasoning.memo import CALIBRATION_FILE, Calibration, MemoConfig, MemoState, Thresholds, decide


@dataclass
class Resolved:
    """A frame's reasoning: word classes, the hidden state that predicts the first action token,
    whether the hypothesis held word for word (then the prefill's rows after it, e.g. an action
    draft, saw this frame's reasoning), and the statistics the chunk reports."""

    classes: list[int]
    act_hidden: torch.Tensor  # [H]
    held: bool
    stats: dict = field(default_factory=dict)


class ReasoningReuse:
    """One policy's reasoning: the word classes (``words``, then ``<act>``) and their vocabulary
    ids, what it wrote last frame and the reuse thresholds of its ``memo`` configuration."""

    def __init__(self, words: tuple[str, ...], token_ids: list[int], max_tokens: int, bundle_path: str = "") -> None:
        self.words = tuple(words)
        self.act_class = len(self.words)  # <act>
        self.token_ids = list(token_ids)  # class -> vocabulary id
        self.max_tokens = max_tokens
        self.bundle_path = bundle_path  # where a calibrated mode finds the bundle's calibration
        self.state = MemoState()
        self.thresholds: Thresholds | None = None

    # -- configuration ------------------------------------------------------------------------
    def thresholds_for(self, memo: MemoConfig) -> Thresholds | None:
        """The thresholds ``memo`` asks for (None: no reuse); ConfigError when its calibration
        cannot be read."""
        if not memo.enabled:
            return None
        calibration = None
        if memo.mode == "calibrated":
            path = memo.calibration or str(Path(self.bundle_path or ".") / CALIBRATION_FILE)
            calibration = Calibration.load(path, self.words)
        return Thresholds(self.words, memo, calibration)

    def configure(self, memo: MemoConfig) -> None:
        self.thresholds = self.thresholds_for(memo)
        self.state.reset()

    def reset(self) -> None:
        self.state.reset()
        if self.thresholds is not None:
            self.thresholds.reset()

    # -- one frame ----------------------------------------------------------------------------
    def hypothesis(self, key: Hashable) -> list[int] | None:
        """The previous frame's reasoning to validate in this frame's prefill, for a frame of
        ``key`` (episode, instruction); None: regenerate (no reuse, or another episode or task)."""
        if self.thresholds is None:
            return None
        if key != self.state.key:
            self.state.reset()
            self.state.key = key
            return None
        return list(self.state.classes) or None

    def prefill_ids(self, hypothesis: list[int] | None) -> list[int]:
        """The rows the prefill appends: the hypothesis's words and ``<act>`` (none without one)."""
        return [] if hypothesis is None else [self.token_ids[c] for c in (*hypothesis, self.act_class)]

    def resolve(
        self, memo: MemoConfig, rows_out: torch.Tensor, hypothesis: list[int] | None,
        logits: Callable[[torch.Tensor], torch.Tensor], decode: Callable[[int, int], torch.Tensor],
    ) -> Resolved:  # fmt: skip
        """This frame's reasoning under ``memo`` (the policy's configuration now). ``rows_out``
        [1 + n, H]: the prefill's output at the last prefix row and, with a hypothesis (n = its
        words + ``<act>``), at each of its rows; ``logits(hidden)`` scores the word classes;
        ``decode(c, i)`` runs word class ``c`` as reasoning token ``i`` (its slot: the prefix
        length + i) and returns its output row."""
        prev = hypothesis
        n_prev = len(prev) if prev else 0
        scores = logits(rows_out[: n_prev + 1]).float()  # row i predicts word i
        stats: dict = {"reasoning_validated": prev is not None, "reasoning_refresh": False}
        keep, decision = 0, None
        if prev is not None:
            target = torch.tensor([*prev, self.act_class])
            probs = scores.softmax(-1)
            p = probs[torch.arange(n_prev + 1), target]
            if memo.mode == "exact":
                ok = (probs.argmax(-1) == target).numpy()
            else:
                ok = p.numpy() >= self.thresholds.of(target.numpy())
            every = memo.refresh_every
            decision = decide(ok, force_refresh=bool(every) and self.state.frames_since_refresh + 1 >= every)
            keep = decision.keep
            stats["reasoning_refresh"] = decision.refresh
            stats["reasoning_min_prob"] = float(p.min())
        stats["reasoning_kept_whole"] = prev is not None and keep == n_prev + 1
        if stats["reasoning_kept_whole"]:  # every word and <act> held: the actions follow the <act> row
            classes, act_hidden = list(prev), rows_out[n_prev + 1]
        else:
            classes = list(prev[:keep]) if prev else []
            nxt = int(scores[keep].argmax())
            while nxt != self.act_class and len(classes) < self.max_tokens:
                classes.append(nxt)
                nxt = int(logits(decode(nxt, len(classes) - 1)).argmax())
            act_hidden = decode(self.act_class, len(classes))
            if decision is not None and memo.mode == "calibrated":
                # False rejections: a failed word the regeneration wrote again at its place.
                same = [i for i in decision.failed.tolist() if i < min(len(classes), n_prev) and classes[i] == prev[i]]
                if same:
                    self.thresholds.adapt(target.numpy()[same], p.numpy()[same])
        reused = min(keep, len(classes))
        m = self.state
        m.classes = classes
        m.frames_since_refresh = 0 if (prev is None or stats["reasoning_refresh"]) else m.frames_since_refresh + 1
        stats.update(
            reasoning_tokens=[self.token_ids[c] for c in classes], reasoning_text=" ".join(self.words[c] for c in classes),
            reasoning_len=len(classes), reasoning_reused=reused, reasoning_regenerated=len(classes) - reused,
            reasoning_reused_fraction=reused / max(1, len(classes)),
            memo_adaptations=self.thresholds.adaptations if self.thresholds is not None else 0,
        )  # fmt: skip
        # The same words (then <act> too, validated or forced by the length cap); a regenerated
        # reasoning of the same length with other words does not count.
        return Resolved(classes, act_hidden, prev is not None and classes == list(prev), stats)
