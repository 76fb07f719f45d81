"""Bundles: self-contained, safetensors only, validated with errors that name the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE
from vla_accel_ros.core.errors import BundleError, ParityError
from vla_accel_ros.core.parity import run_parity
from vla_accel_ros.core.prefix import FullRecompute, PrefixPlan
from vla_accel_ros.models.factory import load_bundle, load_policy, model_from_bundle
from vla_accel_ros.models.factory import read_model_spec as read_spec  # the loaders' check: the family's too

PACKAGE = Path(__import__("vla_accel_ros").__file__).parent
VLA_ACCEL = str(Path(sys.executable).with_name("vla-accel"))


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / CONFIG_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / CONFIG_FILE).write_text(json.dumps(cfg))
    return dst


def test_bundle_holds_only_json_and_safetensors(tiny_bundles):
    for path in tiny_bundles.values():
        assert sorted(p.name for p in path.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
        b = load_bundle(path)
        assert b.spec.joint_names[0] == "left_waist" and len(b.spec.joint_names) == 14
        assert "action" in b.spec.norm_stats


def test_roundtrip_is_bit_exact(tiny_bundles):
    b = load_bundle(tiny_bundles["flow"])
    model = model_from_bundle(b)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, b.state_dict[name]), name


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"joint_names": ["a", "b"]}, "joint_names"),
        ({"format": "something/9"}, "format"),
        ({"image_size": 225}, "image_size"),
        ({"family": "diffusion"}, "family='diffusion' is not a known model family; known: ar, flow, smolvla"),
        ({"family": None}, "field 'family' is missing"),
        ({"dt": -1.0}, "dt"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"instruction_template": "no placeholder"}, "instruction_template"),
        ({"norm_stats": {}}, "norm_stats.action"),
    ],
)
def test_bad_config_fields_are_named(tiny_bundles, tmp_path, changes, field):
    bad = _edit_config(tiny_bundles["ar"], tmp_path / "bad", **changes)
    with pytest.raises(BundleError, match=field.replace(".", "\\.")):
        read_spec(bad)


def _edit_module(src: Path, dst: Path, module: str, **changes) -> Path:
    cfg = json.loads((src / CONFIG_FILE).read_text())
    return _edit_config(src, dst, **{module: {**cfg[module], **changes}})


@pytest.mark.parametrize(
    "module, changes, words",
    [
        ("lm", {"num_hidden_layers": 10**9}, "lm.num_hidden_layers=1000000000 is out of range [1, 256]"),
        ("vision", {"hidden_size": 10**7}, "vision.hidden_size=10000000 is out of range"),
        ("expert", {"intermediate_size": "big"}, "expert.intermediate_size='big' must be an integer"),
        ("lm", {"num_attention_heads": 3}, "lm.num_attention_heads=3 must be a multiple of lm.num_key_value_heads=2"),
        ("vision", {"num_attention_heads": 3}, "vision.hidden_size=32 must be a multiple of vision.num_attention_heads=3"),
        ("lm", {"num_hidden_layers": 256, "hidden_size": 32768, "intermediate_size": 131072}, "add up to about"),
        ("lm", {"vocab_size": None}, "lm.vocab_size is required"),
    ],
)
def test_absurd_module_sizes_are_refused_before_anything_is_built(tiny_bundles, tmp_path, module, changes, words):
    src = tiny_bundles["flow"]
    if module == "lm" and "num_hidden_layers" in changes:  # the expert must match the lm's depth
        src = _edit_module(src, tmp_path / "deep", "expert", num_hidden_layers=changes["num_hidden_layers"])
    cfg = json.loads((src / CONFIG_FILE).read_text())
    edited = {k: v for k, v in {**cfg[module], **changes}.items() if v is not None}
    bad = _edit_config(src, tmp_path / "bad", **{module: edited})
    with pytest.raises(BundleError) as e:
        load_policy(bad)  # the loader refuses (no allocator traceback) ...
    assert words in str(e.value)
    out = subprocess.run([VLA_ACCEL, "bundle", "inspect", str(bad)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr  # ... and so does inspect


def test_inspect_checks_the_weights_against_the_config_like_the_loader(tiny_bundles, tmp_path):
    bad = _edit_module(tiny_bundles["flow"], tmp_path / "bad", "lm", intermediate_size=96)  # valid, but not these weights
    with pytest.raises(BundleError, match="config implies") as loader:
        load_policy(bad)
    out = subprocess.run([VLA_ACCEL, "bundle", "inspect", str(bad)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "config implies" in out.stderr and out.stdout == ""
    assert str(loader.value).split(": ", 1)[1] in out.stderr  # the same reason


def test_create_demo_never_overwrites_a_bundle(tiny_bundles, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(tiny_bundles["ar"], out)
    before = (out / WEIGHTS_FILE).read_bytes()
    run = subprocess.run([VLA_ACCEL, "bundle", "create-demo", "--family", "flow", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "exists already" in run.stderr and "never overwritten" in run.stderr
    assert (out / WEIGHTS_FILE).read_bytes() == before and read_spec(out).family == "ar"


def test_weights_that_do_not_match_the_config_are_rejected(tiny_bundles, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_bundles["ar"], bad)
    state = load_file(str(bad / WEIGHTS_FILE))
    state.pop(next(iter(state)))
    save_file(state, str(bad / WEIGHTS_FILE))
    with pytest.raises(BundleError, match="missing"):
        load_policy(bad)
    (bad / WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(BundleError, match="safetensors"):
        load_bundle(bad)
    with pytest.raises(BundleError, match="not a bundle"):
        load_bundle(tmp_path)


def test_no_pickle_anywhere_in_the_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for needle in ("import pickle", "torch.load(", "cloudpickle", "pickle.load", "from pickle"):
            if needle in text:
                offenders.append(f"{path.relative_to(PACKAGE)}: {needle}")
    assert not offenders


class _PruneEverythingPlanner(FullRecompute):
    """An 'accelerated path' that is wrong: drops all image tokens after layer 1 once warm."""

    name = "broken"

    def __init__(self):
        self.calls = 0

    def plan(self, ctx):
        self.calls += 1
        slots = ctx.layout.all_slots()
        if self.calls == 1:
            return super().plan(ctx)
        keep = ctx.layout.text_slots()
        layer_slots = [slots, slots] + [keep] * (ctx.layout.num_layers - 2)
        return PrefixPlan(layer_slots=layer_slots, drop={2: ctx.layout.image_slots()}, full=False)


def test_policy_refuses_to_start_when_its_accelerated_path_fails_parity(tiny_bundles):
    with pytest.raises(ParityError, match="refuses to start"):
        load_policy(tiny_bundles["ar"], planner=_PruneEverythingPlanner())


def test_parity_gate_reports_numbers_and_catches_a_wrong_kernel(tiny_bundles):
    from vla_accel_ros.core.policy_config import PolicyConfig

    policy = load_policy(tiny_bundles["flow"], PolicyConfig(parity_check=False))
    good = run_parity(policy)
    assert good.passed and good.metrics["prefix_hidden_max_abs"] <= 1e-4

    class Off:
        name = "off-by-a-bit"
        write_kv = staticmethod(policy.vlm_engine.kernels.write_kv)

        @staticmethod
        def attend(q, k, v, mask, scale):
            return 1.01 * torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )

    policy.vlm_engine.kernels = Off()
    bad = run_parity(policy)
    assert not bad.passed and "FAIL" in bad.table()


def test_bundle_average_weighs_every_tensor_and_statistic_and_refuses_what_does_not_average(tiny_bundles, tmp_path):
    """``vla-accel bundle average``: each weight and normalization statistic is the weighted sum
    of the bundles'; the name, noise scale and step count are the first bundle's; averaging a bundle with
    itself gives its policy back; bundles of another architecture, bad weights and an existing
    --out are refused with the reason."""
    import numpy as np

    from vla_accel_ros.cli import main
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.core.parity import fixed_observation
    from vla_accel_ros.models.average import average_bundles
    from vla_accel_ros.models.factory import create_demo_bundle

    a = tiny_bundles["flow"]
    stats = json.loads((a / CONFIG_FILE).read_text())["norm_stats"]
    shifted = {k: {s: (np.asarray(v) + 1.0).tolist() for s, v in d.items()} for k, d in stats.items()}
    b = create_demo_bundle("flow", "tiny", tmp_path / "b0", seed=1)
    b = _edit_config(b, tmp_path / "b", norm_stats=shifted, name="other", noise_scale=0.5, num_steps=7)
    out = tmp_path / "avg"
    assert main(["bundle", "average", "--bundle", str(a), "--bundle", str(b), "--weights", "0.25,0.75", "--out", str(out)]) == 0
    wa, wb, avg = (load_bundle(p).state_dict for p in (a, b, out))
    assert avg.keys() == wa.keys() and all(avg[k].dtype == wa[k].dtype for k in wa)
    for k in wa:
        assert torch.allclose(avg[k].float(), 0.25 * wa[k].float() + 0.75 * wb[k].float(), atol=1e-6), k
    spec, first = read_spec(out), read_spec(a)
    assert spec.name == first.name and spec.noise_scale == first.noise_scale and spec.num_steps == first.num_steps != 7
    assert np.allclose(spec.norm_stats["action"]["mean"], np.asarray(stats["action"]["mean"]) + 0.75)
    average_bundles([a, a], tmp_path / "same")
    obs = fixed_observation(first, 0)
    chunks = [load_policy(p).infer(obs, noise=np.zeros(load_policy(a).noise_shape, np.float32)).actions for p in (a, tmp_path / "same")]
    assert np.array_equal(*chunks)
    refused = {
        "exists already": dict(paths=[a, b], out=out),
        "give two bundles or more": dict(paths=[a], out=tmp_path / "x"),
        "must sum to 1": dict(paths=[a, b], out=tmp_path / "x", weights=[0.5, 0.6]),
        "2 weights for 3 bundles": dict(paths=[a, b, a], out=tmp_path / "x", weights=[0.5, 0.5]),
        "differs from .*family": dict(paths=[a, tiny_bundles["ar"]], out=tmp_path / "x"),
    }
    for words, kw in refused.items():
        with pytest.raises((ConfigError, BundleError), match=words):
            average_bundles(**kw)
    assert not (tmp_path / "x").exists()
