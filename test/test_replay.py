"""The replay benchmark (`vla-accel replay`) on a real few-frame bag recorded with the simulator.

This is also CI's run of the benchmark end to end: tiny bundles, a two-episode bag of a few
frames, every report file checked.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
pytest.importorskip("rosbags", reason="requirements-sim.txt is not installed")

from vla_accel_ros.bench import modes as bm  # noqa: E402
from vla_accel_ros.bench import replay as rp  # noqa: E402
from vla_accel_ros.bench.flops import FrameWork, decoder_layer_flops, estimate_flops  # noqa: E402
from vla_accel_ros.bench.report import PLOTS  # noqa: E402
from vla_accel_ros.core.prune import PruneConfig  # noqa: E402
from vla_accel_ros.cli import main  # noqa: E402
from helpers import record_sim_bag, still_bag  # noqa: E402
from vla_accel_ros.core.errors import BagError, BundleError, ConfigError  # noqa: E402

EPISODES, STEPS, WARMUP = 2, 4, 2
MODES = ["baseline", "cache", "transformers"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim_bag(tmp_path_factory) -> Path:
    """Two scripted transfer_cube episodes of a few ticks, top camera rendered at 240x320."""
    return record_sim_bag(tmp_path_factory.mktemp("replay") / "cube_bag", EPISODES, STEPS)


@pytest.fixture(scope="module")
def replays(sim_bag, tiny_bundles, tmp_path_factory):
    """Both families replayed through the CLI once; each mode's calls recorded in order."""
    calls: list[tuple[str, int]] = []
    original = bm.ModeRun.step

    def recording_step(self, obs, noise):
        calls.append((self.name, obs.stamp_ns))
        return original(self, obs, noise)

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bm.ModeRun, "step", recording_step)
        for fam in ("ar", "flow"):
            calls.clear()
            report = tmp_path_factory.mktemp(f"report_{fam}")
            argv = ["replay", str(sim_bag), "--bundle", str(tiny_bundles[fam]), "--modes", ",".join(MODES),
                    "--report", str(report), "--warmup", str(WARMUP), "--no-progress"]  # fmt: skip
            assert main(argv) == 0
            out[fam] = (report, json.loads((report / "report.json").read_text()), list(calls))
    return out


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_report_json_schema_and_values(replays, sim_bag, tiny_bundles, family: str) -> None:
    _, rep, _ = replays[family]
    assert rep["schema"] == rp.SCHEMA
    assert rep["frames"] == EPISODES * STEPS - WARMUP  # every bag frame, warm-up excluded
    assert rep["warmup"] == WARMUP
    assert rep["bag"]["path"] == str(sim_bag) and rep["bag"]["observations"] == EPISODES * STEPS
    assert [e["frames"] for e in rep["bag"]["episodes"]] == [STEPS] * EPISODES
    age = rep["bag"]["observation_age_ms"]  # at inference start, on the bag's clock: within max_age_ms
    assert 0.0 <= age["min"] <= age["p50"] <= age["max"] <= 100.0
    assert rep["bundle"]["path"] == str(tiny_bundles[family]) and rep["bundle"]["family"] == family
    assert rep["mode_order"] == MODES and set(rep["modes"]) == set(MODES)
    assert rep["machine"]["torch_threads"] >= 1 and rep["machine"]["cpu_count"] >= 1
    assert "--modes baseline,cache,transformers" in rep["command"]
    for name, m in rep["modes"].items():
        lat = m["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"], name
        assert len(m["per_frame"]["latency_ms"]) == rep["frames"]
        # the ratio of the medians of the same frames, and the median of the per-frame ratios
        base_lat = rep["modes"]["baseline"]["latency_ms"]
        assert m["speedup_vs_baseline"] == pytest.approx(base_lat["p50"] / lat["p50"]), name
        per_frame = np.asarray(rep["modes"]["baseline"]["per_frame"]["latency_ms"]) / np.asarray(m["per_frame"]["latency_ms"])
        assert m["speedup_paired_median"] == pytest.approx(float(np.median(per_frame)), rel=1e-2), name  # rounded to 1 us
        assert 0.0 <= m["reuse_fraction"]["mean"] <= 1.0
        assert m["flops"]["estimate"] is True and m["flops"]["gflops_per_frame"]["mean"] > 0
        assert "total" in m["stages_ms"] and "prefill" in m["stages_ms"]
    base = rep["modes"]["baseline"]
    assert base["speedup_vs_baseline"] == 1.0
    assert base["deviation"]["max_abs"] == 0.0 and base["deviation"]["max_over_std"] == 0.0
    assert base["reuse_fraction"]["mean"] == 0.0
    assert "select" in rep["modes"]["cache"]["stages_ms"]  # selection overhead is timed
    # transformers computes the same policy (the parity gate's reference): near-zero deviation,
    # which also proves the flow modes got the same noise on each frame.
    dev = rep["modes"]["transformers"]["deviation"]
    assert dev["max_over_std"] < 1e-2
    if family == "ar":
        assert dev["identical_token_share"] >= 0.9
        assert base["deviation"]["identical_token_share"] == 1.0
    # The transformers path scores the whole vocabulary on every row: more work than the engine.
    assert rep["modes"]["transformers"]["flops"]["gflops_per_frame"]["mean"] >= base["flops"]["gflops_per_frame"]["mean"]


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_interleaved_rotating_order_and_episode_resets(replays, family: str) -> None:
    _, rep, calls = replays[family]
    n = len(MODES)
    frames = EPISODES * STEPS
    assert len(calls) == frames * n  # every mode saw every frame (warm-up included)
    for i in range(frames):
        block = calls[i * n : (i + 1) * n]
        assert {name for name, _ in block} == set(MODES)  # all modes on one frame before the next
        assert len({stamp for _, stamp in block}) == 1
        assert block[0][0] == MODES[i % n]  # the first to run rotates
    assert rep["frame_episodes"] == [0] * (STEPS - WARMUP) + [1] * STEPS
    # The cache starts over at the episode boundary (reset on every mode) and only there.
    boundary = STEPS - WARMUP
    resets = rep["modes"]["cache"]["per_frame"]["reset"]
    assert resets[boundary] and not any(resets[boundary + 1 :])


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_report_md_and_plots(replays, family: str) -> None:
    report, rep, _ = replays[family]
    md = (report / "report.md").read_text()
    for needle in ("| mode | p50 ms | p95 ms | p99 ms | speedup vs baseline |", "Per-stage breakdown", "FLOPs estimate",
                   rep["command"], "torch", "side by side are the figures to trust",
                   "observation age at inference start"):  # fmt: skip
        assert needle in md
    from PIL import Image

    for name in PLOTS:
        data = (report / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        with Image.open(report / name) as img:
            img.verify()
        assert f"]({name})" in md


def test_cli_prints_headline(sim_bag, tiny_bundles, tmp_path, capsys) -> None:
    argv = ["replay", str(sim_bag), "--bundle", str(tiny_bundles["ar"]), "--modes", "cache", "--report",
            str(tmp_path / "r"), "--no-plots", "--no-parity", "--max-frames", "2", "--prune", "keep_global=32"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speedup vs baseline" in out and "baseline" in out and "cache" in out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["frames"] == 2 and rep["mode_order"] == ["baseline", "cache"]  # baseline added first
    assert "--prune keep_global=32" in rep["command"]
    assert not any((tmp_path / "r" / p).exists() for p in PLOTS)


def test_frame_noise_is_deterministic_per_frame(tiny_bundles) -> None:
    from vla_accel_ros.core.bundle import read_spec

    spec = read_spec(tiny_bundles["flow"])
    shape = (spec.chunk_size, spec.action_dim)
    a, b = bm.frame_noise(0, 3, shape), bm.frame_noise(0, 3, shape)
    assert a.shape == (spec.chunk_size, spec.action_dim) and np.array_equal(a, b)
    assert not np.array_equal(a, bm.frame_noise(0, 4, shape))
    assert not np.array_equal(a, bm.frame_noise(1, 3, shape))


def test_flops_formula() -> None:
    cfg = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    # one row, 5 keys: q,o 2*8*4*2*2 + k,v 2*8*4*2*1 + mlp 6*8*16 + attn 4*2*4*5
    assert decoder_layer_flops(cfg, 1, 5) == 2 * 8 * 4 * (2 * 2 + 2 * 1) + 6 * 8 * 16 + 4 * 2 * 4 * 5
    from vla_accel_ros.models.factory import demo_spec

    spec = demo_spec("flow", "tiny")
    layers = spec.lm["num_hidden_layers"]
    full = estimate_flops(spec, FrameWork(274, [274] * layers, 1), flow_steps=10)
    partial = estimate_flops(spec, FrameWork(274, [274, 274] + [100] * (layers - 2), 1), flow_steps=10)
    skipped = estimate_flops(spec, FrameWork(274, [18] * layers, 0), flow_steps=10)
    assert partial["prefill"] < full["prefill"] and partial["denoise"] == full["denoise"]
    assert skipped["vision"] == 0 and skipped["total"] < partial["total"]
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k != "total"))
    # ar decode: A - 1 single rows, row i seeing P + i keys (the average P + A/2 is exact);
    # an action draft's decode rows are priced the same way, its prefill rows with the prefix
    ar = demo_spec("ar", "tiny")
    a, p, ln = ar.action_dim * ar.chunk_size, 300, ar.lm["num_hidden_layers"]
    plain = estimate_flops(ar, FrameWork(p, [p] * ln, 1), flow_steps=0)
    assert plain["decode"] == pytest.approx(sum(ln * decoder_layer_flops(ar.lm, 1, p + i) for i in range(1, a)))
    drafted = estimate_flops(ar, FrameWork(p, [p] * ln, 1, decode_rows=4, draft_rows=a - 1), flow_steps=0)
    assert drafted["decode"] == pytest.approx(plain["decode"] * 4 / (a - 1)) and drafted["head"] > plain["head"]


