"""The ``pi05`` family: LeRobot 0.4.4 pi0.5 checkpoints imported and computed as LeRobot computes
them, on the package's engine, and every method on a random-weight pi0.5 bundle.

Fixtures: ``test/fixtures/pi05/*`` (two settings: cameras, state / action sizes, chunk length,
normalization, a truncated prompt), made with LeRobot's own ``pi05`` by ``make_fixtures.py``
there, in the side venv of ``install_pi05_venv.sh`` (transformers 4.53.2 with openpi's adaRMS
files). The slow test regenerates them where that venv exists.
"""

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

from vla_accel_ros.core.errors import BundleError, ConfigError, PlanError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import preset
from vla_accel_ros.models.factory import load_policy
from vla_accel_ros.models.pi05.lerobot_import import import_lerobot
from vla_accel_ros.models.pi05.modeling_pi05 import discretize_state, state_prompt
from vla_accel_ros.models.reference import check_fixture, fixture_observation, load_fixture

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "test" / "fixtures" / "pi05"
FIXTURES = {p.name: p for p in sorted(LOCAL.iterdir()) if (p / "fixture.json").is_file()}
PI05_PY = Path(os.environ.get("LEROBOT_PI05_PYTHON", "/tmp/lerobot-pi05-venv/bin/python"))


def _import(name: str, out: Path, **kw) -> Path:
    fx = FIXTURES[name]
    # The fixtures' SigLIP is 32 wide with 2 heads: not in its weights (So400m's 1152 is).
    return import_lerobot(fx / "policy", out, tokenizer=fx / "tokenizer", **{"vision_heads": 2, **kw})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi05")
    return {name: _import(name, root / name) for name in FIXTURES}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A random-weight tiny pi0.5 bundle, two cameras (written by the CLI)."""
    out = tmp_path_factory.mktemp("pi05demo") / "b"
    proc = subprocess.run([sys.executable, "-m", "vla_accel_ros.cli", "bundle", "create-demo", "--family", "pi05", "--size",
                           "tiny", "--cameras", "cam_high,cam_left_wrist", "--chunk-size", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "the flow time through adaRMS" in proc.stdout
    return out


def test_there_are_fixtures_of_two_settings():
    assert {"two_cameras_aloha", "one_camera_meanstd"} <= set(FIXTURES)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_imported_bundle_computes_what_lerobot_computes(imported, name):
    """The raw observation -> LeRobot's actions in robot units (fp32, 1e-4 of the action spread),
    every intermediate of the fixture on the way, LeRobot's prompt and token ids; the start-up
    gate passes with every token method."""
    torch.set_num_threads(1)
    fx = load_fixture(FIXTURES[name])
    meta = json.loads((FIXTURES[name] / "fixture.json").read_text())
    policy = load_policy(imported[name], PolicyConfig(parity_check=False))
    report = check_fixture(policy, fx, 1e-4)
    assert report.passed, report.table()
    for key in ("x_0_padded", "v_t_step0", "adarms_cond_t1", "state_padded", "prefix_kv_layer0_keys", "image0_features"):
        assert report.metrics[f"debug.{key}_rel"] < 1e-4, key
    obs = fixture_observation(policy, fx)
    assert policy.prompt(obs.instruction, obs.state) == meta["prompt"]
    _, ids = policy.layout_of(obs)
    from safetensors.torch import load_file

    t = load_file(str(FIXTURES[name] / "fixture.safetensors"))
    valid = t["input.language.attention_mask"][0].bool()
    assert ids == t["input.language.tokens"][0][valid].tolist()  # truncated where LeRobot truncates
    for accel in ("none", "cache", "prune", "cache+prune"):
        gated = load_policy(imported[name], PolicyConfig.from_dict({"accel": accel, "parity_tolerance": 1e-4}))
        assert gated.parity_report.passed, (accel, gated.parity_report.table())


def test_the_state_is_written_into_the_prompt_as_lerobot_writes_it():
    """256 bins over [-1, 1] (np.digitize: below -1 is -1, from 1 - 1/128 on 255); the task
    stripped, ``_`` and newlines as spaces."""
    x = np.array([-3.0, -1.0, -0.9921875, -0.99, 0.0, 0.9921874, 0.9921875, 1.0, 5.0], dtype=np.float32)
    assert discretize_state(x).tolist() == [-1, 0, 1, 1, 128, 254, 255, 255, 255]
    assert state_prompt(" pick_up\nthe cube ", np.array([0, 255, -1])) == "Task: pick up the cube, State: 0 255 -1;\nAction: "


def test_the_saved_preprocessor_sets_how_many_state_values_the_prompt_holds(imported):
    """LeRobot's state step saves no config: a reloaded pipeline writes 32 values whatever the
    policy's max_state_dim (8 in this fixture), and so does the import."""
    src = json.loads((imported["one_camera_meanstd"] / "source.json").read_text())
    assert src["lerobot_config"]["max_state_dim"] == 8 and src["prompt_state_dim"] == 32
    spec = load_policy(imported["one_camera_meanstd"], PolicyConfig(parity_check=False)).spec
    assert spec.options["max_state_dim"] == 32 and spec.max_text_tokens == 64


