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
from vla_accel_ros.core.precision import COMPONENTS, PrecisionConfig, preset
from vla_accel_ros.core.types import ChunkGuidance
from vla_accel_ros.models.family import get_family
from vla_accel_ros.models.factory import build_policy, load_bundle, model_from_bundle, sibling_policy
from vla_accel_ros.core.engine import DecoderStack
from vla_accel_ros.models.precision import (
    Bf16Linear,
    FusedLinear,
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
    for family in ("ar", "flow"):
        defaults = get_family(family).precision_defaults
        resolved = cfg.resolve(get_family(family))
        assert resolved.components() == {**defaults, **({"expert": "fp32"} if family == "ar" else {})}
    assert not PrecisionConfig().reduced and PrecisionConfig().label() == "fp32"
    assert PrecisionConfig(lm="int8").label() == "lm=int8"
    assert PrecisionConfig(expert="bf16").resolve(get_family("ar")).label() == "fp32"  # ar has no expert
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
    comps = component_linears(model, get_family(family))
    sizes = {c: len(v) for c, v in comps.items()}
    assert sizes["vision"] > 0 and sizes["projector"] == 2 and sizes["lm"] > 0
    assert (sizes["expert"] > 0) == (family == "flow")
    converted = convert_model(model, get_family(family), PrecisionConfig(lm="int8", vision="bf16", expert="bf16").resolve(get_family(family)))
    counts = linear_precisions(converted)
    assert counts["int8"] == sizes["lm"]
    assert counts["bf16"] == sizes["vision"] + sizes["expert"]
    assert linear_precisions(model) == {
        "fp32": sum(1 for m in model.modules() if isinstance(m, nn.Linear)), "bf16": 0, "int8": 0, "hybrid": 0
    }  # fmt: skip
    hybrid = linear_precisions(convert_model(model, get_family(family), PrecisionConfig(lm="hybrid").resolve(get_family(family))))
    assert hybrid["hybrid"] == sizes["lm"] and hybrid["int8"] == hybrid["bf16"] == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the original is untouched
    # What stays fp32 is shared with the original, not copied (a 3.2 B model's copy did not fit).
    shared = {p.data_ptr() for p in model.parameters()}
    kept = [p for n, p in converted.named_parameters() if "norm" in n]
    assert kept and all(p.data_ptr() in shared for p in kept)
    assert convert_model(model, get_family(family), PrecisionConfig()) is model
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
def test_each_precision_loads_infers_and_is_gated(models, family, precision, bf16_cpu):
    spec, model = models[family]
    overrides = preset(precision)
    policy = build_policy(spec, model, _config(family, **overrides))
    report = policy.parity_report
    assert report.passed, report.table()
    assert policy.precision.reduced and policy.model is not model
    assert any("fp32 reference" in n for n in report.notes)
    obs = fixed_observation(spec)
    out = policy.infer(obs, noise=gate_noise(policy))
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


def test_the_precision_gate_samples_the_fp32_reference_at_the_policys_noise_scale(models):
    """A reduced-precision flow policy run with deterministic chunks is gated against an fp32
    reference sampled the same way (against one sampled at noise 1 every precision failed, fp32
    on another backend too); changing the scale at run time gates at the reference's scale."""
    from vla_accel_ros.core.parity import run_parity

    spec, model = models["flow"]
    noisy = build_policy(spec, model, _config("flow", **preset("bf16")))
    quiet = build_policy(spec, model, _config("flow", **preset("bf16")).replace(flow_noise_scale=0.0))
    assert quiet.parity_report.passed, quiet.parity_report.table()
    assert quiet.fp32_reference.noise_scale == 0.0 and noisy.fp32_reference.noise_scale == 1.0
    # the deviations are precision's alone, at both scales
    for p in (noisy, quiet):
        assert max(v for k, v in p.parity_report.metrics.items() if k.endswith("max_over_std")) <= 0.02
    # siblings at two scales sharing converted weights each get a reference of their own scale
    converted: dict = {}
    base = build_policy(spec, model, PolicyConfig(parity_check=False))
    a = sibling_policy(base, _config("flow", lm="bf16"), converted=converted)
    b = sibling_policy(base, _config("flow", lm="bf16").replace(flow_noise_scale=0.0), converted=converted)
    assert (a.fp32_reference.noise_scale, b.fp32_reference.noise_scale) == (1.0, 0.0)
    a.configure(a.config.replace(flow_noise_scale=0.0))  # run-time change: the gate keeps the reference's scale
    again = run_parity(a)
    assert again.passed, again.table()
    assert again.metrics == pytest.approx(a.parity_report.metrics) and a.config.flow_noise_scale == 0.0


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
    # one converted copy (the dict also keeps the gate's fp32 reference, computed once)
    assert a.model is b.model and sum(isinstance(v, nn.Module) for v in converted.values()) == 1
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
    assert torch.equal(int8(many), int8.packed(many))  # the direct op call is the stock module's
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


def test_auto_falls_back_while_the_gate_refuses(models, bf16_cpu):
    """``auto`` steps components back to fp32 until the gate accepts (random tiny ar weights
    flip tokens under every reduced precision); an explicit precision never falls back."""
    spec, model = models["ar"]
    config = PolicyConfig.from_dict({"precision": preset("auto")})  # the default, strict limits
    labels = [c.label() for c in config.precision.candidates(get_family("ar"))]
    assert labels == ["vision=bf16,projector=bf16,lm=hybrid", "vision=bf16,projector=bf16", "fp32"]
    policy = build_policy(spec, model, config)
    assert policy.precision.label() in labels[1:] and policy.config.precision.lm == "auto"
    assert any(f"the gate refused {labels[0]}" in n for n in policy.parity_report.notes)
    with pytest.raises(ParityError, match="refuses to start"):
        build_policy(spec, model, PolicyConfig.from_dict({"precision": {"lm": "hybrid"}}))
    # Components not set to auto keep their value; without auto there is one candidate.
    assert [c.vision for c in PrecisionConfig(lm="auto", vision="bf16").candidates(get_family("ar"))] == ["bf16", "bf16"]
    assert len(PrecisionConfig(lm="int8").candidates(get_family("ar"))) == 1


def test_attention_precision_follows_the_family_and_its_fallbacks():
    """``attention: auto`` takes the family's choice (bf16 above ``few_rows`` rows), and a
    fallback of ``auto`` may take it to fp32: smolvla's do, once its tower falls back to bf16
    (bf16 attention over that prefix lost the trained bundle's task). An explicit setting wins."""
    smolvla = get_family("smolvla")
    labels = [c.label() for c in PrecisionConfig(**preset("auto")).candidates(smolvla)]
    assert labels[:3] == ["vision=int8,projector=bf16,lm=bf16,expert=bf16",
                          "vision=bf16,projector=bf16,lm=bf16,expert=bf16 attention=fp32",
                          "vision=bf16,projector=bf16,lm=bf16 attention=fp32"]  # fmt: skip
    first, fallback = PrecisionConfig(**preset("auto")).candidates(smolvla)[:2]
    assert first.bf16_attention_above("lm") == first.few_rows and fallback.bf16_attention_above("lm") is None
    assert fallback.bf16_attention_above("expert") is None
    kept = PrecisionConfig(**preset("auto"), attention="bf16").candidates(smolvla)[1]
    assert kept.attention == "bf16" and kept.vision == "bf16"
    # Explicit precisions take the family's default attention; fp32 components never attend in bf16.
    assert PrecisionConfig(lm="bf16").resolve(smolvla).bf16_attention_above("lm") == 32
    assert PrecisionConfig(lm="bf16", attention="fp32").resolve(smolvla).bf16_attention_above("lm") is None
    assert PrecisionConfig(attention="bf16").resolve(smolvla).bf16_attention_above("lm") is None
    assert PrecisionConfig(attention="fp32").label() == "fp32"
    assert PrecisionConfig(vision="bf16", attention="fp32").label() == "vision=bf16"  # the tower's attention is not the decoders'
    # Where no decoder runs bf16 the attention setting changes nothing: no second, identical candidate.
    assert [c.label() for c in PrecisionConfig(**preset("auto")).candidates(smolvla, native_bf16=False)] == ["vision=int8", "fp32"]
    with pytest.raises(ConfigError, match="attention"):
        PrecisionConfig(attention="fp16")


def test_auto_runs_fp32_where_the_cpu_has_no_bf16(models, monkeypatch):
    """An AVX2-only CPU has no bf16 instructions: oneDNN emulates bf16 there, slower than fp32
    (the shipped SmolVLA's bf16 fast mode ran 1.6x slower than its fp32 baseline), so ``auto``
    runs fp32 where a family's default is bf16, int8 where it is hybrid, and says so; an explicit
    bf16 still runs, with a note. An int8 vision graph on OpenVINO follows VNNI instead: its
    MatMuls saturate without it, while PyTorch's int8 and ONNX Runtime's 7-bit weights do not."""
    import vla_accel_ros.models.precision as mp

    monkeypatch.setattr(mp, "native_bf16", lambda: False)
    monkeypatch.setattr(mp, "native_vnni", lambda: False)
    auto = PrecisionConfig(**{c: "auto" for c in COMPONENTS})
    assert auto.resolve(get_family("ar"), native_bf16=False).components() == {
        "vision": "fp32", "projector": "fp32", "lm": "int8", "expert": "fp32", "heads": "fp32"}  # fmt: skip
    assert [c.label() for c in auto.candidates(get_family("ar"), native_bf16=False)] == ["lm=int8", "fp32"]
    assert PrecisionConfig(lm="bf16").resolve(get_family("ar"), native_bf16=False).lm == "bf16"
    smolvla, graph = get_family("smolvla"), PrecisionConfig(vision="auto", lm="auto", backend="openvino")
    assert graph.resolve(smolvla).label() == "vision=int8,lm=bf16 +openvino"
    assert graph.resolve(smolvla, native_vnni=False).label() == "lm=bf16 +openvino"  # vision fp32
    # ONNX Runtime's int8 graph takes 7-bit weights without VNNI (core.backends) and stays int8.
    assert graph.replace(backend="onnxruntime").resolve(smolvla, native_bf16=False, native_vnni=False).label() == "vision=int8 +onnxruntime"
    assert graph.resolve(smolvla, native_bf16=False).label() == "vision=int8 +openvino"  # AVX-VNNI without bf16
    assert graph.replace(backend="torch").resolve(smolvla, native_bf16=False, native_vnni=False).label() == "vision=int8"
    spec, model = models["flow"]
    policy = build_policy(spec, model, PolicyConfig.from_dict({"precision": preset("auto")}))
    assert policy.precision.label() == "fp32" and policy.parity_report.passed
    assert any("no bf16 instructions (AVX-512 or AVX-NE-CONVERT) nor VNNI: precision auto runs" in n and "lm=fp32, expert=fp32" in n
               for n in policy.precision_notes)  # fmt: skip
    explicit = build_policy(spec, model, PolicyConfig.from_dict({"precision": preset("bf16")}))
    assert explicit.precision.label() == "lm=bf16,expert=bf16"
    assert any("lm=bf16, expert=bf16 runs its bf16 matmuls emulated" in n for n in explicit.precision_notes)


def _stacks(model, family):
    return [model.lm.model] if family == "ar" else [model.vlm, model.expert]


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_reduced_precision_layers_fuse_qkv_and_gate_up_with_the_members_results(models, family):
    """bf16, int8 and hybrid decoders run q/k/v and gate/up as one matmul each; outputs are the
    members' (int8: the same quantization, bf16: within rounding), the state_dict is unchanged,
    a copy fuses its own layers; fp32 layers are not fused."""
    spec, model = models[family]
    converted = {}
    for p in ("bf16", "hybrid", "int8", "fp32"):
        converted[p] = convert_model(model, get_family(family), PrecisionConfig(lm=p, expert=p if family == "flow" else "fp32").resolve(get_family(family)))
        for stack in map(DecoderStack, _stacks(converted[p], family)):
            assert all((g is not None) == (p != "fp32") for g in stack.qkv + stack.gate_up), p
        keys = converted[p].state_dict().keys()
        assert not any("fused" in k for k in keys)
        if p in ("bf16", "fp32"):
            assert keys == model.state_dict().keys()
    for p in ("bf16", "int8"):
        layer = _stacks(converted[p], family)[0].layers[0]
        group = layer.self_attn.q_proj.fused
        assert isinstance(group, FusedLinear)
        assert group.members == (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        x = torch.randn(1, 40, layer.self_attn.q_proj.in_features)
        with torch.inference_mode():
            for got, member in zip(group(x), group.members):
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, member(x), rtol=1e-2, atol=1e-3 if p == "bf16" else 1e-5)
            gate, up = layer.mlp.gate_proj.fused(x, low=True)
            assert gate.dtype == (torch.bfloat16 if p == "bf16" else torch.float32)
            torch.testing.assert_close(up.float(), layer.mlp.up_proj(x), rtol=1e-2, atol=1e-2)
    twin = copy.deepcopy(converted["bf16"])
    twin_layer, layer = _stacks(twin, family)[0].layers[0], _stacks(converted["bf16"], family)[0].layers[0]
    assert twin_layer.self_attn.q_proj.fused is not layer.self_attn.q_proj.fused
    assert twin_layer.self_attn.q_proj.fused.members[2] is twin_layer.self_attn.v_proj


def test_hybrid_fused_projections_run_int8_for_few_rows_and_bf16_for_many():
    torch.manual_seed(0)
    lins = [nn.Linear(64, 32), nn.Linear(64, 16)]
    members = [HybridLinear(lin, int8_max_rows=4) for lin in lins]
    group = FusedLinear(members, lins)
    few, many = torch.randn(1, 4, 64), torch.randn(1, 9, 64)
    for got, m in zip(group(few), members):
        torch.testing.assert_close(got, m.int8(few), rtol=1e-5, atol=1e-5)  # int8, one call
    for got, m in zip(group(many), members):
        torch.testing.assert_close(got, m.bf16(many), rtol=1e-2, atol=1e-3)  # bf16, one call
    x = many.clone().requires_grad_(True)
    outs = group(x)  # a gradient: the members one by one (hybrid: bf16)
    assert all(torch.equal(o.detach(), m.bf16(many)) for o, m in zip(outs, members))
    with pytest.raises(TypeError, match="cannot fuse"):
        FusedLinear([members[0], Bf16Linear(lins[1])], lins)


def test_flow_keeps_its_kv_cache_in_bf16_when_both_decoders_attend_in_bf16(models):
    """The cache stores K/V as bf16 attention reads them; RoPE stays fp32; the token cache and
    pruning (attention taps) run on it; fp32 and int8 keep an fp32 cache."""
    spec, model = models["flow"]
    policy = build_policy(spec, model, _config("flow", **preset("bf16"), few_rows=spec.chunk_size - 1))
    assert policy.cache.k.dtype == torch.bfloat16 and policy.vlm_engine.cos.dtype == torch.float32
    # Real-Time Chunking differentiates through the bf16 cache's reads.
    obs, noise = fixed_observation(spec), gate_noise(policy)
    free = policy.infer(obs, noise=noise).actions
    prev = np.zeros((spec.chunk_size, spec.action_dim), np.float32)
    guided = policy.infer(obs, noise=noise, guidance=ChunkGuidance(prev_actions=prev, weights=np.ones(spec.chunk_size, np.float32), frozen=0))
    assert np.isfinite(guided.actions).all() and not np.allclose(guided.actions, free)
    accel = build_policy(spec, model, PolicyConfig.from_dict({"accel": "cache+prune", "precision": preset("bf16")}))
    assert accel.cache.k.dtype == torch.bfloat16
    for _ in range(2):
        out = accel.infer(obs, noise=gate_noise(accel))
    assert np.isfinite(out.actions).all() and out.stats["tokens_kept_fraction"] < 1
    # The expert's chunk rows attend in fp32 when they are few, or with attention fp32: the cache stays fp32.
    few = build_policy(spec, model, _config("flow", **preset("bf16"), few_rows=spec.chunk_size))
    assert few.cache.k.dtype == torch.float32
    fp32_attention = build_policy(spec, model, _config("flow", **preset("bf16"), few_rows=spec.chunk_size - 1, attention="fp32"))
    assert fp32_attention.cache.k.dtype == torch.float32 and fp32_attention.precision.label().endswith("attention=fp32")
    for p in ("fp32", "int8"):
        assert build_policy(spec, model, _config("flow", lm=p, expert=p)).cache.k.dtype == torch.float32