# -- errors: one clear line, exit code 2 ---------------------------------------------------------


def _run_cli(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vla-accel: error: ")
    return err


def test_errors(sim_bag, tiny_bundles, tmp_path, capsys) -> None:
    rep = str(tmp_path / "r")
    ar, flow = str(tiny_bundles["ar"]), str(tiny_bundles["flow"])
    err = _run_cli(capsys, ["replay", str(tmp_path / "nope"), "--bundle", ar, "--report", rep])
    assert "does not exist" in err
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", str(tmp_path / "no_bundle"), "--report", rep])
    assert "not a bundle" in err
    wrong_cam = still_bag(tmp_path, camera="cam_low", joints=True)
    err = _run_cli(capsys, ["replay", str(wrong_cam), "--bundle", ar, "--report", rep])
    assert "cam_high" in err and "cam_low" in err
    no_state = still_bag(tmp_path, camera="cam_high", joints=False)
    err = _run_cli(capsys, ["replay", str(no_state), "--bundle", flow, "--report", rep])
    assert "joint states" in err and "14-D state" in err
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--modes", "baseline,warp", "--report", rep])
    assert "warp" in err and "cache" in err
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--warmup", "100", "--no-parity", "--report", rep])
    assert "--warmup 100 leaves no frame to time" in err  # from the bag's metadata, before any weights load
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--modes", ",", "--report", rep])
    assert "names no mode" in err
    # Overrides are checked whether or not a chosen mode uses them, and a report path that is
    # a file is refused before anything runs.
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--modes", "baseline,prune", "--cache", "nope=1", "--report", rep])
    assert "--cache nope=1" in err and "CacheConfig has no field(s) nope" in err
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--modes", "baseline", "--prune", "keep_global=-5", "--report", rep])
    assert "--prune keep_global=-5" in err and "keep_global" in err
    (tmp_path / "afile").write_text("x")
    err = _run_cli(capsys, ["replay", str(sim_bag), "--bundle", ar, "--no-parity", "--report", str(tmp_path / "afile")])
    assert "is a file" in err
    assert not (tmp_path / "r").exists()  # nothing written on failure
    # The same typed errors from the Python API.
    cfg = rp.ReplayConfig(bag=no_state, bundle=Path(flow))
    with pytest.raises(BagError):
        rp.run_replay(cfg)
    with pytest.raises(BundleError):
        rp.run_replay(rp.ReplayConfig(bag=sim_bag, bundle=tmp_path))
    with pytest.raises(ConfigError):
        bm.parse_modes("cache,cache")


def test_mode_suffix_parsing():
    m = bm.mode_of("cache+prune@int8+compile")
    assert m.policy["accel"] == "cache+prune"
    assert m.policy["precision"] == {"lm": "int8", "expert": "int8", "compile": True}
    assert bm.mode_of("baseline@compile").policy["precision"] == {"compile": True}
    assert bm.mode_of("baseline@auto").policy["precision"]["vision"] == "auto"
    assert "precision" not in bm.mode_of("cache").policy  # unsuffixed: fp32 eager
    assert bm.parse_modes("baseline@bf16,cache@int8") == ["baseline", "baseline@bf16", "cache@int8"]
    for bad in ("baseline@fp8", "baseline@", "baseline@bf16+int8", "warp@bf16", "transformers@bf16", "baseline@bf16+jit"):
        with pytest.raises(ConfigError):
            bm.mode_of(bad)


def test_replay_with_precision_suffix(sim_bag, tiny_bundles, tmp_path):
    """A reduced-precision mode side by side with the fp32 baseline: gated on the bag's frames,
    reported with its speedup, deviation against the baseline and what its gate measured."""
    cfg = rp.ReplayConfig(bag=sim_bag, bundle=tiny_bundles["flow"], modes=("baseline", "baseline@bf16"), warmup=1)
    rep = rp.run_replay(cfg)
    bf16 = rep["modes"]["baseline@bf16"]
    assert bf16["precision"] == "lm=bf16,expert=bf16" and not bf16["compiled"]
    assert rep["modes"]["baseline"]["precision"] == "fp32"
    assert bf16["speedup_vs_baseline"] > 0 and 0 < bf16["deviation"]["max_over_std"] < 0.02
    assert bf16["parity_gate"]["precision_second_frame_max_over_std"] <= 0.02
    assert "(bf16)" in bf16["doc"]
    from vla_accel_ros.bench.report import headline_text, markdown

    line = "baseline@bf16 ran lm=bf16,expert=bf16 (precision resolved on the bag's frames)"
    assert line in headline_text(rep) and f"- {line}" in markdown(rep, [])


def test_prune_and_cache_overrides_reach_their_modes_only(sim_bag, tiny_bundles):
    cfg = rp.ReplayConfig(
        bag=sim_bag, bundle=tiny_bundles["ar"], cache_overrides={"relevance_mode": "off"},
        prune_overrides={"keep_global": 48, "dynamic_layers": [0.25, 0.5]},
    )  # fmt: skip
    both = bm.policy_config(bm.mode_of("cache+prune-aggressive"), cfg)
    assert both.prune.keep_global == 48 and both.prune.keep_local == 32  # the override over the preset
    assert both.prune.dynamic_layers == (0.25, 0.5) and both.cache.relevance_mode == "off"
    prune = bm.policy_config(bm.mode_of("prune"), cfg)
    assert prune.prune.keep_global == 48 and prune.cache.relevance_mode == "threshold"
    assert bm.policy_config(bm.mode_of("cache"), cfg).prune == PruneConfig()
    bad = dataclasses.replace(cfg, prune_overrides={"keep_global": 300})
    with pytest.raises(ConfigError, match="keep_global"):
        bm.policy_config(bm.mode_of("prune"), bad)


def test_pipelined_throughput_counts_the_drain_at_episode_ends(sim_bag, tiny_bundles):
    """The frames still in flight when an episode ends are decoded by flush(): that work is part
    of what the timed frames cost, so frames/s counts it (it was left out before)."""
    cfg = rp.ReplayConfig(bag=sim_bag, bundle=tiny_bundles["ar"], modes=("baseline", "pipelined"), warmup=1,
                          parity_check=False, pipeline_depth=4)  # fmt: skip
    rep = rp.run_replay(cfg)
    base, pipe = rep["modes"]["baseline"], rep["modes"]["pipelined"]
    assert base["drain_ms"] == 0.0 and pipe["drain_ms"] > 0.0
    frames = rep["frames"]
    spent_s = (pipe["call_ms"]["mean"] * frames + pipe["drain_ms"]) / 1e3
    assert pipe["throughput_fps"] == pytest.approx(frames / spent_s, rel=1e-9)


def test_report_json_holds_no_bare_nan():
    """A mode without inferences has NaN latencies: report.json carries them as null, valid JSON."""
    from vla_accel_ros.bench.report import json_safe

    out = json.dumps(json_safe({"p50": float("nan"), "xs": [1.0, float("inf"), (2, float("-inf"))], "n": 3}), allow_nan=False)
    assert json.loads(out) == {"p50": None, "xs": [1.0, None, [2, None]], "n": 3}
