"""The replay benchmark: a recorded rosbag through one policy in several modes, side by side.

Users record bags on their robots and replay them here to choose settings before trusting
them on hardware. Every mode has its own policy object (caches evolve independently; the
engine modes share one copy of the weights) and sees every frame of the bag in order. Per
frame, all modes run on the same observation, in an order that rotates from frame to frame
so none always runs first (or always right after bag decoding). The first ``warmup`` frames
are processed but left out of the statistics. Flow policies get the same noise in every mode
on a given frame (seeded by the frame index), so their deviation measures the mode, not the
sampler. Latency is the ActionChunk's ``timings_ms["total"]``: observation in to actions out,
preprocessing and token selection included; bag decoding is outside it.

Nothing here imports rclpy: bags are read through ``vla_accel_ros.io.bag_reader``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla_accel_ros.bench.cache_bench import PRESETS, STAGES
from vla_accel_ros.bench.flops import FORMULA, FrameWork, estimate_flops, work_from_stats
from vla_accel_ros.bench.reasoning import reasoning_summary, truth_words
from vla_accel_ros.bench.stats import action_deviation, action_std, distribution, percentile
from vla_accel_ros.core.errors import BagError, ConfigError
from vla_accel_ros.models.family import get_family
from vla_accel_ros.sim.aloha import task_of_instruction

SCHEMA = "vla_accel_ros.replay/1"


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
class ReplayConfig:
    bag: Path
    bundle: Path
    modes: tuple[str, ...] = ("baseline", "cache")
    warmup: int = 2  # frames processed first and left out of the statistics
    max_frames: int = 0  # timed frames at most (0: the whole bag)
    seed: int = 0  # flow noise of frame i: default_rng((seed, i))
    parity_check: bool = True
    num_threads: int = 0  # torch threads (0: torch's default)
    flow_steps: int = 0  # flow: Euler steps (0: the bundle's)
    cache_overrides: dict[str, Any] = field(default_factory=dict)  # CacheConfig fields for every cache mode
    prune_overrides: dict[str, Any] = field(default_factory=dict)  # PruneConfig fields for every pruning mode
    # PrecisionConfig fields (the gate's precision limits) for every mode with a precision suffix
    precision_overrides: dict[str, Any] = field(default_factory=dict)
    pipeline_steps: int = 0  # pipelined modes: decode steps advanced per frame (0: from the depth, else 1)
    pipeline_depth: int = 0  # pipelined modes: frames in flight (0: what the steps need)
    # The observation rule's limits (SyncConfig fields; default: the camera and policy nodes').
    sync_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.max_frames < 0:
            raise ConfigError(f"--max-frames must be >= 0, got {self.max_frames}")
        if self.flow_steps < 0:
            raise ConfigError(f"--flow-steps must be >= 0, got {self.flow_steps}")
        if self.pipeline_steps < 0 or self.pipeline_depth < 0:
            raise ConfigError(f"--pipeline-steps / --pipeline-depth must be >= 0, got {self.pipeline_steps} / {self.pipeline_depth}")
        parse_modes(list(self.modes))
        check_overrides(self)
        if "cameras" in self.sync_overrides:
            raise ConfigError(
                f"--sync cameras={self.sync_overrides['cameras']!r}: the cameras come from the bundle "
                "(its config.json), a replay cannot choose them"
            )


# ------------------------------------------------------------------------------ inputs


def inspect_bag(path: Path, spec) -> dict[str, Any]:
    """Check that the bag can feed this bundle before any weights load; return its metadata."""
    from vla_accel_ros.io.bag_reader import BagReader

    with BagReader(path) as bag:
        cams = bag.cameras()
        missing = [c for c in spec.cameras if c not in cams]
        if missing:
            raise BagError(
                f"bag {path} has no camera(s) {', '.join(missing)} that bundle {spec.name} needs; "
                f"it has {', '.join(sorted(cams)) or 'none'}"
            )
        topics = bag.topics
        wanted = bag.robot.joint_state_topics  # the reader assembles the state from these
        if spec.state_dim and not all(t in topics for t in wanted):
            raise BagError(
                f"bag {path} has no joint states ({', '.join(wanted)}) "
                f"but the {spec.family} bundle {spec.name} needs a {spec.state_dim}-D state"
            )
        if spec.state_dim and spec.state_dim != bag.robot.dim:
            raise BagError(f"bag {path} yields {bag.robot.dim}-D states; bundle {spec.name} expects {spec.state_dim}-D")
        return {
            "path": str(path),
            "cameras": sorted(cams),
            "frames": min(topics[cams[c]].count for c in spec.cameras),  # observations at most
            "duration_s": bag.duration_ns / 1e9,
            "messages": bag.message_count,
        }


# ------------------------------------------------------------------------------ modes


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


def policy_config(mode: Mode, cfg: ReplayConfig):
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
        seed=cfg.seed,
    )  # fmt: skip
    return PolicyConfig.from_dict(fields)


def build_runs(bundle, names: list[str], cfg: ReplayConfig, gate_observations=None) -> list[ModeRun]:
    """One policy per mode sharing one model's weights (one converted copy per precision); each
    engine mode passes the parity gate (with ``cfg.parity_check``; on ``gate_observations``,
    two frames, when given) before it is timed."""
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
        gate = gate_observations if configs[n].precision.gated_against_fp32 else None
        policy = base if n == BASELINE else sibling_policy(base, configs[n], converted=converted, gate_observations=gate)
        run = ModeRun(n, modes[n], policy, configs[n].to_dict())
        if modes[n].pipelined:
            from vla_accel_ros.models.pipeline import PipelinedAr

            run.pipeline = PipelinedAr(policy, steps=cfg.pipeline_steps, depth=cfg.pipeline_depth)
        runs.append(run)
    return runs


# ------------------------------------------------------------------------------ the run


def gate_frames_from_bag(path: Path, sync, second: int = 10) -> tuple[Any, Any] | None:
    """The bag's first observation and its ``second``-th (or last): real frames for the parity
    gate of the reduced-precision modes; None when the bag has fewer than two."""
    from vla_accel_ros.io.bag_reader import BagReader

    first = last = None
    with BagReader(path) as bag:
        for i, sample in enumerate(bag.samples(sync)):
            if first is None:
                first = sample.observation
            else:
                last = sample.observation
            if i >= second:
                break
    return None if last is None else (first, last)


def frame_noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The flow noise of frame ``index`` (``shape``: the policies' ``noise_shape``): the same in
    every mode, reproducible across runs."""
    rng = np.random.default_rng((seed, index))
    return rng.standard_normal(shape).astype(np.float32)


