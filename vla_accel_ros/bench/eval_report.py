"""The closed-loop evaluation's report: report.json, report.md and two plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vla_accel_ros.bench import report
from vla_accel_ros.bench.report import SIM_FRAMES, _md_table, _text_table, precision_lines

PLOTS = ("success.png", "error_vs_speedup.png")
HEADER = ["mode", "success", "95% CI", "mean reward", "p50 ms", "p95 ms", "speedup", "open-loop |err| rad", "err / range",
          "first chunks: spread policy / expert, slope"]  # fmt: skip


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for name in result["mode_order"]:
        m = result["modes"][name]
        lo, hi = m["success_ci95"]
        ol = m.get("open_loop_error") or {}
        out.append([
            name, f"{m['successes']}/{m['episodes']} ({100 * m['success_rate']:.0f}%)", f"[{100 * lo:.0f}, {100 * hi:.0f}]%",
            f"{m['mean_reward']:.2f}", f"{m['latency_ms']['p50']:.1f}", f"{m['latency_ms']['p95']:.1f}",
            f"{m['speedup_vs_baseline']:.2f}x" if m.get("speedup_vs_baseline") else "-",
            f"{ol['mean_abs_rad']:.4f}" if "mean_abs_rad" in ol else "-",
            f"{100 * ol['mean_abs_range_fraction']:.2f}%" if "mean_abs_range_fraction" in ol else "-",
            _first_chunk_cell(ol.get("first_chunk")),
        ])  # fmt: skip
    return out


def _first_chunk_cell(fc: dict[str, Any] | None) -> str:
    """Spread of the first chunks, policy / expert, and the policy's slope on the expert (reports
    before the slope: the spreads alone)."""
    if not fc:
        return "-"
    cell = f"{fc['policy_spread']:.4f} / {fc['expert_spread']:.4f}"
    return cell + (f", slope {fc['slope']:.2f}" if fc.get("slope") is not None else "")


ROS_HEADER = ["mode", "success (ROS graph)", "95% CI", "mean reward", "p50 ms", "p95 ms", "obs->chunk wall p50 / p95 ms", "chunks"]


def ros_rows(result: dict[str, Any]) -> list[list[str]]:
    """The --through-ros run of every mode (modes.<mode>.ros_graph), or no rows."""
    out = []
    for name in result["mode_order"]:
        g = result["modes"][name].get("ros_graph")
        if not g:
            continue
        lo, hi = g["success_ci95"]
        wall = g["obs_to_chunk_wall_ms"]
        out.append([
            name, f"{g['successes']}/{g['episodes']}", f"[{100 * lo:.0f}, {100 * hi:.0f}]%",
            "-" if g["mean_reward"] is None else f"{g['mean_reward']:.2f}",
            f"{g['latency_ms']['p50']:.1f}", f"{g['latency_ms']['p95']:.1f}", f"{wall['p50']} / {wall['p95']}",
            str(g["chunks"]),
        ])  # fmt: skip
    return out


def stage_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per mode, the share of episodes whose best grade reached each task stage (reports
    written before the stages were recorded: no rows)."""
    names = [n for n in result["mode_order"] if result["modes"][n].get("stages")]
    if not names:
        return [], []
    header = ["mode", *(f"{s['stage']}: {s['name']}" for s in result["modes"][names[0]]["stages"])]
    out = []
    for n in names:
        cells = [f"{s['reached']} ({100 * s['rate']:.0f}%) [{100 * s['ci95'][0]:.0f}, {100 * s['ci95'][1]:.0f}]"
                 for s in result["modes"][n]["stages"]]  # fmt: skip
        out.append([n, *cells])
    return header, out


def paired_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per mode, its episodes against the baseline's on the same seeds (``paired_vs_baseline``)."""
    names = [n for n in result["mode_order"] if result["modes"][n].get("paired_vs_baseline")]
    if not names:
        return [], []

    def cell(c: dict[str, Any]) -> str:
        return f"{c['baseline_only']} / {c['mode_only']} (p={c['p_value']:.2f})"

    first = result["modes"][names[0]]["paired_vs_baseline"]
    header = ["mode", "seeds", *(s["name"] for s in first["stages"]), "best grade higher / lower / equal"]
    out = []
    for n in names:
        p = result["modes"][n]["paired_vs_baseline"]
        r = p["reward"]
        out.append([n, str(p["seeds"]), *(cell(s) for s in p["stages"]), f"{r['higher']} / {r['lower']} / {r['equal']} (p={r['p_value']:.2f})"])
    return header, out


def position_rows(by: dict[str, list[dict[str, Any]]], stages: tuple[str, ...], axis: str) -> tuple[list[str], list[list[str]]]:
    """Per mode and bin of the object's start (:func:`~vla_accel_ros.bench.outcomes.by_position`):
    the episodes and the share that reached each stage."""
    header = ["mode", f"object {axis} (m)", "episodes", *stages]
    out = []
    for name, bins in by.items():
        for b in bins:
            n = b["episodes"]
            cells = [f"{k} ({100 * k / n:.0f}%)" if n else "-" for k in b["reached"]]
            out.append([name, f"{b['from']:.3f}-{b['to']:.3f}", str(n), *cells])
    return header, out


