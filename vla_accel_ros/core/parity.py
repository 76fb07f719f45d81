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
  (Pruning is approximate on every frame: with it these two are checked at ``accel_tolerance``,
  and on a flow policy the first one also against the policy's sampling spread on that frame,
  ``parity_tolerance_prune``: pruning may move a chunk no further than new noise does.)

Accelerated check (any planner but the full recompute, ``accel_tolerance`` in units of the
action std): frame A, then frame B = A with a block of patches changed (a moving object),
through the policy's own planner; B's actions against the full-compute reference of B. The
check must exercise what runs: with pruning some token must be dropped, and with the token
cache some token must be reused unless its relevance eviction evicted every static token
(then nothing approximate ran and there is nothing to verify, which the report says).

Precision check (a policy whose ``precision`` is below fp32 carries an :class:`Fp32Reference`:
the fp32 transformers path of the same bundle on the gate's two frames, computed once when it
is built, so the fp32 weights need not stay loaded): every action check above compares with
that reference instead, at the ``precision.gate_*`` limits (ar: share of identical action
tokens and max |delta| in action units; flow: max |delta| / action std, same noise), and the
second frame is also run through the full recompute so precision is measured apart from any
token method. The two frames are the synthetic ones by default; callers with real frames (the
replay benchmark: the bag's first observations) pass them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vla_accel_ros.core.prefix import FullRecompute
from vla_accel_ros.core.types import ActionChunk, Observation


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
        st = spec.norm_stats["state"]
        center = st["mean"] if "mean" in st else (np.add(st["min"], st["max"]) / 2 if "min" in st else np.zeros(spec.state_dim))
        state = np.asarray(center, dtype=np.float32) + 0.1 * rng.standard_normal(spec.state_dim).astype(np.float32)
    return Observation(images=images, instruction=spec.default_instruction, stamp_ns=0, state=state)


def _normalized(policy, actions: np.ndarray) -> np.ndarray:
    """Actions in units of the bundle's action spread (``policy.action_scale()``: center, scale)."""
    center, scale = policy.action_scale()
    return (actions - center) / scale


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


_SPREAD_SEED = 4321  # the other noise of the pruning check's sampling spread
# Failures of the token method itself, whatever the precision (precision auto stops at them).
TOKEN_METHOD_CHECKS = ("prune_over_sampling_spread", "accel_second_frame", "pruning dropped", "the token cache reused")

PARITY_STEPS = ("prefix_hidden", "actions", "actions_reuse", "accelerated")


def gate_noise(policy, seed: int = 1234) -> np.ndarray | None:
    """The noise of every gate inference, of the shape ``policy.noise_shape`` (None: the policy
    samples no noise, e.g. greedy token decoding)."""
    shape = policy.noise_shape
    if shape is None:
        return None
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def gate_frames(spec, seed: int = 1234, observations=None) -> tuple[Observation, Observation]:
    """The gate's two frames: ``observations`` when given, else a fixed synthetic frame and the
    same frame with a moving block."""
    if observations is not None:
        first, second = observations
        return first, second
    first = fixed_observation(spec, seed)
    return first, changed_observation(first, spec)


@dataclass
class Fp32Reference:
    """The fp32 transformers path of a bundle on the gate's frames, for reduced-precision gates."""

    observations: tuple[Observation, Observation]
    noise: np.ndarray | None
    chunks: tuple[ActionChunk, ActionChunk]
    noise_scale: float = 1.0  # the fp32 policy's noise scale: the chunks were sampled at it


def fp32_reference(fp32_policy, seed: int = 1234, observations=None) -> Fp32Reference:
    """Run the gate's frames through ``fp32_policy``'s transformers path (an fp32 policy of the
    same bundle; it may be dropped afterwards)."""
    frames = gate_frames(fp32_policy.spec, seed, observations)
    noise = gate_noise(fp32_policy, seed)
    chunks = tuple(fp32_policy.reference_infer(o, noise=noise) for o in frames)
    return Fp32Reference(frames, noise, chunks, noise_scale_of(fp32_policy))


def noise_scale_of(policy) -> float:
    """The noise scale ``policy`` samples at (its flow_noise_scale, else its bundle's; 1 for
    policies that integrate no flow)."""
    return getattr(policy, "noise_scale", 1.0)


def _check_precision(report: ParityReport, name: str, policy, got: ActionChunk, ref: ActionChunk) -> None:
    """Reduced precision against fp32 at the ``precision.gate_*`` limits: policies that decode
    action tokens by the share of identical tokens and the largest deviation in action units,
    the others (same noise) by the largest deviation over the action spread."""
    limits = policy.config.precision
    if "action_tokens" in ref.stats:
        same = np.mean([a == b for a, b in zip(got.stats["action_tokens"], ref.stats["action_tokens"])])
        # checked as 1 - share <= 1 - min share, so the report's rule "value <= tolerance" holds
        report.check(f"{name}_token_differ_share", float(1.0 - same), tolerance=1.0 - limits.gate_ar_min_identical_tokens)
        report.check(f"{name}_max_abs", float(np.abs(got.actions - ref.actions).max()), tolerance=limits.gate_ar_max_abs)
    else:
        delta = np.abs(_normalized(policy, got.actions) - _normalized(policy, ref.actions))
        report.check(f"{name}_max_over_std", float(delta.max()), tolerance=limits.gate_flow_max_over_std)


def run_parity(
    policy,
    tolerance: float = 1e-3,
    seed: int = 1234,
    accel_tolerance: float | None = None,
    observations=None,
    on_step: Callable[[str], None] | None = None,
) -> ParityReport:
    """Compare ``policy`` (any family's) with its plain reference forward (fp32: the
    same modules; reduced precision: ``policy.fp32_reference``); the accelerated check runs
    when its planner is not the full recompute. ``observations``: the gate's two frames.
    ``on_step(name)`` after each of :data:`PARITY_STEPS` (progress; "accelerated" also when
    there is nothing to check)."""
    step = on_step or (lambda _name: None)
    spec, cfg = policy.spec, policy.config
    accel_tolerance = cfg.parity_tolerance_accel if accel_tolerance is None else accel_tolerance
    fp32 = getattr(policy, "fp32_reference", None)
    if fp32 is not None and fp32.noise_scale != noise_scale_of(policy):
        # The noise scale changed since the reference was sampled (a run-time parameter):
        # precision is compared at the reference's, not across two samplers.
        with _noise_scale(policy, fp32.noise_scale):
            return run_parity(policy, tolerance, seed, accel_tolerance, observations, on_step)
    if fp32 is not None:
        (obs, second), noise = fp32.observations, fp32.noise
    else:
        obs, second = gate_frames(spec, seed, observations)
        noise = gate_noise(policy, seed)
    report = ParityReport(tolerance=tolerance)
    policy.reset()

    if fp32 is None:
        ref_h = policy.reference_prefix_hidden(obs)
        eng_h = policy.engine_prefix_hidden(obs)
        report.check("prefix_hidden_max_abs", float((ref_h - eng_h).abs().max()))
        ref = policy.reference_infer(obs, noise=noise)
        ref2 = policy.reference_infer(second, noise=noise) if cfg.accel != "none" else None
    else:
        ref, ref2 = fp32.chunks
        report.notes.append(f"precision {policy.precision.label()}: against the fp32 reference of the bundle")
        _precision_only(policy, second, noise, ref2, report)
    step("prefix_hidden")
    ref_n = _normalized(policy, ref.actions)
    exact = not cfg.uses_prune and fp32 is None
    first = None  # the first call's actions: pruning alone (nothing reused yet)
    for name in ("actions", "actions_reuse"):  # the second call reuses every reusable token
        got = policy.infer(obs, noise=noise)
        first = got.actions if first is None else first
        delta = np.abs(_normalized(policy, got.actions) - ref_n)
        if cfg.uses_prune:  # pruning is approximate from the first frame on
            report.check(f"{name}_mean_abs_norm", float(delta.mean()), tolerance=accel_tolerance)
        elif fp32 is not None:
            _check_precision(report, name, policy, got, ref)
        else:
            report.check(f"{name}_max_abs_norm", float(delta.max()))
        if exact and "action_tokens" in ref.stats:
            mismatched = sum(a != b for a, b in zip(got.stats["action_tokens"], ref.stats["action_tokens"]))
            report.check(f"{name}_token_mismatches", float(mismatched), tolerance=0.0)
        step(name)
    if cfg.uses_prune and noise is not None:  # after both: it overwrites the cached prefix
        _check_prune_spread(policy, obs, noise, first, report)
    if cfg.accel != "none":
        _accelerated_check(policy, obs, second, noise, ref2, report, accel_tolerance)
    step("accelerated")
    policy.reset()
    return report


@contextlib.contextmanager
def _full_recompute(policy):
    """``policy`` without its token method for a while; its planner starts over afterwards
    (the full recompute wrote the cached prefix)."""
    planner = policy.planner
    policy.planner = FullRecompute()
    try:
        yield
    finally:
        policy.planner = planner
        planner.reset("external prefix write")


@contextlib.contextmanager
def _noise_scale(policy, scale: float):
    """``policy`` sampling at noise ``scale`` for a while (its configuration restored after)."""
    config = policy.config
    policy.config = config.replace(flow_noise_scale=scale)
    try:
        yield
    finally:
        policy.config = config


def _check_prune_spread(policy, obs: Observation, noise: np.ndarray, pruned: np.ndarray, report: ParityReport) -> None:
    """A flow policy's pruned first frame (nothing reused yet: pruning alone) against the
    policy's own sampling spread on that frame, both measured on the policy's own full
    recompute (its precision, not fp32's). A bound in action std cannot tell a trained policy
    from a random one: on two trained policies here pruning moved the first chunk 1.4-2.9x as far
    as new noise does (the task's frames) and lost the task in closed loop at every setting
    tried, while passing the absolute bound; on random weights the spread is wide."""
    other = np.random.default_rng(_SPREAD_SEED).standard_normal(noise.shape).astype(np.float32)
    trained = noise_scale_of(policy) == 1.0
    with _full_recompute(policy):
        a = _normalized(policy, policy.infer(obs, noise=noise).actions)
        # The spread is the trained sampler's (noise scale 1) whatever flow_noise_scale runs:
        # a policy run with less noise is no less uncertain, and at 0 it would be 0.
        with _noise_scale(policy, 1.0):
            a1 = a if trained else _normalized(policy, policy.infer(obs, noise=noise).actions)
            b = _normalized(policy, policy.infer(obs, noise=other).actions)
    moved = float(np.abs(_normalized(policy, pruned) - a).mean())
    spread = float(np.abs(a1 - b).mean())
    report.metrics["prune_first_frame_mean_abs_norm"] = moved
    report.metrics["sampling_spread_mean_abs_norm"] = spread
    if not (np.isfinite(spread) and spread > 0):
        ratio = 0.0 if moved == 0 else float("inf")
        if ratio:
            report.notes.append(f"the chunk does not depend on the noise (sampling spread {spread:.3g}): pruning, which "
                                "moves it, cannot be held to the spread")  # fmt: skip
    else:
        ratio = moved / spread
    report.check("prune_over_sampling_spread", ratio, tolerance=policy.config.parity_tolerance_prune)
    if np.isfinite(ratio) and ratio > policy.config.parity_tolerance_prune:
        report.notes.append(f"pruning moves the first chunk {ratio:.2g}x as far as new noise does: keep more tokens "
                            "(prune.keep_*, prune.min_keep) or do not prune this policy")  # fmt: skip


def _precision_only(policy, second: Observation, noise, ref: ActionChunk, report: ParityReport) -> None:
    """The second frame through the full recompute: precision apart from any token method."""
    with _full_recompute(policy):
        got = policy.infer(second, noise=noise)
    _check_precision(report, "precision_second_frame", policy, got, ref)


def _accelerated_check(policy, obs: Observation, second: Observation, noise, ref, report: ParityReport, tolerance: float) -> None:
    cfg = policy.config
    policy.reset()
    policy.infer(obs, noise=noise)
    got = policy.infer(second, noise=noise)
    delta = np.abs(_normalized(policy, got.actions) - _normalized(policy, ref.actions))
    # The mean, not the max: one ar token flipping to a neighbouring bin on one dimension is
    # not a broken plan; a broken plan moves every action.
    report.check("accel_second_frame_mean_abs_norm", float(delta.mean()), tolerance=tolerance)
    report.metrics["accel_second_frame_max_abs_norm"] = float(delta.max())
    st = got.stats
    if "action_tokens" in ref.stats:
        same = np.mean([a == b for a, b in zip(st["action_tokens"], ref.stats["action_tokens"])])
        report.metrics["accel_identical_token_share"] = float(same)
    if cfg.uses_prune:
        report.metrics["accel_tokens_pruned"] = float(st.get("tokens_pruned", 0))
        if not st.get("tokens_pruned", 0):
            report.failures.append("pruning dropped no token on the gate's frames: the gate cannot verify it")
    if cfg.uses_cache:
        # Decoder K/V or only vision features (cache.reuse_vision past the decoder's depth)
        reused = max(int(st.get("reused_tokens", 0)), int(st.get("vision_reused", 0)))
        report.metrics["accel_tokens_reused"] = float(reused)
        static, evicted = int(st.get("static_tokens", 0)), int(st.get("evicted_tokens", 0))
        candidates = int(st.get("candidate_tokens", static))  # static, on cameras without a scene cut
        if reused == 0 and candidates > evicted:
            report.failures.append("the token cache reused no token on the gate's frames: the gate cannot verify it")
        elif reused == 0:
            why = "relevance eviction evicted every static token (flat attention)" if candidates else (
                f"no camera kept enough static tokens ({static} static, every camera a scene cut)")
            report.notes.append(f"no reuse to verify: {why}")
