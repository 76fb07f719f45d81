"""The action draft of ``ar`` policies: the previous chunk's action tokens as the draft of
speculative decoding, with no draft model (``policy.action_draft: previous``).

Consecutive frames of a closed loop mostly decode the same action tokens, so the previous
chunk ``d`` is a good guess of this one. Its tokens ``d[0..n-2]`` ride along as ``n - 1`` extra
rows of the prefill (after a reasoning bundle's reasoning and ``<act>``); row ``i`` predicts
token ``i + 1``. :func:`greedy_tokens` keeps the predictions up to the first draft token that
differs from what the model chose, which is exactly what greedy decoding writes: every kept
token was predicted from inputs equal to the tokens before it (in fp32; a reduced-precision LM
computes the draft rows on another numeric path than single decode rows). Decoding resumes at
the first rejected token in forwards of :data:`DRAFT_WINDOW` rows: the last token and the next
guesses of the draft, again kept up to the first mismatch. A rejected row's K/V is overwritten
before any row may read it (the causal mask hides later slots).

The policy calls :class:`ActionDraft` for the draft of a frame (:meth:`ActionDraft.for_frame`),
hands :func:`greedy_tokens` the prefill's draft rows and remembers the tokens decoded
(:meth:`ActionDraft.remember`).
"""

from __future__ import annotations

from typing import Callable, Hashable

# Rows of each decode forward after a draft's first rejection: the last token and the next
# guesses of the draft. A forward of a few rows costs about one decode step (the weights stream
# once), so a wrong guess costs little and a right one saves a step. Measured on the trained
# ar bundle (40 frames, mean ms per frame): 1 row 184, 4 rows 172, 8 rows 178, 16 rows 201.
DRAFT_WINDOW = 4


class ActionDraft:
    """The last chunk's action tokens, and the episode and instruction they were decoded in:
    another episode or task starts without a draft (the old chunk says nothing about it)."""

    def __init__(self) -> None:
        self.tokens: list[int] | None = None
        self.key: Hashable = None

    def reset(self) -> None:
        self.tokens = None

    def remember(self, tokens: list[int], key: Hashable) -> None:
        self.tokens, self.key = list(tokens), key

    def for_frame(self, key: Hashable) -> list[int] | None:
        """The draft for a frame of ``key`` (episode, instruction), or None."""
        return self.tokens if self.tokens is not None and key == self.key else None

    @staticmethod
    def prefill_ids(draft: list[int]) -> list[int]:
        """The draft's rows in the prefill: every token but the last (never an input)."""
        return draft[:-1]


def confirm(tokens: list[int], guesses, predicted: list[int], n: int) -> int:
    """Append to ``tokens`` the predictions whose inputs were right: ``predicted[i]`` followed
    the input ``guesses[i]``, which must equal the last token so far. Returns how many."""
    got = 0
    for guess, token in zip(guesses, predicted):
        if guess != tokens[-1] or len(tokens) >= n:
            break
        tokens.append(token)
        got += 1
    return got


def greedy_tokens(
    n: int, first: int, draft: list[int] | None, draft_predicted: list[int] | None,
    step: Callable[[list[int], int], list[int]],
) -> tuple[list[int], int, int, int]:  # fmt: skip
    """``n`` action tokens, greedy: ``first``, then as many as the prefill's draft rows confirm
    (``draft_predicted``: the token each row ``draft[i]`` predicted; None: no draft rows), then
    decode forwards: ``step(inputs, i)`` runs ``inputs`` as the rows of tokens ``i, i + 1, ...``
    and returns the token each row predicts; each takes the last token and, with a draft, its
    next ``DRAFT_WINDOW - 1`` guesses. Returns the tokens, how many of them draft rows confirmed
    (the prefill's and the windows'), the decode forwards and their rows."""
    tokens = [first]
    accepted = 0 if draft_predicted is None else confirm(tokens, draft, draft_predicted, n)
    steps, rows_run = 0, 0
    while len(tokens) < n:
        # guesses for tokens len .. at most n - 2: the last token is never an input
        guesses = [] if draft is None else draft[len(tokens) : min(len(tokens) + DRAFT_WINDOW, n) - 1]
        predicted = step([tokens[-1], *guesses], len(tokens) - 1)
        tokens.append(predicted[0])
        accepted += confirm(tokens, guesses, predicted[1:], n)
        steps, rows_run = steps + 1, rows_run + 1 + len(guesses)
    return tokens, accepted, steps, rows_run

