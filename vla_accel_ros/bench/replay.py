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

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla_accel_ros.bench.cache_bench import STAGES
from vla_accel_ros.bench.flops import FORMULA, estimate_flops
from vla_accel_ros.bench.machine import machine_info
from vla_accel_ros.bench.modes import BASELINE, ModeRun, build_runs, check_overrides, frame_noise, parse_modes
from vla_accel_ros.bench.reasoning import reasoning_summary, truth_words
from vla_accel_ros.bench.stats import action_deviation, action_std, distribution, percentile
from vla_accel_ros.core.errors import BagError, ConfigError
from vla_accel_ros.io.bag_reader import gate_frames_from_bag, inspect_bag
from vla_accel_ros.models.family import get_family
from vla_accel_ros.sim.aloha import task_of_instruction

SCHEMA = "vla_accel_ros.replay/1"


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


# ------------------------------------------------------------------------------ the run


def run_replay(cfg: ReplayConfig, *, progress: bool = False, command: str = "") -> dict[str, Any]:
    """Replay ``cfg.bag`` through ``cfg.bundle`` in every mode; returns the report (see
    :mod:`vla_accel_ros.bench.report`)."""
    from vla_accel_ros.models.factory import load_bundle

    names, spec, sync, bag_info = _checked_inputs(cfg)
    bag_path, bundle_path = Path(cfg.bag), Path(cfg.bundle)
    runs = build_runs(load_bundle(bundle_path), names, cfg, gate_observations=gate_frames_from_bag(bag_path, sync))
    for r in runs:
        r.reset()  # forget the parity gate's frames
    ref = next(r.policy for r in runs if r.name == BASELINE)
    flow_steps = getattr(ref, "num_steps", 0)  # policies that integrate a flow; 0: token decoding
    seen = _replay_frames(cfg, runs, spec, sync, bag_info["frames"], progress)
    for r in runs:  # bookkeeping after the bag, not between two timed inferences
        r.flops = [estimate_flops(spec, w, flow_steps=flow_steps) for w in r.work]
    if not seen.frame_episodes:
        raise BagError(
            f"bag {bag_path} yielded {seen.processed} observation(s) for cameras {', '.join(spec.cameras)}, none after "
            f"the {cfg.warmup} warm-up frame(s); record a longer bag or lower --warmup"
        )
    meta = {
        "schema": SCHEMA,
        "command": command,
        "bag": {**bag_info, "observations": seen.processed, "skipped": seen.skipped, "episodes": list(seen.episodes.values()),
                # each observation is inferred on as it is made: its age then, on the bag's clock
                "observation_age_ms": distribution(seen.obs_ages)},  # fmt: skip
        "bundle": _bundle_info(bundle_path, spec, ref, flow_steps),
        "frames": len(seen.frame_episodes),
        "warmup": min(cfg.warmup, seen.processed),
        "seed": cfg.seed,
        "mode_order": names,
        "machine": machine_info(),
        "flops_formula": FORMULA,
        "frame_episodes": seen.frame_episodes,
        "frame_stamps_ns": seen.frame_stamps,
    }
    return {**meta, "modes": summarize(runs, spec, seen.truths)}


def _checked_inputs(cfg: ReplayConfig) -> tuple[list[str], Any, Any, dict[str, Any]]:
    """What can be checked before any weights load: the modes, the bundle's spec, the
    observation rule for its cameras and the bag (its metadata), with room for a timed frame."""
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.models.factory import read_model_spec

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
    return names, spec, sync, bag_info


