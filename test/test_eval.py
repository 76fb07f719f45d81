"""Closed-loop evaluation (`vla-accel eval`) in the real simulator, on tiny bundles."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from vla_accel_ros.bench.outcomes import mcnemar_exact, paired_vs_baseline, stage_summary, wilson_interval
from vla_accel_ros.cli import main


def test_wilson_interval():
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.15 < hi < 0.17  # 0/20 still allows up to ~16%
    lo, hi = wilson_interval(20, 20)
    assert hi == 1.0 and 0.83 < lo < 0.85
    lo, hi = wilson_interval(10, 20)
    assert lo < 0.5 < hi and abs((lo + hi) / 2 - 0.5) < 1e-9


def _episodes(grades, seed0=100):
    return [{"seed": seed0 + i, "success": g >= 4, "max_reward": float(g)} for i, g in enumerate(grades)]


def test_stages_reached_and_paired_comparison():
    base = _episodes([0, 1, 2, 4, 4, 3, 0, 1])
    mode = _episodes([1, 0, 2, 4, 2, 3, 0, 0])
    stages = stage_summary([e["max_reward"] for e in base], "transfer_cube")
    assert [(s["name"], s["reached"]) for s in stages] == [
        ("touched", 6), ("lifted", 4), ("transfer attempted", 3), ("transferred", 2)
    ]  # fmt: skip
    assert stages[0]["rate"] == 0.75 and list(wilson_interval(6, 8)) == stages[0]["ci95"]
    p = paired_vs_baseline(base, mode, "transfer_cube")
    assert p["seeds"] == 8
    touched = p["stages"][0]  # seed 100 only the mode, 101 and 107 only the baseline
    assert (touched["both"], touched["baseline_only"], touched["mode_only"]) == (4, 2, 1)
    assert p["success"] == {"both": 1, "baseline_only": 1, "mode_only": 0, "p_value": 1.0}
    assert p["reward"] == {"higher": 1, "lower": 3, "equal": 4, "p_value": mcnemar_exact(1, 3)}
    # only seeds both modes ran are paired
    assert paired_vs_baseline(base, mode[:3], "transfer_cube")["seeds"] == 3
    with pytest.raises(ValueError, match="no stages for task"):
        stage_summary([1.0], "stacking")


def test_mcnemar_exact_p_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert abs(mcnemar_exact(1, 11) - 26 / 4096) < 1e-12  # 2 * P(X <= 1), X ~ Bin(12, 1/2)
    assert mcnemar_exact(11, 1) == mcnemar_exact(1, 11)
    assert mcnemar_exact(3, 3) == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_bench_outcomes_reads_an_older_report(tmp_path, capsys):
    """`vla-accel bench outcomes` derives the stages and the pairing from per_episode records,
    so reports written before those fields existed get them too."""
    old = {"task": "transfer_cube", "mode_order": ["baseline", "prune"], "modes": {
        "baseline": {"per_episode": _episodes([0, 1, 1, 4])}, "prune": {"per_episode": _episodes([0, 0, 1, 4])}}}
    (tmp_path / "report.json").write_text(json.dumps(old))
    out = tmp_path / "with.json"
    assert main(["bench", "outcomes", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "touched" in text and "1 / 0 (p=1.00)" in text
    result = json.loads(out.read_text())
    assert result["modes"]["prune"]["stages"][0]["reached"] == 2
    assert result["modes"]["prune"]["paired_vs_baseline"]["stages"][0]["baseline_only"] == 1
    assert "stages" not in old["modes"]["prune"]  # the input is left as it was
    del old["modes"]["baseline"]
    (tmp_path / "report.json").write_text(json.dumps(old))
    assert main(["bench", "outcomes", str(tmp_path)]) == 2
    assert "no 'baseline' mode" in capsys.readouterr().err


def test_outcomes_by_where_the_object_started(tmp_path, capsys):
    """Stages per bin of the object's start: each episode counted once, in the bin its seed's
    placement falls in (the last bin closed); `bench outcomes --by y` places them as the simulator does."""
    from vla_accel_ros.bench.outcomes import by_position

    result = {"task": "transfer_cube", "mode_order": ["baseline"], "modes": {"baseline": {"per_episode": _episodes([0, 1, 4, 2, 4])}}}
    position = {100: 0.40, 101: 0.449, 102: 0.45, 103: 0.55, 104: 0.60}
    bins = by_position(result, position, [0.40, 0.45, 0.50, 0.55, 0.60])["baseline"]
    assert [b["episodes"] for b in bins] == [2, 1, 0, 2]
    assert bins[0]["reached"] == [1, 0, 0, 0] and bins[1]["reached"] == [1, 1, 1, 1] and bins[3]["reached"] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="outside the bins"):
        by_position(result, {**position, 104: 0.61}, [0.40, 0.50, 0.60])
    with pytest.raises(ValueError, match="must rise"):
        by_position(result, position, [0.5, 0.5])

    pytest.importorskip("gym_aloha")
    from vla_accel_ros.sim import sample_object_qpos

    (tmp_path / "report.json").write_text(json.dumps({**result, "modes": {"baseline": {"per_episode": _episodes([4] * 40)}}}))
    out = tmp_path / "by.json"
    assert main(["bench", "outcomes", str(tmp_path), "--by", "y", "--bins", "2", "--json", str(out)]) == 0
    assert "by where the object started (y)" in capsys.readouterr().out
    by = json.loads(out.read_text())["by_position"]
    assert by["edges"] == [0.4, 0.5, 0.6]
    low = sum(sample_object_qpos("transfer_cube", 100 + i)[1] < 0.5 for i in range(40))
    assert [b["episodes"] for b in by["modes"]["baseline"]] == [low, 40 - low]
    assert 0 < low < 40
    assert main(["bench", "outcomes", str(tmp_path), "--by", "y", "--bins", "0"]) == 2
    assert "--bins must be >= 1, got 0" in capsys.readouterr().err


def test_bench_outcomes_joins_halves_and_pairs_other_evaluations(tmp_path, capsys):
    """Halves of the seeds run in two processes join into one evaluation; several evaluations
    (other bundles, checkpoints) pair with the first one's reference mode, seed by seed."""

    def report(name, grades, seed0, modes=("baseline",), policy=None):
        d = tmp_path / name
        d.mkdir()
        r = {"task": "transfer_cube", "mode_order": list(modes),
             "modes": {m: {"per_episode": _episodes(grades, seed0)} for m in modes}}  # fmt: skip
        if policy is not None:  # what eval reports record: each mode's policy configuration
            r["modes"]["baseline"]["policy_config"] = {"seed": seed0, "accel": "none", **policy}
        if "lerobot" in modes:  # the lerobot mode records LeRobot's worker: its checkpoint is per part
            r["modes"]["lerobot"]["policy_config"] = {"lerobot": f"{name}/lerobot", "threads": 1, "load_s": seed0 / 100}
        (d / "report.json").write_text(json.dumps(r))
        return str(d)

    ref = f"{report('ref_a', [4, 4, 2], 100, ('baseline', 'lerobot'))},{report('ref_b', [4, 0, 0], 103, ('baseline', 'lerobot'))}"
    other = f"{report('new_a', [0, 4, 2], 100)},{report('new_b', [4, 4, 4], 103)}"
    out = tmp_path / "side.json"
    assert main(["bench", "outcomes", ref, other, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["mode_order"] == [f"{ref}:baseline", f"{ref}:lerobot", f"{other}:baseline"]
    paired = result["modes"][f"{other}:baseline"]["paired_vs_baseline"]
    assert paired["seeds"] == 6  # both halves of both evaluations
    assert (paired["success"]["baseline_only"], paired["success"]["mode_only"]) == (1, 2)  # seed 100; 104, 105
    assert result["modes"][f"{other}:baseline"]["stages"][-1]["reached"] == 4
    assert f"against {ref}:baseline" in text
    # LeRobot's runtime as the reference
    assert main(["bench", "outcomes", ref, other, "--reference", "lerobot"]) == 0
    assert f"against {ref}:lerobot" in capsys.readouterr().out
    assert main(["bench", "outcomes", ref, "--reference", "lerobot"]) == 0
    text = capsys.readouterr().out
    assert text.split("against lerobot, seed by seed")[1].count("\nbaseline ") == 1  # the baseline, paired with LeRobot
    for argv, message in (
        ([ref, other, "--reference", "cache"], "has no 'cache' mode"),
        ([f"{ref},{report('again', [4], 101, ('baseline', 'lerobot'))}"], "repeats seeds [101]"),
        ([f"{ref},{other}"], "part 3 ran modes baseline"),
        ([ref, report("far", [4], 900)], "shares no seed with"),
        # parts of one run share its settings (the noise seed apart); a field a report predates is its default
        ([f"{report('n0_a', [4], 100, policy={'flow_noise_scale': 0.0})},{report('n1_b', [4], 103, policy={})}"],
         "part 2 ran other settings than part 1 (baseline policy: flow_noise_scale 0.0 / 1.0)"),
    ):
        assert main(["bench", "outcomes", *argv]) == 2
        assert message in capsys.readouterr().err, argv
    same = f"{report('s_a', [4], 100, policy={'flow_noise_scale': 1.0})},{report('s_b', [0], 103, policy={})}"
    assert main(["bench", "outcomes", same]) == 0
    # NAME= names an evaluation in the tables (a GPU call's summary pairs four bundles of ten parts each)
    assert main(["bench", "outcomes", f"start={ref}", f"run={other}", "--json", str(out)]) == 0
    assert "against start:baseline" in capsys.readouterr().out
    assert json.loads(out.read_text())["mode_order"] == ["start:baseline", "start:lerobot", "run:baseline"]
    assert main(["bench", "outcomes", f"x={ref}", f"x={other}"]) == 2
    assert "the name 'x' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["flow", "ar"])
def test_eval_one_short_episode_per_mode(family, tiny_bundles, tmp_path):
    out = tmp_path / "report"
    argv = ["eval", "--bundle", str(tiny_bundles[family]), "--episodes", "1", "--steps", "8", "--modes",
            "baseline,cache", "--report", str(out), "--open-loop-episodes", "2", "--open-loop-stride", "4",
            "--height", "120", "--width", "160", "--no-progress", "--no-parity"]  # fmt: skip
    extra = "pipelined" if family == "ar" else "prune"
    argv[argv.index("baseline,cache")] = f"baseline,cache,{extra}"
    if family == "ar":
        argv.remove("--no-parity")  # the gate runs in one of the two
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["task"] == "transfer_cube" and report["bundle"]["name"] == f"demo-{family}-tiny"
    modes = ["baseline", "cache", extra]
    assert report["mode_order"] == modes
    for mode in modes:
        m = report["modes"][mode]
        assert m["episodes"] == 1 and m["success_rate"] in (0.0, 1.0)
        lo, hi = m["success_ci95"]
        assert 0.0 <= lo <= m["success_rate"] <= hi <= 1.0
        assert m["latency_ms"]["p50"] > 0 and m["inferences_per_episode"] >= 1
        # two demonstrations for one episode: the open loop's seeds go on past the episodes'
        assert m["open_loop_error"]["mean_abs_rad"] > 0 and m["open_loop_error"]["chunks"] == 4
        assert m["open_loop_error"]["first_chunk"]["demos"] == 2 and "slope" in m["open_loop_error"]["first_chunk"]
        assert [s["stage"] for s in m["stages"]] == [1, 2, 3, 4]
        assert m["stages"][-1]["reached"] == m["successes"]  # the last stage is success
        if mode != "baseline":
            assert m["paired_vs_baseline"]["seeds"] == 1
        by_motion = m["inferences_by_motion"]
        assert by_motion["coarse"] + by_motion["fine"] == m["inferences_per_episode"]
        kept = m["tokens_kept_fraction"]["mean"]
        assert kept < 1.0 if mode == "prune" else kept == 1.0  # only pruning drops image tokens
        assert 0.0 <= m["reuse_fraction"]["mean"] <= 1.0
    assert report["modes"]["baseline"]["reuse_fraction"]["mean"] == 0.0
    assert "paired_vs_baseline" not in report["modes"]["baseline"]
    assert (out / "report.md").is_file() and (out / "success.png").is_file()
    text = (out / "report.md").read_text()
    assert "Task stages reached" in text and "Motion and image tokens" in text and ", slope " in text
    assert "| mode | success (Wilson 95%) | touched | lifted | success: gained / lost | McNemar p: success / touched / lifted |" in text


def test_prefix_statistics_are_split_by_the_motion_mode_of_each_inference():
    from vla_accel_ros.bench.eval import prefix_summary

    s = prefix_summary([("coarse", 0.3, 0.1), ("fine", 0.6, 0.2), ("coarse", 0.5, 0.3)])
    assert s["tokens_kept_fraction"] == pytest.approx({"mean": 1.4 / 3, "coarse": 0.4, "fine": 0.6})
    assert s["reuse_fraction"] == pytest.approx({"mean": 0.2, "coarse": 0.2, "fine": 0.2})
    assert s["inferences_by_motion"] == {"coarse": 2, "fine": 1}
    assert prefix_summary([("coarse", 1.0, 0.0)])["tokens_kept_fraction"]["fine"] is None  # no fine inference
    assert prefix_summary([]) == {}


# -- through the ROS graph (--through-ros): real nodes over DDS, the real simulator ---------------
@pytest.mark.ros
def test_eval_through_the_ros_graph_reports_each_mode(tiny_bundles, ros_params_file, ros_domain, tmp_path):
    """One 20-step episode per mode, the whole graph in this process (bringup --one-process):
    the simulator's outcome, its per-episode record (same seed as the ROS-free path) and the
    policy node's InferenceStats land in modes.<mode>.ros_graph; the ROS-free keys stay."""
    pytest.importorskip("rclpy")
    pytest.importorskip("gym_aloha")
    out = tmp_path / "report"
    argv = ["eval", "--bundle", str(tiny_bundles["flow"]), "--episodes", "1", "--steps", "20", "--modes",
            "baseline,cache", "--report", str(out), "--open-loop-episodes", "0", "--height", "120", "--width", "160",
            "--no-progress", "--no-plots", "--threads", "1", "--params", str(ros_params_file), "--no-parity",
            "--through-ros", "--one-process", "--domain-id", str(ros_domain), "--seed", "100007"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["ros_graph"]["layout"] == "one process" and report["seeds"] == [100007]
    for mode in ("baseline", "cache"):
        m = report["modes"][mode]
        assert m["episodes"] == 1 and "latency_ms" in m  # the ROS-free run is still there
        g = m["ros_graph"]
        assert g["episodes"] == 1 and g["successes"] in (0, 1) and g["success_rate"] in (0.0, 1.0)
        lo, hi = g["success_ci95"]
        assert 0.0 <= lo <= g["success_rate"] <= hi <= 1.0
        assert g["per_episode"][0]["seed"] == 100007 and g["mean_reward"] == g["per_episode"][0]["max_reward"]
        assert g["chunks"] >= 1 and g["latency_ms"]["p50"] > 0 and g["latency_ms"]["p95"] >= g["latency_ms"]["p50"]
        assert g["sim_steps"] >= 20 and g["policy_errors"] == 0
    assert "ROS graph" in (out / "report.md").read_text()


@pytest.mark.parametrize("mode", ["transformers", "pipelined"])
def test_eval_through_ros_refuses_a_mode_the_graph_cannot_run(mode, tiny_bundles, tmp_path, capsys):
    argv = ["eval", "--bundle", str(tiny_bundles["ar"]), "--episodes", "1", "--modes", f"baseline,{mode}",
            "--report", str(tmp_path / "r"), "--through-ros"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"mode {mode!r} cannot run through the ROS graph" in err
    assert not (tmp_path / "r").exists()  # refused before any episode ran


def test_open_loop_error_does_not_inherit_the_closed_loops_motion_mode(tiny_bundles):
    """No controller runs along the expert's demonstrations: whatever motion mode the last
    closed-loop tick left on a pruning policy, its open-loop error is the same."""
    import numpy as np

    from vla_accel_ros.bench import eval as ev
    from vla_accel_ros.bench.modes import build_runs
    from vla_accel_ros.core.bundle import load_bundle
    from vla_accel_ros.core.robot.safety import default_limits

    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=1, steps=12, modes=("baseline", "prune"), parity_check=False,
                        num_threads=1, open_loop_episodes=1, open_loop_stride=4, height=120, width=160)  # fmt: skip
    graph = ev.GraphConfigs.load(None)
    bundle = load_bundle(cfg.bundle)
    robot = ev.SimRobot(cfg.task, tuple(bundle.spec.cameras), graph.robot, graph.sync(bundle.spec.image_size), cfg.height, cfg.width)
    policy = build_runs(bundle, ["baseline", "prune"], cfg)[1].policy
    demos = ev.record_demos(robot, cfg.task, [cfg.seed], cfg.steps, cfg.open_loop_stride)
    lo, hi = (np.asarray(x) for x in default_limits(graph.robot))
    errors = {}
    for mode in ("coarse", "fine"):
        policy.set_motion_mode(mode)
        errors[mode] = ev.open_loop_error(policy, demos, lo, hi)["mean_abs_rad"]
    assert errors["coarse"] == errors["fine"]


def test_first_chunk_spread_is_zero_for_a_policy_blind_to_its_images(tiny_bundles):
    """The first frames of two seeds differ only where the cube lies; a policy whose vision
    tower sees nothing must have no spread (each demonstration's own noise must not count)."""
    import numpy as np
    import torch

    from vla_accel_ros.bench import eval as ev
    from vla_accel_ros.bench.modes import build_runs
    from vla_accel_ros.core.bundle import load_bundle
    from vla_accel_ros.core.robot.safety import default_limits

    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=2, steps=8, modes=("baseline",), parity_check=False,
                        num_threads=1, open_loop_episodes=2, open_loop_stride=4, height=120, width=160)  # fmt: skip
    graph = ev.GraphConfigs.load(None)
    bundle = load_bundle(cfg.bundle)
    robot = ev.SimRobot(cfg.task, tuple(bundle.spec.cameras), graph.robot, graph.sync(bundle.spec.image_size), cfg.height, cfg.width)
    policy = build_runs(bundle, ["baseline"], cfg)[0].policy
    demos = ev.record_demos(robot, cfg.task, [cfg.seed, cfg.seed + 1], cfg.steps, cfg.open_loop_stride)
    lo, hi = (np.asarray(x) for x in default_limits(graph.robot))
    seeing = ev.open_loop_error(policy, demos, lo, hi)["first_chunk"]
    assert seeing["demos"] == 2 and seeing["expert_spread"] > 0 and seeing["policy_spread"] > 0
    assert seeing["slope"] != 0.0 and -1.0 <= seeing["corr"] <= 1.0
    follows = ev._first_chunk_spread([(2 * e + 1.0, e) for e in (np.zeros((3, 2)), np.ones((3, 2)), np.full((3, 2), 3.0))])
    assert follows["slope"] == pytest.approx(2.0) and follows["corr"] == pytest.approx(1.0)
    with torch.no_grad():
        for p in policy.model.vis.parameters():
            p.zero_()
    blind = ev.open_loop_error(policy, demos, lo, hi)["first_chunk"]
    assert blind["policy_spread"] == 0.0 and blind["expert_spread"] == seeing["expert_spread"]
    assert blind["slope"] == 0.0 and blind["corr"] is None  # the same chunk whatever the scene


def test_measured_latency_lands_a_chunk_its_latency_after_its_frame():
    from vla_accel_ros.bench.eval import landing_ns

    ms = 1_000_000
    # sequential: the frame was rendered at now; rendering time is the simulator's, not counted
    assert landing_ns("measured", 100 * ms, 100 * ms, 58.0) == 158 * ms
    # pipelined: an older frame whose chunk saw 95 ms of compute while in flight
    assert landing_ns("measured", 100 * ms, 20 * ms, 95.0) == 115 * ms
    # never before the next tick; zero latency: the next tick
    assert landing_ns("measured", 100 * ms, 20 * ms, 10.0) == 100 * ms + 1
    assert landing_ns("zero", 100 * ms, 100 * ms, 58.0) == 100 * ms + 1


def test_each_mode_is_warmed_up_once_outside_its_episodes(tiny_bundles, monkeypatch):
    """A mode's first call (lazy packing, compiled graphs) happens before its first episode and
    is not among the latencies; the episodes' results are what they would be without it."""
    from vla_accel_ros.bench import eval as ev

    calls = []
    original = ev.warm_up
    monkeypatch.setattr(ev, "warm_up", lambda robot, run, seed: calls.append((run.name, seed)) or original(robot, run, seed))
    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=2, steps=8, modes=("baseline", "cache"), parity_check=False,
                        num_threads=1, open_loop_episodes=0, height=120, width=160, seed=7)  # fmt: skip
    warmed = ev.run_eval(cfg, progress=False)
    assert calls == [("baseline", 7), ("cache", 7)]
    for m in warmed["modes"].values():
        assert len(m["per_episode"]) == 2 and m["latency_ms"]["p50"] > 0
    monkeypatch.setattr(ev, "warm_up", lambda robot, run, seed: None)
    cold = ev.run_eval(cfg, progress=False)
    for name in ("baseline", "cache"):  # the warm-up leaves no state behind
        assert warmed["modes"][name]["per_episode"] == cold["modes"][name]["per_episode"]
        assert warmed["modes"][name]["inferences_per_episode"] == cold["modes"][name]["inferences_per_episode"]


def test_scheduler_overrides_reach_the_controller_and_the_graphs_parameter_file(tiny_bundles, tmp_path, capsys):
    """`--scheduler FIELD=VALUE` changes the chunk scheduler the episodes run with (and the copy of
    the parameter file a --through-ros graph reads); a bad value is refused before any episode."""
    from vla_accel_ros.bench import eval as ev
    from vla_accel_ros.core.params_file import node_section

    ensemble = {"aggregation": "temporal_ensemble", "async_threshold": 0.9}
    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=1, steps=8, modes=("baseline",), parity_check=False,
                        num_threads=1, open_loop_episodes=0, height=120, width=160, scheduler_overrides=ensemble)  # fmt: skip
    result = ev.run_eval(cfg, progress=False)
    assert {k: result["scheduler"][k] for k in ensemble} == ensemble
    assert result["scheduler"]["execute_horizon"] == ev.GraphConfigs.load(None).scheduler.execute_horizon  # the file's
    section = node_section(ev.graph_params("baseline", cfg), "action_controller_node")["scheduler"]
    assert {k: section[k] for k in ensemble} == ensemble and "execute_horizon" in section

    argv = ["eval", "--bundle", str(tiny_bundles["flow"]), "--episodes", "1", "--modes", "baseline",
            "--report", str(tmp_path / "r"), "--scheduler", "aggregation=newest"]  # fmt: skip
    assert main(argv) == 2
    assert "--scheduler aggregation=newest" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_an_episodes_noise_depends_on_its_seed_not_on_where_the_run_started(tiny_bundles, monkeypatch):
    """Seed 8 draws the same noise in a run of seeds 7, 8 and in a run of seed 8 alone, so an
    episode (a failure seen in a long run) replays by its seed."""
    from vla_accel_ros.bench import eval as ev

    drawn: dict[int, list] = {}
    original = ev.run_episode

    def recording(robot, run, graph, seed, cfg):
        infer = run.policy.infer

        def infer_and_note(obs, *, noise=None, guidance=None):
            drawn.setdefault((cfg.seed, seed), []).append(None if noise is None else noise.copy())
            return infer(obs, noise=noise, guidance=guidance)

        monkeypatch.setattr(run.policy, "infer", infer_and_note)
        try:
            return original(robot, run, graph, seed, cfg)
        finally:
            monkeypatch.setattr(run.policy, "infer", infer)

    monkeypatch.setattr(ev, "run_episode", recording)
    for start, episodes in ((7, 2), (8, 1)):
        cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=episodes, steps=8, modes=("baseline",), parity_check=False,
                            num_threads=1, open_loop_episodes=0, height=120, width=160, seed=start)  # fmt: skip
        ev.run_eval(cfg, progress=False)
    long_run, alone, other = drawn[(7, 8)], drawn[(8, 8)], drawn[(7, 7)]
    assert long_run and len(long_run) == len(alone)
    assert all(np.array_equal(a, b) for a, b in zip(long_run, alone))
    assert not np.array_equal(long_run[0], other[0])  # and seeds differ from one another


