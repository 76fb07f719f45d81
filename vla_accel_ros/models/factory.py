"""Build modules and policies from bundles; write random-weight demo bundles."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.bundle import WEIGHTS_FILE, Bundle, BundleSpec, load_bundle, read_spec, save_bundle
from vla_accel_ros.core.errors import BundleError, ConfigError, ParityError, VlaAccelError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES, ALOHA_START_ARM, PolicyNodeConfig
from vla_accel_ros.core.types import Observation
from vla_accel_ros.core.prefix import PrefixPlanner
from vla_accel_ros.models.base import make_planner
from vla_accel_ros.models.common import skip_init

ALOHA_START = np.array([*ALOHA_START_ARM, 0.5] * 2, dtype=np.float32)  # grippers half open

# Model sizes. ``tiny`` keeps tests fast; ``mini`` (~7M parameters) is what ``vla-accel train``
# trains on a CPU in about an hour (the shipped models/ bundles); ``small`` (~130M parameters)
# is for CPU benchmarks. The vision grid is OpenVLA's 16 x 16 (224 px, 14 px patches) in all.
SIZES = ("tiny", "mini", "small")
_SIZES = {
    "tiny": {
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        "lm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "expert": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16),
        "vocab": 1024,
    },
    "mini": {
        "vision": dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3),
        "lm": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "expert": dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, head_dim=64),
        "vocab": 1024,
    },
    "small": {
        "vision": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6),
        "lm": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
        "expert": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=12, head_dim=64),
        "vocab": 32000,
    },
}


def build_model(spec: BundleSpec) -> nn.Module:
    if spec.family == "ar":
        from vla_accel_ros.models.ar import ArVLA

        return ArVLA(spec)
    from vla_accel_ros.models.flow import FlowVLA

    return FlowVLA(spec)


def demo_spec(
    family: str,
    size: str,
    *,
    cameras: tuple[str, ...] = ("cam_high",),
    action_dim: int = 14,
    chunk_size: int | None = None,
    lm_type: str = "llama",
    state_dim: int | None = None,
    norm_stats: dict | None = None,
    name: str | None = None,
    default_instruction: str | None = None,
    reasoning_words: tuple[str, ...] = (),
    max_reasoning_tokens: int = 0,
) -> BundleSpec:
    """The spec of a ``size`` model of ``family``. Defaults: ALOHA joints, statistics around the
    ALOHA start pose (random-weight demo bundles); ``vla-accel train`` passes the statistics of
    its data. ``state_dim`` None: the family's default (flow: the action size; ar: no state)."""
    if size not in _SIZES:
        raise ConfigError(f"size={size!r} is not one of {', '.join(_SIZES)}")
    if family not in ("ar", "flow"):
        raise ConfigError(f"family={family!r} is not one of ar, flow")
    sz = _SIZES[size]
    vocab = sz["vocab"]
    lm = {"model_type": lm_type, **sz["lm"], "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0}
    vision = {**sz["vision"], "image_size": 224, "patch_size": 14}
    joints = ALOHA_JOINT_NAMES if action_dim == 14 else tuple(f"joint_{i}" for i in range(action_dim))
    if state_dim is None:
        state_dim = action_dim if family == "flow" else 0
    if norm_stats is None:
        start = ALOHA_START if action_dim == 14 else np.zeros(action_dim, dtype=np.float32)
        std = np.full(action_dim, 0.25, dtype=np.float32)
        stats = {"mean": start, "std": std, "q01": start - 2.5 * std, "q99": start + 2.5 * std}
        norm_stats = {"action": {k: v.tolist() for k, v in stats.items()}}
        if state_dim:
            s_mean = start if state_dim == action_dim else np.zeros(state_dim, dtype=np.float32)
            norm_stats["state"] = {"mean": s_mean.tolist(), "std": [0.25] * state_dim}
    common = dict(
        cameras=cameras, image_size=224, patch_size=14, action_dim=action_dim, joint_names=joints,
        vision=vision, dt=0.02, state_dim=state_dim, norm_stats=norm_stats, name=name or f"demo-{family}-{size}",
    )  # fmt: skip
    if default_instruction is not None:
        common["default_instruction"] = default_instruction
    if family == "ar":
        # A reasoning policy's words take the ids just below the action bins.
        return BundleSpec(
            family="ar", text_vocab=vocab - 256 - 3 - len(reasoning_words), action_bins=256, chunk_size=chunk_size or 1,
            lm=lm, reasoning_words=tuple(reasoning_words), max_reasoning_tokens=max_reasoning_tokens, **common,
        )  # fmt: skip
    expert = {
        "model_type": lm_type, **sz["expert"], "num_hidden_layers": lm["num_hidden_layers"],
        "num_key_value_heads": lm["num_key_value_heads"], "vocab_size": 1, "max_position_embeddings": 4096,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "rope_theta": 10000.0,
    }  # fmt: skip
    return BundleSpec(
        family="flow", text_vocab=vocab - 3, chunk_size=chunk_size or 50, num_steps=10,
        instruction_template="{instruction}", lm=lm, expert=expert, **common,
    )  # fmt: skip


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


def model_from_bundle(bundle: Bundle) -> nn.Module:
    weights = {k: (tuple(v.shape), v.is_floating_point()) for k, v in bundle.state_dict.items()}
    check_weights(bundle.path, bundle.spec, weights)  # before anything is allocated
    with skip_init():
        model = build_model(bundle.spec)
    model.load_state_dict({k: v.to(torch.float32) for k, v in bundle.state_dict.items()}, strict=True)
    return model.eval()


def load_policy(
    bundle: str | Path | Bundle,
    config: PolicyConfig | None = None,
    *,
    planner: PrefixPlanner | None = None,
):
    """A ready policy. With ``config.parity_check`` the accelerated path must pass the parity
    gate first, or this raises :class:`ParityError` (the policy refuses to start)."""
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    return build_policy(
        bundle.spec, model_from_bundle(bundle), config, planner=planner, where=str(bundle.path), bundle_path=str(bundle.path)
    )


def load_for_robot(cfg: PolicyNodeConfig, instruction: str = ""):
    """The policy node's policy: the bundle checked against ``cfg.robot``, torch threads set,
    loaded (through the parity gate) and, with ``cfg.warmup``, run once on a blank observation."""
    if not cfg.bundle:
        raise VlaAccelError("parameter 'bundle' is empty: give the path of a model bundle")
    spec = read_spec(cfg.bundle)
    if tuple(spec.joint_names) != tuple(cfg.robot.joint_names):
        raise VlaAccelError(
            f"the bundle's joint_names {list(spec.joint_names)} differ from robot.joint_names {list(cfg.robot.joint_names)}"
        )
    if spec.state_dim and spec.state_dim != cfg.robot.dim:
        raise VlaAccelError(f"the bundle expects a {spec.state_dim}-D state, the robot has {cfg.robot.dim} joints")
    if cfg.trigger == "pipelined" and spec.family != "ar":
        raise VlaAccelError(f"trigger=pipelined pipelines ar decoding; bundle {spec.name} is {spec.family}")
    if not cfg.policy.num_threads:
        # torch's default takes every core; the control loop, the camera callbacks and DDS
        # then wait behind inference (measured: 2 threads on 2 cores ran inference 10-30x
        # slower than 1). Leave one core to the rest of the graph.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    policy = load_policy(cfg.bundle, cfg.policy)
    if cfg.warmup:
        blank = {c: np.zeros((spec.image_size, spec.image_size, 3), np.uint8) for c in spec.cameras}
        state = np.zeros(spec.state_dim, np.float32) if spec.state_dim else None
        policy.infer(Observation(images=blank, instruction=instruction, stamp_ns=0, state=state))
        policy.reset()
    return policy


def _policy(spec: BundleSpec, model: nn.Module, config: PolicyConfig, planner, bundle_path: str = "", precision=None):
    if spec.family == "ar":
        from vla_accel_ros.models.ar import ArPolicy

        return ArPolicy(spec, model, config, planner, bundle_path=bundle_path, precision=precision)
    from vla_accel_ros.models.flow import FlowPolicy

    return FlowPolicy(spec, model, config, planner, precision=precision)


def build_policy(
    spec: BundleSpec,
    model: nn.Module,
    config: PolicyConfig | None = None,
    *,
    planner=None,
    where: str = "",
    bundle_path: str = "",
    converted: dict[str, nn.Module] | None = None,
    gate_observations: tuple[Observation, Observation] | None = None,
):
    """A policy around already-built fp32 modules (several policies may share one model's
    weights, each with its own KV cache and planner), gated like :func:`load_policy`.

    ``config.precision`` below fp32 runs on a converted copy of ``model`` (``converted``, a
    dict the caller keeps, shares one copy per precision between policies); the gate then
    compares it with the fp32 transformers path of ``model`` on ``gate_observations`` (two
    frames; default: the gate's synthetic frames). Components set to ``auto`` fall back as
    :meth:`PrecisionConfig.candidates` lists while the gate refuses (its report notes which)."""
    from vla_accel_ros.core.parity import fp32_reference, run_parity
    from vla_accel_ros.models.precision import convert_model

    config = config or PolicyConfig()
    candidates = config.precision.candidates(spec.family)
    fp32_ref = None
    refused: list[str] = []
    for precision in candidates:
        run_model = model
        if precision.reduced:
            key = precision.label()
            run_model = converted.get(key) if converted is not None else None
            if run_model is None:
                run_model = convert_model(model, spec.family, precision)
                if converted is not None:
                    converted[key] = run_model
        policy = _policy(spec, run_model, config, planner or make_planner(config), bundle_path, precision)
        if not config.parity_check:
            return policy
        if precision.reduced:
            if fp32_ref is None:
                fp32 = _policy(spec, model, PolicyConfig(parity_check=False), None)
                fp32_ref = fp32_reference(fp32, observations=gate_observations)
            policy.fp32_reference = fp32_ref
        report = run_parity(policy, tolerance=config.parity_tolerance, observations=gate_observations)
        if report.passed:
            if refused:
                report.notes.append(f"precision auto: the gate refused {'; '.join(refused)}, running {precision.label()}")
            policy.parity_report = report
            return policy
        refused.append(precision.label())
    tried = f" (precision auto tried {'; '.join(refused)})" if len(refused) > 1 else ""
    raise ParityError(f"{where or spec.name}: parity gate failed{tried}, the policy refuses to start:\n{report.table()}")


def sibling_policy(policy, config: PolicyConfig, **kwargs):
    """Another policy on ``policy``'s weights with its own cache, planner and config (``policy``
    must run fp32: reduced-precision siblings are converted from its weights)."""
    if policy.precision.reduced:
        raise ConfigError("build sibling policies from an fp32 policy (its weights are what other precisions convert)")
    return build_policy(policy.spec, policy.model, config, where=policy.spec.name, bundle_path=policy.bundle_path, **kwargs)


def inspect_bundle(path: str | Path) -> str:
    """A bundle's description once it passed the loader's checks (config fields and sizes,
    weights against the config), reading only the weights' header; raises :class:`BundleError`."""
    spec = read_spec(path)
    weights = stored_weights(path)
    check_weights(path, spec, weights)
    return describe(Path(path), spec, sum(math.prod(shape) for shape, _ in weights.values()))


def describe(path: Path, s: BundleSpec, parameters: int) -> str:
    lines = [
        f"bundle      {path}",
        f"name        {s.name} (family {s.family})",
        f"parameters  {parameters / 1e6:.1f} M",
        f"cameras     {', '.join(s.cameras)} at {s.image_size}px, {s.grid}x{s.grid} tokens each",
        f"lm          {s.lm.get('model_type', 'llama')}: {s.lm['num_hidden_layers']} layers, hidden {s.lm['hidden_size']}, "
        f"heads {s.lm['num_attention_heads']}/{s.lm.get('num_key_value_heads', s.lm['num_attention_heads'])} (q/kv)",
    ]
    if s.expert:
        lines.append(f"expert      hidden {s.expert['hidden_size']}, {s.expert['num_hidden_layers']} layers")
    lines += [
        f"actions     chunk {s.chunk_size} x {s.action_dim}, dt {s.dt}s"
        + (f", {s.num_steps} Euler steps" if s.family == "flow" else f", {s.action_dim * s.chunk_size} tokens from {s.action_bins} bins"),
        f"joints      {', '.join(s.joint_names)}",
        f"state       {s.state_dim or 'none'}",
        f"template    {s.instruction_template!r}",
        f"norm stats  {', '.join(sorted(s.norm_stats))}",
    ]
    return "\n".join(lines)