def motion_rows(result: dict[str, Any]) -> list[list[str]]:
    """Per mode, the control ticks in fine motion and the image tokens its inferences kept and
    reused, overall and by motion mode (reports written before these were recorded: no rows)."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    out = []
    for name in result["mode_order"]:
        m = result["modes"][name]
        kept, reused = m.get("tokens_kept_fraction"), m.get("reuse_fraction")
        if kept is None or reused is None:
            continue
        n = m.get("inferences_by_motion", {})
        out.append([
            name, pct(m.get("fine_fraction")), f"{n.get('coarse', 0)} / {n.get('fine', 0)}",
            pct(kept["mean"]), pct(kept["coarse"]), pct(kept["fine"]), pct(reused["mean"]),
        ])  # fmt: skip
    return out


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per mode with what judges it against the baseline: success (Wilson 95%), the first
    two task stages, the exact McNemar p-value of each against the baseline on the same seeds,
    latency and speed-up, the ticks in fine motion and the image tokens kept in coarse / fine
    motion (reports without stages: no rows)."""
    names = [n for n in result["mode_order"] if result["modes"][n].get("stages")]
    if not names:
        return [], []

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    def p_value(v: float) -> str:  # a decisive loss must not read as 0.00
        return "<0.001" if v < 1e-3 else f"{v:.3f}"

    stage_names = [s["name"] for s in result["modes"][names[0]]["stages"][:2]]
    vs_lerobot = any("speedup_vs_lerobot" in result["modes"][n] for n in names)  # a run with the lerobot mode
    header = ["mode", "success (Wilson 95%)", *stage_names, "success: gained / lost",
              f"McNemar p: success / {' / '.join(stage_names)}", "p50 ms", "speedup",
              *(["vs LeRobot"] if vs_lerobot else []), "ticks in fine", "tokens kept coarse / fine"]  # fmt: skip
    out = []
    for n in names:
        m = result["modes"][n]
        lo, hi = m["success_ci95"]
        stages = [f"{s['reached']}/{m['episodes']}" for s in m["stages"][:2]]
        p = m.get("paired_vs_baseline")
        paired = "-" if p is None else " / ".join(p_value(c["p_value"]) for c in (p["success"], *p["stages"][:2]))
        swing = "-" if p is None else f"+{p['success']['mode_only']} / -{p['success']['baseline_only']}"
        kept = m.get("tokens_kept_fraction") or {}
        out.append([
            n, f"{m['successes']}/{m['episodes']} [{100 * lo:.0f}, {100 * hi:.0f}]%", *stages, swing, paired,
            f"{m['latency_ms']['p50']:.1f}", f"{m['speedup_vs_baseline']:.2f}x" if m.get("speedup_vs_baseline") else "-",
            *([f"{m['speedup_vs_lerobot']:.2f}x" if m.get("speedup_vs_lerobot") else "-"] if vs_lerobot else []),
            pct(m.get("fine_fraction")), f"{pct(kept.get('coarse'))} / {pct(kept.get('fine'))}",
        ])  # fmt: skip
    return header, out


MOTION_HEADER = ["mode", "ticks in fine", "inferences coarse / fine", "tokens kept", "kept (coarse)", "kept (fine)", "reused"]


def title(result: dict[str, Any]) -> str:
    b = result["bundle"]
    return (
        f"eval: {result['task']}, bundle {b['name']} ({b['family']}), {result['episodes']} episodes x "
        f"{result['steps']} steps per mode (seeds {result['seeds'][0]}..{result['seeds'][-1]}), latency model "
        f"{result['latency_model']}"
    )


def refused_lines(result: dict[str, Any]) -> list[str]:
    """One line per mode the parity gate refused to start (not run): its failed checks."""
    out = []
    for name, why in result.get("refused", {}).items():
        fail = next((line.split("FAIL: ", 1)[1] for line in why.splitlines() if "FAIL: " in line), why.splitlines()[0])
        out.append(f"{name}: refused by the parity gate, not run ({fail})")
    return out


def headline_text(result: dict[str, Any]) -> str:
    text = title(result) + "\n" + _text_table(HEADER, rows(result))
    ros = ros_rows(result)
    text += "\n" + _text_table(ROS_HEADER, ros) if ros else ""
    return "\n".join([text, *precision_lines(result, SIM_FRAMES), *refused_lines(result)])