def test_the_noise_scale_reaches_the_policy_and_a_bad_one_is_refused_by_its_flag(tiny_bundles, tmp_path, capsys):
    """--noise-scale is the policy's flow_noise_scale in every mode (recorded in the report);
    by default the bundle's noise_scale, recorded as the scale that ran; out of range it is
    refused, named as the flag, before anything runs."""
    import json
    import shutil

    from vla_accel_ros.bench import eval as ev

    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=1, steps=4, modes=("baseline", "cache"), parity_check=False,
                        num_threads=1, open_loop_episodes=0, height=120, width=160, noise_scale=0.0)  # fmt: skip
    result = ev.run_eval(cfg, progress=False)
    assert {m["policy_config"]["flow_noise_scale"] for m in result["modes"].values()} == {0.0}
    half = tmp_path / "half"
    shutil.copytree(tiny_bundles["flow"], half)
    (half / "config.json").write_text(json.dumps({**json.loads((half / "config.json").read_text()), "noise_scale": 0.5}))
    result = ev.run_eval(ev.EvalConfig(**{**cfg.__dict__, "bundle": half, "noise_scale": -1.0}), progress=False)
    assert {m["policy_config"]["flow_noise_scale"] for m in result["modes"].values()} == {0.5}
    argv = ["eval", "--bundle", str(tiny_bundles["flow"]), "--episodes", "1", "--report", str(tmp_path / "r"),
            "--noise-scale", "-0.5"]  # fmt: skip
    assert main(argv) == 2
    assert "--noise-scale: PolicyConfig.flow_noise_scale=-0.5 is neither -1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_mode_the_gate_refuses_is_reported_and_the_others_run(tmp_path):
    """The gate runs on the task's own frames; pruning moves the shipped trained flow policy
    further than new noise does (it lost the task in closed loop), so the prune mode is refused
    by name, and the baseline still runs."""
    pytest.importorskip("gym_aloha")
    from vla_accel_ros.bench import eval as ev
    from vla_accel_ros.bench.eval_report import headline_text
    from vla_accel_ros.core.bundle import shipped_bundle

    cfg = ev.EvalConfig(bundle=shipped_bundle("transfer_cube-flow"), episodes=1, steps=12, modes=("baseline", "prune"),
                        num_threads=1, open_loop_episodes=0)  # fmt: skip
    result = ev.run_eval(cfg, progress=False)
    assert result["mode_order"] == ["baseline"] and list(result["modes"]) == ["baseline"]
    assert "prune_over_sampling_spread" in result["refused"]["prune"]
    assert "prune: refused by the parity gate, not run (prune_over_sampling_spread=" in headline_text(result)


