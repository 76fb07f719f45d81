"""The trained bundles the package ships (bundles/transfer_cube-{ar,flow,ar-reasoning,smolvla}): installed, small,
loadable through the parity gate, and trained: on frames of the scripted expert they predict
the expert's next actions far better than an untrained bundle of the same shape does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, SHIPPED, WEIGHTS_FILE, read_spec, shipped_bundle

MAX_WEIGHTS = 20 * 2**20  # the repository carries them: fp16 and small (the SmolVLA one 17.1 MiB)
# Open-loop error on the held-out frames below: (at most, at least this many times below an
# untrained bundle's). Measured: ar 0.073 vs 0.43, flow 0.028 vs 0.41; the SmolVLA bundle, a
# weaker policy (68/200 where flow scores 81/100), 0.104 vs 0.394 (its predecessor: 0.115).
OPEN_LOOP_BOUND = {"transfer_cube-smolvla": (0.15, 3)}


@pytest.fixture(scope="module")
def scripted_demos():
    """``demos(name)``: two held-out seeds of the scripted expert at bundle ``name``'s cameras, one
    observation every 30 ticks (recorded once per camera set)."""
    from vla_accel_ros.bench.eval import GraphConfigs, SimRobot, record_demos
    from vla_accel_ros.core.robot.safety import default_limits

    graph = GraphConfigs.load(None)
    lo, hi = (graph.safety.lower, graph.safety.upper) if graph.safety.lower else default_limits(graph.robot)
    recorded = {}

    def demos(name):
        spec = read_spec(shipped_bundle(name))
        key = (tuple(spec.cameras), spec.image_size)
        if key not in recorded:
            robot = SimRobot("transfer_cube", key[0], graph.robot, graph.sync(spec.image_size), 480, 640)  # as recorded for training
            recorded[key] = record_demos(robot, "transfer_cube", [100007, 100008], steps=240, stride=30)  # held-out seeds
        return recorded[key], np.asarray(lo, np.float32), np.asarray(hi, np.float32)

    return demos


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_bundle_is_installed_small_and_documented(name):
    path = shipped_bundle(name)
    assert (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).stat().st_size <= MAX_WEIGHTS
    card = (path / "README.md").read_text()
    assert "vla-accel train" in card and "vla-accel eval" in card  # how it was made and measured
    assert json.loads((path / CONFIG_FILE).read_text())["name"] == name


# The autoregressive bundles' gates (about 75 s together) run with `make test-slow`: the default
# suite keeps the two flow-matching bundles the results are measured on.
GATE_SLOW = {"transfer_cube-ar", "transfer_cube-ar-reasoning"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in GATE_SLOW else n for n in SHIPPED])
def test_shipped_bundle_passes_the_gate_and_beats_an_untrained_one(name, scripted_demos):
    from vla_accel_ros.bench.eval import open_loop_error
    from vla_accel_ros.core.bundle import load_bundle
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import build_model, build_policy, load_policy

    demos, lower, upper = scripted_demos(name)
    trained = load_policy(shipped_bundle(name), PolicyConfig(accel="cache"))  # the start-up gate runs
    assert trained.parity_report.passed
    spec = load_bundle(shipped_bundle(name)).spec
    assert getattr(trained, "noise_scale", 1.0) == spec.noise_scale  # the bundle's, by default
    # Both open-loop errors with the trained sampler (noise 1): from zero noise an untrained
    # net's chunk is its mean path and errs less (SmolVLA: 0.30 against 0.40 rad), the trained
    # one about as much (0.119 against 0.115), so the bound is set at 1.
    trained.configure(trained.config.replace(flow_noise_scale=1.0))
    torch.manual_seed(0)
    untrained = build_policy(spec, build_model(spec).eval(), PolicyConfig(parity_check=False, flow_noise_scale=1.0),
                             bundle_path=str(shipped_bundle(name)))  # same shape and tokenizer, fresh weights
    got = open_loop_error(trained, demos, lower, upper)["mean_abs_rad"]
    base = open_loop_error(untrained, demos, lower, upper)["mean_abs_rad"]
    chunk = trained.infer(demos[0].frames[0][1])
    assert chunk.actions.shape == (spec.chunk_size, spec.action_dim) and np.isfinite(chunk.actions).all()
    most, factor = OPEN_LOOP_BOUND.get(name, (0.1, 4))
    assert got < most and got < base / factor, (got, base)


def test_the_shipped_reasoning_bundle_reasons_like_the_ground_truth(scripted_demos):
    """On held-out expert frames its reasoning matches the simulator's ground truth, the
    calibration it ships is used at load, and exact reuse changes nothing."""
    from vla_accel_ros.bench.reasoning import truth_words, word_agreement
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    demos, _, _ = scripted_demos("transfer_cube-ar-reasoning")
    path = shipped_bundle("transfer_cube-ar-reasoning")
    greedy = load_policy(path, PolicyConfig(parity_check=False))
    memo = load_policy(path, PolicyConfig.from_dict({"parity_check": False, "memo": {"mode": "calibrated"}}))
    assert memo.reasoning.thresholds.calibrated.min() < 0.9  # the shipped reasoning_calibration.json, not the 1.0 default
    exact = load_policy(path, PolicyConfig.from_dict({"parity_check": False, "memo": {"mode": "exact"}}))
    agree = []
    for demo in demos:
        for step, obs in demo.frames:
            a = greedy.infer(obs)
            agree.append(word_agreement(a.stats["reasoning_text"].split(), truth_words("transfer_cube", step, obs.state)))
            for _ in range(2):  # the second call on the same frame reuses everything
                b = exact.infer(obs)
                assert b.stats["action_tokens"] == a.stats["action_tokens"]
                assert b.stats["reasoning_tokens"] == a.stats["reasoning_tokens"]
            assert b.stats["reasoning_reused_fraction"] == 1.0
    assert np.mean(agree) > 0.8, agree


def test_the_shipped_flow_bundle_grasps_in_closed_loop(tmp_path):
    """The reference policy does the task, not only the expert's next actions: four held-out
    seeds in the simulator through `vla-accel eval`. Measured on seeds 100000..100099: lifted
    97, transferred 81; these four all transferred. The bounds leave room for another CPU's
    rounding to change a rollout (the superseded bundle lifted the cube on 13 of 100 seeds)."""
    pytest.importorskip("gym_aloha")
    from vla_accel_ros.cli import main

    out = tmp_path / "eval"
    argv = ["eval", "--bundle", str(shipped_bundle("transfer_cube-flow")), "--episodes", "4", "--seed", "100000",
            "--modes", "baseline", "--open-loop-episodes", "0", "--threads", "1", "--no-plots", "--no-progress",
            "--report", str(out)]  # fmt: skip
    assert main(argv) == 0
    stages = {s["name"]: s["reached"] for s in json.loads((out / "report.json").read_text())["modes"]["baseline"]["stages"]}
    assert stages["lifted"] >= 3 and stages["transferred"] >= 1, stages
