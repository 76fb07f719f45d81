"""The benchmark modes and what runs them, shared by the replay benchmark, the closed-loop
evaluation and the LeRobot comparisons: the table of modes (:data:`MODES`, with the
``@<precision>[+compile]`` suffix of :func:`mode_of`), the policy configuration a mode runs with
(:func:`policy_config`), one policy per mode on one model's weights (:func:`build_runs`), what a
mode measured (:class:`ModeRun`), and the flow noise every mode gets on a frame (:func:`frame_noise`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vla_accel_ros.bench.cache_bench import PRESETS
from vla_accel_ros.bench.flops import FrameWork, work_from_stats
from vla_accel_ros.core.errors import ConfigError, ParityError
from vla_accel_ros.models.family import get_family


@dataclass(frozen=True)
class Mode:
    """A benchmark mode: PolicyConfig fields (nested ``cache`` as a dict) and how to call it."""

    policy: dict[str, Any]
    reference: bool = False  # call reference_infer (plain transformers) instead of infer
    doc: str = ""
    pipelined: bool = False  # ar: ActionFlow's pipelined decode (models.pipeline.PipelinedAr)


# Named pruning configurations (overrides of PruneConfig()).
PRUNE_PRESETS: dict[str, dict[str, Any]] = {
    # Static pruning only (self-speculation, global, dynamic tokens), no layer-level pruning.
    "static": {"dynamic_layers": ()},
    # Fewer tokens kept at every stage.
    "aggressive": {"keep_global": 32, "keep_local": 32, "keep_dynamic": 16, "dynamic_keep": 0.7},
}

# Adding a mode is one line here.
MODES: dict[str, Mode] = {
    "baseline": Mode({"accel": "none"}, doc="the engine, full prefix recompute every frame (the reference)"),
    "transformers": Mode({"accel": "none"}, reference=True, doc="transformers' own forward and DynamicCache"),
    "cache": Mode({"accel": "cache"}, doc="VLA-Cache token reuse, default settings"),
    **{
        f"cache-{name}": Mode({"accel": "cache", "cache": dict(preset)}, doc=f"token cache, bench preset {name!r}")
        for name, preset in PRESETS.items()
        if name != "default"
    },
    "prune": Mode({"accel": "prune"}, doc="SpecPrune-VLA token pruning, default settings"),
    **{
        f"prune-{name}": Mode({"accel": "prune", "prune": dict(p)}, doc=f"token pruning, preset {name!r}")
        for name, p in PRUNE_PRESETS.items()
    },
    "cache+prune": Mode({"accel": "cache+prune"}, doc="token cache and pruning in one plan, default settings"),
    "cache+prune-aggressive": Mode(
        {"accel": "cache+prune", "prune": dict(PRUNE_PRESETS["aggressive"])}, doc="token cache with aggressive pruning"
    ),
    **{
        "pipelined" + ("" if accel == "none" else f"+{accel}"): Mode(
            {"accel": accel}, pipelined=True,
            doc="ar: prefill of each frame packed with the decode steps of the frames in flight"
            + ("" if accel == "none" else f", prefix planned by {accel}"),
        )  # fmt: skip
        for accel in ("none", "cache", "prune", "cache+prune")
    },
    # MEMO-VLM, reasoning bundles only: the previous reasoning validated in the prefill.
    **{
        "memo" + ("" if accel == "none" else f"+{accel}"): Mode(
            {"accel": accel, "memo": {"mode": "calibrated"}},
            doc="reasoning reuse with calibrated thresholds" + ("" if accel == "none" else f", prefix planned by {accel}"),
        )  # fmt: skip
        for accel in ("none", "cache", "prune", "cache+prune")
    },
    "memo-exact": Mode({"accel": "none", "memo": {"mode": "exact"}}, doc="reasoning reuse where a word must be the argmax"),
    # ar: the previous chunk's action tokens verified in the prefill (exact greedy tokens).
    **{
        ("" if accel == "none" else f"{accel}+") + "draft": Mode(
            {"accel": accel, "action_draft": "previous"},
            doc="ar: the previous chunk's action tokens drafted in the prefill, decode from the first rejected one"
            + ("" if accel == "none" else f", prefix planned by {accel}"),
        )  # fmt: skip
        for accel in ("none", "cache", "prune", "cache+prune")
    },
    "memo+draft": Mode(
        {"accel": "none", "memo": {"mode": "calibrated"}, "action_draft": "previous"},
        doc="reasoning reuse with calibrated thresholds, then the previous action tokens drafted after <act>",
    ),
    "memo-exact+draft": Mode(
        {"accel": "none", "memo": {"mode": "exact"}, "action_draft": "previous"},
        doc="exact reasoning reuse, then the previous action tokens drafted after <act> (equals greedy decoding)",
    ),
}
BASELINE = "baseline"
COMPILE = "compile"


def mode_of(name: str) -> Mode:
    """The mode a name runs: one of :data:`MODES`, optionally with a runtime suffix
    ``@<precision preset>[+<backend>][+compile]`` (e.g. ``baseline@bf16``,
    ``cache+prune@int8+compile``, ``baseline@auto+openvino``, ``baseline@onnxruntime``): the
    base mode at that precision (presets of :data:`vla_accel_ros.core.precision.PRESETS`),
    its vision tower on that backend (:data:`~vla_accel_ros.core.precision.BACKENDS`; torch
    when none is named), compiled or eager. Unsuffixed: fp32 eager on torch."""
    from vla_accel_ros.core.precision import BACKENDS, PRESETS, preset

    base, at, suffix = name.partition("@")
    if base not in MODES:
        raise ConfigError(f"unknown mode {base!r}; choose from {', '.join(MODES)} (with @<precision>[+<backend>][+compile])")
    mode = MODES[base]
    if not at:
        return mode
    parts = suffix.split("+")
    compiled = COMPILE in parts
    backends = [p for p in parts if p in BACKENDS and p != "torch"]
    rest = [p for p in parts if p != COMPILE and p not in backends]
    if len(rest) > 1 or rest == [""] or len(backends) > 1 or parts.count(COMPILE) > 1:
        raise ConfigError(
            f"mode {name!r}: the suffix is @<precision>[+<backend>][+compile], precision one of {', '.join(PRESETS)}, "
            f"backend one of {', '.join(b for b in BACKENDS if b != 'torch')}"
        )
    precision = preset(rest[0]) if rest else {}
    backend = backends[0] if backends else "torch"
    if mode.reference and (compiled or backend != "torch" or any(v != "fp32" for v in precision.values())):
        raise ConfigError(f"mode {name!r}: the transformers path runs fp32 eager on torch (it is the reference)")
    what = (rest[0] if rest else "fp32") + ("" if backend == "torch" else f", vision on {backend}") + (", compiled" if compiled else "")
    policy = {**mode.policy, "precision": {**precision, "compile": compiled, **({} if backend == "torch" else {"backend": backend})}}
    return dataclasses.replace(mode, policy=policy, doc=f"{mode.doc} ({what})")


def parse_modes(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """Mode names in run order; the baseline is added first when missing (speedup and
    deviation are measured against it)."""
    names = [m.strip() for m in text.split(",")] if isinstance(text, str) else [m.strip() for m in text]
    names = [m for m in names if m]
    if not names:
        raise ConfigError(f"--modes names no mode ({text!r}); choose from {', '.join(MODES)}")
    for m in names:
        mode_of(m)  # ConfigError for an unknown mode or suffix
    if len(set(names)) != len(names):
        raise ConfigError(f"--modes lists a mode twice: {','.join(names)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return names


@dataclass
class ModeRun:
    """One mode's policy and everything it measured on the timed frames."""

    name: str
    mode: Mode
    policy: Any
    config: dict[str, Any]
    latency: list[float] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    flops: list[dict[str, float]] = field(default_factory=list)
    work: list[FrameWork] = field(default_factory=list)  # what each timed inference computed

    call_ms: list[float] = field(default_factory=list)  # each timed frame's call (the mode's cost per frame)
    flush_ms: float = 0.0  # finishing the frames in flight at episode ends, once timing began (pipelined)
    stamps: list[int] = field(default_factory=list)  # of the recorded chunks' observations
    pipeline: Any = None  # PipelinedAr for pipelined modes

    def step(self, obs, noise: np.ndarray) -> list:
        """Process one frame; the chunks that completed (pipelined: those of earlier frames)."""
        if self.pipeline is not None:
            return self.pipeline.push(obs)
        if not self.mode.reference:
            return [self.policy.infer(obs, noise=noise)]
        return [self.policy.reference_infer(obs, noise=noise)]

    def flush(self, timed: bool) -> list:
        """The chunks still in flight; their decode work counts toward throughput once the
        timed frames began (it is what those frames cost, only later)."""
        if self.pipeline is None:
            return []
        t0 = time.perf_counter_ns()
        chunks = self.pipeline.flush()
        if timed:
            self.flush_ms += (time.perf_counter_ns() - t0) / 1e6
        return chunks

    def reset(self) -> None:
        (self.pipeline or self.policy).reset()

    def record(self, chunk, spec, instruction: str) -> None:
        """One timed frame's chunk (obs-to-action latency: for a pipelined chunk, the pipeline's
        own compute from the call its frame entered in to the one it completed in)."""
        st = chunk.stats
        self.latency.append(float(st.get("staleness_busy_ms", chunk.timings_ms["total"])))
        self.stages.append(dict(chunk.timings_ms))
        self.stats.append(st)
        self.stamps.append(int(chunk.stamp_ns))
        self.actions.append(np.asarray(chunk.actions, dtype=np.float32))
        if "action_tokens" in st:
            self.tokens.append(list(st["action_tokens"]))
        layout, _ = self.policy.layout_for(instruction)
        self.work.append(work_from_stats(spec, st, layout.length, self.mode.reference))


