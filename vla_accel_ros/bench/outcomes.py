"""Closed-loop outcomes beyond success: the task stages reached, and modes compared episode by
episode on the same seeds.

A weak policy (the shipped ones solve transfer_cube in ~7% of episodes) makes success a blunt
yardstick: two modes 7/100 and 5/100 have overlapping Wilson intervals whatever happened. The
simulator grades every step 0..4 (:data:`STAGES`), and every mode runs the same seeds, so two
sharper figures come for free from the per-episode records:

* the share of episodes that reached each stage (e.g. touched the cube: ~28% for the flow
  bundle), each with its Wilson interval;
* a paired comparison against the baseline: for success and for each stage, the seeds where
  only the baseline reached it and those where only the mode did, with the exact McNemar test's
  two-sided p-value (a binomial test on the discordant seeds; scipy). Seeds on which both agree
  carry no information about a difference, which is why pairing separates modes that
  independent intervals cannot.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

# gym-aloha's grades (its tasks' get_reward): the stage an episode reached is its best grade.
STAGES: dict[str, tuple[str, ...]] = {
    "transfer_cube": ("touched", "lifted", "transfer attempted", "transferred"),
    "insertion": ("touched both", "grasped both", "peg touches socket", "inserted"),
}


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a success rate (sensible at 0/n and n/n, unlike Wald's)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    den = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, center - half), min(1.0, center + half))


def stage_summary(max_rewards: Sequence[float], task: str) -> list[dict[str, Any]]:
    """Per stage k = 1..4 of ``task``: episodes whose best grade reached k, share and 95% CI."""
    if task not in STAGES:
        raise ValueError(f"no stages for task {task!r}; known: {', '.join(STAGES)}")
    n = len(max_rewards)
    out = []
    for k, name in enumerate(STAGES[task], start=1):
        hit = sum(r >= k for r in max_rewards)
        out.append({"stage": k, "name": name, "reached": hit, "rate": hit / n if n else float("nan"),
                    "ci95": list(wilson_interval(hit, n))})  # fmt: skip
    return out


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pair counts (1.0 when there are none)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a} and {only_b}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_a, n, 0.5).pvalue)


def paired_vs_baseline(
    baseline: Sequence[Mapping[str, Any]], mode: Sequence[Mapping[str, Any]], task: str
) -> dict[str, Any]:
    """Episode-by-episode comparison on the seeds both ran (``per_episode`` records: ``seed``,
    ``max_reward``). For ``success`` and each stage: ``baseline_only`` / ``mode_only`` (seeds
    where just one reached it), ``both``, and the exact McNemar p-value; ``reward``: seeds where
    the mode's best grade was higher / lower / equal, with the sign test's p-value. The p-values
    are per comparison, not corrected for the several stages and modes of a report."""
    if task not in STAGES:
        raise ValueError(f"no stages for task {task!r}; known: {', '.join(STAGES)}")
    base = {e["seed"]: float(e["max_reward"]) for e in baseline}
    other = {e["seed"]: float(e["max_reward"]) for e in mode}
    seeds = [s for s in base if s in other]
    stages = len(STAGES[task])

    def compare(k: int) -> dict[str, Any]:
        a = [base[s] >= k for s in seeds]
        b = [other[s] >= k for s in seeds]
        only_a = sum(x and not y for x, y in zip(a, b))
        only_b = sum(y and not x for x, y in zip(a, b))
        return {"both": sum(x and y for x, y in zip(a, b)), "baseline_only": only_a, "mode_only": only_b,
                "p_value": mcnemar_exact(only_a, only_b)}  # fmt: skip

    higher = sum(other[s] > base[s] for s in seeds)
    lower = sum(other[s] < base[s] for s in seeds)
    return {
        "seeds": len(seeds),
        "success": compare(stages),
        "stages": [{"stage": k, "name": STAGES[task][k - 1], **compare(k)} for k in range(1, stages + 1)],
        "reward": {
            "higher": higher,
            "lower": lower,
            "equal": len(seeds) - higher - lower,
            "p_value": mcnemar_exact(higher, lower),  # the sign test: the same binomial test
        },
    }


def with_outcomes(result: dict[str, Any], baseline: str = "baseline") -> dict[str, Any]:
    """An eval report (report.json) with ``stages`` and ``paired_vs_baseline`` derived from its
    ``per_episode`` records for every mode (reports written before these fields existed get
    them; newer ones get the same values again). The input is not modified."""
    if baseline not in result.get("modes", {}):
        raise ValueError(f"the report has no {baseline!r} mode to pair with (modes: {', '.join(result.get('modes', {}))})")
    task = result["task"]
    modes = {}
    for name, m in result["modes"].items():
        eps = m.get("per_episode")
        if eps is None:
            raise ValueError(f"mode {name!r} has no per_episode records: not an eval report")
        m = {**m, "stages": stage_summary([e["max_reward"] for e in eps], task)}
        if name != baseline:
            m["paired_vs_baseline"] = paired_vs_baseline(result["modes"][baseline]["per_episode"], eps, task)
        modes[name] = m
    return {**result, "modes": modes}