def test_the_report_says_what_precision_ran_and_what_the_gate_measured(tiny_bundles):
    """precision auto resolves per bundle (and steps back when the gate refuses): the report
    keeps what ran, next to the gate's metrics."""
    from vla_accel_ros.bench import eval as ev

    cfg = ev.EvalConfig(bundle=tiny_bundles["flow"], episodes=1, steps=12, modes=("baseline", "baseline@bf16"),
                        num_threads=1, open_loop_episodes=0, height=120, width=160)  # fmt: skip
    result = ev.run_eval(cfg, progress=False)
    bf16 = result["modes"]["baseline@bf16"]
    assert bf16["precision"] == "lm=bf16,expert=bf16" and result["modes"]["baseline"]["precision"] == "fp32"
    assert "precision_second_frame_max_over_std" in bf16["parity_gate"]["metrics"]
    from vla_accel_ros.bench.eval_report import headline_text

    assert "baseline@bf16 ran lm=bf16,expert=bf16 (precision resolved on the simulator's frames)" in headline_text(result)
    assert "baseline ran" not in headline_text(result)
    # The gate's frames do not follow the run's first seed: two halves of one evaluation run
    # the same precision (auto could otherwise resolve differently in each).
    later = ev.run_eval(dataclasses.replace(cfg, seed=cfg.seed + 7), progress=False)
    assert later["modes"]["baseline@bf16"]["parity_gate"] == bf16["parity_gate"]


