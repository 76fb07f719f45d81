"""Build modules and policies from bundles; write random-weight demo bundles."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core import bundle as core_bundle
from vla_accel_ros.core.bundle import WEIGHTS_FILE, Bundle, BundleSpec, read_spec, save_bundle
from vla_accel_ros.core.errors import BundleError, ConfigError, ParityError, VlaAccelError
from vla_accel_ros.core.memory import keep_freed_memory
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import PolicyNodeConfig
from vla_accel_ros.core.types import Observation
from vla_accel_ros.core.prefix import PrefixPlanner
from vla_accel_ros.models.base import make_planner
from vla_accel_ros.models.common import skip_init
from vla_accel_ros.models.family import Family, family_names, get_family

def spec_family(spec: BundleSpec, where: str | Path = "") -> Family:
    """The plug-in of ``spec``'s family, after it checked the spec (:class:`BundleError` naming
    ``where`` and the field otherwise)."""
    family = get_family(spec.family)
    try:
        family.validate_spec(spec)
    except ConfigError as e:
        raise BundleError(f"{where}: {e}" if where else str(e)) from e
    return family


def read_model_spec(path: str | Path) -> BundleSpec:
    """A bundle's config.json, checked by its family too (the loaders' first step)."""
    spec = read_spec(path)
    spec_family(spec, Path(path) / "config.json")
    return spec


def build_model(spec: BundleSpec) -> nn.Module:
    return spec_family(spec).build_model(spec)


def demo_spec(family: str, size: str, **kwargs) -> BundleSpec:
    """The spec of a random-weight ``size`` model of ``family`` (:mod:`vla_accel_ros.models.demo`;
    keyword arguments: cameras, action_dim, chunk_size, lm_type, state_dim, norm_stats, name,
    default_instruction, reasoning_words, max_reasoning_tokens, as the family takes them)."""
    fam = get_family(family)  # BundleError for an unknown family
    if family not in family_names(can="demo"):
        raise ConfigError(f"family={family!r} has no random-weight demo bundles; families that do: {', '.join(family_names(can='demo'))}")
    return fam.demo_spec(size, **kwargs)


def create_demo_bundle(family: str, size: str, out: str | Path, *, seed: int = 0, **spec_kwargs) -> Path:
    """Write a random-weight bundle (deterministic for a given seed)."""
    spec = demo_spec(family, size, **spec_kwargs)
    torch.manual_seed(seed)
    model = build_model(spec)
    return save_bundle(out, spec, model.state_dict())


def expected_weights(spec: BundleSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight the config implies (built on the meta device: nothing allocated)."""
    with torch.device("meta"), skip_init():
        model = build_model(spec)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights(where: str | Path, spec: BundleSpec, weights: dict[str, tuple[tuple[int, ...], bool]]) -> None:
    """Raise :class:`BundleError` unless ``weights`` (name -> (shape, is floating point)) are
    exactly what ``spec`` implies: the loader's rule, and ``vla-accel bundle inspect``'s."""
    expected = expected_weights(spec)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise BundleError(
            f"{where}: weights do not match the config: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, (shape, floating) in weights.items():
        if tuple(shape) != expected[name]:
            raise BundleError(f"{where}: {name} has shape {list(shape)}, config implies {list(expected[name])}")
        if not floating:
            raise BundleError(f"{where}: {name} is not a floating point tensor")


def stored_weights(path: str | Path) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (shape, is floating point) of a bundle's model.safetensors, read from its header
    (no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise BundleError(f"{path}: missing {WEIGHTS_FILE}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype() in ("F16", "BF16", "F32", "F64"))
            return out
    except (SafetensorError, OSError) as e:
        raise BundleError(f"{weights}: unreadable safetensors file: {e}") from e


def load_bundle(path: str | Path) -> Bundle:
    """A bundle's config (checked by its family) and weights (safetensors)."""
    bundle = core_bundle.load_bundle(path)
    spec_family(bundle.spec, Path(path) / "config.json")
    return bundle


def model_from_bundle(bundle: Bundle) -> nn.Module:
    weights = {k: (tuple(v.shape), v.is_floating_point()) for k, v in bundle.state_dict.items()}
    check_weights(bundle.path, bundle.spec, weights)  # before anything is allocated
    with skip_init():
        model = build_model(bundle.spec)
    # assign: the parameters become the loaded tensors instead of copies of them. An fp32 file's
    # tensors are memory-mapped (safetensors), so its weights are never held twice: a 3.2 B fp32
    # pi0 peaked at 23.9 GB resident with the copy, on a 24 GiB machine.
    model.load_state_dict({k: v.to(torch.float32) for k, v in bundle.state_dict.items()}, strict=True, assign=True)
    return model.eval()


def load_policy(
    bundle: str | Path | Bundle,
    config: PolicyConfig | None = None,
    *,
    planner: PrefixPlanner | None = None,
    gate_observations: tuple[Observation, Observation] | None = None,
):
    """A ready policy. With ``config.parity_check`` the accelerated path must pass the parity
    gate first (on ``gate_observations``, default the synthetic pair), or this raises
    :class:`ParityError` (the policy refuses to start)."""
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    return build_policy(
        bundle.spec, model_from_bundle(bundle), config, planner=planner, where=str(bundle.path), bundle_path=str(bundle.path),
        gate_observations=gate_observations,
    )  # fmt: skip


def load_for_robot(cfg: PolicyNodeConfig, instruction: str = "", gate_observations: tuple[Observation, Observation] | None = None):
    """The policy node's policy: the bundle checked against ``cfg.robot``, torch threads set,
    loaded (through the parity gate, on ``gate_observations`` when given: the frames of
    ``cfg.gate_bag``) and, with ``cfg.warmup``, run once on a blank observation."""
    if not cfg.bundle:
        raise VlaAccelError("parameter 'bundle' is empty: give the path of a model bundle")
    spec = read_model_spec(cfg.bundle)
    if tuple(spec.joint_names) != tuple(cfg.robot.joint_names):
        raise VlaAccelError(
            f"the bundle's joint_names {list(spec.joint_names)} differ from robot.joint_names {list(cfg.robot.joint_names)}"
        )
    if spec.state_dim and spec.state_dim != cfg.robot.dim:
        raise VlaAccelError(f"the bundle expects a {spec.state_dim}-D state, the robot has {cfg.robot.dim} joints")
    if cfg.trigger == "pipelined" and not get_family(spec.family).pipelines:
        raise VlaAccelError(f"trigger=pipelined pipelines ar decoding; bundle {spec.name} is {spec.family}")
    if not cfg.policy.num_threads:
        # torch's default takes every core; the control loop, the camera callbacks and DDS
        # then wait behind inference (measured: 2 threads on 2 cores ran inference 10-30x
        # slower than 1). Leave one core to the rest of the graph.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    policy = load_policy(cfg.bundle, cfg.policy, gate_observations=gate_observations)
    if cfg.warmup:
        blank = {c: np.zeros((spec.image_size, spec.image_size, 3), np.uint8) for c in spec.cameras}
        state = np.zeros(spec.state_dim, np.float32) if spec.state_dim else None
        policy.infer(Observation(images=blank, instruction=instruction, stamp_ns=0, state=state))
        policy.reset()
    return policy


def build_policy(
    spec: BundleSpec,
    model: nn.Module,
    config: PolicyConfig | None = None,
    *,
    planner=None,
    where: str = "",
    bundle_path: str = "",
    converted: dict | None = None,
    gate_observations: tuple[Observation, Observation] | None = None,
):
    """A policy around already-built fp32 modules (several policies may share one model's
    weights, each with its own KV cache and planner), gated like :func:`load_policy`.

    ``config.precision`` below fp32 runs on a converted copy of ``model`` (``converted``, a
    dict the caller keeps, shares one copy per precision between policies, and one exported
    graph per backend and precision); the gate then compares it with the fp32 transformers
    path of ``model`` on ``gate_observations`` (two frames; default: the gate's synthetic
    frames). Components set to ``auto`` fall back as :meth:`PrecisionConfig.candidates` lists
    while the gate refuses (its report notes which); a backend that is not installed or does
    not run the precision is passed over the same way, without a gate run
    (``policy.precision_notes`` says why, with or without the gate)."""
    from vla_accel_ros.core.backends import BackendUnavailable
    from vla_accel_ros.core.parity import TOKEN_METHOD_CHECKS, fp32_reference, run_parity
    from vla_accel_ros.models.precision import convert_model, native_bf16, native_vnni

    config = config or PolicyConfig()
    keep_freed_memory(config.malloc_keep_mb)  # here, not per policy: internal fp32 references use defaults
    family = spec_family(spec, where)
    cpu = {"native_bf16": native_bf16(), "native_vnni": native_vnni()}
    candidates = config.precision.candidates(family, **cpu)
    fp32_ref = None
    refused: list[str] = []  # by the gate
    passed_over: list[str] = []  # backends that could not run
    cpu_notes = _cpu_notes(config.precision, family, **cpu)
    converted = {} if converted is None else converted
    while candidates:
        precision = candidates.pop(0)
        run_model = model
        if precision.reduced:
            key = precision.weights_label()
            run_model = converted.get(key)
            if run_model is None:
                run_model = converted[key] = convert_model(model, family, precision)
        policy = family.make_policy(
            spec, run_model, config, planner or make_planner(config), bundle_path=bundle_path, precision=precision
        )
        if precision.backend != "torch" and config.uses_cache and config.cache.reuse_vision:
            passed_over.append(f"{precision.label()}: cache.reuse_vision runs the vision tower in the vision cache "
                               "(partial passes over per-layer K/V), on torch")  # fmt: skip
            continue
        if precision.backend != "torch":
            try:
                policy.vision_graph = _vision_graph(policy, model, precision, converted, gate_observations)
            except BackendUnavailable as e:
                passed_over.append(f"{precision.label()}: {e}")
                # The same precision on torch next, before the backend's less precise fallbacks
                # (ONNX Runtime has no bf16: auto's bf16 vision then runs on torch, not fp32 on it).
                same = precision.replace(backend="torch")
                candidates = [same] + [c for c in candidates if c != same]
                continue
        step_notes = policy.use_step_graphs(model, converted) if precision.backend != "torch" else []
        notes = cpu_notes + [f"{p}; running {precision.label()} instead" for p in passed_over] + step_notes
        policy.gate_observations = gate_observations
        policy.precision_notes = list(notes)  # its own list: the gate's note below goes to both once
        if not config.parity_check:
            return policy
        if precision.gated_against_fp32:
            if fp32_ref is None:
                # One fp32 reference per gate frames for the policies sharing ``converted``
                # (a replay's modes): at full size it is two fp32 reference inferences each.
                # The reference samples as the policy does (its noise scale): the gate compares
                # precision, not two samplers.
                scale = config.noise_scale(spec.noise_scale)
                kept = converted.get("fp32_reference")
                if kept is not None and kept[0] is gate_observations and kept[2] == scale:
                    fp32_ref = kept[1]
                else:
                    ref_config = PolicyConfig(parity_check=False, flow_noise_scale=scale)
                    fp32 = family.make_policy(spec, model, ref_config, None, bundle_path=bundle_path)
                    fp32_ref = fp32_reference(fp32, observations=gate_observations)
                    converted["fp32_reference"] = (gate_observations, fp32_ref, scale)
            policy.fp32_reference = fp32_ref
        report = run_parity(policy, tolerance=config.parity_tolerance, observations=gate_observations)
        if report.passed:
            report.notes += notes
            if refused:
                report.notes.append(f"precision {config.precision.label()}: the gate refused {'; '.join(refused)}, running {precision.label()}")
                policy.precision_notes.append(report.notes[-1])
            policy.parity_report = report
            return policy
        refused.append(precision.label())
        if all(f.startswith(TOKEN_METHOD_CHECKS) for f in report.failures):
            break  # the token method failed, not the precision: another precision would not pass
    tried = f" (precision auto tried {'; '.join(refused)})" if len(refused) > 1 else ""
    raise ParityError(f"{where or spec.name}: parity gate failed{tried}, the policy refuses to start:\n{report.table()}")


def _cpu_notes(asked, family, *, native_bf16: bool, native_vnni: bool) -> list[str]:
    """What a CPU without bf16 instructions or VNNI changes: ``auto`` runs what
    ``PrecisionConfig._auto`` says there; explicit bf16 components run emulated (slower than
    fp32), and an explicit int8 vision graph on a backend saturates."""
    from vla_accel_ros.core.precision import COMPONENTS, WITHOUT_BF16

    usual, here = asked.resolve(family), asked.resolve(family, native_bf16=native_bf16, native_vnni=native_vnni)
    changed = [f"{c}={getattr(here, c)}" for c in COMPONENTS if getattr(usual, c) != getattr(here, c)]
    lacks = " nor ".join(w for w, ok in (("bf16 instructions (AVX-512 or AVX-NE-CONVERT)", native_bf16), ("VNNI", native_vnni)) if not ok)
    graph = asked.backend != "torch"
    # (a vision graph on a backend is not emulated: OpenVINO runs its bf16 hint as fp32 there)
    explicit = [f"{c}={getattr(asked, c)}" for c in COMPONENTS if getattr(asked, c) in WITHOUT_BF16 and not (c == "vision" and graph)]
    notes = []
    if changed:
        notes.append(f"this CPU has no {lacks}: precision auto runs {', '.join(changed)}")
    if explicit and not native_bf16:
        notes.append(f"this CPU has no bf16 instructions: {', '.join(explicit)} runs its bf16 matmuls emulated, slower than fp32")
    if asked.vision == "int8" and asked.backend == "openvino" and not native_vnni:
        notes.append("this CPU has no VNNI: openvino's int8 vision graph saturates and runs slower than fp32 here "
                     "(the gate is likely to refuse it)")  # fmt: skip
    if here.vision == "int8" and asked.backend == "onnxruntime" and not native_vnni and not asked.graphs:
        notes.append("this CPU has no VNNI: onnxruntime's int8 vision graph takes 7-bit weights (reduce_range), "
                     "which do not saturate")  # fmt: skip
    return notes


def _vision_graph(policy, model: nn.Module, precision, converted: dict, gate_observations):
    """The policy's vision tower + connector on ``precision.backend`` (one per backend and vision
    precision in ``converted``): read from ``precision.graphs``, else exported now (OpenVINO
    int8 calibrated on the gate's frames)."""
    from vla_accel_ros.core.backends import graph_file, load_runner
    from vla_accel_ros.core.parity import gate_frames
    from vla_accel_ros.models.graphs import VISION, vision_example, vision_runner

    key = f"graph:{VISION}:{precision.backend}:{precision.vision}:{precision.graphs}"
    if key not in converted:
        threads = torch.get_num_threads()
        if precision.graphs:
            _check_graphs_source(Path(precision.graphs), model)
            path = Path(precision.graphs) / graph_file(VISION, precision.backend, precision.vision)
            converted[key] = load_runner(path, precision.backend, precision.vision, threads=threads,
                                         shape=vision_example(policy.spec).shape)  # fmt: skip
        else:
            calibration = [policy.frames(o).pixels for o in gate_frames(policy.spec, observations=gate_observations)]
            converted[key] = vision_runner(model, policy.spec, precision, threads=threads, calibration=calibration)
    return converted[key]


def _check_graphs_source(graphs: Path, model: nn.Module) -> None:
    """``precision.graphs`` must hold graphs of this model's vision tower (export.json's
    fingerprint): the shapes of another bundle's graph can match, and without the gate
    (``parity_check: false``) nothing else would notice."""
    import json

    from vla_accel_ros.core.backends import BackendUnavailable
    from vla_accel_ros.models.graphs import vision_fingerprint

    meta_file = graphs / "export.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BackendUnavailable(f"precision.graphs={graphs}: no readable export.json ({e}); write the graphs with "
                                 "vla-accel export --onnx") from e  # fmt: skip
    if meta.get("vision_fingerprint") != vision_fingerprint(model):
        raise BackendUnavailable(f"precision.graphs={graphs}: exported from another vision tower (bundle "
                                 f"{meta.get('bundle', '?')}); export this bundle's with vla-accel export --onnx")  # fmt: skip


def sibling_policy(policy, config: PolicyConfig, **kwargs):
    """Another policy on ``policy``'s weights with its own cache, planner and config (``policy``
    must run fp32: reduced-precision siblings are converted from its weights)."""
    if policy.precision.reduced:
        raise ConfigError("build sibling policies from an fp32 policy (its weights are what other precisions convert)")
    return build_policy(policy.spec, policy.model, config, where=policy.spec.name, bundle_path=policy.bundle_path, **kwargs)


def inspect_bundle(path: str | Path) -> str:
    """A bundle's description once it passed the loader's checks (config fields and sizes,
    weights against the config), reading only the weights' header; raises :class:`BundleError`."""
    spec = read_model_spec(path)
    weights = stored_weights(path)
    check_weights(path, spec, weights)
    return describe(Path(path), spec, sum(math.prod(shape) for shape, _ in weights.values()))


def describe(path: Path, s: BundleSpec, parameters: int) -> str:
    lines = [
        f"bundle      {path}",
        f"name        {s.name} (family {s.family})",
        f"parameters  {parameters / 1e6:.1f} M",
        f"cameras     {', '.join(s.cameras)} at {s.image_size}px ({s.image_resize}), {s.grid}x{s.grid} tokens each",
        f"lm          {s.lm.get('model_type', 'llama')}: {s.lm['num_hidden_layers']} layers, hidden {s.lm['hidden_size']}, "
        f"heads {s.lm['num_attention_heads']}/{s.lm.get('num_key_value_heads', s.lm['num_attention_heads'])} (q/kv)",
    ]
    if s.expert:
        lines.append(f"expert      hidden {s.expert['hidden_size']}, {s.expert['num_hidden_layers']} layers")
    lines += [
        f"actions     chunk {s.chunk_size} x {s.action_dim}, dt {s.dt}s",
        *get_family(s.family).describe(s),
        f"joints      {', '.join(s.joint_names)}",
        f"state       {s.state_dim or 'none'}",
        f"template    {s.instruction_template!r}",
        f"tokenizer   {s.tokenizer}",
        f"norm stats  {', '.join(sorted(s.norm_stats))}",
    ]
    return "\n".join(lines)
