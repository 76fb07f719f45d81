"""Compiled static steps (core/compiled.py) and their export (core/export.py) on tiny bundles."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch

from vla_accel_ros.core.compiled import CompiledEngine, is_static_plan
from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.export import check_program, custom_ops, export_policy, policy_steps, save_programs
from vla_accel_ros.core.parity import changed_observation, fixed_observation, gate_noise
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.models.factory import load_policy


def _swap_in_compiled(policy, backend: str, inline: bool | None = None) -> list[CompiledEngine]:
    """The policy's engines as CompiledEngines over the same caches (what precision.compile
    builds, with a backend that needs no C++ toolchain: the graph, functionalization and the
    ops' fake kernels are exercised, code generation is not). ``inline``: the CPU build's
    functional step (reference ops in the graph) instead of the custom ops."""
    engines = []
    for attr in ("engine", "vlm_engine", "expert_engine", "prefix_engine"):
        old = getattr(policy, attr, None)
        if old is None:
            continue
        new = next((e for e, o in engines if o is old), None)
        if new is None:
            new = CompiledEngine(
                old.stack, old.cache, max_positions=old.cos.shape[0], backend=backend, inline=inline,
                bf16_attention_above=old.bf16_attention_above,
            )  # fmt: skip
            engines.append((new, old))
        setattr(policy, attr, new)
    return [e for e, _ in engines]


@pytest.mark.parametrize("family", ["ar", "flow"])
@pytest.mark.parametrize("inline, accel", [(False, "none"), (True, "none"), (True, "cache+prune")])
def test_compiled_steps_match_eager(tiny_bundles, family, inline, accel):
    """The compiled steps give the eager actions on two frames (the second one reuses and
    prunes with cache+prune) and leave the same K/V and valid flags in the cache: over the
    custom ops, and as the CPU build runs them (reference ops inlined, functional: the engine
    writes the rows' K/V after the graph)."""
    config = PolicyConfig(parity_check=False, accel=accel)
    eager, compiled = load_policy(tiny_bundles[family], config), load_policy(tiny_bundles[family], config)
    engines = _swap_in_compiled(compiled, "aot_eager", inline=inline)
    spec = eager.spec
    noise = gate_noise(eager)
    obs = fixed_observation(spec)
    for frame in (obs, changed_observation(obs, spec)):
        a, c = eager.infer(frame, noise=noise), compiled.infer(frame, noise=noise)
        assert np.abs(a.actions - c.actions).max() <= 1e-5
        if family == "ar":
            assert a.stats["action_tokens"] == c.stats["action_tokens"]
    # Every step was static without accel: prefill, and decode tokens / Euler steps.
    per_infer = {"ar": spec.action_dim * spec.chunk_size, "flow": 1 + spec.num_steps}[family]
    calls = sum(e.static_calls for e in engines)
    assert calls == 2 * per_infer if accel == "none" else 0 < calls < 2 * per_infer
    assert torch.equal(eager.cache.valid, compiled.cache.valid)
    valid = eager.cache.valid[:, None, None, :, None]  # [L, 1, 1, S, 1] over [L, B, Hkv, S, D]
    for name in ("k", "v"):
        a, c = getattr(eager.cache, name), getattr(compiled.cache, name)
        assert (a - c).abs().mul(valid).max() <= 1e-5


def test_inline_bf16_flow_expert_matches_eager(tiny_bundles):
    """bf16 expert and VLM: the compiled step runs the fused q/k/v and gate/up projections as
    one matmul over the stacked weights; actions stay within the precision gate's limit of the
    eager bf16 policy."""
    config = PolicyConfig.from_dict({"parity_check": False, "precision": {"lm": "bf16", "expert": "bf16"}})
    eager, compiled = load_policy(tiny_bundles["flow"], config), load_policy(tiny_bundles["flow"], config)
    assert compiled.expert_stack.qkv[0] is not None  # the bf16 expert's projections are fused
    engines = _swap_in_compiled(compiled, "aot_eager", inline=True)
    spec, noise = eager.spec, gate_noise(eager)
    a, c = eager.infer(fixed_observation(spec), noise=noise), compiled.infer(fixed_observation(spec), noise=noise)
    std = np.asarray(spec.norm_stats["action"]["std"], dtype=np.float32)
    assert (np.abs(a.actions - c.actions) / std).max() <= 0.02
    assert sum(e.static_calls for e in engines) == 1 + spec.num_steps


def test_compiled_reads_follow_the_cache(tiny_bundles):
    """The attention path a compiled step takes: every key (a flow expert step over a whole
    prefix), one key set for all rows (the expert over a pruned prefix, an ar decode row), or
    per-row masks (a causal prefill); a key window that cuts off readable keys is refused."""
    from vla_accel_ros.core.errors import PlanError

    flow = load_policy(tiny_bundles["flow"], PolicyConfig(parity_check=False))
    flow.infer(fixed_observation(flow.spec), noise=gate_noise(flow))
    engine = CompiledEngine(flow.expert_stack, flow.cache, max_positions=flow.expert_engine.cos.shape[0], backend="aot_eager")
    plan = flow.expert_plan(flow.layout_for(flow.spec.default_instruction)[0].length)
    assert engine._reads(plan.slots, plan.key_window) == "all"
    assert engine._reads(plan.slots, None) == "shared"  # the unused tail of the cache is masked
    flow.cache.invalidate(torch.tensor([3, 5]), from_layer=1)  # pruned prefix tokens
    assert engine._reads(plan.slots, plan.key_window) == "shared"
    with pytest.raises(PlanError, match="key_window"):
        engine.forward(torch.zeros(1, plan.slots.numel(), flow.expert_stack.hidden_size), StepPlan(
            slots=plan.slots, positions=plan.slots, key_window=plan.key_window - 1))  # fmt: skip

    ar = load_policy(tiny_bundles["ar"], PolicyConfig(parity_check=False))
    ar.infer(fixed_observation(ar.spec))
    engine = CompiledEngine(ar.stack, ar.cache, max_positions=ar.engine.cos.shape[0], backend="aot_eager")
    assert engine._reads(torch.arange(8), None) == "per_row"  # causal rows
    assert engine._reads(torch.tensor([ar.max_slots - 1]), None) == "shared"  # one row


def test_non_static_plans_stay_eager(tiny_bundles):
    policy = load_policy(tiny_bundles["ar"], PolicyConfig(parity_check=False, accel="cache+prune"))
    (engine,) = _swap_in_compiled(policy, "aot_eager")
    obs = fixed_observation(policy.spec)
    policy.infer(obs)
    decode_steps = policy.num_action_tokens - 1
    assert engine.static_calls == decode_steps  # the pruned prefill ran the eager loop
    slots = torch.arange(4)
    assert is_static_plan(StepPlan(slots=slots, positions=slots, layer_slots=[slots] * 3))
    assert not is_static_plan(StepPlan(slots=slots, positions=slots, layer_slots=[slots, slots[:2]]))
    assert not is_static_plan(StepPlan(slots=slots, positions=slots, drop={1: slots[:1]}))
    # A partial recompute with the same rows at every layer (reuse from layer 0): its row count
    # changes from frame to frame, so it stays eager instead of compiling a graph per count.
    gaps = torch.tensor([0, 2, 3, 7])
    assert not is_static_plan(StepPlan(slots=gaps, positions=gaps, layer_slots=[gaps] * 3))


@pytest.mark.slow
@pytest.mark.parametrize("family, precision", [("ar", "fp32"), ("flow", "fp32"), ("flow", "bf16")])
def test_compile_switch_passes_the_gate(tiny_bundles, family, precision):
    """precision.compile=True with inductor (the CPU build: inlined ops, frozen weights): the
    gate's exact checks (1e-3 against transformers) in fp32, its precision limits in bf16."""
    components = {"lm": precision, "expert": precision} if precision != "fp32" else {}
    policy = load_policy(tiny_bundles[family], PolicyConfig.from_dict({"precision": {"compile": True, **components}}))
    assert policy.parity_report.passed
    assert isinstance(policy.prefix_engine, CompiledEngine) and policy.prefix_engine.static_calls > 0
    assert policy.prefix_engine.inline and policy.prefix_engine.frozen


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_export_round_trip(tiny_bundles, tmp_path, family):
    """Every static step exports with the two custom ops as graph nodes, survives a save / load
    round trip (in memory) and matches the eager engine; the archive holds no pickle."""
    policy = load_policy(tiny_bundles[family], PolicyConfig(parity_check=False))
    policy.infer(fixed_observation(policy.spec), noise=gate_noise(policy))  # a cache with content
    programs = export_policy(policy)
    assert set(programs) == {"ar": {"prefill", "decode"}, "flow": {"prefill", "expert"}}[family]
    layers = policy.prefix_engine.stack.num_layers
    for name, (engine, slots) in policy_steps(policy).items():
        ep = programs[name]
        assert custom_ops(ep) == {"vla_accel.write_kv.default": layers, "vla_accel.attend.default": layers}
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        names = zipfile.ZipFile(io.BytesIO(buf.getvalue())).namelist()
        assert not any(n.endswith(".pkl") for n in names)
        buf.seek(0)
        assert check_program(torch.export.load(buf), engine, slots) <= 1e-5
    paths = save_programs(programs, tmp_path / "out", {"family": family})
    assert {p.name for p in paths} == {f"{n}.pt2" for n in programs} | {"export.json"}


@pytest.mark.parametrize("precision", ["int8", "hybrid"])
def test_int8_does_not_export(tiny_bundles, precision):  # its packed weights live in this process
    policy = load_policy(tiny_bundles["ar"], PolicyConfig.from_dict({"parity_check": False, "precision": {"lm": precision}}))
    with pytest.raises(ConfigError, match="int8"):
        export_policy(policy)


def test_export_cli(tiny_bundles, tmp_path, capsys):
    import json

    from vla_accel_ros.cli import main

    assert main(["export", "--bundle", str(tiny_bundles["flow"]), "--out", str(tmp_path / "steps")]) == 0
    manifest = json.loads((tmp_path / "steps" / "export.json").read_text())
    assert set(manifest["steps"]) == {"prefill", "expert"} and manifest["max_abs_delta"] <= 1e-5
    assert manifest["steps"]["expert"]["inputs"]["x"][1] == 50
    assert manifest["steps"]["expert"]["input_dtypes"] == {
        "x": "float32", "slots": "int64", "positions": "int64", "k_cache": "float32", "v_cache": "float32",
        "valid": "bool", "allowed": "bool",
    }  # fmt: skip
    assert "max |exported - engine|" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["int8", "hybrid"])
def test_int8_layers_compile_as_one_op(tiny_bundles, precision):
    """int8 layers stay inside the compiled graph (vla_accel::int8_linear) and give the eager
    int8 results (hybrid: int8 in the decode graph, bf16 in the prefill graph)."""
    config = PolicyConfig.from_dict({"parity_check": False, "precision": {"lm": precision}})
    eager, compiled = load_policy(tiny_bundles["ar"], config), load_policy(tiny_bundles["ar"], config)
    (engine,) = _swap_in_compiled(compiled, "aot_eager")
    obs = fixed_observation(eager.spec)
    a, c = eager.infer(obs), compiled.infer(obs)
    assert a.stats["action_tokens"] == c.stats["action_tokens"] and engine.static_calls > 0
    assert np.abs(a.actions - c.actions).max() <= 1e-5