def markdown(result: dict[str, Any], plots: list[str]) -> str:
    notes = [*precision_lines(result, SIM_FRAMES), *refused_lines(result)]
    parts = [
        f"# Closed-loop evaluation: {result['bundle']['name']} on {result['task']}",
        "",
        title(result) + ".",
        "",
        f"Command: `{result['command']}`" if result.get("command") else "",
        "",
        _md_table(HEADER, rows(result)),
        "",
        *[f"- {line}" for line in notes],
        *([""] if notes else []),
        "Success: the task's reward reached its maximum (4) during the episode; 95% CI is the Wilson score "
        "interval. Latency: observation in to actions out (ActionChunk timings), selection included. Open-loop "
        "error: mean |chunk - scripted expert| along held-out expert demonstrations (arm joints in rad, grippers "
        "normalized), and as a fraction of each joint's range. First chunks spread: at each demonstration's "
        "first frame the arm is at home on every seed, so only the image says where the object is; mean "
        "|chunk - mean chunk| across those demonstrations, the policy's and the expert's (a policy that "
        "ignores the scene is near 0).",
        "",
    ]
    header, summary = summary_rows(result)
    if summary:
        parts += [
            "Every mode against the baseline in one table (the sections below have the details): success with its "
            "Wilson interval, the first two task stages reached, the seeds the mode succeeded on and the baseline did "
            "not (gained) and the reverse (lost), the exact McNemar p-value of success and of those "
            "stages against the baseline on the same seeds (per comparison, uncorrected), latency p50 and the speed-up "
            "over the baseline (and over LeRobot's own runtime, the lerobot mode, when it ran), the control "
            "ticks in fine motion and the image tokens kept in coarse / fine motion.",
            "",
            _md_table(header, summary),
            "",
        ]
    header, stages = stage_rows(result)
    if stages:
        parts += [
            "Task stages reached: episodes whose best grade reached each stage (the last is success), share and "
            "95% Wilson interval. The earlier stages separate modes of a policy that rarely succeeds.",
            "",
            _md_table(header, stages),
            "",
        ]
    header, paired = paired_rows(result)
    if paired:
        parts += [
            "Paired with the baseline (same seeds): per stage, the seeds where only the baseline reached it / only "
            "the mode did, and the exact McNemar test's two-sided p-value (seeds where both agree say nothing "
            "about a difference; not corrected for the several stages and modes); the last stage is success. Best "
            "grade: seeds where the mode's was higher / lower / equal, with the sign test's p-value.",
            "",
            _md_table(header, paired),
            "",
        ]
    motion = motion_rows(result)
    if motion:
        parts += [
            "Motion and image tokens: the control ticks the controller's motion switch spent in fine mode, the "
            "inferences made in each mode, and the image tokens they kept (not pruned; mean over token-layers, "
            "as the replay's tokens_kept_fraction) and reused from earlier frames. Velocity-aware pruning keeps "
            "more tokens in fine motion.",
            "",
            _md_table(MOTION_HEADER, motion),
            "",
        ]
    ros = ros_rows(result)
    if ros:
        parts += [
            f"Through the ROS graph ({result['ros_graph']['layout']}): the same seeds, aloha_sim_node in lockstep with "
            "the controller, the policy node built with the mode's parameters. Latency: the policy node's "
            "InferenceStats total; obs->chunk wall: the simulator's frame out to the chunk back, over DDS.",
            "",
            _md_table(ROS_HEADER, ros),
            "",
        ]
    reasoning = [
        [n, f"{m['reasoning_tokens_mean']:.1f}", f"{100 * m['reasoning_reused_fraction']['mean']:.1f}%",
         f"{100 * m['reasoning_truth_agreement']['mean']:.1f}%", f"{100 * m['reasoning_truth_agreement']['identical_share']:.1f}%"]
        for n, m in result["modes"].items() if "reasoning_truth_agreement" in m
    ]  # fmt: skip
    if reasoning:
        parts += [
            "Reasoning (reasoning bundles): words per inference, share reused from the previous frame (MEMO-VLM), "
            "and agreement with the simulator's ground-truth reasoning at the frame's step (words; whole texts).",
            "",
            _md_table(["mode", "words", "reused", "ground truth (words)", "ground truth (texts)"], reasoning),
            "",
        ]
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def write_plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["mode_order"]
    modes = result["modes"]
    fig, ax = plt.subplots(figsize=(7, 4))
    rates = [100 * modes[n]["success_rate"] for n in names]
    lo = [100 * (modes[n]["success_rate"] - modes[n]["success_ci95"][0]) for n in names]
    hi = [100 * (modes[n]["success_ci95"][1] - modes[n]["success_rate"]) for n in names]
    ax.bar(names, rates, yerr=[lo, hi], capsize=6, color="tab:blue", alpha=0.8)
    ax.set_ylabel("success [%] (95% Wilson interval)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{result['bundle']['name']} on {result['task']}, {result['episodes']} episodes per mode")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / PLOTS[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for n in names:
        m = modes[n]
        err = (m.get("open_loop_error") or {}).get("mean_abs_rad")
        if err is None or not m.get("speedup_vs_baseline"):
            continue
        ax.scatter(m["speedup_vs_baseline"], err, s=60)
        ax.annotate(n, (m["speedup_vs_baseline"], err), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("obs-to-action speedup vs baseline (p50)")
    ax.set_ylabel("open-loop mean |error| vs expert [rad]")
    ax.set_title("Open-loop error against speedup")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=100)
    plt.close(fig)
    return list(PLOTS)


def write_report(result: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    return report.write_report(result, out_dir, plots=plots, to_markdown=markdown, plotter=write_plots)
