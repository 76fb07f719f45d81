"""Precision per component: config, conversion, and the parity gate against fp32 (tiny bundles)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from vla_accel_ros.core.errors import ConfigError, ParityError
from vla_accel_ros.core.parity import fixed_observation, gate_noise
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import COMPONENTS, FAMILY_DEFAULTS, PrecisionConfig, preset
from vla_accel_ros.core.types import ChunkGuidance
from vla_accel_ros.models.factory import build_policy, load_bundle, model_from_bundle, sibling_policy
from vla_accel_ros.models.precision import (
    Bf16Linear,
    HybridLinear,
    Int8Linear,
    component_linears,
    convert_model,
    linear_precisions,
)

# Random weights put several ar action tokens near a tie, so ar gates in these tests use loose
# token limits; the flow gate runs at its defaults.
LOOSE_AR = {"gate_ar_min_identical_tokens": 0.0, "gate_ar_max_abs": 1e3}


def _config(family: str, **precision) -> PolicyConfig:
    limits = LOOSE_AR if family == "ar" else {}
    return PolicyConfig.from_dict({"precision": {**limits, **precision}})


@pytest.fixture(scope="module")
def models(tiny_bundles):
    return {fam: (load_bundle(path).spec, model_from_bundle(load_bundle(path))) for fam, path in tiny_bundles.items()}


def test_config_resolves_auto_per_family():
    cfg = PrecisionConfig(**{c: "auto" for c in COMPONENTS})
    for family, defaults in FAMILY_DEFAULTS.items():
        resolved = cfg.resolve(family)
        assert resolved.components() == {**defaults, **({"expert": "fp32"} if family == "ar" else {})}
    assert not PrecisionConfig().reduced and PrecisionConfig().label() == "fp32"
    assert PrecisionConfig(lm="int8").label() == "lm=int8"
    assert PrecisionConfig(expert="bf16").resolve("ar").label() == "fp32"  # ar has no expert
    with pytest.raises(ConfigError, match="fp32"):
        PrecisionConfig(lm="fp16")
    with pytest.raises(ConfigError, match="auto"):
        preset("fp8")
    assert preset("bf16") == {"lm": "bf16", "expert": "bf16"}
    # Read-only ROS parameters: they change the weights.
    specs = {s.name: s for s in PrecisionConfig.specs()}
    assert all(specs[c].read_only for c in (*COMPONENTS, "compile"))
    assert not specs["gate_flow_max_over_std"].read_only


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_convert_model_per_component(models, family):
    spec, model = models[family]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    comps = component_linears(model, family)
    sizes = {c: len(v) for c, v in comps.items()}
    assert sizes["vision"] > 0 and sizes["projector"] == 2 and sizes["lm"] > 0
    assert (sizes["expert"] > 0) == (family == "flow")
    converted = convert_model(model, family, PrecisionConfig(lm="int8", vision="bf16", expert="bf16").resolve(family))
    counts = linear_precisions(converted)
    assert counts["int8"] == sizes["lm"]
    assert counts["bf16"] == sizes["vision"] + sizes["expert"]
    assert linear_precisions(model) == {
        "fp32": sum(1 for m in model.modules() if isinstance(m, nn.Linear)), "bf16": 0, "int8": 0, "hybrid": 0
    }  # fmt: skip
    hybrid = linear_precisions(convert_model(model, family, PrecisionConfig(lm="hybrid").resolve(family)))
    assert hybrid["hybrid"] == sizes["lm"] and hybrid["int8"] == hybrid["bf16"] == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the original is untouched
    assert convert_model(model, family, PrecisionConfig()) is model
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    bf16 = Bf16Linear(lin)
    assert bf16(x).dtype == torch.float32
    assert (bf16(x) - lin(x)).abs().max() < 2e-2
    # The prepacked oneDNN weight gives what a plain bf16 matmul gives.
    assert torch.equal(bf16(x), torch.nn.functional.linear(x.bfloat16(), bf16.weight, bf16.bias).float())
    assert torch.equal(copy.deepcopy(bf16)(x), bf16(x))  # a copy repacks


@pytest.mark.parametrize("family", ["ar", "flow"])
@pytest.mark.parametrize("precision", ["bf16", "int8", "hybrid", "auto"])
def test_each_precision_loads_infers_and_is_gated(models, family, precision):
    spec, model = models[family]
    overrides = preset(precision)
    policy = build_policy(spec, model, _config(family, **overrides))
    report = policy.parity_report
    assert report.passed, report.table()
    assert policy.precision.reduced and policy.model is not model
    assert any("fp32 reference" in n for n in report.notes)
    obs = fixed_observation(spec)
    out = policy.infer(obs, noise=gate_noise(spec))
    assert np.isfinite(out.actions).all() and out.actions.shape == (spec.chunk_size, spec.action_dim)
    # A tolerance below what the gate measured must fail: the policy refuses to start.
    if family == "flow":
        measured = max(v for k, v in report.metrics.items() if k.endswith("max_over_std"))
        assert measured > 0
        bad = {"gate_flow_max_over_std": measured / 2}
    else:
        measured = max(v for k, v in report.metrics.items() if k.endswith("_max_abs"))
        assert measured > 0, "random tiny ar weights flip some token under reduced precision"
        bad = {**LOOSE_AR, "gate_ar_max_abs": measured / 2}
    if precision == "auto":  # auto steps back towards fp32 instead of refusing
        fallback = build_policy(spec, model, PolicyConfig.from_dict({"precision": {**overrides, **bad}}))
        assert fallback.precision.label() != policy.precision.label()
        return
    with pytest.raises(ParityError, match="refuses to start"):
        build_policy(spec, model, PolicyConfig.from_dict({"precision": {**overrides, **bad}}))


def test_ar_token_share_limit_fails_on_flipped_tokens(models):
    spec, model = models["ar"]
    policy = build_policy(spec, model, _config("ar", lm="bf16"))
    differ = max(v for k, v in policy.parity_report.metrics.items() if k.endswith("token_differ_share"))
    assert differ > 0
    with pytest.raises(ParityError, match="token_differ_share"):
        build_policy(spec, model, PolicyConfig.from_dict({"precision": {"lm": "bf16", "gate_ar_max_abs": 1e3}}))


def test_precision_is_fixed_and_siblings_share_converted_weights(models):
    spec, model = models["flow"]
    base = build_policy(spec, model, PolicyConfig(parity_check=False))
    converted: dict = {}
    a = sibling_policy(base, _config("flow", lm="bf16"), converted=converted)
    b = sibling_policy(base, _config("flow", lm="bf16").replace(accel="cache"), converted=converted)
    assert a.model is b.model and len(converted) == 1
    with pytest.raises(ConfigError, match="precision.lm"):
        a.configure(a.config.replace(precision=PrecisionConfig(lm="int8")))
    a.configure(a.config.replace(precision=a.config.precision.replace(gate_flow_max_over_std=0.05)))  # limits may change
    with pytest.raises(ConfigError, match="fp32 policy"):
        sibling_policy(a, PolicyConfig())


def test_int8_expert_refuses_rtc_guidance(models):
    spec, model = models["flow"]
    policy = build_policy(spec, model, PolicyConfig.from_dict({"parity_check": False, "precision": {"expert": "int8"}}))
    prev = np.zeros((spec.chunk_size, spec.action_dim), np.float32)
    guidance = ChunkGuidance(prev_actions=prev, weights=np.ones(spec.chunk_size, np.float32), frozen=0)
    with pytest.raises(ConfigError, match="int8 has no backward"):
        policy.infer(fixed_observation(spec), guidance=guidance)
    bf16 = build_policy(spec, model, PolicyConfig.from_dict({"parity_check": False, "precision": {"expert": "bf16"}}))
    assert np.isfinite(bf16.infer(fixed_observation(spec), guidance=guidance).actions).all()


def test_parity_cli_gates_a_precision(tiny_bundles, capsys):
    from vla_accel_ros.cli import main

    assert main(["parity", "--bundle", str(tiny_bundles["flow"]), "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "precision=bf16" in out and "actions_max_over_std" in out and "PASS" in out
    assert main(["parity", "--bundle", str(tiny_bundles["ar"]), "--precision", "bf16"]) == 1  # random weights flip tokens
    assert "token_differ_share" in capsys.readouterr().out


def test_hybrid_linear_runs_int8_for_few_rows_and_bf16_for_many():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    hybrid, bf16, int8 = HybridLinear(lin, int8_max_rows=4), Bf16Linear(lin), Int8Linear(lin)
    few, many = torch.randn(1, 4, 64), torch.randn(1, 5, 64)
    assert torch.equal(hybrid(few), int8(few)) and not torch.equal(hybrid(few), bf16(few))
    assert torch.equal(hybrid(many), bf16(many)) and not torch.equal(hybrid(many), int8(many))
    # A call that needs a gradient (Real-Time Chunking guidance) takes bf16: int8 has no backward.
    x = few.clone().requires_grad_(True)
    out = hybrid(x)
    assert torch.equal(out.detach(), bf16(few))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ConfigError, match="few_rows"):
        PrecisionConfig(few_rows=-1)


def test_auto_falls_back_while_the_gate_refuses(models):
    """``auto`` steps components back to fp32 until the gate accepts (random tiny ar weights
    flip tokens under every reduced precision); an explicit precision never falls back."""
    spec, model = models["ar"]
    config = PolicyConfig.from_dict({"precision": preset("auto")})  # the default, strict limits
    labels = [c.label() for c in config.precision.candidates("ar")]
    assert labels == ["vision=bf16,projector=bf16,lm=hybrid", "vision=bf16,projector=bf16", "fp32"]
    policy = build_policy(spec, model, config)
    assert policy.precision.label() in labels[1:] and policy.config.precision.lm == "auto"
    assert any(f"the gate refused {labels[0]}" in n for n in policy.parity_report.notes)
    with pytest.raises(ParityError, match="refuses to start"):
        build_policy(spec, model, PolicyConfig.from_dict({"precision": {"lm": "hybrid"}}))
    # Components not set to auto keep their value; without auto there is one candidate.
    assert [c.vision for c in PrecisionConfig(lm="auto", vision="bf16").candidates("ar")] == ["bf16", "bf16"]
    assert len(PrecisionConfig(lm="int8").candidates("ar")) == 1