def test_import_names_what_it_cannot_infer_or_run(tmp_path):
    from safetensors.torch import load_file, save_file

    name = "two_cameras_aloha"
    with pytest.raises(ConfigError, match="SigLIP's head count is not in its weights .* pass --vision-heads N"):
        _import(name, tmp_path / "a", vision_heads=None)
    with pytest.raises(BundleError, match="google/paligemma-3b-pt-224.*pass --tokenizer DIR"):
        import_lerobot(FIXTURES[name] / "policy", tmp_path / "b", vision_heads=2)
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES[name] / "policy", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "image_resolution": [112, 96]}))
    with pytest.raises(ConfigError, match=r"image_resolution=\[112, 96\]: PaliGemma reads square images"):
        import_lerobot(bad, tmp_path / "c", tokenizer=FIXTURES[name] / "tokenizer", vision_heads=2)
    (bad / "config.json").write_text(json.dumps({**cfg, "type": "pi0"}))
    with pytest.raises(BundleError, match="type='pi0'; this importer reads LeRobot pi05 checkpoints"):
        import_lerobot(bad, tmp_path / "d", tokenizer=FIXTURES[name] / "tokenizer", vision_heads=2)
    (bad / "config.json").write_text(json.dumps(cfg))
    state = {k: v for k, v in load_file(str(bad / "model.safetensors")).items() if ".norm.dense." not in k}
    os.chmod(bad / "model.safetensors", 0o644)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(BundleError, match="no adaptive norms"):
        import_lerobot(bad, tmp_path / "e", tokenizer=FIXTURES[name] / "tokenizer", vision_heads=2)
    assert not any((tmp_path / n).exists() for n in "abcde")


def test_the_engine_takes_the_condition_of_adaptive_norms_only(demo):
    """The expert's norms are adaptive: a forward without the condition is refused, and a plain
    decoder refuses one (a condition silently ignored would be a wrong model)."""
    policy = load_policy(demo, PolicyConfig(parity_check=False))
    assert policy.expert_stack.adaptive and not policy.vlm_stack.adaptive
    plan = policy.expert_plan(4)
    x = torch.zeros(1, policy.spec.chunk_size, policy.expert_stack.hidden_size)
    with pytest.raises(PlanError, match="adaptive: its forward needs the condition"):
        policy.expert_engine.forward(x, plan)
    rows = torch.arange(4)
    with pytest.raises(PlanError, match="cond given, but this decoder's norms are plain"):
        policy.vlm_engine.forward(torch.zeros(1, 4, policy.vlm_stack.hidden_size), plan.__class__(slots=rows, positions=rows),
                                  cond=torch.zeros(1, policy.expert_stack.cond_dim))  # fmt: skip


def test_every_method_runs_on_a_demo_bundle(demo, bf16_cpu):
    """The gate passes with the token cache (vision reuse too), pruning and precision ``auto``;
    the compiled expert step (a backend without code generation: the graph and its condition
    input are exercised) gives the eager actions, with and without pruned prefix tokens; Real-Time
    Chunking guidance runs through the adaptive expert (eager, autograd)."""
    from vla_accel_ros.core.compiled import CompiledEngine
    from vla_accel_ros.core.types import ChunkGuidance

    torch.set_num_threads(1)
    cache = {"relevance_mode": "off", "topk_reuse": 64, "reuse_vision": True}
    policy = load_policy(demo, PolicyConfig.from_dict({"accel": "cache", "cache": cache}))
    assert policy.parity_report.passed and policy.parity_report.metrics["accel_tokens_reused"] > 0
    pruned = load_policy(demo, PolicyConfig.from_dict({"accel": "prune"}))
    assert pruned.parity_report.passed and pruned.parity_report.metrics["accel_tokens_pruned"] > 0
    auto = load_policy(demo, PolicyConfig.from_dict({"precision": preset("auto")}))
    assert auto.precision.reduced and auto.parity_report.passed, auto.parity_report.table()

    for accel in ("none", "cache+prune"):
        cfg = PolicyConfig(parity_check=False, accel=accel)
        eager, compiled = load_policy(demo, cfg), load_policy(demo, cfg)
        compiled.expert_engine = CompiledEngine(compiled.expert_stack, compiled.cache, max_positions=compiled.max_slots,
                                                backend="aot_eager")  # fmt: skip
        obs, noise, a = helpers.assert_same_actions_on_gate_frames(eager, compiled)
        assert compiled.expert_engine.static_calls == 2 * eager.num_steps
    h = eager.spec.chunk_size
    guide = ChunkGuidance(prev_actions=a.actions + 0.5, weights=np.linspace(1, 0, h).astype(np.float32), frozen=3)
    guided = compiled.infer(obs, noise=noise, guidance=guide).actions
    np.testing.assert_allclose(guided, eager.infer(obs, noise=noise, guidance=guide).actions, atol=1e-5)
    assert compiled.expert_engine.static_calls == 2 * eager.num_steps  # guided steps ran eager
    np.testing.assert_array_equal(guided[:3], guide.prev_actions[:3])  # the frozen part is the old chunk
    plain = eager.infer(obs, noise=noise).actions
    assert np.abs(guided[3:10] - plain[3:10]).max() > 1e-3  # guidance pulls the next steps