def test_no_baseline_runs_only_the_listed_modes_and_pairs_with_an_earlier_report(tiny_bundles, tmp_path, capsys):
    """--no-baseline skips the baseline's episodes; the mode's episodes are the ones a full
    evaluation runs on the same seeds, so `bench outcomes` pairs it with that run's baseline.
    With nothing but the baseline listed it is refused before anything runs."""
    common = ["--bundle", str(tiny_bundles["flow"]), "--episodes", "2", "--steps", "8", "--seed", "5", "--height", "120",
              "--width", "160", "--open-loop-episodes", "0", "--no-progress", "--no-parity", "--no-plots"]  # fmt: skip
    full, alone = tmp_path / "full", tmp_path / "alone"
    assert main(["eval", *common, "--modes", "cache", "--report", str(full)]) == 0
    assert main(["eval", *common, "--modes", "cache", "--no-baseline", "--report", str(alone)]) == 0
    a, b = (json.loads((d / "report.json").read_text()) for d in (full, alone))
    assert a["mode_order"] == ["baseline", "cache"] and b["mode_order"] == ["cache"]
    assert b["modes"]["cache"]["per_episode"] == a["modes"]["cache"]["per_episode"]
    assert "speedup_vs_baseline" not in b["modes"]["cache"] and "paired_vs_baseline" not in b["modes"]["cache"]
    capsys.readouterr()
    assert main(["bench", "outcomes", f"base={full}", f"alone={alone}"]) == 0
    assert "alone:cache" in capsys.readouterr().out
    assert main(["eval", *common, "--modes", "baseline", "--no-baseline", "--report", str(tmp_path / "none")]) == 2
    assert "--no-baseline leaves no mode to run" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_the_lerobot_mode_alone_runs_beside_an_added_baseline():
    """`--modes lerobot` alone was refused as naming no mode; the baseline is added to it as to
    any other list, and lerobot keeps its place after the modes listed before it."""
    from vla_accel_ros.bench.eval import eval_modes

    assert eval_modes("lerobot") == ["baseline", "lerobot"]
    assert eval_modes("cache,lerobot") == ["baseline", "cache", "lerobot"]
    assert eval_modes("lerobot,cache") == ["baseline", "lerobot", "cache"]
