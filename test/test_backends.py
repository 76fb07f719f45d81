"""Exported graphs on ONNX Runtime and OpenVINO: the ONNX export of the vision tower + connector
against the eager modules, and the ``precision.backend`` policies through the gate (tiny
bundles; skipped with a reason where a runtime is not installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.parity import changed_observation, fixed_observation
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import PrecisionConfig, preset
from vla_accel_ros.models.factory import create_demo_bundle, load_policy, sibling_policy
from vla_accel_ros.models.precision import native_vnni

onnx = pytest.importorskip("onnx", reason="onnx is not installed (requirements.txt)")
pytest.importorskip("onnxscript", reason="onnxscript (torch.onnx's exporter) is not installed (requirements.txt)")

RUNTIMES = [
    pytest.param(b, marks=pytest.mark.skipif(not _has, reason=f"{b} is not installed (requirements.txt)"))
    for b, _has in (("onnxruntime", __import__("importlib").util.find_spec("onnxruntime") is not None),
                    ("openvino", __import__("importlib").util.find_spec("openvino") is not None))
]  # fmt: skip


@pytest.fixture(scope="module")
def smolvla(tmp_path_factory):
    """A tiny two-camera SmolVLA, its fp32 policy, the gate's frame and noise."""
    path = create_demo_bundle("smolvla", "tiny", tmp_path_factory.mktemp("b") / "smolvla", cameras=("cam_high", "cam_left"))
    base = load_policy(path, PolicyConfig(parity_check=False))
    obs = fixed_observation(base.spec)
    noise = np.random.default_rng(0).standard_normal(base.noise_shape).astype(np.float32)
    return base, obs, noise, {}


def _actions(policy, obs, noise):
    policy.reset()
    return policy.infer(obs, noise=noise).actions