def run_replay(cfg: ReplayConfig, *, progress: bool = False, command: str = "") -> dict[str, Any]:
    """Replay ``cfg.bag`` through ``cfg.bundle`` in every mode; returns the report (see
    :mod:`vla_accel_ros.bench.report`)."""
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_bundle, read_model_spec

    cfg.validate()
    names = parse_modes(list(cfg.modes))
    bag_path, bundle_path = Path(cfg.bag), Path(cfg.bundle)
    if not bag_path.exists():
        raise BagError(f"bag {bag_path} does not exist")
    spec = read_model_spec(bundle_path)  # BundleError when it is not a bundle; cheap, before the bag
    sync = SyncConfig.from_dict({**cfg.sync_overrides, "cameras": tuple(spec.cameras)})  # ConfigError before weights load
    bag_info = inspect_bag(bag_path, spec)
    if cfg.warmup >= bag_info["frames"]:
        raise ConfigError(
            f"--warmup {cfg.warmup} leaves no frame to time: bag {bag_path} has at most {bag_info['frames']} "
            f"observations for cameras {', '.join(spec.cameras)} (use --warmup < {bag_info['frames']})"
        )
    runs = build_runs(load_bundle(bundle_path), names, cfg, gate_observations=gate_frames_from_bag(bag_path, sync))
    for r in runs:
        r.reset()  # forget the parity gate's frames
    ref = next(r.policy for r in runs if r.name == BASELINE)
    flow_steps = getattr(ref, "num_steps", 0)  # policies that integrate a flow; 0: token decoding
    noise_shape = ref.noise_shape or (spec.chunk_size, spec.action_dim)  # token decoding ignores it

    frame_episodes: list[int] = []
    frame_stamps: list[int] = []
    obs_ages: list[float] = []  # ms, of the timed frames' observations when their inference started
    episodes: dict[int, dict[str, Any]] = {}
    timed_frames: dict[int, str] = {}  # stamp -> instruction, of the timed frames
    truths: dict[int, list[str] | None] = {}  # stamp -> the ground-truth reasoning (reasoning bundles)
    processed = 0
    prev_episode: int | None = None
    expected = bag_info["frames"]
    if cfg.max_frames:
        expected = min(expected, cfg.warmup + cfg.max_frames)

    def record(r: ModeRun, chunks: list) -> None:
        for chunk in chunks:
            if chunk.stamp_ns in timed_frames:
                r.record(chunk, spec, timed_frames[chunk.stamp_ns])

    bar = progress_bar(expected, "replay", "frame", enabled=progress)
    with BagReader(bag_path) as bag, bar:
        for sample in bag.samples(sync):
            obs = sample.observation
            if spec.state_dim and obs.state is None:
                raise BagError(f"bag {bag_path}: observation at {obs.stamp_ns} ns has no state; bundle {spec.name} needs one")
            if prev_episode is not None and obs.episode != prev_episode:
                for r in runs:  # a new episode: nothing carried over (the cache also keys on it)
                    record(r, r.flush(timed=bool(frame_episodes)))
                    r.reset()
            prev_episode = obs.episode
            ep = episodes.setdefault(obs.episode, {"index": obs.episode, "instruction": obs.instruction, "frames": 0})
            ep["frames"] += 1
            noise = frame_noise(cfg.seed, processed, noise_shape)
            timed = processed >= cfg.warmup
            if timed:
                timed_frames[obs.stamp_ns] = obs.instruction
                if spec.reasoning_words:  # one simulator step per recorded frame of an episode
                    truths[obs.stamp_ns] = truth_words(task_of_instruction(obs.instruction), ep["frames"] - 1, obs.state)
            k = processed % len(runs)
            for r in runs[k:] + runs[:k]:  # rotate who runs first
                t0 = time.perf_counter_ns()
                chunks = r.step(obs, noise)
                if timed:
                    r.call_ms.append((time.perf_counter_ns() - t0) / 1e6)
                record(r, chunks)
            if timed:
                frame_episodes.append(obs.episode)
                frame_stamps.append(obs.stamp_ns)
                obs_ages.append(sample.age_ms)
            processed += 1
            bar.update(1)
            if timed and progress:
                bar.set_postfix_str(" ".join(f"{r.name} {statistics.median(r.call_ms):.0f}ms" for r in runs))
            if cfg.max_frames and len(frame_episodes) >= cfg.max_frames:
                break
        skipped = dict(bag.skipped)
    for r in runs:  # the frames still in flight, then bookkeeping (not between two timed inferences)
        record(r, r.flush(timed=bool(frame_episodes)))
        r.flops = [estimate_flops(spec, w, flow_steps=flow_steps) for w in r.work]
    if not frame_episodes:
        raise BagError(
            f"bag {bag_path} yielded {processed} observation(s) for cameras {', '.join(spec.cameras)}, none after "
            f"the {cfg.warmup} warm-up frame(s); record a longer bag or lower --warmup"
        )
    meta = {
        "schema": SCHEMA,
        "command": command,
        "bag": {**bag_info, "observations": processed, "skipped": skipped, "episodes": list(episodes.values()),
                # each observation is inferred on as it is made: its age then, on the bag's clock
                "observation_age_ms": distribution(obs_ages)},  # fmt: skip
        "bundle": _bundle_info(bundle_path, spec, ref, flow_steps),
        "frames": len(frame_episodes),
        "warmup": min(cfg.warmup, processed),
        "seed": cfg.seed,
        "mode_order": names,
        "machine": machine_info(),
        "flops_formula": FORMULA,
        "frame_episodes": frame_episodes,
        "frame_stamps_ns": frame_stamps,
    }
    return {**meta, "modes": summarize(runs, spec, truths)}


