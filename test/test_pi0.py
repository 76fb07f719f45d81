"""The ``pi0`` family: LeRobot 0.3.3 pi0 checkpoints imported and computed as LeRobot computes them
(its own outputs in ``../shared/fixtures/pi0-lerobot``), on the package's engine.

The fixture lives in ../shared only (CI has it): without it every test here skips and says so;
with ``VLA_ACCEL_REQUIRE_SHARED=1`` (CI) they fail instead (test/helpers.py, ``shared_fixture``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import helpers  # test/helpers.py
import numpy as np
import pytest
import torch

from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import preset
from vla_accel_ros.models.factory import load_policy
from vla_accel_ros.models.pi0.lerobot_import import import_lerobot
from vla_accel_ros.models.reference import check_fixture, fixture_observation, load_fixture

FIXTURE = helpers.SHARED_FIXTURES / "pi0-lerobot"


@pytest.fixture(scope="module", autouse=True)
def _the_fixture():
    """Every test here reads LeRobot's pi0 outputs from ../shared (18 MB, not in the repository):
    without it they skip, saying the pi0 family goes unchecked; in CI they fail instead. Module
    scope: it must run before the module-scoped ``bundle`` reads the fixture (a function-scoped
    check ran after it, and a checkout without ../shared errored instead of skipping)."""
    helpers.shared_fixture("pi0-lerobot", "the pi0 family (import, parity with LeRobot, bf16, replay)")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # The fixture's SigLIP is 128 wide with 4 heads: not in its weights (So400m's 1152 is).
    out = tmp_path_factory.mktemp("pi0") / "bundle"
    return import_lerobot(FIXTURE / "policy", out, tokenizer=FIXTURE / "tokenizer", vision_heads=4)


def test_the_imported_bundle_computes_what_lerobot_computes(bundle):
    """The raw observation -> LeRobot's actions in robot units (fp32, 1e-4 of the action std), every
    intermediate of the fixture on the way; the start-up gate passes with every token method."""
    torch.set_num_threads(1)
    fx = load_fixture(FIXTURE)
    policy = load_policy(bundle, PolicyConfig(parity_check=False))
    report = check_fixture(policy, fx, 1e-4)
    assert report.passed, report.table()
    assert report.metrics["debug.x_0_padded_rel"] < 1e-4 and report.metrics["debug.prefix_kv_layer0_keys_rel"] < 1e-4
    for accel in ("none", "cache", "prune", "cache+prune"):
        gated = load_policy(bundle, PolicyConfig.from_dict({"accel": accel, "parity_tolerance": 1e-4}))
        assert gated.parity_report.passed, (accel, gated.parity_report.table())


def test_bf16_lands_within_lerobots_own_bf16_difference(bundle, bf16_cpu):
    """Unmodified LeRobot runs pi0 in bf16: its actions differ from the fp32 reference by up to
    0.025 (normalized). Ours with the LM and the expert in bf16, and with ``auto``, stay within that."""
    from safetensors.torch import load_file

    t = load_file(str(FIXTURE / "fixture.safetensors"))
    native = float((t["output.lerobot_native_bf16.actions_normalized"] - t["output.actions_normalized"]).abs().max())
    fx = load_fixture(FIXTURE)
    for name in ("bf16", "auto"):
        policy = load_policy(bundle, PolicyConfig.from_dict({"precision": preset(name)}))
        assert policy.precision.reduced and policy.parity_report.passed
        got = policy.infer(fixture_observation(policy, fx), noise=fx.noise).actions
        _, scale = policy.action_scale()
        assert float(np.abs((got - fx.actions) / scale).max()) <= native, name


def test_both_key_layouts_import_to_the_same_weights(bundle, tmp_path):
    """Published checkpoints name the tensors as older transformers did (``paligemma.language_model.model``,
    ``paligemma.vision_tower``, ``language_model.lm_head``); LeRobot renames them on load, so do we."""
    from safetensors.torch import load_file, save_file

    old = tmp_path / "old"
    shutil.copytree(FIXTURE / "policy", old)
    state = load_file(str(old / "model.safetensors"))
    renamed = {}
    for k, v in state.items():
        k = k.replace(".paligemma.model.language_model", ".paligemma.language_model.model")
        k = k.replace(".paligemma.lm_head", ".paligemma.language_model.lm_head")
        k = k.replace(".paligemma.model.vision_tower", ".paligemma.vision_tower")
        k = k.replace(".paligemma.model.multi_modal_projector", ".paligemma.multi_modal_projector")
        renamed[k] = v
    os.chmod(old / "model.safetensors", 0o644)
    save_file(renamed, str(old / "model.safetensors"))
    again = import_lerobot(old, tmp_path / "b", tokenizer=FIXTURE / "tokenizer", vision_heads=4)
    a, b = load_file(str(bundle / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_import_names_what_it_cannot_infer_or_find(tmp_path):
    with pytest.raises(ConfigError, match="SigLIP's head count is not in its weights .* pass --vision-heads N"):
        import_lerobot(FIXTURE / "policy", tmp_path / "a", tokenizer=FIXTURE / "tokenizer")
    with pytest.raises(BundleError, match="google/paligemma-3b-pt-224.*pass --tokenizer DIR"):
        import_lerobot(FIXTURE / "policy", tmp_path / "b", vision_heads=4)
    cfg = json.loads((FIXTURE / "policy" / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURE / "policy", bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "use_delta_joint_actions_aloha": True}))
    with pytest.raises(ConfigError, match="use_delta_joint_actions_aloha"):
        import_lerobot(bad, tmp_path / "c", tokenizer=FIXTURE / "tokenizer", vision_heads=4)
    assert not any((tmp_path / n).exists() for n in "abc")


def test_an_imported_bundle_replays_and_closes_the_loop(bundle, tmp_path, ros_params_file):
    """``vla-accel replay`` (three simulator cameras at their own size) and ``vla-accel bringup
    --synthetic-camera`` run the pi0 bundle unchanged."""
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    bag = tmp_path / "bag"
    assert main(["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "3", "--cameras",
                 "top,left_wrist,right_wrist", "--height", "96", "--width", "128", "--out", str(bag)]) == 0  # fmt: skip
    report = tmp_path / "report"
    assert main(["replay", str(bag), "--bundle", str(bundle), "--modes", "transformers,baseline,cache+prune", "--warmup", "1",
                 "--report", str(report), "--no-progress", "--no-plots"]) == 0  # fmt: skip
    rep = json.loads((report / "report.json").read_text())
    assert rep["bundle"]["family"] == "pi0" and rep["modes"]["transformers"]["deviation"]["max_over_std"] < 1e-3
    helpers.bringup_summary(bundle, ros_params_file, tmp_path)
