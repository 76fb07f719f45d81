"""The ``smolvla`` family: LeRobot SmolVLA checkpoints imported and computed exactly as LeRobot
computes them (its own outputs in reference fixtures), on the package's engine.

Fixtures: ``../shared/fixtures/smolvla-lerobot`` (LeRobot's defaults, 3 cameras, 512 px) and
``test/fixtures/smolvla/*`` (other settings of the options that change the forward pass, made
with LeRobot by ``test/fixtures/smolvla/make_fixtures.py``). The slow test regenerates the
latter with LeRobot itself where its side venv exists.
"""

from __future__ import annotations

import json
import os
import re
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
from vla_accel_ros.models.factory import inspect_bundle, load_policy
from vla_accel_ros.models.reference import check_fixture, fixture_observation, load_fixture
from vla_accel_ros.models.smolvla.configuration_smolvla import SmolVLAOptions
from vla_accel_ros.models.lerobot.reader import SOURCE_FILE
from vla_accel_ros.models.smolvla.lerobot_import import import_lerobot

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "test" / "fixtures" / "smolvla"
SHARED = helpers.SHARED_FIXTURES / "smolvla-lerobot"
LEROBOT_PY = Path(os.environ.get("LEROBOT_PYTHON", "/tmp/lerobot-venv/bin/python"))
FIXTURES = {p.name: p for p in sorted(LOCAL.iterdir()) if (p / "fixture.json").is_file()}
if (SHARED / "fixture.json").is_file():
    FIXTURES["shared"] = SHARED


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vla_accel_ros.cli", *argv], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every fixture's LeRobot checkpoint imported into a bundle (the library call the CLI makes)."""
    root = tmp_path_factory.mktemp("smolvla")
    return {name: import_lerobot(fx / "policy", root / name) for name, fx in FIXTURES.items()}


def test_the_shared_fixture_is_there():
    """CI runs with ../shared beside the checkout: the LeRobot-defaults fixture must be checked."""
    helpers.shared_fixture(SHARED.name, "SmolVLA at LeRobot's defaults (3 cameras, 512 px)")
    assert "shared" in FIXTURES and len(FIXTURES) >= 4


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_imported_bundle_computes_what_lerobot_computes(imported, name):
    """Raw observation as the policy node builds it (images [h, w, 3], the state vector, the
    task text) -> actions in robot units equal to LeRobot's ``output.actions``, fp32, 1e-4 in
    units of the action spread; every intermediate the fixture carries agrees on the way."""
    torch.set_num_threads(1)
    fx = load_fixture(FIXTURES[name])
    cameras = json.loads((imported[name] / SOURCE_FILE).read_text())["cameras"]
    policy = load_policy(imported[name], PolicyConfig(parity_check=False))
    report = check_fixture(policy, fx, 1e-4, cameras)
    assert report.passed, report.table()
    got = policy.infer(fixture_observation(policy, fx, cameras), noise=fx.noise).actions
    assert np.abs(got - fx.actions).max() < 1e-4 * max(1.0, float(np.abs(fx.actions).max()))
    # ... and the policy's own start-up gate passes (engine vs its reference forward).
    gated = load_policy(imported[name], PolicyConfig(parity_check=True, parity_tolerance=1e-4))
    assert gated.parity_report.passed, gated.parity_report.table()


