"""Writing the replay benchmark's report: report.json, report.md and PNG plots.

The JSON is the machine-readable record (schema ``vla_accel_ros.replay/1``, see
:func:`vla_accel_ros.bench.replay.run_replay`); the markdown is what a person reads; the plots
show what a table hides (the latency tail, reuse and deviation over the episode).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS = ("latency_cdf.png", "reuse_per_frame.png", "deviation_per_frame.png")

TRUST_NOTE = (
    "All modes ran in one process on the same frames, interleaved per frame in a rotating order, "
    "so they shared the machine's load; the ratios (speedup, deviation) measured side by side are "
    "the figures to trust. Absolute milliseconds move with the machine and its neighbours."
)


def _deviation_cell(name: str, row: dict[str, Any]) -> str:
    if name == "baseline":
        return "(reference)"
    d = row["deviation"]
    if "identical_token_share" in d:
        return f"tokens {100 * d['identical_token_share']:.1f}% identical, max abs {d['max_abs']:.4f}"
    return f"max abs/std {d['max_over_std']:.4f}"


def headline_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name in result["mode_order"]:
        r = result["modes"][name]
        lat = r["latency_ms"]
        rows.append([
            name, f"{lat['p50']:.1f}", f"{lat['p95']:.1f}", f"{lat['p99']:.1f}",
            f"{r['speedup_vs_baseline']:.2f}x", f"{r['throughput_fps']:.2f} ({r['throughput_speedup_vs_baseline']:.2f}x)",
            f"{r['staleness_frames']['mean']:.1f}", f"{100 * r['reuse_fraction']['mean']:.1f}%",
            f"{100 * r.get('tokens_kept_fraction', {}).get('mean', 1.0):.1f}%",
            _deviation_cell(name, r), f"{r['flops']['gflops_per_frame']['mean']:.2f}",
        ])  # fmt: skip
    return rows


HEADLINE = ["mode", "p50 ms", "p95 ms", "p99 ms", "speedup vs baseline", "frames/s", "stale frames", "reuse mean", "kept mean", "deviation vs baseline", "est. GFLOPs/frame"]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    left = {0, header.index("deviation vs baseline")} if "deviation vs baseline" in header else {0}

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


# Whose frames the parity gate saw, as precision_lines names them.
BAG_FRAMES = "the bag's frames"
SIM_FRAMES = "the simulator's frames"


def precision_lines(result: dict[str, Any], frames: str) -> list[str]:
    """What each mode below fp32 ran. ``auto`` and its fallbacks resolve at start-up on the
    gate's frames (``frames``: a bag's in a replay, the simulator's in an eval), so one mode name
    can run different configurations in two benchmarks (seen: PyTorch's int8 vision tower passed
    on a bag at 0.0199 std of the 0.02 limit and was refused in the simulator); tables that put a
    replay's latency beside an eval's success compare these lines first."""
    out = []
    for name in result["mode_order"]:
        m = result["modes"][name]
        label = m.get("precision") or (m.get("gate") or {}).get("precision")
        if label and label != "fp32":
            out.append(f"{name} ran {label} (precision resolved on {frames})")
    return out


def headline_text(result: dict[str, Any]) -> str:
    """The headline table for a terminal."""
    b, bag = result["bundle"], result["bag"]
    title = (
        f"replay: {bag['path']} ({result['frames']} timed frames after {result['warmup']} warm-up, "
        f"{len(bag['episodes'])} episode(s)), bundle {b['name']} ({b['family']}, {b['parameters_m']} M params)"
    )
    return "\n".join([title, _text_table(HEADLINE, headline_rows(result)), *precision_lines(result, BAG_FRAMES)])


def stage_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    names = result["mode_order"]
    stages: list[str] = []
    for n in names:
        stages += [s for s in result["modes"][n]["stages_ms"] if s not in stages]
    stages = [s for s in stages if s != "total"] + ["total"]
    rows = []
    for s in stages:
        cells = []
        for n in names:
            st = result["modes"][n]["stages_ms"].get(s)
            cells.append(f"{st['p50']:.1f}" if st else "-")
        rows.append([s, *cells])
    return ["stage (p50 ms)", *names], rows


_COMPONENTS = ("vision", "projector", "prefill", "reason", "decode", "denoise", "head", "state")


def work_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    present = {c for n in result["mode_order"] for c in result["modes"][n]["flops"]["by_component_gflops_mean"]}
    comps = [c for c in _COMPONENTS if c in present] + sorted(present - set(_COMPONENTS) - {"total"})
    header = ["mode", "reuse mean / min / max", "prefix rows computed per layer (mean)", "resets", *[f"{c} GFLOPs" for c in comps]]
    rows = []
    for n in result["mode_order"]:
        r = result["modes"][n]
        ru, by = r["reuse_fraction"], r["flops"]["by_component_gflops_mean"]
        rows.append([
            n, f"{100 * ru['mean']:.1f}% / {100 * ru['min']:.1f}% / {100 * ru['max']:.1f}%",
            f"{r['rows_computed_mean']:.1f} of {r['prefix_len']}", str(r["resets"]), *[f"{by.get(c, 0.0):.3f}" for c in comps],
        ])  # fmt: skip
    return header, rows


_PLANNER_COUNTERS = ("static_tokens", "reused_tokens", "evicted_tokens", "capped_tokens", "max_age_recomputed", "scene_cut")


def planner_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per-frame means of the token cache's own counters, for the modes that report them."""
    rows = []
    for n in result["mode_order"]:
        sm = result["modes"][n]["stats_mean"]
        if any(k in sm for k in _PLANNER_COUNTERS):
            rows.append([n, *[f"{sm[k]:.2f}" if k in sm else "-" for k in _PLANNER_COUNTERS]])
    return ["mode", *_PLANNER_COUNTERS], rows