# ------------------------------------------------------------------------------ summaries


def deviation(run: ModeRun, ref: ModeRun, std: np.ndarray) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Deviation from the baseline on the same frames: summary and per-frame series.

    Policies that decode action tokens: share of identical tokens and max |delta| in action
    units; the others (same noise in every mode): max |delta| / action std."""
    use_tokens = run.tokens and ref.tokens
    dev = action_deviation(run.actions, ref.actions, std, *((run.tokens, ref.tokens) if use_tokens else ()))
    summary: dict[str, Any] = {
        "max_abs": max(dev.max_abs),
        "mean_abs": float(np.mean(dev.mean_abs)),
        "max_over_std": max(dev.max_over_std),
        "p50_frame_max_over_std": float(np.median(dev.max_over_std)),
    }
    series = {"max_abs": dev.max_abs, "max_over_std": dev.max_over_std}
    if dev.token_share is not None:
        summary["identical_token_share"] = float(np.mean(dev.token_share))
        summary["identical_chunk_share"] = dev.identical_chunks
        series["identical_token_share"] = dev.token_share
    return summary, series


def _scalar_stats_mean(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of every numeric per-frame stat a planner reports (bools as a share of frames);
    data-driven so a new planner's counters show up without code here."""
    keys = sorted({k for s in stats for k, v in s.items() if isinstance(v, (bool, int, float))})
    return {k: float(np.mean([float(s.get(k, 0)) for s in stats])) for k in keys}