def test_the_prompt_follows_the_state(imported):
    """The state is text: another state, other token ids (the same layout while the count holds);
    bins written with other digit counts (one token per digit) give another layout."""
    from dataclasses import replace

    from vla_accel_ros.core.parity import fixed_observation

    policy = load_policy(imported["two_cameras_aloha"], PolicyConfig(parity_check=False))
    st = policy.spec.norm_stats["state"]
    q01, q99 = (np.asarray(st[k], np.float32) for k in ("q01", "q99"))
    obs = fixed_observation(policy.spec)
    a = policy.layout_of(replace(obs, state=q01 + 0.75 * (q99 - q01)))  # normalized 0.5: bin 192
    b = policy.layout_of(replace(obs, state=q01 + 0.8 * (q99 - q01)))  # 0.6: bin 204
    c = policy.layout_of(replace(obs, state=q01 - 1.0))  # below -1: bin -1
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0].length < a[0].length


def test_an_imported_bundle_replays_evaluates_and_closes_the_loop(imported, demo, tmp_path, ros_params_file):
    """``vla-accel replay`` (two simulator cameras at their own size), ``vla-accel eval`` (one
    short closed-loop episode) and ``vla-accel bringup --synthetic-camera`` (the policy node with
    ``bundle:=``) run pi0.5 bundles unchanged."""
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    bundle = imported["two_cameras_aloha"]
    bag = tmp_path / "bag"
    assert main(["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "4", "--cameras",
                 "top,left_wrist", "--height", "96", "--width", "128", "--out", str(bag)]) == 0  # fmt: skip
    report = tmp_path / "report"
    modes = "transformers,baseline,cache,prune,cache+prune,baseline@auto"
    assert main(["replay", str(bag), "--bundle", str(bundle), "--modes", modes, "--warmup", "1", "--report", str(report),
                 "--no-progress", "--no-plots", "--precision", "gate_flow_max_over_std=0.2"]) == 0  # fmt: skip
    rep = json.loads((report / "report.json").read_text())
    assert rep["bundle"]["family"] == "pi05" and rep["modes"]["transformers"]["deviation"]["max_over_std"] < 1e-4
    assert rep["modes"]["prune"]["tokens_kept_fraction"]["mean"] < 1.0
    ev = tmp_path / "eval"
    assert main(["eval", "--bundle", str(demo), "--episodes", "1", "--steps", "8", "--modes", "baseline,cache", "--report",
                 str(ev), "--open-loop-episodes", "1", "--open-loop-stride", "4", "--height", "120", "--width", "160",
                 "--no-progress", "--no-plots", "--no-parity"]) == 0  # fmt: skip
    ev_rep = json.loads((ev / "report.json").read_text())
    assert all(m["inferences_per_episode"] >= 1 for m in ev_rep["modes"].values())
    # Its chunk is 10 actions (200 ms). In one process inference competes with the camera and
    # control callbacks for the interpreter: on a 2-core AVX2 EPYC it took 288 ms and every chunk
    # arrived after its last action (0 commands); each node in its own process, 140 ms.
    helpers.bringup_summary(bundle, ros_params_file, tmp_path, one_process=False)


@pytest.mark.slow
def test_the_fixtures_regenerate_bit_exactly_with_lerobot(tmp_path):
    """LeRobot's pi05 itself (its side venv with openpi's transformers files) rewrites
    test/fixtures/pi05 identically."""
    if not PI05_PY.is_file():
        pytest.skip(f"LeRobot pi05's side venv is missing ({PI05_PY}; test/fixtures/pi05/install_pi05_venv.sh)")
    proc = subprocess.run([str(PI05_PY), str(LOCAL / "make_fixtures.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    for name, fx in FIXTURES.items():
        for file in ("fixture.safetensors", "policy/model.safetensors"):
            a, b = load_file(str(fx / file)), load_file(str(tmp_path / name / file))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, file)