def draft_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """ar modes with ``action_draft``: per-frame means of the draft's rows and what they gave."""
    rows = []
    for n in result["mode_order"]:
        sm = result["modes"][n]["stats_mean"]
        if sm.get("draft_rows", 0) > 0:
            share = sm["draft_accepted"] / sm["draft_rows"]
            rows.append([
                n, f"{sm['draft_rows']:.1f}", f"{sm['draft_accepted']:.1f} ({100 * share:.1f}%)", f"{sm['decode_steps']:.1f}",
                f"{sm.get('decode_rows', 0.0):.1f}",
            ])  # fmt: skip
    header = ["mode", "draft rows in the prefill", "tokens the draft confirmed (prefill and windows)", "decode forwards",
              "decode rows"]  # fmt: skip
    return header, rows


def reasoning_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Reasoning bundles: reuse and agreement per mode (MEMO-VLM)."""
    rows = []
    for n in result["mode_order"]:
        r = result["modes"][n]
        if "reasoning_reused_fraction" not in r:
            continue
        vs, gt = r.get("reasoning_agreement_vs_baseline"), r.get("reasoning_truth_agreement")
        rows.append([
            n, f"{r['reasoning_tokens_mean']:.1f}", f"{100 * r['reasoning_reused_fraction']['mean']:.1f}%",
            f"{r['reasoning_regenerated_tokens_mean']:.1f}", f"{100 * r['reasoning_refresh_share']:.1f}%",
            f"{100 * vs['mean']:.2f}% / {100 * vs['identical_share']:.1f}%" if vs else "-",
            f"{100 * gt['mean']:.1f}% / {100 * gt['identical_share']:.1f}%" if gt else "-",
        ])  # fmt: skip
    header = ["mode", "words", "reused", "regenerated words", "refreshes", "agreement vs baseline (words / texts)",
              "agreement vs ground truth (words / texts)"]  # fmt: skip
    return header, rows


def markdown(result: dict[str, Any], plots: list[str]) -> str:
    b, bag, m = result["bundle"], result["bag"], result["machine"]
    fam = b["family"]
    dev_def = (
        "share of action tokens identical to the baseline's on the same frame, and max |delta| in action units"
        if b.get("token_actions")
        else "max |delta| / action std over the chunk, the same noise in every mode on a given frame"
    )
    ran = precision_lines(result, BAG_FRAMES)
    lines = [
        f"# Replay benchmark: {b['name']} on {Path(bag['path']).name}",
        "",
        f"{result['frames']} timed frames after {result['warmup']} warm-up frame(s); modes run side by side, "
        f"interleaved per frame in a rotating order.",
        "",
        "## Headline",
        "",
        _md_table(HEADLINE, headline_rows(result)),
        "",
        *[f"- {line}" for line in ran],
        *([""] if ran else []),
        "Latency: observation in to actions out (`timings_ms.total`), preprocessing and token selection "
        "included. Speedup: baseline p50 / mode p50 (median of the per-frame ratios: "
        + ", ".join(f"{n} {result['modes'][n]['speedup_paired_median']:.2f}x" for n in result["mode_order"])
        + f"). Deviation vs baseline ({fam}): {dev_def}. GFLOPs: an analytic estimate (below).",
        "",
        f"> {TRUST_NOTE}",
        "",
        "## Per-stage breakdown",
        "",
        _md_table(*stage_rows(result)),
        "",
        "## Reuse and work",
        "",
        _md_table(*work_rows(result)),
        "",
    ]
    ph, pr = planner_rows(result)
    if pr:
        lines += ["Token cache counters (per-frame means, image tokens):", "", _md_table(ph, pr), ""]
    dh, dr = draft_rows(result)
    if dr:
        lines += ["Action draft (per-frame means; the previous chunk's tokens verified in the prefill):", "", _md_table(dh, dr), ""]
    rh, rr = reasoning_rows(result)
    if rr:
        lines += ["## Reasoning (MEMO-VLM)", "", _md_table(rh, rr), ""]
    lines += ["## FLOPs estimate", "", "```", result["flops_formula"], "```", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    eps = ", ".join(f"#{e['index']} ({e['frames']} frames)" for e in bag["episodes"])
    age = bag.get("observation_age_ms")  # (not in reports written before it was measured)
    age = f"; observation age at inference start p50 {age['p50']:.1f} ms, max {age['max']:.1f} ms (bag clock)" if age else ""
    lines += [
        "## Run",
        "",
        "```",
        result["command"] or "(called from Python)",
        "```",
        "",
        f"- bag: `{bag['path']}`: {bag['observations']} observations "
        f"(cameras {', '.join(bag['cameras'])}), {bag['duration_s']:.2f} s, episodes {eps}; "
        f"not made {bag['skipped']}{age}",
        f"- bundle: `{b['path']}`: {b['name']} ({fam}), {b['parameters_m']} M parameters, cameras "
        f"{', '.join(b['cameras'])} at {b['image_size']} px ({b['grid']}x{b['grid']} tokens), chunk "
        f"{b['chunk_size']} x {b['action_dim']}" + (f", {b['flow_steps']} Euler steps" if b.get("flow_steps") else ""),
        f"- lm: {b['lm']}; vision: {b['vision']}" + (f"; expert: {b['expert']}" if "expert" in b else ""),
        f"- machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), torch {m['torch']} with "
        f"{m['torch_threads']} threads, numpy {m['numpy']}, Python {m['python']}, {m['platform']}, "
        f"load average (1 min) {m['load_avg_1m']} at the end",
        f"- flow noise seed: {result['seed']} (frame i uses default_rng((seed, i)))",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    import numpy as np

    names = result["mode_order"]
    modes = result["modes"]
    frames = np.arange(result["frames"])
    eps = result["frame_episodes"]
    cuts = [i for i in range(1, len(eps)) if eps[i] != eps[i - 1]]

    def episode_lines(ax) -> None:
        for c in cuts:
            ax.axvline(c - 0.5, color="grey", linestyle=":", linewidth=1)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        lat = np.sort(np.asarray(modes[n]["per_frame"]["latency_ms"]))
        ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=f"{n} (p50 {np.median(lat):.1f} ms)")
    ax.set_xlabel("obs-to-action latency [ms]")
    ax.set_ylabel("fraction of frames")
    ax.set_title(f"Latency CDF, {result['bundle']['name']}")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, PLOTS[0])

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot(frames, 100 * np.asarray(modes[n]["per_frame"]["reuse_fraction"]), marker=".", label=n)
    episode_lines(ax)
    ax.set_xlabel("timed frame (dotted: episode boundary)")
    ax.set_ylabel("image tokens reused [% of token-layers]")
    ax.set_ylim(-2, 102)
    ax.set_title("Reuse per frame")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, PLOTS[1])

    ar = bool(result["bundle"].get("token_actions"))  # token-decoding policies: a token panel too
    others = [n for n in names if n != "baseline"]
    fig, axes = plt.subplots(2 if ar else 1, 1, figsize=(7, 6 if ar else 4), squeeze=False)
    ax = axes[0][0]
    for n in others:
        ax.plot(frames, modes[n]["per_frame"]["deviation_max_over_std"], marker=".", label=n)
    episode_lines(ax)
    ax.set_ylabel("max |action - baseline| / std")
    ax.set_title("Deviation from the baseline per frame" + ("" if ar else " (same noise per frame)"))
    ax.grid(alpha=0.3)
    if ar:
        ax2 = axes[1][0]
        for n in others:
            ax2.plot(frames, 100 * np.asarray(modes[n]["per_frame"]["identical_token_share"]), marker=".", label=n)
        episode_lines(ax2)
        ax2.set_ylabel("identical action tokens [%]")
        ax2.set_ylim(-2, 102)
        ax2.grid(alpha=0.3)
    axes[-1][0].set_xlabel("timed frame (dotted: episode boundary)")
    if others:
        ax.legend()
    save(fig, PLOTS[2])
    return list(PLOTS)


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None (null): Python writes them as bare NaN, which
    is not JSON, and other readers (jq, browsers) refuse the whole file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def check_report_dir(out_dir: str | Path, flag: str = "--report") -> None:
    """Refuse, before a long run, a report directory that could not be written (nothing is
    created here: a run that fails leaves nothing behind)."""
    import os

    from vla_accel_ros.core.errors import ConfigError

    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a directory for report.json, report.md and the plots")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot create it under {parent} (not a writable directory)")


def write_report(
    result: dict[str, Any], out_dir: str | Path, *, plots: bool = True, to_markdown=None, plotter=None
) -> dict[str, Path]:
    """Write report.json, report.md and (with ``plots``) the PNGs into ``out_dir``; another
    benchmark passes its own ``to_markdown(result, plot_names)`` and ``plotter(result, out)``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = (plotter or write_plots)(result, out) if plots else []
    (out / "report.json").write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text((to_markdown or markdown)(result, names))
    return {"json": out / "report.json", "markdown": out / "report.md", **{n: out / n for n in names}}