def test_parity_cli_passes_the_fixture_and_fails_loud_on_a_wrong_one(tmp_path):
    name = "shared" if "shared" in FIXTURES else sorted(FIXTURES)[0]
    bundle = tmp_path / "bundle"
    proc = _cli("bundle", "import", "--lerobot", str(FIXTURES[name] / "policy"), "--out", str(bundle))
    assert proc.returncode == 0, proc.stderr
    assert "family smolvla" in proc.stdout and "tokenizer   bundle" in proc.stdout
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json", "model.safetensors", SOURCE_FILE, "tokenizer"]
    proc = _cli("parity", "--bundle", str(bundle), "--reference", str(FIXTURES[name]))
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr
    # One camera mirrored in the reference's inputs: the actions (and its first intermediate) differ.
    from safetensors.torch import load_file, save_file

    wrong = tmp_path / "wrong"
    shutil.copytree(FIXTURES[name], wrong, ignore=shutil.ignore_patterns("policy", "vlm"))
    tensors = load_file(str(wrong / "fixture.safetensors"))
    key = next(k for k in tensors if k.startswith("raw.observation.images."))
    tensors[key] = tensors[key].flip(-1).contiguous()
    save_file(tensors, str(wrong / "fixture.safetensors"))
    proc = _cli("parity", "--bundle", str(bundle), "--reference", str(wrong))
    assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout + proc.stderr
    if name == "shared":  # it carries debug.* intermediates: the first that differs is named
        assert "first intermediate that differs: debug.image0_after_resize_with_pad_and_2x_minus_1" in proc.stdout


