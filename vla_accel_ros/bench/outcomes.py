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

import bisect
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


def by_position(result: Mapping[str, Any], position: Mapping[int, float], edges: Sequence[float]) -> dict[str, list[dict[str, Any]]]:
    """Per mode, its episodes binned by where the task's object started (``position``: seed ->
    one coordinate; bins ``[edges[i], edges[i + 1])``, the last one closed): per bin the episodes
    and how many reached each stage. A policy that reaches where the object usually is, rather
    than where it is, scores well in the middle bins and fails at the edges, which its overall
    rate hides."""
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bin edges must rise, at least two: {list(edges)}")
    task = result["task"]
    if task not in STAGES:
        raise ValueError(f"no stages for task {task!r}; known: {', '.join(STAGES)}")
    out: dict[str, list[dict[str, Any]]] = {}
    last = len(edges) - 2
    for name in result.get("mode_order", result["modes"]):
        bins = [{"from": edges[i], "to": edges[i + 1], "episodes": 0, "reached": [0] * len(STAGES[task])} for i in range(last + 1)]
        for e in result["modes"][name]["per_episode"]:
            x = position[e["seed"]]
            if not edges[0] <= x <= edges[-1]:
                raise ValueError(f"seed {e['seed']}: the object starts at {x:.3f}, outside the bins {edges[0]:g}..{edges[-1]:g}")
            i = min(bisect.bisect_right(edges, x) - 1, last)  # the last bin holds its upper edge
            bins[i]["episodes"] += 1
            for k in range(len(STAGES[task])):
                bins[i]["reached"][k] += int(e["max_reward"] >= k + 1)
        out[name] = bins
    return out


def join_parts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One evaluation run in parts (e.g. halves of the seeds in two processes, one core each): the
    parts' ``per_episode`` records joined mode by mode. The parts must grade the same task and
    the same modes on disjoint seeds; a single part is returned as it is."""
    if len(parts) == 1:
        return dict(parts[0])
    first = parts[0]
    modes: dict[str, list] = {n: [] for n in first["modes"]}
    for i, part in enumerate(parts):
        if part["task"] != first["task"]:
            raise ValueError(f"part {i + 1} grades task {part['task']!r}, part 1 {first['task']!r}")
        if set(part["modes"]) != set(modes):
            raise ValueError(f"part {i + 1} ran modes {', '.join(part['modes'])}, part 1 {', '.join(modes)}")
        differ = _settings_differ(first, part)
        if differ:
            raise ValueError(f"part {i + 1} ran other settings than part 1 ({differ}): not parts of one run")
        for name, m in part["modes"].items():
            eps = m.get("per_episode")
            if eps is None:
                raise ValueError(f"part {i + 1}, mode {name!r} has no per_episode records: not an eval report")
            seen = {e["seed"] for e in modes[name]}
            again = sorted(e["seed"] for e in eps if e["seed"] in seen)
            if again:
                raise ValueError(f"part {i + 1} repeats seeds {again[:5]} of mode {name!r}: parts must run disjoint seeds")
            modes[name] += eps
    order = first.get("mode_order", list(modes))
    return {"task": first["task"], "mode_order": order, "modes": {n: {"per_episode": modes[n]} for n in order}}


def _settings_differ(first: Mapping[str, Any], part: Mapping[str, Any]) -> str:
    """The settings two parts of one run must share (bundle, episode length, scheduler, each
    mode's policy configuration but its noise seed), as "what: a / b"; "" when they agree.
    Reports without a setting (older ones) are not held to it; a policy field a report predates
    counts as its default. The lerobot mode's record is LeRobot's worker (its checkpoint, load
    time: per part); of it, the threads and the noise scale are settings."""
    from vla_accel_ros.core.policy_config import PolicyConfig

    # Reports record the noise scale that ran (the bundle's made explicit); one that predates the
    # field ran the trained sampler, 1, whatever the default is now.
    defaults = {**PolicyConfig().to_dict(), "flow_noise_scale": 1.0}

    def policy(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if config is None:
            return None
        if "accel" not in config:  # not a PolicyConfig: the lerobot mode's worker
            return {"threads": config.get("threads"), "noise_scale": config.get("noise_scale", 1.0)}
        return {k: v for k, v in {**defaults, **config}.items() if k != "seed"}

    def settings(r: Mapping[str, Any]) -> dict[str, Any]:
        out = {"bundle": (r.get("bundle") or {}).get("path"), "steps": r.get("steps"), "scheduler": r.get("scheduler")}
        for name, m in r.get("modes", {}).items():
            out[f"{name} policy"] = policy(m.get("policy_config"))
        return out

    a, b = settings(first), settings(part)
    for key in a:
        if a[key] is not None and b.get(key) is not None and a[key] != b[key]:
            if isinstance(a[key], dict):
                diff = sorted(k for k in {*a[key], *b[key]} if a[key].get(k) != b[key].get(k))
                return f"{key}: " + ", ".join(f"{k} {a[key].get(k)!r} / {b[key].get(k)!r}" for k in diff)
            return f"{key}: {a[key]!r} / {b[key]!r}"
    return ""


def side_by_side(evaluations: Sequence[tuple[str, Mapping[str, Any]]], reference: str = "baseline") -> dict[str, Any]:
    """Evaluations on the same seeds of other bundles, checkpoints or settings (``(label,
    report)``, each report possibly :func:`join_parts`' result) as one report whose modes are
    ``label:mode``, with :func:`with_outcomes` pairing each with the first evaluation's
    ``reference`` mode (e.g. ``lerobot``: LeRobot's runtime as the success reference)."""
    label0, first = evaluations[0]
    if reference not in first["modes"]:
        raise ValueError(f"the first evaluation ({label0}) has no {reference!r} mode (modes: {', '.join(first['modes'])})")
    tasks = {r["task"] for _, r in evaluations}
    if len(tasks) > 1:
        raise ValueError(f"the evaluations grade different tasks: {', '.join(sorted(tasks))}")
    seeds = {e["seed"] for e in first["modes"][reference]["per_episode"]}
    modes: dict[str, Any] = {}
    for label, r in evaluations:
        if not any(e["seed"] in seeds for m in r["modes"].values() for e in m["per_episode"]):
            raise ValueError(f"{label} shares no seed with {label0}: nothing to pair (`vla-accel eval --seed`)")
        for name in r.get("mode_order", r["modes"]):
            key = f"{label}:{name}"
            if key in modes:
                raise ValueError(f"{key} is given twice")
            modes[key] = {"per_episode": r["modes"][name]["per_episode"]}
    ref = f"{label0}:{reference}"
    order = [ref, *(k for k in modes if k != ref)]
    return with_outcomes({"task": first["task"], "mode_order": order, "modes": {k: modes[k] for k in order}}, baseline=ref)