def check_overrides(cfg) -> None:
    """``--cache`` / ``--prune`` / ``--precision`` values checked before anything runs, whether
    or not a chosen mode uses them (a typo must not pass silently)."""
    from vla_accel_ros.core.cache import CacheConfig
    from vla_accel_ros.core.precision import PrecisionConfig
    from vla_accel_ros.core.prune import PruneConfig

    for flag, cls, values in (
        ("--cache", CacheConfig, cfg.cache_overrides), ("--prune", PruneConfig, cfg.prune_overrides),
        ("--precision", PrecisionConfig, getattr(cfg, "precision_overrides", {})),
    ):  # fmt: skip
        if values:
            try:
                cls.from_dict(values)
            except ConfigError as e:
                raise ConfigError(f"{flag} {', '.join(f'{k}={v}' for k, v in values.items())}: {e}") from None


def policy_config(mode: Mode, cfg):
    """The :class:`PolicyConfig` mode ``mode`` runs with under ``cfg`` (a replay or an eval
    configuration): the mode's fields, the run's ``--cache`` / ``--prune`` / ``--precision``
    overrides where the mode uses them, and the run-wide settings (parity gate, threads, flow
    steps, seed). ConfigError for an invalid override."""
    from vla_accel_ros.core.policy_config import PolicyConfig

    fields = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mode.policy.items()}
    if fields.get("accel") in ("cache", "cache+prune") and cfg.cache_overrides:
        fields["cache"] = {**fields.get("cache", {}), **cfg.cache_overrides}
    if fields.get("accel") in ("prune", "cache+prune") and getattr(cfg, "prune_overrides", None):
        fields["prune"] = {**fields.get("prune", {}), **cfg.prune_overrides}
    if "precision" in fields and getattr(cfg, "precision_overrides", None):
        fields["precision"] = {**fields["precision"], **cfg.precision_overrides}
    # The transformers path is what the parity gate compares against; gating it is moot.
    fields.update(
        parity_check=cfg.parity_check and not mode.reference, num_threads=cfg.num_threads, flow_steps=cfg.flow_steps,
        flow_noise_scale=getattr(cfg, "noise_scale", -1.0), seed=cfg.seed,
    )  # fmt: skip
    return PolicyConfig.from_dict(fields)