def _lerobot_copy(tmp_path: Path, **changes) -> Path:
    src = FIXTURES["self_attn_one_camera"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg_path = dst / "policy" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    return dst / "policy"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"type": "pi0"}, "type='pi0'; this importer reads LeRobot smolvla checkpoints"),
        ({"use_delta_joint_actions_aloha": True}, "use_delta_joint_actions_aloha=true: LeRobot itself does not implement it"),
        ({"resize_imgs_with_padding": [128, 96]}, r"resize_imgs_with_padding=\[128, 96\]: SmolVLM's pixel shuffle needs a square"),
        ({"normalization_mapping": {"VISUAL": "MEAN_STD", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}, "normalization_mapping.VISUAL=MEAN_STD"),
        ({"vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"}, "vlm_model_name='HuggingFaceTB/SmolVLM2-500M-Video-Instruct'.*--vlm DIR"),
        ({"num_expert_layers": 2}, "num_expert_layers=2 must divide the VLM's 3 layers"),
    ],
)
def test_import_refuses_what_lerobot_cannot_run_naming_the_option(tmp_path, changes, message):
    with pytest.raises((BundleError, ConfigError), match=message):
        import_lerobot(_lerobot_copy(tmp_path, **changes), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_finds_the_vlm_by_option_and_never_overwrites(tmp_path):
    policy = _lerobot_copy(tmp_path, vlm_model_name="somewhere/else")
    out = import_lerobot(policy, tmp_path / "b", vlm=policy.parent / "vlm", name="one-cam")
    assert "name        one-cam (family smolvla)" in inspect_bundle(out)
    with pytest.raises(BundleError, match="exists already"):
        import_lerobot(policy, tmp_path / "b", vlm=policy.parent / "vlm")


def test_layer_plan_follows_lerobots_rules():
    """What each VLM layer does while denoising, and the combinations LeRobot cannot run."""
    kinds = lambda o, n: "".join(s.kind[0] for s in o.layer_plan(n))  # noqa: E731
    assert kinds(SmolVLAOptions(), 16) == "sc" * 8  # published SmolVLA: self every 2nd layer
    assert kinds(SmolVLAOptions(attention_mode="self_attn"), 4) == "ssss"
    plan = SmolVLAOptions(num_expert_layers=2, self_attn_every_n_layers=4).layer_plan(4)
    assert [(s.expert_layer, s.kind) for s in plan] == [(0, "self"), (-1, "skip"), (1, "cross"), (-1, "skip")]
    with pytest.raises(ConfigError, match="VLM layer 1 is a self-attention layer with no expert layer"):
        SmolVLAOptions(num_expert_layers=2, self_attn_every_n_layers=1).layer_plan(4)
    # LeRobot gives expert layer 1 VLM-width K/V maps (1 % 2 != 0) but runs it as self-attention at VLM layer 2.
    with pytest.raises(ConfigError, match="expert layer 1 runs self-attention at VLM layer 2 but its K/V maps take 64 inputs"):
        SmolVLAOptions(num_expert_layers=2, self_attn_every_n_layers=2).check_kv_widths(4, expert_hidden=48, vlm_kv_width=64)


def test_no_family_branches_outside_the_family_modules():
    """Families are plug-ins: nothing outside their modules asks which family a bundle is."""
    pattern = re.compile(r"""family\s*[!=]=\s*["'](ar|flow|smolvla|pi0|pi05)["']""")
    family_modules = {"models/ar.py", "models/flow.py"}  # and the packages models/smolvla, models/pi0, models/pi05
    bad = []
    for path in sorted((REPO / "vla_accel_ros").rglob("*.py")):
        rel = path.relative_to(REPO / "vla_accel_ros").as_posix()
        if rel in family_modules or rel.startswith(("models/smolvla/", "models/pi0/", "models/pi05/")):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_a_random_smolvla_demo_bundle_runs_the_engine_against_its_reference(tmp_path):
    """``bundle create-demo --family smolvla``: the SmolVLA architecture with random weights (no
    checkpoint needed), through the start-up gate with the token cache and pruning."""
    proc = _cli("bundle", "create-demo", "--family", "smolvla", "--size", "tiny", "--cameras", "cam_high,cam_left_wrist",
                "--out", str(tmp_path / "demo"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for accel in ("none", "cache", "prune", "cache+prune"):
        policy = load_policy(tmp_path / "demo", PolicyConfig.from_dict({"accel": accel}))
        assert policy.parity_report.passed, (accel, policy.parity_report.table())
    cache = {"relevance_mode": "off", "topk_reuse": 64, "reuse_vision": True}
    policy = load_policy(tmp_path / "demo", PolicyConfig.from_dict({"accel": "cache", "cache": cache}))
    assert policy.parity_report.passed and policy.parity_report.metrics["accel_tokens_reused"] > 0


def test_the_vision_cache_recomputes_a_fresh_tokens_block_of_patches(tmp_path):
    """A SmolVLA token merges a block of s x s patches (pixel shuffle): the vision cache runs a
    fresh token's whole block through the encoder (attending to every patch's K/V) and maps the
    block to the token; with every token fresh it is the stock tower's forward, with the same
    pixels a partial pass gives the full pass's embeddings, and stale tokens keep theirs."""
    from vla_accel_ros.models.factory import build_model, demo_spec
    from vla_accel_ros.models.vision import VisionCache

    torch.manual_seed(0)
    vis = build_model(demo_spec("smolvla", "tiny")).vis.eval()  # 128 px, 16 px patches, 2 x 2 shuffle
    assert (vis.num_patches, vis.num_tokens) == (64, 16)
    assert vis.token_patches(torch.tensor([0, 5])).tolist() == [0, 1, 8, 9, 18, 19, 26, 27]
    cache = VisionCache(vis, cameras=1)
    a, b = torch.randn(1, 3, 128, 128), torch.randn(1, 3, 128, 128)
    fresh = torch.zeros(1, 16, dtype=torch.bool)
    fresh[0, [3, 9, 10]] = True
    with torch.inference_mode():
        first = cache.embed(a, [0], None).clone()
        assert torch.allclose(first, vis(a), atol=1e-5) and cache.computed == 64
        same = cache.embed(a, [0], fresh)
        assert cache.computed == 12 and torch.allclose(same, first, atol=1e-5)
        mixed = cache.embed(b, [0], fresh)
    assert torch.equal(mixed[0, ~fresh[0]], first[0, ~fresh[0]])
    assert not torch.allclose(mixed[0, fresh[0]], first[0, fresh[0]])


@pytest.mark.slow
def test_the_local_fixtures_regenerate_bit_exactly_with_lerobot(tmp_path):
    """LeRobot itself (its side venv) rewrites test/fixtures/smolvla identically."""
    if not LEROBOT_PY.is_file():
        pytest.skip(f"LeRobot's side venv is missing ({LEROBOT_PY}; ../shared/tools/lerobot-reference/install_lerobot_venv.sh)")
    proc = subprocess.run([str(LEROBOT_PY), str(LOCAL / "make_fixtures.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    for name in (n for n in FIXTURES if n != "shared"):
        for file in ("fixture.safetensors", "training.safetensors"):
            a, b = load_file(str(FIXTURES[name] / file)), load_file(str(tmp_path / name / file))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, file)


@pytest.fixture(scope="module")
def two_camera_bundle(imported):
    """The 2-camera, 14-joint ALOHA-shaped fixture's bundle (cam_high, cam_left_wrist)."""
    return imported["fewer_experts_special_tokens"]


def test_an_imported_bundle_replays_a_simulator_bag_in_every_mode(two_camera_bundle, tmp_path):
    """``vla-accel replay`` runs the bundle unchanged: two cameras of a simulator bag at their own
    size (the policy pads them to 128 px), the gate on the bag's frames, the plain reference,
    the token cache and pruning."""
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    bag = tmp_path / "bag"
    argv = ["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "6", "--cameras", "top,left_wrist",
            "--height", "96", "--width", "128", "--out", str(bag)]  # fmt: skip
    assert main(argv) == 0
    report = tmp_path / "report"
    argv = ["replay", str(bag), "--bundle", str(two_camera_bundle), "--modes", "transformers,baseline,cache,prune,cache+prune",
            "--warmup", "1", "--report", str(report), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((report / "report.json").read_text())
    assert rep["bundle"]["family"] == "smolvla" and rep["frames"] == 5
    modes = rep["modes"]
    assert modes["transformers"]["deviation"]["max_over_std"] < 1e-4  # the reference path and the engine agree
    assert modes["prune"]["tokens_kept_fraction"]["mean"] < 1.0 and modes["baseline"]["tokens_kept_fraction"]["mean"] == 1.0


def test_an_imported_bundle_closes_the_loop_under_bringup(two_camera_bundle, tmp_path, ros_params_file):
    """``vla-accel bringup --synthetic-camera``: two synthetic cameras at the bundle's size, the
    policy node runs the imported bundle (``bundle:=``) and the controller executes its chunks."""
    s = helpers.bringup_summary(two_camera_bundle, ros_params_file, tmp_path)
    assert s["camera_node"]["observations"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [False, True], ids=["interleaved", "sequential"])
def test_bench_lerobot_runs_lerobot_and_ours_on_the_same_frames(two_camera_bundle, tmp_path, sequential):
    """``vla-accel bench lerobot`` with LeRobot's side venv: both sides on a simulator bag's
    frames (interleaved, or ours first and then LeRobot); our fp32 baseline equals LeRobot's
    actions (1e-4 std), every mode reports its speedup over LeRobot (the ratio of the p50s)."""
    if not LEROBOT_PY.is_file():
        pytest.skip(f"LeRobot's side venv is missing ({LEROBOT_PY})")
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    bag = tmp_path / "bag"
    assert main(["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "4", "--cameras",
                 "top,left_wrist", "--height", "96", "--width", "128", "--out", str(bag)]) == 0  # fmt: skip
    fx = FIXTURES["fewer_experts_special_tokens"]
    report = tmp_path / "report"
    argv = ["bench", "lerobot", "--lerobot", str(fx / "policy"), "--vlm", str(fx / "vlm"), "--python", str(LEROBOT_PY),
            "--bag", str(bag), "--bundle", str(two_camera_bundle), "--max-frames", "3", "--threads", "1",
            "--modes", "baseline,cache+prune", "--report", str(report)] + ["--sequential"] * sequential  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((report / "report.json").read_text())
    assert rep["frames"] == 3 and rep["lerobot"]["latency_ms"]["p50"] > 0 and rep["sequential"] == sequential
    assert rep["modes"]["baseline"]["deviation_vs_lerobot"]["max_over_std"] < 1e-4
    le_p50 = rep["lerobot"]["latency_ms"]["p50"]
    for name, m in rep["modes"].items():  # LeRobot's p50 over the mode's, as report.md prints it
        assert m["gate"]["passed"], name
        assert m["speedup_vs_lerobot"] == pytest.approx(le_p50 / m["latency_ms"]["p50"]), name
        assert f"| {m['speedup_vs_lerobot']:.2f}x |" in (report / "report.md").read_text(), name
    assert (report / "report.md").read_text().count("| LeRobot |") == 1 and (report / "latency.png").is_file()


def test_the_compiled_expert_step_matches_the_eager_one(tmp_path):
    """``precision.compile``: the expert's step as one graph (here a backend without code
    generation: the graph and its inlined attention are exercised) gives the eager actions,
    with and without pruned prefix tokens; guidance (autograd) stays eager."""
    from vla_accel_ros.core.types import ChunkGuidance
    from vla_accel_ros.models.factory import create_demo_bundle
    from vla_accel_ros.models.smolvla.expert import ExpertEngine

    path = create_demo_bundle("smolvla", "tiny", tmp_path / "b", cameras=("cam_high", "cam_left_wrist"))
    for accel in ("none", "cache+prune"):
        cfg = PolicyConfig(parity_check=False, accel=accel)
        eager, compiled = load_policy(path, cfg), load_policy(path, cfg)
        old = compiled.expert_engine
        compiled.expert_engine = ExpertEngine(
            compiled.model.expert, compiled.options.layer_plan(4), compiled.cache, max_positions=old.step.cos.shape[0],
            compile=True, backend="aot_eager",
        )  # fmt: skip
        obs, noise, a = helpers.assert_same_actions_on_gate_frames(eager, compiled)
        assert compiled.expert_engine.static_calls == 2 * eager.num_steps
    guide = ChunkGuidance(prev_actions=a.actions, weights=np.ones(eager.spec.chunk_size, np.float32), frozen=0)
    np.testing.assert_allclose(compiled.infer(obs, noise=noise, guidance=guide).actions,
                               eager.infer(obs, noise=noise, guidance=guide).actions, atol=1e-5)  # fmt: skip
    assert compiled.expert_engine.static_calls == 2 * eager.num_steps  # guided steps ran eager


# -- training here, export to LeRobot ---------------------------------------------------------------
TRAINING = sorted(n for n, p in FIXTURES.items() if (p / "training.safetensors").is_file())


@pytest.mark.parametrize("name", TRAINING)
def test_the_training_loss_is_lerobots(imported, name):
    """``training_loss`` on a batch of two observations with actions, given the noise and flow
    times LeRobot was given: LeRobot's own ``SmolVLAPolicy.forward`` loss (make_fixtures.py
    --training), fp32, within 1e-5; other times give another loss (the check can fail)."""
    from safetensors.torch import load_file

    from vla_accel_ros.models.lerobot_compat import resize_with_pad

    torch.set_num_threads(1)
    t = load_file(str(FIXTURES[name] / "training.safetensors"))
    policy = load_policy(imported[name], PolicyConfig(parity_check=False))
    feature = {ours: theirs for theirs, ours in json.loads((imported[name] / SOURCE_FILE).read_text())["cameras"].items()}
    size = policy.spec.image_size
    pixels = torch.stack([resize_with_pad(t[f"raw.{feature[c]}"], size) for c in policy.spec.cameras], 1) * 2 - 1
    task = json.loads((FIXTURES[name] / "fixture.json").read_text())["task"]

    def loss(time):
        with torch.no_grad():
            return float(policy.training_loss(pixels, t["raw.observation.state"], task, t["raw.action"], None, None,
                                              noise=t["noise"], time=time)[0])  # fmt: skip

    assert abs(loss(t["time"]) - float(t["loss"])) < 1e-5, (loss(t["time"]), float(t["loss"]))
    assert abs(loss(t["time"] * 0.5) - float(t["loss"])) > 1e-3


def _exported(imported, tmp_path):
    from vla_accel_ros.models.smolvla.lerobot_export import export_lerobot

    return export_lerobot(imported["fewer_experts_special_tokens"], tmp_path / "lerobot")


def test_an_exported_checkpoint_imports_back_to_the_same_policy(imported, tmp_path):
    """``bundle export-lerobot`` then ``bundle import --lerobot``: the same weights, options,
    statistics and tokenizer ids (the export is LeRobot's layout, read by the importer that reads
    LeRobot's own checkpoints), the same actions; never overwritten."""
    from safetensors.torch import load_file

    src = imported["fewer_experts_special_tokens"]
    out = _exported(imported, tmp_path)
    back = import_lerobot(out, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    s1, s2 = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("options", "norm_stats", "lm", "expert", "vision", "image_size", "patch_size", "chunk_size", "num_steps", "cameras"):
        assert s1[key] == s2[key], key
    p1, p2 = (load_policy(p, PolicyConfig(parity_check=False)) for p in (src, back))
    assert p1.text_ids("transfer the cube") == p2.text_ids("transfer the cube")
    obs = fixture_observation(p1, load_fixture(FIXTURES["fewer_experts_special_tokens"]),
                              json.loads((src / SOURCE_FILE).read_text())["cameras"])  # fmt: skip
    noise = np.random.default_rng(0).standard_normal(p1.noise_shape).astype(np.float32)
    assert np.abs(p1.infer(obs, noise=noise).actions - p2.infer(obs, noise=noise).actions).max() < 1e-6
    with pytest.raises(BundleError, match="never overwritten"):
        _exported(imported, tmp_path)
    proc = _cli("bundle", "export-lerobot", "--bundle", str(imported["self_attn_one_camera"]), "--out", str(tmp_path / "x"),
                "--image-size", "480by640")  # fmt: skip
    assert proc.returncode == 2 and "--image-size '480by640'" in proc.stderr


@pytest.mark.slow
def test_lerobot_loads_an_exported_checkpoint_and_computes_our_actions(imported, tmp_path):
    """LeRobot 0.4.4 (its side venv) loads the export with ``SmolVLAPolicy.from_pretrained`` and
    its processors, and ``bench lerobot`` finds our fp32 baseline within 1e-4 std of it."""
    if not LEROBOT_PY.is_file():
        pytest.skip(f"LeRobot's side venv is missing ({LEROBOT_PY})")
    pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
    from vla_accel_ros.cli import main

    out = _exported(imported, tmp_path)
    bag = tmp_path / "bag"
    assert main(["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "4", "--cameras",
                 "top,left_wrist", "--height", "96", "--width", "128", "--out", str(bag)]) == 0  # fmt: skip
    report = tmp_path / "report"
    argv = ["bench", "lerobot", "--lerobot", str(out), "--python", str(LEROBOT_PY), "--bag", str(bag), "--bundle",
            str(imported["fewer_experts_special_tokens"]), "--max-frames", "2", "--threads", "1", "--modes", "baseline",
            "--report", str(report)]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((report / "report.json").read_text())
    assert rep["modes"]["baseline"]["deviation_vs_lerobot"]["max_over_std"] < 1e-4


def test_cameras_of_one_size_are_resized_in_one_call_to_the_same_values():
    """padded_frames resizes same-size uint8 cameras as one batch and makes the uint8 frames on
    first read; both equal the per-camera path (LeRobot's, which the fixtures check)."""
    from vla_accel_ros.models.lerobot_compat import frame_tensor, padded_frames, resize_with_pad

    rng = np.random.default_rng(3)
    images = {c: rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for c in ("a", "b", "c")}
    got = padded_frames(images, ("a", "b", "c"), 40)
    one = torch.cat([resize_with_pad(frame_tensor(images[c], c)[None], 40) for c in ("a", "b", "c")])
    assert torch.equal(got.pixels, one * 2.0 - 1.0)
    assert torch.equal(got.raw, (one * 255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous())
    images["c"] = rng.integers(0, 256, (40, 80, 3), dtype=np.uint8)  # another size: one call per camera
    mixed = padded_frames(images, ("a", "b", "c"), 40)
    assert torch.equal(mixed.pixels[:2], got.pixels[:2]) and mixed.raw.shape == (3, 40, 40, 3)
