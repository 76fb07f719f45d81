"""LeRobot SmolVLA checkpoints -> ``smolvla`` bundles (``vla-accel bundle import --lerobot DIR``).

Reads LeRobot's saved layout (``config.json`` of type ``smolvla``, ``model.safetensors``, the
pre- and post-processor pipelines' JSON and their statistics files) and the SmolVLM directory
its ``vlm_model_name`` names (config, tokenizer): ``--vlm``, else that path, else the local
Hugging Face cache when it is a hub id (an offline lookup; nothing is downloaded). Writes an
ordinary bundle: config.json, model.safetensors (our module names), the tokenizer's files in
``tokenizer/`` (written by transformers) and ``source.json`` (where it came from, LeRobot's
camera feature -> bundle camera map).

Every option that changes the forward pass is carried into the bundle (see
:class:`~vla_accel_ros.models.smolvla.configuration_smolvla.SmolVLAOptions`); options without
an effect on one inference (``pad_language_to`` and ``prefix_length``: padding tokens nobody
attends to; ``empty_cameras``: blank cameras with no attention; ``n_action_steps``,
``rtc_config``: execution, which the controller does here) are noted in source.json. A value
LeRobot itself cannot run is refused naming the option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models import demo
from vla_accel_ros.models.factory import check_weights, spec_family
from vla_accel_ros.models.lerobot_compat import write_imported
from vla_accel_ros.models.lerobot_compat import NORM_MODES
from vla_accel_ros.models.smolvla.configuration_smolvla import SmolVLAOptions

_PREFIX = "model."
# LeRobot's module names -> ours (the first prefix that matches).
_KEY_MAP = (
    ("model.vlm_with_expert.vlm.model.vision_model.", "vis.vision."),
    ("model.vlm_with_expert.vlm.model.connector.", "vis.connector."),
    ("model.vlm_with_expert.vlm.model.text_model.", "vlm."),
    ("model.vlm_with_expert.lm_expert.", "expert."),
    ("model.state_proj.", "state_proj."),
    ("model.action_in_proj.", "action_in."),
    ("model.action_out_proj.", "action_out."),
    ("model.action_time_mlp_in.", "time_in."),
    ("model.action_time_mlp_out.", "time_out."),
)
_UNUSED = ("model.vlm_with_expert.vlm.lm_head.",)  # SmolVLA never reads the VLM's language head
_IMAGE_KEY = "observation.images."


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise BundleError(f"{path}: missing (a LeRobot policy directory holds config.json, model.safetensors and the processors' JSON)") from e
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BundleError(f"{path}: top level must be an object")
    return data


def find_vlm_dir(name: str, policy_dir: Path, vlm: str | Path | None) -> Path:
    """The SmolVLM directory: ``vlm``, else ``name`` as a path (as given, then beside the
    checkpoint), else the local Hugging Face cache of hub id ``name``."""
    if vlm:
        path = Path(vlm)
        if not (path / CONFIG_FILE).is_file():
            raise BundleError(f"--vlm {path}: no config.json there (the SmolVLM directory has config.json and the tokenizer)")
        return path
    for path in (Path(name), policy_dir / name, policy_dir.parent / name):
        if (path / CONFIG_FILE).is_file():
            return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, local_files_only=True))
    except Exception as e:  # the hub raises many types for "not cached" and "not an id"
        raise BundleError(
            f"vlm_model_name={name!r}: not a directory here or beside the checkpoint, and not in the local Hugging Face "
            f"cache ({type(e).__name__}); pass --vlm DIR with the SmolVLM config.json and tokenizer"
        ) from e


def _processor_step(pipeline: dict, name: str) -> dict | None:
    for step in pipeline.get("steps", []):
        if step.get("registry_name") == name:
            return step
    return None


def _stats(policy_dir: Path, step: dict | None) -> dict[str, dict[str, list[float]]]:
    """Feature -> statistic -> values, from a normalizer step's state file."""
    if step is None or not step.get("state_file"):
        return {}
    from safetensors.torch import load_file

    tensors = load_file(str(policy_dir / step["state_file"]))
    out: dict[str, dict[str, list[float]]] = {}
    for key, value in tensors.items():
        feature, _, stat = key.rpartition(".")
        out.setdefault(feature, {})[stat] = value.float().reshape(-1).tolist()
    return out


def _norm_mode(cfg: dict, kind: str) -> str:
    mode = str((cfg.get("normalization_mapping") or {}).get(kind, "IDENTITY"))
    if mode not in NORM_MODES:
        raise ConfigError(f"normalization_mapping.{kind}={mode!r} is not a LeRobot normalization mode ({', '.join(NORM_MODES)})")
    return mode