@dataclass
class _Replayed:
    """What one pass over the bag saw, besides what each mode measured (in its ModeRun)."""

    processed: int = 0  # observations, warm-up included
    frame_episodes: list[int] = field(default_factory=list)  # of the timed frames
    frame_stamps: list[int] = field(default_factory=list)
    obs_ages: list[float] = field(default_factory=list)  # ms, of the timed frames' observations when their inference started
    episodes: dict[int, dict[str, Any]] = field(default_factory=dict)
    timed_frames: dict[int, str] = field(default_factory=dict)  # stamp -> instruction, of the timed frames
    truths: dict[int, list[str] | None] = field(default_factory=dict)  # stamp -> the ground-truth reasoning (reasoning bundles)
    skipped: dict[str, int] = field(default_factory=dict)  # the bag's messages left out, by reason

    def enter(self, obs, spec, timed: bool) -> None:
        """Count a new observation in its episode; a timed one's stamp (and reasoning truth)."""
        ep = self.episodes.setdefault(obs.episode, {"index": obs.episode, "instruction": obs.instruction, "frames": 0})
        ep["frames"] += 1
        if timed:
            self.timed_frames[obs.stamp_ns] = obs.instruction
            if spec.reasoning_words:  # one simulator step per recorded frame of an episode
                self.truths[obs.stamp_ns] = truth_words(task_of_instruction(obs.instruction), ep["frames"] - 1, obs.state)

    def record(self, run: ModeRun, chunks: list, spec) -> None:
        """The chunks of timed frames into ``run``'s measurements (warm-up chunks are dropped)."""
        for chunk in chunks:
            if chunk.stamp_ns in self.timed_frames:
                run.record(chunk, spec, self.timed_frames[chunk.stamp_ns])


def _replay_frames(cfg: ReplayConfig, runs: list[ModeRun], spec, sync, frames: int, progress: bool) -> _Replayed:
    """Every observation of the bag through every mode, in an order that rotates per frame;
    a new episode first finishes and resets every mode."""
    from vla_accel_ros.bench.progress import progress_bar
    from vla_accel_ros.io.bag_reader import BagReader

    bag_path = Path(cfg.bag)
    ref = next(r.policy for r in runs if r.name == BASELINE)
    noise_shape = ref.noise_shape or (spec.chunk_size, spec.action_dim)  # token decoding ignores it
    seen = _Replayed()
    prev_episode: int | None = None
    expected = min(frames, cfg.warmup + cfg.max_frames) if cfg.max_frames else frames
    bar = progress_bar(expected, "replay", "frame", enabled=progress)
    with BagReader(bag_path) as bag, bar:
        for sample in bag.samples(sync):
            obs = sample.observation
            if spec.state_dim and obs.state is None:
                raise BagError(f"bag {bag_path}: observation at {obs.stamp_ns} ns has no state; bundle {spec.name} needs one")
            if prev_episode is not None and obs.episode != prev_episode:
                for r in runs:  # a new episode: nothing carried over (the cache also keys on it)
                    seen.record(r, r.flush(timed=bool(seen.frame_episodes)), spec)
                    r.reset()
            prev_episode = obs.episode
            timed = seen.processed >= cfg.warmup
            seen.enter(obs, spec, timed)
            noise = frame_noise(cfg.seed, seen.processed, noise_shape)
            k = seen.processed % len(runs)
            for r in runs[k:] + runs[:k]:  # rotate who runs first
                t0 = time.perf_counter_ns()
                chunks = r.step(obs, noise)
                if timed:
                    r.call_ms.append((time.perf_counter_ns() - t0) / 1e6)
                seen.record(r, chunks, spec)
            if timed:
                seen.frame_episodes.append(obs.episode)
                seen.frame_stamps.append(obs.stamp_ns)
                seen.obs_ages.append(sample.age_ms)
            seen.processed += 1
            bar.update(1)
            if timed and progress:
                bar.set_postfix_str(" ".join(f"{r.name} {statistics.median(r.call_ms):.0f}ms" for r in runs))
            if cfg.max_frames and len(seen.frame_episodes) >= cfg.max_frames:
                break
        seen.skipped = dict(bag.skipped)
    for r in runs:  # the frames still in flight
        seen.record(r, r.flush(timed=bool(seen.frame_episodes)), spec)
    return seen


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