def summarize(runs: list[ModeRun], spec, truths: dict[int, list[str] | None] | None = None) -> dict[str, Any]:
    ref = next(r for r in runs if r.name == BASELINE)
    std = action_std(spec)
    base = np.asarray(ref.latency)
    base_fps = len(ref.call_ms) / ((sum(ref.call_ms) + ref.flush_ms) / 1e3)
    out: dict[str, Any] = {}
    for r in runs:
        lat = np.asarray(r.latency)
        fps = len(r.call_ms) / ((sum(r.call_ms) + r.flush_ms) / 1e3)  # a pipeline's drain included
        stale_frames = [float(s.get("staleness_calls", 0)) for s in r.stats]
        reuse = [float(s.get("reuse_fraction", 0.0)) for s in r.stats]  # transformers: no reuse
        kept = [float(s.get("tokens_kept_fraction", 1.0)) for s in r.stats]
        dev, dev_series = deviation(r, ref, std)
        components = sorted({k for f in r.flops for k in f})
        stages = [s for s in STAGES if any(s in t for t in r.stages)]
        out[r.name] = {
            "doc": r.mode.doc,
            "reference_path": r.mode.reference,
            "policy_config": r.config,
            # what ran: precision per component (auto resolved) and the compile switch
            "precision": r.policy.precision.label(),
            "compiled": bool(r.config["precision"]["compile"]),
            "parity_gate": _gate_metrics(r.policy),
            "latency_ms": distribution(r.latency),  # obs-to-action (pipelined: its own compute while in flight)
            "call_ms": distribution(r.call_ms),  # the mode's cost per frame
            "drain_ms": r.flush_ms,  # pipelined: finishing the frames in flight at episode ends (in throughput)
            "throughput_fps": fps,
            "throughput_speedup_vs_baseline": fps / base_fps,
            "actions_per_s": fps * spec.chunk_size,
            "staleness_frames": {"mean": float(np.mean(stale_frames)), "max": float(np.max(stale_frames))},
            # how old a chunk's observation is when the chunk comes out, on this mode's own compute
            "staleness_ms": distribution(r.latency),
            "stages_ms": {s: {"p50": percentile([t.get(s, 0.0) for t in r.stages], 50),
                              "mean": float(np.mean([t.get(s, 0.0) for t in r.stages]))} for s in stages},  # fmt: skip
            # Ratio of medians, and the median of per-frame ratios (robust to a neighbour
            # stealing the CPU for a few frames): both from the same frames side by side.
            "speedup_vs_baseline": float(np.median(base) / np.median(lat)),
            "speedup_paired_median": float(np.median(base / lat)),
            "deviation": dev,
            "reuse_fraction": {"mean": float(np.mean(reuse)), "min": float(np.min(reuse)), "max": float(np.max(reuse))},
            # image token-layers not dropped by pruning (1: nothing pruned), per layer as well
            "tokens_kept_fraction": {"mean": float(np.mean(kept)), "min": float(np.min(kept)), "max": float(np.max(kept))},
            "tokens_kept_per_layer_mean": [
                round(float(x), 1) for x in np.mean([s.get("image_kept_per_layer", [0]) for s in r.stats], axis=0)
            ] if r.stats and "image_kept_per_layer" in r.stats[0] else [],
            # Prefix rows computed per LM layer (the transformers path computes all of them).
            "prefix_len": max(w.prefix_len for w in r.work),
            "rows_per_layer_mean": [round(float(x), 1) for x in np.mean([w.rows_per_layer for w in r.work], axis=0)],
            "rows_computed_mean": float(np.mean([w.rows_per_layer for w in r.work])),
            "resets": sum(bool(s.get("reset_reason")) for s in r.stats),
            "stats_mean": _scalar_stats_mean(r.stats),
            "flops": {
                "estimate": True,
                "gflops_per_frame": {"mean": float(np.mean([f["total"] for f in r.flops])) / 1e9,
                                     "p50": percentile([f["total"] for f in r.flops], 50) / 1e9},  # fmt: skip
                "by_component_gflops_mean": {c: float(np.mean([f.get(c, 0.0) for f in r.flops])) / 1e9 for c in components},
            },
            "per_frame": {
                "latency_ms": [round(x, 3) for x in r.latency],
                "reuse_fraction": reuse,
                "deviation_max_abs": dev_series["max_abs"],
                "deviation_max_over_std": dev_series["max_over_std"],
                **({"identical_token_share": dev_series["identical_token_share"]} if "identical_token_share" in dev_series else {}),
                "gflops": [f["total"] / 1e9 for f in r.flops],
                "reset": [bool(s.get("reset_reason")) for s in r.stats],
            },
        }
        if spec.reasoning_words and not r.mode.reference:
            by_stamp = {t: s.get("reasoning_text", "").split() for t, s in zip(ref.stamps, ref.stats)}
            reference = [by_stamp.get(t, []) for t in r.stamps]
            out[r.name].update(reasoning_summary(r.stats, [(truths or {}).get(t) for t in r.stamps], reference))
            out[r.name]["per_frame"]["reasoning_reused_fraction"] = [float(s.get("reasoning_reused_fraction", 0.0)) for s in r.stats]
    return out


def _gate_metrics(policy) -> dict[str, float] | None:
    """What the parity gate measured when this mode's policy was built (None: not gated)."""
    report = getattr(policy, "parity_report", None)
    return None if report is None else dict(report.metrics)


def _bundle_info(path: Path, spec, policy, flow_steps: int) -> dict[str, Any]:
    params = sum(p.numel() for p in policy.model.parameters())
    info = {
        "path": str(path),
        "name": spec.name,
        "family": spec.family,
        "token_actions": get_family(spec.family).token_actions,
        "parameters_m": round(params / 1e6, 2),
        "cameras": list(spec.cameras),
        "image_size": spec.image_size,
        "grid": spec.grid,
        "chunk_size": spec.chunk_size,
        "action_dim": spec.action_dim,
        "state_dim": spec.state_dim,
        "lm": {k: spec.lm.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                            "num_attention_heads", "num_key_value_heads", "vocab_size")},  # fmt: skip
        "vision": {k: spec.vision.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")},
    }
    if flow_steps:
        info["flow_steps"] = flow_steps
        info["expert"] = {k: spec.expert.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")}
    return info


def machine_info() -> dict[str, Any]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