def _check_config(cfg: dict) -> None:
    if cfg.get("type") != "smolvla":
        raise BundleError(f"config.json: type={cfg.get('type')!r}; this importer reads LeRobot smolvla checkpoints")
    if cfg.get("use_delta_joint_actions_aloha"):
        raise ConfigError("use_delta_joint_actions_aloha=true: LeRobot itself does not implement it (NotImplementedError)")
    if int(cfg.get("n_obs_steps", 1)) != 1:
        raise ConfigError(f"n_obs_steps={cfg.get('n_obs_steps')}: SmolVLA reads one observation step")
    size = cfg.get("resize_imgs_with_padding")
    if size is not None and (len(size) != 2 or size[0] != size[1]):
        raise ConfigError(
            f"resize_imgs_with_padding={size}: SmolVLM's pixel shuffle needs a square image (LeRobot fails on others)"
        )
    if _norm_mode(cfg, "VISUAL") != "IDENTITY":
        raise ConfigError(
            f"normalization_mapping.VISUAL={_norm_mode(cfg, 'VISUAL')}: image normalization by dataset statistics is not "
            "supported by this importer yet (SmolVLA's default is IDENTITY)"
        )


def _map_weights(state: dict[str, torch.Tensor], vlm_layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key.startswith(_UNUSED):
            continue
        for src, dst in _KEY_MAP:
            if key.startswith(src):
                new = dst + key[len(src):]
                break
        else:
            raise BundleError(f"model.safetensors: unexpected weight {key} for a SmolVLA checkpoint")
        if new.startswith("vlm.layers."):
            if int(new.split(".")[2]) >= vlm_layers:
                continue  # a layer SmolVLA truncated away (num_vlm_layers)
        out[new] = value.float().contiguous()
    return out


def import_lerobot(
    policy_dir: str | Path, out: str | Path, *, vlm: str | Path | None = None, name: str | None = None,
    joint_names: tuple[str, ...] | None = None, fps: float = 50.0, default_instruction: str = "", **unused,
) -> Path:  # fmt: skip
    """Write a ``smolvla`` bundle at ``out`` from LeRobot's saved policy at ``policy_dir``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    policy_dir, out = Path(policy_dir), Path(out)
    if out.exists():
        raise BundleError(f"{out} exists already; bundles are never overwritten")
    cfg = _read_json(policy_dir / CONFIG_FILE)
    _check_config(cfg)
    pre = _read_json(policy_dir / "policy_preprocessor.json")
    post = _read_json(policy_dir / "policy_postprocessor.json")
    vlm_dir = find_vlm_dir(str(cfg.get("vlm_model_name", "")), policy_dir, vlm)
    vlm_cfg = _read_json(vlm_dir / CONFIG_FILE)
    text, vision = dict(vlm_cfg.get("text_config") or {}), dict(vlm_cfg.get("vision_config") or {})
    if not text or not vision:
        raise BundleError(f"{vlm_dir / CONFIG_FILE}: not a SmolVLM config (no text_config / vision_config)")

    # Features: the cameras (LeRobot's blank empty cameras are never attended to: left out), state, action.
    feats = cfg.get("input_features") or {}
    image_keys = [k for k, f in feats.items() if (f or {}).get("type") == "VISUAL" and not k.startswith(_IMAGE_KEY + "empty_camera_")]
    if not image_keys:
        raise BundleError("config.json: input_features has no camera (VISUAL) feature")
    cameras = {k: k[len(_IMAGE_KEY):] if k.startswith(_IMAGE_KEY) else k for k in image_keys}
    state_feat = feats.get("observation.state") or {}
    action_feat = (cfg.get("output_features") or {}).get("action") or {}
    if not state_feat or not action_feat:
        raise BundleError("config.json: SmolVLA needs input_features.observation.state and output_features.action")
    state_dim, action_dim = int(state_feat["shape"][0]), int(action_feat["shape"][0])

    # Statistics as LeRobot's processors hold them (only what has the feature's size).
    stats = {**_stats(policy_dir, _processor_step(post, "unnormalizer_processor")),
             **_stats(policy_dir, _processor_step(pre, "normalizer_processor"))}  # fmt: skip
    norm_step = _processor_step(pre, "normalizer_processor") or {}
    eps = float((norm_step.get("config") or {}).get("eps", 1e-8))

    def stats_of(feature: str, dim: int) -> dict[str, list[float]]:
        return {k: v for k, v in stats.get(feature, {}).items() if len(v) == dim}

    norm_stats = {"state": stats_of("observation.state", state_dim), "action": stats_of("action", action_dim)}
    tok_step = (_processor_step(pre, "tokenizer_processor") or {}).get("config") or {}
    max_text = int(tok_step.get("max_length", cfg.get("tokenizer_max_length", 48)))

    # Weights: our names; the VLM truncated to num_vlm_layers; the expert's sizes from its weights.
    try:
        state = load_file(str(policy_dir / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise BundleError(f"{policy_dir / WEIGHTS_FILE}: unreadable safetensors file: {e}") from e
    n_text = 1 + max((int(k.split(".")[6]) for k in state if k.startswith("model.vlm_with_expert.vlm.model.text_model.layers.")), default=-1)
    vlm_layers = int(cfg.get("num_vlm_layers", -1))
    vlm_layers = min(vlm_layers, n_text) if vlm_layers > 0 else n_text
    weights = _map_weights(state, vlm_layers)
    n_expert = 1 + max((int(k.split(".")[2]) for k in weights if k.startswith("expert.layers.")), default=-1)
    if n_expert < 1 or "expert.layers.0.mlp.gate_proj.weight" not in weights:
        raise BundleError(f"{policy_dir / WEIGHTS_FILE}: no action expert layers (model.vlm_with_expert.lm_expert.*)")
    e_inter, e_hidden = weights["expert.layers.0.mlp.gate_proj.weight"].shape

    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir), local_files_only=True)
    opts = SmolVLAOptions(
        max_state_dim=int(cfg.get("max_state_dim", 32)), max_action_dim=int(cfg.get("max_action_dim", 32)),
        attention_mode=str(cfg.get("attention_mode", "cross_attn")),
        self_attn_every_n_layers=int(cfg.get("self_attn_every_n_layers", 2)),
        num_expert_layers=int(cfg.get("num_expert_layers", -1)),
        add_image_special_tokens=bool(cfg.get("add_image_special_tokens", False)),
        fake_image_token_id=int(getattr(tokenizer, "fake_image_token_id", None) or -1),
        global_image_token_id=int(getattr(tokenizer, "global_image_token_id", None) or -1),
        min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
        state_norm=_norm_mode(cfg, "STATE"), action_norm=_norm_mode(cfg, "ACTION"), norm_eps=eps,
        adapt_to_pi_aloha=bool(cfg.get("adapt_to_pi_aloha", False)), truncate_text=bool(tok_step.get("truncation", True)),
    )  # fmt: skip
    lm = {k: v for k, v in text.items() if k not in ("rope_scaling", "architectures", "torch_dtype", "dtype", "transformers_version")}
    lm.update(model_type="llama", num_hidden_layers=vlm_layers, rope_theta=10000.0)  # SmolVLA's own RoPE: base 10,000
    lm.setdefault("head_dim", int(text["hidden_size"]) // int(text["num_attention_heads"]))
    expert = {**lm, "hidden_size": int(e_hidden), "intermediate_size": int(e_inter), "num_hidden_layers": n_expert,
              "vocab_size": 1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # fmt: skip
    scale = int(vlm_cfg.get("scale_factor", 1))
    size = cfg.get("resize_imgs_with_padding") or [vision["image_size"]] * 2
    if int(size[0]) != int(vision["image_size"]):
        raise ConfigError(
            f"resize_imgs_with_padding={list(size)} but the vision tower is {vision['image_size']} px: SmolVLM's pixel "
            "shuffle then sees another patch grid than its position embeddings"
        )
    vision_cfg = {k: v for k, v in vision.items() if k not in ("architectures", "torch_dtype", "dtype", "transformers_version")}
    vision_cfg["scale_factor"] = scale
    joints = tuple(joint_names) if joint_names else demo.joint_names(action_dim)
    spec = BundleSpec(
        family="smolvla", name=name or policy_dir.resolve().name, cameras=tuple(cameras.values()),
        image_size=int(size[0]), patch_size=int(vision["patch_size"]) * scale, image_resize="pad", tokenizer="bundle",
        instruction_template="{instruction}", default_instruction=default_instruction, max_text_tokens=max_text,
        text_vocab=int(text.get("vocab_size", 16)), action_dim=action_dim, chunk_size=int(cfg.get("chunk_size", 50)),
        dt=1.0 / fps, joint_names=joints, state_dim=state_dim, num_steps=int(cfg.get("num_steps", 10)),
        norm_stats=norm_stats, vision=vision_cfg, lm=lm, expert=expert, options=opts.to_dict(),
    )  # fmt: skip
    spec_family(spec, out / CONFIG_FILE)
    check_weights(policy_dir / WEIGHTS_FILE, spec, {k: (tuple(v.shape), True) for k, v in weights.items()})

    source: dict[str, Any] = {
        "lerobot_policy": str(policy_dir.resolve()), "vlm": str(vlm_dir.resolve()), "vlm_model_name": cfg.get("vlm_model_name"),
        "cameras": cameras, "lerobot_config": cfg,
        "no_effect_here": {k: cfg.get(k) for k in ("pad_language_to", "prefix_length", "empty_cameras", "n_action_steps", "rtc_config")},
    }  # fmt: skip
    return write_imported(out, spec, weights, tokenizer, source)
