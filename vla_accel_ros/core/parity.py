"""The parity gate: the engine path against transformers' own forward, on fixed inputs.

vla.cpp's lesson: a precision slip in one discrete index silently moved actions by ~2 std.
So parity is a gate that fails loud, not a log line: ``vla-accel parity`` exits non-zero and
a policy refuses to start when its accelerated path is beyond tolerance.

Exact checks (float32, ``tolerance``):
* ``prefix_hidden``: final hidden states of the whole prefix, engine vs transformers;
* ``actions``: one full ``infer`` against the transformers path (same noise for flow), in
  normalized action units (ar: also the decoded tokens must be identical);
* ``actions_reuse``: the same observation a second time through the policy's planner: with
  identical frames every reusable token is reused, which must still equal the reference.
  (Pruning is approximate on every frame: with it these two are checked at ``accel_tolerance``.)

Accelerated check (any planner but the full recompute, ``accel_tolerance`` in units of the
action std): frame A, then frame B = A with a block of patches changed (a moving object),
through the policy's own planner; B's actions against the full-compute reference of B. The
check must exercise what runs: with pruning some token must be dropped, and with the token
cache some token must be reused unless its relevance eviction evicted every static token
(then nothing approximate ran and there is nothing to verify, which the report says).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vla_accel_ros.core.types import Observation


@dataclass
class ParityReport:
    tolerance: float
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def check(self, name: str, value: float, tolerance: float | None = None) -> None:
        tol = self.tolerance if tolerance is None else tolerance
        self.metrics[name] = value
        if not (value <= tol):  # also catches NaN
            self.failures.append(f"{name}={value:.3g} > {tol:.3g}")

    def table(self) -> str:
        rows = [f"  {k:<32} {v:.3e}" for k, v in self.metrics.items()]
        rows += [f"  note: {n}" for n in self.notes]
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
        return "\n".join(rows + [f"  tolerance {self.tolerance:g} -> {verdict}"])


def fixed_observation(spec, seed: int = 1234) -> Observation:
    """Deterministic inputs: smooth random images (not flat noise), the default instruction."""
    rng = np.random.default_rng(seed)
    images = {}
    for cam in spec.cameras:
        low = rng.integers(0, 256, size=(8, 8, 3)).astype(np.float32)
        img = np.kron(low, np.ones((spec.image_size // 8 + 1, spec.image_size // 8 + 1, 1)))
        images[cam] = img[: spec.image_size, : spec.image_size].astype(np.uint8)
    state = None
    if spec.state_dim:
        state = np.asarray(spec.norm_stats["state"]["mean"], dtype=np.float32) + 0.1 * rng.standard_normal(
            spec.state_dim
        ).astype(np.float32)
    return Observation(images=images, instruction=spec.default_instruction, stamp_ns=0, state=state)


def _normalized(policy, actions: np.ndarray) -> np.ndarray:
    stats = policy.action_norm.stats
    return (actions - stats["mean"]) / np.maximum(stats["std"], 1e-6)


def changed_observation(obs: Observation, spec) -> Observation:
    """``obs`` with a block of about 3 x 3 patches per camera replaced (a moving object) and the
    state nudged: most image tokens are unchanged, some are not."""
    p = spec.patch_size
    y, x = 5 * p, 6 * p
    images = {}
    for cam, img in obs.images.items():
        img = img.copy()
        img[y : y + 3 * p, x : x + 3 * p] = 255 - img[y : y + 3 * p, x : x + 3 * p]
        images[cam] = img
    state = None if obs.state is None else obs.state + 0.02
    return Observation(images=images, instruction=obs.instruction, stamp_ns=obs.stamp_ns + 20_000_000, state=state,
                       episode=obs.episode)  # fmt: skip


def _reference(policy, obs: Observation, noise):
    if policy.spec.family == "flow":
        return policy.reference_infer(obs, noise=noise)
    return policy.reference_infer(obs)


PARITY_STEPS = ("prefix_hidden", "actions", "actions_reuse", "accelerated")


def run_parity(
    policy,
    tolerance: float = 1e-3,
    seed: int = 1234,
    accel_tolerance: float | None = None,
    on_step: Callable[[str], None] | None = None,
) -> ParityReport:
    """Compare ``policy`` (ArPolicy or FlowPolicy) with its transformers reference; the
    accelerated check runs when its planner is not the full recompute. ``on_step(name)`` after
    each of :data:`PARITY_STEPS` (progress; "accelerated" also when there is nothing to check)."""
    step = on_step or (lambda _name: None)
    spec, cfg = policy.spec, policy.config
    accel_tolerance = cfg.parity_tolerance_accel if accel_tolerance is None else accel_tolerance
    obs = fixed_observation(spec, seed)
    report = ParityReport(tolerance=tolerance)
    policy.reset()

    ref_h = policy.reference_prefix_hidden(obs)
    eng_h = policy.engine_prefix_hidden(obs)
    report.check("prefix_hidden_max_abs", float((ref_h - eng_h).abs().max()))
    step("prefix_hidden")

    noise = None
    if spec.family == "flow":
        noise = np.random.default_rng(seed).standard_normal((spec.chunk_size, spec.action_dim)).astype(np.float32)
    ref = _reference(policy, obs, noise)
    ref_n = _normalized(policy, ref.actions)
    exact = not cfg.uses_prune
    for name in ("actions", "actions_reuse"):  # the second call reuses every reusable token
        got = policy.infer(obs, noise=noise)
        delta = np.abs(_normalized(policy, got.actions) - ref_n)
        if exact:
            report.check(f"{name}_max_abs_norm", float(delta.max()))
        else:  # pruning is approximate from the first frame on
            report.check(f"{name}_mean_abs_norm", float(delta.mean()), tolerance=accel_tolerance)
        if spec.family == "ar" and exact:
            mismatched = sum(a != b for a, b in zip(got.stats["action_tokens"], ref.stats["action_tokens"]))
            report.check(f"{name}_token_mismatches", float(mismatched), tolerance=0.0)
        step(name)
    if cfg.accel != "none":
        _accelerated_check(policy, obs, noise, report, accel_tolerance)
    step("accelerated")
    policy.reset()
    return report


def _accelerated_check(policy, obs: Observation, noise, report: ParityReport, tolerance: float) -> None:
    cfg = policy.config
    second = changed_observation(obs, policy.spec)
    ref = _reference(policy, second, noise)
    policy.reset()
    policy.infer(obs, noise=noise)
    got = policy.infer(second, noise=noise)
    delta = np.abs(_normalized(policy, got.actions) - _normalized(policy, ref.actions))
    # The mean, not the max: one ar token flipping to a neighbouring bin on one dimension is
    # not a broken plan; a broken plan moves every action.
    report.check("accel_second_frame_mean_abs_norm", float(delta.mean()), tolerance=tolerance)
    report.metrics["accel_second_frame_max_abs_norm"] = float(delta.max())
    st = got.stats
    if policy.spec.family == "ar":
        same = np.mean([a == b for a, b in zip(st["action_tokens"], ref.stats["action_tokens"])])
        report.metrics["accel_identical_token_share"] = float(same)
    if cfg.uses_prune:
        report.metrics["accel_tokens_pruned"] = float(st.get("tokens_pruned", 0))
        if not st.get("tokens_pruned", 0):
            report.failures.append("pruning dropped no token on the gate's frames: the gate cannot verify it")
    if cfg.uses_cache:
        reused = int(st.get("reused_tokens", 0))
        report.metrics["accel_tokens_reused"] = float(reused)
        static, evicted = int(st.get("static_tokens", 0)), int(st.get("evicted_tokens", 0))
        if reused == 0 and not (static and evicted == static):
            report.failures.append("the token cache reused no token on the gate's frames: the gate cannot verify it")
        elif reused == 0:
            report.notes.append("no reuse to verify: relevance eviction evicted every static token (flat attention)")
