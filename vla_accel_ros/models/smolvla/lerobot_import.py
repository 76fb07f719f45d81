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
LeRobot itself cannot run is refused naming the option. The layout every family shares (the
processors and their statistics, the camera features, the bundle written) is read by
:mod:`vla_accel_ros.models.lerobot.reader`; what is SmolVLA's own is here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.lerobot.reader import Checkpoint, read_json, renamed
from vla_accel_ros.models.smolvla.configuration_smolvla import SmolVLAOptions

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


def _check_config(ckpt: Checkpoint) -> None:
    cfg = ckpt.cfg
    ckpt.refuse_delta_actions()
    ckpt.refuse_obs_steps("SmolVLA")
    size = cfg.get("resize_imgs_with_padding")
    if size is not None and (len(size) != 2 or size[0] != size[1]):
        raise ConfigError(
            f"resize_imgs_with_padding={size}: SmolVLM's pixel shuffle needs a square image (LeRobot fails on others)"
        )
    ckpt.refuse_image_norm()


def _map_weights(state: dict[str, torch.Tensor], vlm_layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key.startswith(_UNUSED):
            continue
        new = renamed(key, _KEY_MAP)
        if new is None:
            raise BundleError(f"model.safetensors: unexpected weight {key} for a SmolVLA checkpoint")
        if new.startswith("vlm.layers."):
            if int(new.split(".")[2]) >= vlm_layers:
                continue  # a layer SmolVLA truncated away (num_vlm_layers)
        out[new] = value.float().contiguous()
    return out


def import_lerobot(policy_dir: str | Path, out: str | Path, **options) -> Path:
    """Write a ``smolvla`` bundle at ``out`` from LeRobot's saved policy at ``policy_dir``
    (``options``: :class:`~vla_accel_ros.models.smolvla.configuration_smolvla.SmolVLAImport`'s fields)."""
    from transformers import AutoTokenizer

    opts = SmolVLAOptions.import_options.parse("smolvla", options)
    ckpt = Checkpoint(policy_dir, out, "smolvla", SmolVLAOptions)
    cfg = ckpt.cfg
    _check_config(ckpt)
    proc = ckpt.processors()
    vlm_dir = find_vlm_dir(str(cfg.get("vlm_model_name", "")), ckpt.policy_dir, opts.vlm)
    vlm_cfg = read_json(vlm_dir / CONFIG_FILE)
    text, vision = dict(vlm_cfg.get("text_config") or {}), dict(vlm_cfg.get("vision_config") or {})
    if not text or not vision:
        raise BundleError(f"{vlm_dir / CONFIG_FILE}: not a SmolVLM config (no text_config / vision_config)")

    # Features: the cameras (LeRobot's blank empty cameras are never attended to: left out), state, action.
    cameras, state_dim, action_dim = ckpt.features()
    tok_step = proc.config("tokenizer_processor")
    max_text = int(tok_step.get("max_length", cfg.get("tokenizer_max_length", 48)))

    # Weights: our names; the VLM truncated to num_vlm_layers; the expert's sizes from its weights.
    state = ckpt.weights()
    n_text = 1 + max((int(k.split(".")[6]) for k in state if k.startswith("model.vlm_with_expert.vlm.model.text_model.layers.")), default=-1)
    vlm_layers = int(cfg.get("num_vlm_layers", -1))
    vlm_layers = min(vlm_layers, n_text) if vlm_layers > 0 else n_text
    weights = _map_weights(state, vlm_layers)
    n_expert = 1 + max((int(k.split(".")[2]) for k in weights if k.startswith("expert.layers.")), default=-1)
    if n_expert < 1 or "expert.layers.0.mlp.gate_proj.weight" not in weights:
        raise BundleError(f"{ckpt.policy_dir / WEIGHTS_FILE}: no action expert layers (model.vlm_with_expert.lm_expert.*)")
    e_inter, e_hidden = weights["expert.layers.0.mlp.gate_proj.weight"].shape

    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir), local_files_only=True)
    bundle_opts = SmolVLAOptions(
        max_state_dim=int(cfg.get("max_state_dim", 32)), max_action_dim=int(cfg.get("max_action_dim", 32)),
        attention_mode=str(cfg.get("attention_mode", "cross_attn")),
        self_attn_every_n_layers=int(cfg.get("self_attn_every_n_layers", 2)),
        num_expert_layers=int(cfg.get("num_expert_layers", -1)),
        add_image_special_tokens=bool(cfg.get("add_image_special_tokens", False)),
        fake_image_token_id=int(getattr(tokenizer, "fake_image_token_id", None) or -1),
        global_image_token_id=int(getattr(tokenizer, "global_image_token_id", None) or -1),
        min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
        state_norm=ckpt.norm_mode("STATE"), action_norm=ckpt.norm_mode("ACTION"), norm_eps=proc.eps,
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
    spec = BundleSpec(
        **ckpt.spec_fields(opts, cameras, state_dim, action_dim), image_size=int(size[0]),
        patch_size=int(vision["patch_size"]) * scale, max_text_tokens=max_text, text_vocab=int(text.get("vocab_size", 16)),
        chunk_size=int(cfg.get("chunk_size", 50)), num_steps=int(cfg.get("num_steps", 10)),
        norm_stats=proc.norm_stats(state_dim, action_dim), vision=vision_cfg, lm=lm, expert=expert, options=bundle_opts.to_dict(),
    )  # fmt: skip
    source = ckpt.source(
        cameras, ("pad_language_to", "prefix_length", "empty_cameras", "n_action_steps", "rtc_config"),
        vlm=str(vlm_dir.resolve()), vlm_model_name=cfg.get("vlm_model_name"),
    )  # fmt: skip
    return ckpt.write(spec, weights, tokenizer, source)
