"""The parity gate: the engine path against transformers' own forward, on fixed inputs.

vla.cpp's lesson: a precision slip in one discrete index silently moved actions by ~2 std.
So parity is a gate that fails loud, not a log line: ``vla-accel parity`` exits non-zero and
a policy refuses to start when its accelerated path is beyond tolerance.

Checks (float32):
* ``prefix_hidden``: final hidden states of the whole prefix, engine vs transformers;
* ``actions``: one full ``infer`` against the transformers path (same noise for flow), in
  normalized action units (ar: also the decoded tokens must be identical);
* ``actions_reuse``: the same observation a second time through the policy's planner: with
  identical frames every reusable token is reused, which must still equal the reference.
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

    @property
    def passed(self) -> bool:
        return not self.failures

    def check(self, name: str, value: float, tolerance: float | None = None) -> None:
        tol = self.tolerance if tolerance is None else tolerance
        self.metrics[name] = value
        if not (value <= tol):  # also catches NaN
            self.failures.append(f"{name}={value:.3g} > {tol:.3g}")

    def table(self) -> str:
        rows = [f"  {k:<24} {v:.3e}" for k, v in self.metrics.items()]
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


PARITY_STEPS = ("prefix_hidden", "actions", "actions_reuse")


def run_parity(policy, tolerance: float = 1e-3, seed: int = 1234, on_step: Callable[[str], None] | None = None) -> ParityReport:
    """Compare ``policy`` (ArPolicy or FlowPolicy) with its transformers reference;
    ``on_step(name)`` after each of :data:`PARITY_STEPS` (progress)."""
    step = on_step or (lambda _name: None)
    spec = policy.spec
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
        ref = policy.reference_infer(obs, noise=noise)
    else:
        ref = policy.reference_infer(obs)
    ref_n = _normalized(policy, ref.actions)
    for name in ("actions", "actions_reuse"):  # the second call reuses every reusable token
        got = policy.infer(obs, noise=noise)
        report.check(f"{name}_max_abs_norm", float(np.abs(_normalized(policy, got.actions) - ref_n).max()))
        if spec.family == "ar":
            mismatched = sum(a != b for a, b in zip(got.stats["action_tokens"], ref.stats["action_tokens"]))
            report.check(f"{name}_token_mismatches", float(mismatched), tolerance=0.0)
        step(name)
    policy.reset()
    return report