def test_the_vision_graph_is_standard_onnx_at_fixed_shapes(smolvla, tmp_path):
    """Opset 18, standard ops only (no custom domain, no function left for a runtime to
    resolve), one camera's pixels in and its token embeddings out, at the bundle's shapes."""
    from vla_accel_ros.core.backends import OPSET, export_onnx
    from vla_accel_ros.models.graphs import vision_example

    base = smolvla[0]
    path = export_onnx(base.model.vis, (vision_example(base.spec),), tmp_path / "vision.onnx",
                       input_names=("pixels",), output_names=("embeddings",))  # fmt: skip
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"} and model.opset_import[0].version == OPSET
    assert {n.domain for n in model.graph.node} <= {""} and not model.functions
    dims = lambda v: [d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    s, t = base.spec.image_size, base.spec.grid**2
    assert dims(model.graph.input[0]) == [1, 3, s, s]
    assert dims(model.graph.output[0]) == [1, t, base.model.vlm.config.hidden_size]


@pytest.mark.parametrize("backend", RUNTIMES)
def test_fp32_graph_matches_the_eager_modules_and_the_policy(smolvla, backend):
    """fp32 on either runtime: the image-token embeddings within 1e-4 of the eager tower on the
    bundle's own frames, and a whole chunk within 1e-4 of the action std; the gate passed."""
    from vla_accel_ros.models.graphs import check_vision_runner

    base, obs, noise, converted = smolvla
    policy = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": backend}}), converted=converted)
    assert policy.vision_graph is not None and policy.precision.label() == f"fp32 +{backend}"
    pixels = torch.cat([base.frames(o).pixels for o in (obs, changed_observation(obs, base.spec))])
    assert check_vision_runner(policy.vision_graph, base.model, pixels) < 1e-4
    std = base.action_scale()[1]
    graph = policy.expert_engine.graph  # SmolVLA's expert runs on the runtime too
    assert graph is not None and graph.describe() == f"{backend} fp32"
    calls = graph.calls
    assert np.abs((_actions(policy, obs, noise) - _actions(base, obs, noise)) / std).max() < 1e-4
    assert graph.calls == calls + policy.num_steps
    assert policy.parity_report.passed and policy.parity_report.metrics["actions_max_over_std"] < 1e-4


def test_the_expert_graph_exports_per_prefix_length_and_stays_on_torch_where_the_runtime_cannot(smolvla):
    """A prefix of another length (another instruction) exports its own graph on first use and
    matches torch; a precision the runtime does not run (ONNX Runtime has no bf16) leaves the
    expert on torch, with a note that says why, while the vision tower still runs there."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    from dataclasses import replace

    base, obs, noise, converted = smolvla
    policy = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": "onnxruntime"}}), converted=converted)
    graph = policy.expert_engine.graph
    other = replace(obs, instruction="put the small block down on the table, then wave")
    assert policy.layout_of(other)[0].length != policy.layout_of(obs)[0].length
    lengths = len(graph.runners)
    std = base.action_scale()[1]
    assert np.abs((_actions(policy, other, noise) - _actions(base, other, noise)) / std).max() < 1e-4
    assert len(graph.runners) == lengths + 1 and not graph.failed
    bf16 = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": "onnxruntime", "expert": "bf16"}}),
                          converted=converted)  # fmt: skip
    assert bf16.vision_graph is not None and bf16.expert_engine.graph is None
    assert any("the expert's pass runs on torch" in n and "bf16" in n for n in bf16.precision_notes)


def test_the_token_cache_runs_on_the_graph_and_the_vision_cache_stays_on_torch(smolvla):
    """Token cache without vision reuse: every camera with a recomputed token goes through the
    graph (all its patches), and the decoder reuses K/V as on torch (same actions). With
    ``cache.reuse_vision`` the vision cache runs the tower itself (partial passes, per-layer
    K/V): the policy runs it on torch and says so."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    base, obs, noise, converted = smolvla
    # Relevance eviction off: on random weights attention is flat and it would evict every token.
    cfg = {"accel": "cache", "cache": {"relevance_mode": "off"}, "precision": {"backend": "onnxruntime"}}
    policy = sibling_policy(base, PolicyConfig.from_dict(cfg), converted=converted)
    calls = []
    graph = policy.vision_graph
    policy.vision_graph = lambda pixels: calls.append(pixels.shape[0]) or graph(pixels)
    second = changed_observation(obs, base.spec)
    policy.reset()
    policy.infer(obs, noise=noise)
    got = policy.infer(second, noise=noise)
    assert calls == [2, 2]  # both cameras, both frames (each camera has a changed block)
    assert got.stats["reused_tokens"] > 0
    torch_cache = sibling_policy(base, PolicyConfig.from_dict({**cfg, "precision": {}}), converted=converted)
    torch_cache.reset()
    torch_cache.infer(obs, noise=noise)
    np.testing.assert_allclose(got.actions, torch_cache.infer(second, noise=noise).actions, atol=1e-4)
    reuse = {**cfg, "cache": {"relevance_mode": "off", "reuse_vision": True}}
    policy = sibling_policy(base, PolicyConfig.from_dict(reuse), converted=converted)
    assert policy.vision_graph is None and policy.precision.backend == "torch"
    assert any("reuse_vision" in n for n in policy.precision_notes)


def test_openvino_bf16_expert_rebinds_the_prefix_of_each_frame(smolvla):
    """The shipped fast path (bf16 decoders, the expert's pass on OpenVINO bf16 over a bf16 KV
    cache): a second frame's chunk equals the one a fresh policy computes on that frame alone
    (the prefix inputs bound again, not the first frame's), the two frames' chunks differ (the
    check has something to catch), and the chunk stays within the gate of fp32. Where the
    precision keeps the expert's attention fp32, the expert stays on torch and says why."""
    pytest.importorskip("openvino", reason="openvino is not installed (requirements.txt)")
    base, obs, noise, _ = smolvla
    cfg = PolicyConfig.from_dict({"precision": {"backend": "openvino", "lm": "bf16", "expert": "bf16", "attention": "bf16"}})
    policy = sibling_policy(base, cfg, converted={})
    graph = policy.expert_engine.graph
    assert graph is not None and graph.describe() == "openvino bf16" and policy.cache.k.dtype == torch.bfloat16
    second = changed_observation(obs, base.spec)
    policy.reset()
    first_chunk = policy.infer(obs, noise=noise).actions
    got = policy.infer(second, noise=noise).actions
    fresh = sibling_policy(base, cfg, converted={})
    fresh.reset()
    np.testing.assert_allclose(got, fresh.infer(second, noise=noise).actions, rtol=0, atol=1e-6)
    std = base.action_scale()[1]
    assert np.abs((first_chunk - got) / std).max() > 1e-3
    assert np.abs((got - _actions(base, second, noise)) / std).max() < 0.02
    fp32_attention = sibling_policy(base, PolicyConfig.from_dict({"precision": {**cfg.to_dict()["precision"], "attention": "fp32"}}),
                                    converted={})  # fmt: skip
    assert fp32_attention.expert_engine.graph is None
    assert any("attention is fp32" in n and "policy.precision.attention=fp32" in n for n in fp32_attention.precision_notes)


def test_a_failing_expert_graph_leaves_the_expert_on_torch(smolvla, monkeypatch):
    """A runtime that fails to load the graph at start-up (any error, not only a missing
    package) leaves the expert on torch with a note naming the error; one that fails mid-chunk
    puts that prefix length on torch (logged) and the chunk is torch's."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    from vla_accel_ros.core import backends

    base, obs, noise, _ = smolvla
    cfg = PolicyConfig.from_dict({"precision": {"backend": "onnxruntime"}})
    real = backends.StepRunner.__init__

    def broken(self, *a, **k):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(backends.StepRunner, "__init__", broken)
    policy = sibling_policy(base, cfg, converted={})
    assert policy.vision_graph is not None and policy.expert_engine.graph is None
    assert any("the expert's pass runs on torch" in n and "RuntimeError: no such kernel" in n for n in policy.precision_notes)
    monkeypatch.setattr(backends.StepRunner, "__init__", real)
    policy = sibling_policy(base, cfg, converted={})
    graph = policy.expert_engine.graph
    monkeypatch.setattr(backends.StepRunner, "__call__", lambda self, feeds: (_ for _ in ()).throw(RuntimeError("device lost")))
    std = base.action_scale()[1]
    assert np.abs((_actions(policy, obs, noise) - _actions(base, obs, noise)) / std).max() < 1e-4
    length = policy.layout_of(obs)[0].length
    assert "device lost" in graph.failed[length] and length not in graph.runners


@pytest.mark.parametrize("backend", RUNTIMES)
def test_int8_graphs_pass_the_gate(smolvla, backend):
    """int8 vision on either runtime (ONNX Runtime's dynamic quantization; OpenVINO through
    NNCF, calibrated on the gate's frames): the gate measured it against fp32 and let it run."""
    if backend == "openvino":
        pytest.importorskip("nncf", reason="nncf (OpenVINO int8) is not installed (requirements.txt)")
    base, obs, noise, converted = smolvla
    policy = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": backend, "vision": "int8"}}),
                            converted=converted)  # fmt: skip
    assert policy.vision_graph is not None and policy.vision_graph.precision == "int8"
    report = policy.parity_report
    assert report.passed and 0 < report.metrics["actions_max_over_std"] <= PrecisionConfig().gate_flow_max_over_std


def _int8_weight_range(path) -> int:
    """The largest |int8 weight| of ONNX Runtime's quantized MatMuls in graph ``path``."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights, "no int8 weights in the graph"
    return max(int(np.abs(w.astype(np.int32)).max()) for w in weights)


def test_onnxruntime_int8_takes_7_bit_weights_where_the_cpu_has_no_vnni(smolvla, tmp_path, monkeypatch):
    """Without VNNI, u8 x s8 products saturate their int16 pair sums: ONNX Runtime's int8 graph
    is quantized with 7-bit weights there (|w| <= 64), 8-bit elsewhere, and ``auto`` keeps it
    (OpenVINO's runs fp32: its overflow fix is no faster than fp32)."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    import vla_accel_ros.models.precision as mp
    from vla_accel_ros.core.backends import write_graph
    from vla_accel_ros.models.graphs import vision_example

    base, obs, noise, _ = smolvla
    example = vision_example(base.spec)
    for reduce_range, limit in ((True, 64), (False, 127)):
        path = write_graph(base.model.vis, example, tmp_path / str(reduce_range), "vision", "onnxruntime", "int8",
                           reduce_range=reduce_range)  # fmt: skip
        assert limit // 2 < _int8_weight_range(path) <= limit
    monkeypatch.setattr(mp, "native_vnni", lambda: False)
    policy = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": "onnxruntime", "vision": "int8"}}),
                            converted={})  # fmt: skip
    assert policy.vision_graph is not None and policy.vision_graph.precision == "int8" and policy.parity_report.passed
    assert any("7-bit weights" in n for n in policy.precision_notes)


def test_openvino_int8_leaves_the_patch_embedding_unquantized_without_smoothquant(smolvla, tmp_path, capsys):
    """NNCF's int8 graph as ``quantize_openvino`` makes it (the departures its doc measured):
    the Convolution reads the raw pixels, no SmoothQuant scales are inserted, the MatMuls still
    read quantized inputs, NNCF's own log lines stay out of the output, and the tokens stay close
    to the fp32 tower's."""
    pytest.importorskip("openvino", reason="openvino is not installed (requirements.txt)")
    pytest.importorskip("nncf", reason="nncf (OpenVINO int8) is not installed (requirements.txt)")
    import openvino as ov

    from vla_accel_ros.core.backends import GraphRunner, write_graph
    from vla_accel_ros.models.graphs import camera_inputs, check_vision_runner, vision_example

    base, obs, _, _ = smolvla
    pixels = torch.cat([base.frames(o).pixels for o in (obs, changed_observation(obs, base.spec))])
    path = write_graph(base.model.vis, vision_example(base.spec), tmp_path, "vision", "openvino", "int8",
                       calibration=camera_inputs([pixels]))  # fmt: skip
    assert "nncf" not in capsys.readouterr().out.lower()
    ops = ov.Core().read_model(str(path)).get_ops()
    conv = [o for o in ops if o.get_type_name() == "Convolution"]
    assert len(conv) == 1 and conv[0].input_value(0).get_node().get_type_name() == "Parameter"
    assert not [o for o in ops if "smooth_quant" in o.get_friendly_name()]
    fake_quantized = {o.get_type_name() for o in ops for v in o.input_values() if v.get_node().get_type_name() == "FakeQuantize"}
    assert "MatMul" in fake_quantized
    if not native_vnni():
        # Without VNNI (AVX2 only) the u8 x s8 products saturate their int16 pair sums: the
        # tokens are far off (the shipped tower: 6.8% RMS, 99% of the std at worst), which is
        # why auto runs the graph in fp32 there (core.precision.GRAPH_INT8_WITHOUT_VNNI).
        return
    with torch.inference_mode():
        scale = float(base.model.vis(pixels).std())
    assert check_vision_runner(GraphRunner(path, "openvino", "int8", threads=1), base.model, pixels) < 0.5 * scale


def test_a_precision_the_runtime_does_not_run_falls_back_to_torch_and_says_so(smolvla):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    base, obs, noise, converted = smolvla
    policy = sibling_policy(base, PolicyConfig.from_dict({"precision": {"backend": "onnxruntime", "vision": "bf16"}}),
                            converted=converted)  # fmt: skip
    assert policy.vision_graph is None and policy.precision.label() == "vision=bf16"
    assert any("onnxruntime runs fp32, int8" in n and "running vision=bf16 instead" in n for n in policy.parity_report.notes)
    assert policy.precision_notes


def test_auto_on_a_runtime_without_bf16_runs_bf16_on_torch_not_fp32_on_the_runtime(tmp_path, bf16_cpu):
    """pi0.5's ``auto`` puts the vision tower in bf16, which ONNX Runtime does not run: the same
    precision on torch comes next, not the backend's fp32 fallback."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    path = create_demo_bundle("pi05", "tiny", tmp_path / "pi05")
    policy = load_policy(path, PolicyConfig.from_dict({"parity_check": False, "precision": {**preset("auto"), "backend": "onnxruntime"}}))
    assert policy.vision_graph is None
    assert policy.precision.backend == "torch" and policy.precision.vision == "bf16" and policy.precision.lm == "bf16"
    assert any("onnxruntime runs fp32, int8" in n for n in policy.precision_notes)


def test_a_missing_runtime_is_a_clear_error_and_the_policy_falls_back(smolvla, monkeypatch):
    """A runtime that does not import: the error names the package to install; the policy runs
    the vision tower on torch, with or without the gate, and its notes say why."""
    from vla_accel_ros.core.backends import BackendUnavailable, check_backend

    base, obs, noise, converted = smolvla
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino -> ImportError
    with pytest.raises(BackendUnavailable, match=r"openvino==.*requirements.txt"):
        check_backend("openvino", "fp32")
    for gate in (True, False):
        cfg = PolicyConfig.from_dict({"parity_check": gate, "precision": {"backend": "openvino"}})
        policy = sibling_policy(base, cfg, converted={})
        assert policy.vision_graph is None and policy.precision.backend == "torch"
        assert any("'openvino' is not installed" in n for n in policy.precision_notes)
    np.testing.assert_array_equal(_actions(policy, obs, noise), _actions(base, obs, noise))


def test_backend_config_and_mode_suffixes():
    from vla_accel_ros.bench.modes import mode_of, parse_modes
    from vla_accel_ros.models.family import get_family

    fam = get_family("smolvla")
    cands = PrecisionConfig(vision="auto", backend="openvino").candidates(fam)
    assert [c.backend for c in cands[:2]] == ["openvino", "openvino"] and cands[-1].backend == "torch"
    assert len(cands) % 2 == 0 and cands[: len(cands) // 2] == [c.replace(backend="openvino") for c in cands[len(cands) // 2 :]]
    assert PrecisionConfig(backend="onnxruntime").gated_against_fp32 and not PrecisionConfig().gated_against_fp32
    with pytest.raises(ConfigError, match="'torch', 'onnxruntime', 'openvino'"):
        PrecisionConfig(backend="tensorrt")
    p = mode_of("cache@auto+openvino+compile").policy["precision"]
    assert p["backend"] == "openvino" and p["compile"] and p["vision"] == "auto"
    assert mode_of("baseline@onnxruntime").policy["precision"] == {"backend": "onnxruntime", "compile": False}
    assert "backend" not in mode_of("baseline@bf16+compile").policy["precision"]  # torch: the default
    for bad in ("baseline@onnxruntime+openvino", "baseline@auto+bf16+openvino", "transformers@openvino", "baseline@+openvino"):
        with pytest.raises(ConfigError):
            parse_modes(bad)


PI0_FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "pi0-lerobot"


@pytest.mark.parametrize("family", ["flow", "ar", "pi0"])
def test_other_families_export_their_vision_too(tiny_bundles, family, tmp_path):
    """The graph is ``model.vis``, whatever the family: the SigLIP tower + projector of the
    package's own bundles and of pi0 (the LeRobot fixture) export and match as well."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    from vla_accel_ros.models.graphs import check_vision_runner, vision_runner

    if family == "pi0":
        if not PI0_FIXTURE.is_dir():
            pytest.skip(f"{PI0_FIXTURE} is missing (../shared beside the checkout)")
        from vla_accel_ros.models.pi0.lerobot_import import import_lerobot

        path = import_lerobot(PI0_FIXTURE / "policy", tmp_path / "pi0", tokenizer=PI0_FIXTURE / "tokenizer", vision_heads=4)
    else:
        path = tiny_bundles[family]
    policy = load_policy(path, PolicyConfig(parity_check=False))
    runner = vision_runner(policy.model, policy.spec, PrecisionConfig(backend="onnxruntime"), threads=1)
    pixels = policy.frames(fixed_observation(policy.spec)).pixels
    assert check_vision_runner(runner, policy.model, pixels) < 1e-4


def test_export_onnx_writes_checked_graphs_that_a_policy_loads(smolvla, tmp_path):
    """``vla-accel export --onnx``: the fp32 graph and ONNX Runtime's int8 written and checked
    against the eager tower (exit 0 within tolerance); a policy with ``precision.graphs`` loads
    them instead of exporting, and falls back to torch, with a note, where a graph is missing."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    import json

    from vla_accel_ros.cli import main

    base, obs, noise, _ = smolvla
    out = tmp_path / "graphs"
    assert main(["export", "--bundle", base.bundle_path, "--out", str(out), "--onnx", "--tolerance", "1e-4"]) == 0
    meta = json.loads((out / "export.json").read_text())
    assert meta["graphs"]["onnxruntime/fp32"]["max_abs_vs_eager"] < 1e-4 and (out / "vision.int8.onnx").is_file()
    assert meta["graphs"]["onnxruntime/int8"]["reduce_range"] is (not native_vnni())  # 7-bit weights without VNNI
    assert meta["input"]["shape"] == [1, 3, base.spec.image_size, base.spec.image_size]
    assert main(["export", "--bundle", base.bundle_path, "--out", str(out), "--onnx"]) == 2  # never overwritten
    cfg = PolicyConfig.from_dict({"precision": {"backend": "onnxruntime", "vision": "int8", "graphs": str(out)}})
    policy = sibling_policy(base, cfg, converted={})
    assert policy.vision_graph is not None and policy.parity_report.passed
    (out / "vision.onnx").rename(out / "kept.onnx")
    policy = sibling_policy(base, cfg.replace(precision=cfg.precision.replace(vision="fp32")), converted={})
    assert policy.vision_graph is None and any("vision.onnx does not exist" in n for n in policy.precision_notes)
    # Graphs of another vision tower (same shapes) are refused, with or without the gate.
    other = create_demo_bundle("smolvla", "tiny", tmp_path / "other", cameras=("cam_high", "cam_left"), seed=1)
    for check in (True, False):
        policy = load_policy(other, cfg.replace(parity_check=check))
        assert policy.vision_graph is None and any("exported from another vision tower" in n for n in policy.precision_notes)


@pytest.mark.slow
def test_export_onnx_steps_match_the_engine(smolvla, tmp_path):
    """``--onnx --steps``: the prefix pass as a functional ONNX graph (standard ops, the prefix
    K/V among its outputs) matches the engine's hidden states on ONNX Runtime."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    import json

    from vla_accel_ros.cli import main

    base = smolvla[0]
    out = tmp_path / "graphs"
    assert main(["export", "--bundle", base.bundle_path, "--out", str(out), "--onnx", "--steps", "--tolerance", "1e-4"]) == 0
    graphs = json.loads((out / "export.json").read_text())["graphs"]
    for name in ("prefill", "expert"):  # the expert: one denoising pass with the prefix K/V as inputs
        assert graphs[f"step/{name}"]["max_abs_vs_engine"] < 1e-4 and (out / f"{name}.onnx").is_file(), name
    import onnx

    inputs = [i.name for i in onnx.load(str(out / "expert.onnx"), load_external_data=False).graph.input]
    assert inputs == ["x", "k_cache", "v_cache", "valid", "cross_k", "cross_v"]


@pytest.mark.slow
def test_export_onnx_steps_of_an_adaptive_expert_take_its_condition(tmp_path):
    """pi0.5's expert (adaptive norms): its ONNX step takes the condition as an input and
    matches the engine under a random one."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    import json

    import onnx

    from vla_accel_ros.cli import main

    path = create_demo_bundle("pi05", "tiny", tmp_path / "pi05")
    out = tmp_path / "graphs"
    assert main(["export", "--bundle", str(path), "--out", str(out), "--onnx", "--steps", "--tolerance", "1e-4"]) == 0
    graphs = json.loads((out / "export.json").read_text())["graphs"]
    assert graphs["step/expert"]["max_abs_vs_engine"] < 1e-4
    assert [i.name for i in onnx.load(str(out / "expert.onnx"), load_external_data=False).graph.input][-1] == "cond"


def test_parity_cli_gates_a_backend(smolvla, capsys):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    from vla_accel_ros.cli import main

    assert main(["parity", "--bundle", smolvla[0].bundle_path, "--backend", "onnxruntime"]) == 0
    out = capsys.readouterr().out
    assert "vision on onnxruntime" in out and "fp32 +onnxruntime: against the fp32 reference" in out and "PASS" in out