def build_runs(bundle, names: list[str], cfg, gate_observations=None, refused: dict[str, str] | None = None) -> list[ModeRun]:
    """One policy per mode sharing one model's weights (one converted copy per precision); each
    engine mode passes the parity gate (with ``cfg.parity_check``; on ``gate_observations``,
    two frames, when given) before it is timed. A mode the gate refuses raises, or with
    ``refused`` (a dict) is left out and its report kept there by name."""
    from vla_accel_ros.models.factory import load_policy, sibling_policy

    modes = {n: mode_of(n) for n in names}
    configs = {n: policy_config(modes[n], cfg) for n in names}  # invalid overrides fail before loading
    piped = [n for n in names if modes[n].pipelined]
    family = get_family(bundle.spec.family)
    if piped and not family.pipelines:
        raise ConfigError(f"mode(s) {', '.join(piped)} pipeline ar decoding; bundle {bundle.spec.name} is {bundle.spec.family}")
    drafted = [n for n in names if configs[n].action_draft != "off"]
    if drafted and not family.token_actions:
        raise ConfigError(f"mode(s) {', '.join(drafted)} draft ar action tokens; bundle {bundle.spec.name} is {bundle.spec.family}")
    base = load_policy(bundle, configs[BASELINE])
    converted: dict = {}  # per precision one converted copy of the weights; exported graphs; the gate's fp32 reference
    runs = []
    for n in names:
        try:
            policy = base if n == BASELINE else sibling_policy(base, configs[n], converted=converted,
                                                               gate_observations=gate_observations)  # fmt: skip
        except ParityError as e:
            if refused is None:
                raise ParityError(f"mode {n}: {e}") from e
            refused[n] = str(e)
            continue
        run = ModeRun(n, modes[n], policy, configs[n].to_dict())
        if modes[n].pipelined:
            from vla_accel_ros.models.pipeline import PipelinedAr

            run.pipeline = PipelinedAr(policy, steps=cfg.pipeline_steps, depth=cfg.pipeline_depth)
        runs.append(run)
    return runs


def frame_noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The flow noise of frame ``index`` (``shape``: the policies' ``noise_shape``): the same in
    every mode, reproducible across runs."""
    rng = np.random.default_rng((seed, index))
    return rng.standard_normal(shape).astype(np.float32)
