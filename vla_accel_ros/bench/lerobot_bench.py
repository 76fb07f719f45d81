"""``vla-accel bench lerobot``: LeRobot's own SmolVLA, pi0 or pi0.5 and ours, side by side on a bag's frames.

LeRobot runs in its own Python (``--python``: the environment that has LeRobot; it pins torch
and transformers versions this package does not use) as :mod:`vla_accel_ros.bench.lerobot_worker`.
Both get the same frames (the bag through the policy node's observation rule, frames at their
recorded size), the same task text, the same noise per frame, the same torch thread count and
the same weights (the checkpoint, imported here into a bundle of the family its config.json
``type`` names: ``smolvla``, ``pi0`` or ``pi05``). Calls are
interleaved frame by frame, the first runner rotating; with ``sequential`` (for models that do
not fit in memory twice: a full-size pi0 or pi0.5) ours run on every frame first and LeRobot, once our
weights are freed, on the same frames after. Each side's latency is its own wall time
of one chunk with every overhead of the library (LeRobot: its preprocessor,
``predict_action_chunk``, its postprocessor; ours: ``infer``), without the exchange between the
two processes.

report.json: ``lerobot.latency_ms`` and stages, per mode ``latency_ms``, ``stages_p50_ms``,
``speedup_vs_lerobot`` (LeRobot's p50 over the mode's), ``deviation_vs_lerobot`` and
``deviation_vs_fp32`` (max |delta| / action std per frame: max, p50) and the start-up gate's
verdict; report.md: the table and a plot.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla_accel_ros.bench.machine import machine_info
from vla_accel_ros.bench.modes import BASELINE, build_runs, frame_noise, parse_modes
from vla_accel_ros.bench.replay import ReplayConfig
from vla_accel_ros.bench.report import BAG_FRAMES, precision_lines
from vla_accel_ros.bench.stats import distribution
from vla_accel_ros.core.errors import BagError, ConfigError, VlaAccelError
from vla_accel_ros.core.parity import noise_scale_of

WORKER = Path(__file__).with_name("lerobot_worker.py")
SCHEMA = "vla_accel_ros.bench_lerobot/1"


@dataclass
class LeRobotBenchConfig:
    lerobot: Path  # LeRobot's saved SmolVLA or pi0 policy directory
    python: Path  # a Python whose environment has LeRobot
    bag: Path
    report: Path
    vlm: Path | None = None  # smolvla: the SmolVLM directory
    tokenizer: Path | None = None  # pi0 / pi05: PaliGemma's tokenizer directory (both sides load it)
    modes: tuple[str, ...] = ("baseline",)
    threads: int = 2
    max_frames: int = 10
    warmup: int = 1
    seed: int = 0
    bundle: Path | None = None  # an already imported bundle of the same checkpoint (default: import it)
    parity_check: bool = True
    sequential: bool = False  # ours on every frame first, our weights freed, then LeRobot (when both do not fit in memory)
    cache_overrides: dict[str, Any] = field(default_factory=dict)
    prune_overrides: dict[str, Any] = field(default_factory=dict)
    precision_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for flag, value, lo in (("--threads", self.threads, 1), ("--max-frames", self.max_frames, 1), ("--warmup", self.warmup, 0)):
            if value < lo:
                raise ConfigError(f"{flag} must be >= {lo}, got {value}")
        if not (self.lerobot / "config.json").is_file():
            raise ConfigError(f"--lerobot {self.lerobot}: no config.json (LeRobot's saved policy directory)")
        kind = self.policy_type()
        if kind not in ("smolvla", "pi0", "pi05"):
            raise ConfigError(f"--lerobot {self.lerobot}: LeRobot policy type {kind!r}; bench lerobot runs smolvla, pi0 and pi05")
        if kind in ("pi0", "pi05") and self.tokenizer is None:  # LeRobot's side loads it, whatever --bundle says
            raise ConfigError(f"--tokenizer is required for a {kind} checkpoint: the PaliGemma tokenizer directory "
                              f"(LeRobot's {kind} loads it by hub name, which is offline here)")  # fmt: skip
        if self.tokenizer is not None and not self.tokenizer.is_dir():
            raise ConfigError(f"--tokenizer {self.tokenizer}: not a directory")
        if not self.python.is_file():
            raise ConfigError(f"--python {self.python}: not a file (the Python of an environment with lerobot)")
        if not self.bag.exists():
            raise BagError(f"bag {self.bag} does not exist")
        if self.report.exists() and any(self.report.iterdir()):
            raise ConfigError(f"--report {self.report} is not empty; reports are never overwritten")
        parse_modes(list(self.modes))

    def policy_type(self) -> str | None:
        try:
            return json.loads((self.lerobot / "config.json").read_text()).get("type")
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--lerobot {self.lerobot}: unreadable config.json ({e})") from e


def camera_map(lerobot: Path, bundle_path: Path, spec) -> dict[str, str]:
    """LeRobot camera (``observation.images.<name>`` without the prefix) -> the bundle's camera:
    what the import noted in source.json, else the same names (a bundle exported to LeRobot)."""
    from vla_accel_ros.models.lerobot.reader import SOURCE_FILE

    source = bundle_path / SOURCE_FILE
    if source.is_file():
        cameras = json.loads(source.read_text())["cameras"]
        return {k.removeprefix("observation.images."): v for k, v in cameras.items()}
    feats = json.loads((lerobot / "config.json").read_text()).get("input_features") or {}
    theirs = [k.removeprefix("observation.images.") for k, f in feats.items() if (f or {}).get("type") == "VISUAL"]
    if sorted(theirs) != sorted(spec.cameras):
        raise ConfigError(f"--lerobot {lerobot} has cameras {theirs}, the bundle {list(spec.cameras)} (and no {SOURCE_FILE} "
                          "mapping them): not the same policy")  # fmt: skip
    return {c: c for c in theirs}


class LeRobotWorker:
    """The LeRobot process: one request (an observation and its noise) -> actions and timings."""

    def __init__(self, python: Path, policy: Path, threads: int, *, vlm: Path | None = None, tokenizer: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vla-lerobot-"))
        cmd = [str(python), str(WORKER), "--policy", str(policy), "--threads", str(threads), "--exchange", str(self.dir)]
        if vlm:
            cmd += ["--vlm", str(vlm)]
        if tokenizer:
            cmd += ["--tokenizer", str(tokenizer)]
        self.log = self.dir / "worker.log"  # its stderr: LeRobot's own prints, a traceback
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.info = self._answer("loading")
        self.n = 0

    def _answer(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            err = self.log.read_text()[-3000:] if self.log.is_file() else ""
            raise VlaAccelError(f"the LeRobot worker ended while {what} (exit code {self.proc.returncode}):\n{err}")
        return json.loads(line)

    def run(self, obs, cameras: dict[str, str], noise: np.ndarray) -> tuple[np.ndarray, float, dict[str, float]]:
        import torch
        from safetensors.torch import load_file, save_file

        from vla_accel_ros.models.lerobot_compat import frame_tensor

        self.n += 1
        # LeRobot reads frames as [3, h, w] floats in [0, 1]; safetensors writes contiguous tensors only.
        tensors = {f"observation.images.{lerobot_cam}": frame_tensor(obs.images[cam], cam).contiguous()
                   for lerobot_cam, cam in cameras.items()}  # fmt: skip
        tensors["observation.state"] = torch.from_numpy(np.asarray(obs.state, np.float32))
        tensors["noise"] = torch.from_numpy(noise)[None]
        name = f"r{self.n}"
        save_file(tensors, str(self.dir / f"{name}.safetensors"))
        self.proc.stdin.write(json.dumps({"request": name, "task": obs.instruction}) + "\n")
        self.proc.stdin.flush()
        ans = self._answer(f"answering request {self.n}")
        actions = load_file(str(self.dir / f"{name}.out.safetensors"))["actions"].numpy()
        for f in (f"{name}.safetensors", f"{name}.out.safetensors"):
            (self.dir / f).unlink()
        return actions, float(ans["ms"]), ans["stages_ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def _deviation(a: list[np.ndarray], b: list[np.ndarray], std: np.ndarray) -> dict[str, float]:
    per_frame = [float(np.abs((x - y) / std).max()) for x, y in zip(a, b)]
    return {"max_over_std": max(per_frame), "p50_over_std": float(statistics.median(per_frame)),
            "max_abs": max(float(np.abs(x - y).max()) for x, y in zip(a, b))}  # fmt: skip


def run_lerobot_bench(cfg: LeRobotBenchConfig, progress: bool = True, command: str = "") -> dict[str, Any]:
    import torch

    from vla_accel_ros.bench.stats import action_std
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_bundle
    from vla_accel_ros.models.family import get_family

    cfg.validate()
    names = parse_modes(list(cfg.modes))
    cfg.report.mkdir(parents=True, exist_ok=True)
    bundle_path = cfg.bundle or cfg.report / "bundle"
    t0 = time.perf_counter()
    if cfg.bundle is None:
        # only the options given: a family refuses one it does not take
        given = {k: v for k, v in (("vlm", cfg.vlm), ("tokenizer", cfg.tokenizer)) if v is not None}
        get_family(cfg.policy_type()).import_lerobot(cfg.lerobot, bundle_path, **given)
    import_s = time.perf_counter() - t0
    torch.set_num_threads(cfg.threads)
    bundle = load_bundle(bundle_path)
    spec = bundle.spec
    cameras = camera_map(cfg.lerobot, bundle_path, spec)
    sync = SyncConfig(cameras=tuple(spec.cameras))
    frames = []
    with BagReader(cfg.bag) as bag:
        for sample in bag.samples(sync):
            frames.append(sample.observation)
            if len(frames) >= cfg.warmup + cfg.max_frames:
                break
    if len(frames) <= cfg.warmup or len(frames) < 2:  # the start-up gate reads the first two
        raise BagError(f"bag {cfg.bag} yields {len(frames)} observation(s) for cameras {', '.join(spec.cameras)}; need > --warmup "
                       f"{cfg.warmup} and at least 2 (the gate's frames): raise --max-frames or record more")  # fmt: skip
    if any(f.state is None for f in frames):
        raise BagError(f"bag {cfg.bag}: observations without a joint state; {spec.family} needs one")
    rcfg = ReplayConfig(
        bag=cfg.bag, bundle=bundle_path, modes=tuple(names), parity_check=cfg.parity_check, num_threads=cfg.threads,
        seed=cfg.seed, cache_overrides=cfg.cache_overrides, prune_overrides=cfg.prune_overrides,
        precision_overrides=cfg.precision_overrides,
    )  # fmt: skip
    t0 = time.perf_counter()
    # The gate's two frames: the bag's first two (consecutive frames, as the policy sees them).
    runs = build_runs(bundle, names, rcfg, gate_observations=(frames[0], frames[1]))
    build_s = time.perf_counter() - t0
    gates = {r.name: _gate(r.policy) for r in runs}
    for r in runs:
        r.reset()
    lerobot = {"latency": [], "stages": [], "actions": []}
    shape = runs[0].policy.noise_shape
    # Our modes scale the noise inside the flow core (the bundle's noise_scale); LeRobot is
    # handed the noise already scaled, so both sides integrate from one start.
    scale = noise_scale_of(runs[0].policy)
    std = action_std(spec)
    params_m = round(sum(p.numel() for p in runs[0].policy.model.parameters()) / 1e6, 1)
    worker = None if cfg.sequential else _worker(cfg)
    try:
        _interleave(frames, cfg, runs, worker, cameras, shape, scale, spec, lerobot, progress, "bench lerobot")
        if cfg.sequential:
            for r in runs:  # keep what was measured, free the weights before LeRobot loads its own
                r.policy = r.pipeline = None
            del bundle
            gc.collect()
            worker = _worker(cfg)
            _interleave(frames, cfg, [], worker, cameras, shape, scale, spec, lerobot, progress, "bench lerobot (LeRobot)")
    finally:
        if worker is not None:
            worker.close()
    le_p50 = distribution(lerobot["latency"])["p50"]
    base = next(r for r in runs if r.name == BASELINE)
    modes = {}
    for r in runs:
        lat = distribution(r.latency)
        modes[r.name] = {
            "latency_ms": lat,
            "stages_p50_ms": _stage_p50(r.stages),
            "speedup_vs_lerobot": le_p50 / lat["p50"],
            "deviation_vs_lerobot": _deviation(r.actions, lerobot["actions"], std),
            "deviation_vs_fp32": _deviation(r.actions, base.actions, std),
            "gate": gates[r.name],
            "config": r.config,
            "tokens_kept_fraction": float(np.mean([s.get("tokens_kept_fraction", 1.0) for s in r.stats])),
            "reuse_fraction": float(np.mean([s.get("reuse_fraction", 0.0) for s in r.stats])),
        }
    result = {
        "schema": SCHEMA, "command": command, "frames": len(lerobot["latency"]), "warmup": cfg.warmup, "threads": cfg.threads,
        "bag": str(cfg.bag), "lerobot_policy": str(cfg.lerobot), "bundle": str(bundle_path), "family": spec.family,
        "cameras": list(spec.cameras), "parameters_m": params_m, "sequential": cfg.sequential, "noise_scale": scale,
        "lerobot": {"latency_ms": distribution(lerobot["latency"]), "stages_p50_ms": _stage_p50(lerobot["stages"]),
                    **{k: worker.info.get(k) for k in ("versions", "load_s", "parameters", "threads", "calls")}},
        "modes": modes, "mode_order": names, "import_s": round(import_s, 1), "build_s": round(build_s, 1),
        "machine": machine_info(),
    }  # fmt: skip
    _write(cfg.report, result)
    return result


def _worker(cfg: LeRobotBenchConfig) -> LeRobotWorker:
    return LeRobotWorker(cfg.python, cfg.lerobot, cfg.threads, vlm=cfg.vlm, tokenizer=cfg.tokenizer)


def _interleave(frames, cfg: LeRobotBenchConfig, runs, worker, cameras, shape, scale: float, spec, lerobot, progress: bool, label: str) -> None:
    """Every frame through LeRobot (``worker``, unless None) and each of ``runs``, the same
    noise per frame on every side (LeRobot's times ``scale``, our modes' noise scale), the
    first runner rotating from frame to frame."""
    from vla_accel_ros.bench.progress import progress_bar

    bar = progress_bar(len(frames), label, "frame", enabled=progress)
    with bar:
        for i, obs in enumerate(frames):
            noise = frame_noise(cfg.seed, i, shape)
            timed = i >= cfg.warmup
            order = (["lerobot"] if worker is not None else []) + [r.name for r in runs]
            k = i % len(order)
            for name in order[k:] + order[:k]:
                if name == "lerobot":
                    actions, ms, stages = worker.run(obs, cameras, noise * np.float32(scale))
                    if timed:
                        lerobot["latency"].append(ms)
                        lerobot["stages"].append(stages)
                        lerobot["actions"].append(actions)
                    continue
                r = next(x for x in runs if x.name == name)
                chunk = r.step(obs, noise)[0]
                if timed:
                    r.record(chunk, spec, obs.instruction)
            bar.update(1)
            if timed and progress:
                bar.set_postfix_str(" ".join(([f"lerobot {statistics.median(lerobot['latency']):.0f}ms"] if lerobot["latency"] else [])
                                             + [f"{r.name} {statistics.median(r.latency):.0f}ms" for r in runs]))  # fmt: skip


def _gate(policy) -> dict[str, Any]:
    report = getattr(policy, "parity_report", None)
    if report is None:
        return {"ran": False, "precision": policy.precision.label()}
    return {"ran": True, "passed": report.passed, "metrics": report.metrics, "notes": report.notes,
            "precision": policy.precision.label()}  # fmt: skip


def _stage_p50(stages: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in stages for k in s})
    return {k: float(statistics.median(s.get(k, 0.0) for s in stages)) for k in keys}


def _write(out: Path, result: dict[str, Any]) -> None:
    from vla_accel_ros.bench.report import json_safe

    (out / "report.json").write_text(json.dumps(json_safe(result), indent=1, allow_nan=False) + "\n")
    plot = _plot(out, result)
    (out / "report.md").write_text(markdown(result, plot))


def markdown(result: dict[str, Any], plot: str | None) -> str:
    le = result["lerobot"]
    lines = [
        f"# {result['family']}: LeRobot {le['versions']['lerobot']} vs vla_accel_ros, same frames, {result['threads']} thread(s)",
        "",
        f"{result['frames']} timed frames of `{result['bag']}` (after {result['warmup']} warm-up), cameras "
        f"{', '.join(result['cameras'])}, {result['parameters_m']} M parameters, the same noise per frame on both sides "
        f"(times {result.get('noise_scale', 1.0):g}, the bundle's noise scale), "
        + ("ours on every frame first, then LeRobot (--sequential). " if result.get("sequential") else "calls interleaved. ")
        + "Latency: each side's own wall time of one chunk, every library overhead included "
        + f"(LeRobot: {le.get('calls', 'preprocessor, predict_action_chunk, postprocessor')}).",
        "",
        "| runner | p50 ms | p95 ms | speedup vs LeRobot | max dev vs LeRobot (std) | max dev vs our fp32 (std) | gate | stages p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| LeRobot | {le['latency_ms']['p50']:.0f} | {le['latency_ms']['p95']:.0f} | 1.00x | - | - | - | "
        + ", ".join(f"{k} {v:.0f}" for k, v in le["stages_p50_ms"].items()) + " |",
    ]
    for name in result["mode_order"]:
        m = result["modes"][name]
        gate = "-" if not m["gate"].get("ran") else ("pass" if m["gate"]["passed"] else "FAIL")
        lines.append(
            f"| {name} | {m['latency_ms']['p50']:.0f} | {m['latency_ms']['p95']:.0f} | {m['speedup_vs_lerobot']:.2f}x | "
            f"{m['deviation_vs_lerobot']['max_over_std']:.2g} | {m['deviation_vs_fp32']['max_over_std']:.2g} | {gate} | "
            + ", ".join(f"{k} {v:.0f}" for k, v in m["stages_p50_ms"].items() if k != "total") + " |"
        )
    ran = precision_lines(result, BAG_FRAMES)
    lines += ["", *[f"- {line}" for line in ran]] if ran else []
    if plot:
        lines += ["", f"![latency]({plot})"]
    mach = result["machine"]
    lines += ["", f"Machine: {mach['processor']}, {mach['cpus_usable']} usable cores, load {mach['load_avg_1m']} at the end; "
              f"torch {mach['torch']}; command: `{result['command']}`", ""]
    return "\n".join(lines)


def _plot(out: Path, result: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = ["LeRobot", *result["mode_order"]]
    p50 = [result["lerobot"]["latency_ms"]["p50"], *(result["modes"][n]["latency_ms"]["p50"] for n in result["mode_order"])]
    p95 = [result["lerobot"]["latency_ms"]["p95"], *(result["modes"][n]["latency_ms"]["p95"] for n in result["mode_order"])]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    y = np.arange(len(names))
    ax.barh(y, p50, color=["#888"] + ["#3a7"] * (len(names) - 1), label="p50")
    ax.scatter(p95, y, color="k", marker="|", s=200, label="p95")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per chunk (lower is better)")
    ax.set_title(f"{result['family']} chunk latency, {result['threads']} thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return "latency.png"
