"""LeRobot pi0 checkpoints -> ``pi0`` bundles (``vla-accel bundle import --lerobot DIR``).

LeRobot 0.3.3's saved layout: ``config.json`` (type ``pi0``) and ``model.safetensors``, whose
state dict also holds the normalization statistics (``normalize_inputs.buffer_observation_state``,
``unnormalize_outputs.buffer_action``). Both key layouts are read: transformers 4.53's
(``...paligemma.model.{vision_tower,multi_modal_projector,language_model}``, the token embedding
stored only as ``...paligemma.lm_head.weight``) and the older one of the published checkpoints
(``...paligemma.{vision_tower,multi_modal_projector}``, ``...paligemma.language_model.model``,
``...paligemma.language_model.lm_head``).

0.3.3 hard-codes the PaliGemma and expert sizes (its config.json does not carry them), so they
are read from the weights' shapes: widths, depths, MLP sizes and the vocabulary from the tensors;
the Gemma head size from its K/V projection (pi0's Gemma and expert have one K/V head); SigLIP's
head count is not in any shape: So400m's 16 for its 1152-wide tower, else ``--vision-heads``.
The tokenizer is PaliGemma's: ``--tokenizer DIR``, else the local Hugging Face cache of
``google/paligemma-3b-pt-224`` (offline lookup).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models import demo
from vla_accel_ros.models.factory import check_weights, spec_family
from vla_accel_ros.models.pi0.configuration_pi0 import Pi0Options
from vla_accel_ros.models.lerobot_compat import write_imported
from vla_accel_ros.models.smolvla.lerobot_import import _read_json

TOKENIZER_ID = "google/paligemma-3b-pt-224"  # what LeRobot 0.3.3's pi0 loads by name
SIGLIP_HEADS = {1152: 16}  # SigLIP So400m (PaliGemma's tower): width -> heads
_OLD_LAYOUT = (  # the published checkpoints' names -> transformers 4.53's (LeRobot renames them too)
    (re.compile(r"\.paligemma\.language_model\.lm_head"), ".paligemma.lm_head"),
    (re.compile(r"\.paligemma\.language_model\.model"), ".paligemma.model.language_model"),
    (re.compile(r"\.paligemma\.vision_tower"), ".paligemma.model.vision_tower"),
    (re.compile(r"\.paligemma\.multi_modal_projector"), ".paligemma.model.multi_modal_projector"),
)
_PG = "model.paligemma_with_expert.paligemma."
PALIGEMMA_KEYS = (  # 4.53's names -> ours: what pi0 and pi0.5 checkpoints share
    (_PG + "model.vision_tower.vision_model.", "vis.vision."),
    (_PG + "model.multi_modal_projector.linear.", "vis.projector."),
    (_PG + "model.language_model.", "vlm."),
    ("model.paligemma_with_expert.gemma_expert.model.", "expert."),
    ("model.action_in_proj.", "action_in."),
    ("model.action_out_proj.", "action_out."),
)
_KEY_MAP = (
    *PALIGEMMA_KEYS,
    ("model.state_proj.", "state_proj."),
    ("model.action_time_mlp_in.", "time_in."),
    ("model.action_time_mlp_out.", "time_out."),
)
_STATS = {"normalize_inputs.buffer_observation_state.": "state", "unnormalize_outputs.buffer_action.": "action"}
_UNUSED = ("model.paligemma_with_expert.gemma_expert.lm_head.", "normalize_targets.")


def _layers(weights: dict[str, torch.Tensor], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in weights if k.startswith(prefix)), default=-1)


def map_weights(
    state: dict[str, torch.Tensor], key_map=_KEY_MAP, stats_keys=_STATS, unused=_UNUSED, what: str = "pi0"
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list[float]]]]:  # fmt: skip
    """Our names (either layout accepted) and the normalization statistics the state dict holds
    (``stats_keys``: prefix -> feature; pi0.5 keeps them in its processors instead)."""
    weights, stats = {}, {}
    for key, value in state.items():
        for pattern, new in _OLD_LAYOUT:
            key = pattern.sub(new, key)
        stat = next((s for s in stats_keys if key.startswith(s)), None)
        if stat is not None:
            stats.setdefault(stats_keys[stat], {})[key[len(stat):]] = value.float().reshape(-1).tolist()
            continue
        if key.startswith(unused):
            continue
        if key == _PG + "lm_head.weight":  # tied: the token embedding
            weights.setdefault("vlm.embed_tokens.weight", value.float().contiguous())
            continue
        for src, dst in key_map:
            if key.startswith(src):
                weights[dst + key[len(src):]] = value.float().contiguous()
                break
        else:
            raise BundleError(f"model.safetensors: unexpected weight {key} for a LeRobot {what} checkpoint")
    return weights, stats


def open_checkpoint(policy_dir: str | Path, out: str | Path, kind: str) -> tuple[Path, Path, dict]:
    """(policy_dir, out, LeRobot's config.json) of a checkpoint of policy type ``kind``; ``out``
    must not exist (bundles are never overwritten)."""
    policy_dir, out = Path(policy_dir), Path(out)
    if out.exists():
        raise BundleError(f"{out} exists already; bundles are never overwritten")
    cfg = _read_json(policy_dir / CONFIG_FILE)
    if cfg.get("type") != kind:
        raise BundleError(f"config.json: type={cfg.get('type')!r}; this importer reads LeRobot {kind} checkpoints")
    return policy_dir, out, cfg


def load_weights(policy_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(policy_dir / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise BundleError(f"{policy_dir / WEIGHTS_FILE}: unreadable safetensors file: {e}") from e


def features(cfg: dict, what: str) -> tuple[dict[str, str], int, int]:
    """LeRobot's camera feature -> camera name (blank ``empty_camera_*`` ones left out: nobody
    attends to them), the state and action sizes, from a policy's config.json."""
    feats = cfg.get("input_features") or {}
    image_keys = [k for k, f in feats.items() if (f or {}).get("type") == "VISUAL" and "empty_camera_" not in k]
    cameras = {k: k.removeprefix("observation.images.") for k in image_keys}
    state_dim = int((feats.get("observation.state") or {}).get("shape", [0])[0])
    action_dim = int(((cfg.get("output_features") or {}).get("action") or {}).get("shape", [0])[0])
    if not cameras or not state_dim or not action_dim:
        raise BundleError(f"config.json: {what} needs camera (VISUAL) features, observation.state and an action output")
    return cameras, state_dim, action_dim


def vision_from_weights(weights: dict[str, torch.Tensor], vision_heads: int | None, image_size: int) -> dict[str, Any]:
    """SigLIP's config from its weights' shapes; the head count (in no shape) So400m's 16 for its
    1152-wide tower, else ``vision_heads``; its image size must be ``image_size`` (the config's)."""
    patch = weights["vis.vision.embeddings.patch_embedding.weight"]
    v_width, p = int(patch.shape[0]), int(patch.shape[-1])
    if vision_heads is None:
        vision_heads = SIGLIP_HEADS.get(v_width)
        if vision_heads is None:
            raise ConfigError(
                f"SigLIP's head count is not in its weights (width {v_width}; So400m's 1152 has 16): pass --vision-heads N"
            )
    if v_width % vision_heads:
        raise ConfigError(f"--vision-heads {vision_heads} does not divide SigLIP's width {v_width}")
    grid = int(round(weights["vis.vision.embeddings.position_embedding.weight"].shape[0] ** 0.5))
    vision = {
        "hidden_size": v_width, "intermediate_size": int(weights["vis.vision.encoder.layers.0.mlp.fc1.weight"].shape[0]),
        "num_hidden_layers": _layers(weights, "vis.vision.encoder.layers."), "num_attention_heads": int(vision_heads),
        "image_size": grid * p, "patch_size": p, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
    }  # fmt: skip
    if image_size != vision["image_size"]:
        raise ConfigError(f"the config's image size {image_size} but SigLIP's position table is for {vision['image_size']} px")
    return vision


def gemma_sections(weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The VLM's and the expert's Gemma configs from their weights (one K/V head each; the
    expert's head size is the VLM's: they attend jointly)."""
    vocab = int(weights["vlm.embed_tokens.weight"].shape[0])
    lm = _gemma(weights, "vlm.", None, vocab_size=vocab, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    expert = _gemma(weights, "expert.", lm["head_dim"], vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return lm, expert


def find_tokenizer(tokenizer: str | Path | None) -> Path:
    if tokenizer:
        path = Path(tokenizer)
        if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise BundleError(f"--tokenizer {path}: no tokenizer files there (tokenizer.json / tokenizer_config.json)")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=TOKENIZER_ID, local_files_only=True))
    except Exception as e:  # the hub raises many types for "not cached"
        raise BundleError(
            f"pi0 reads PaliGemma's tokenizer ({TOKENIZER_ID}): not in the local Hugging Face cache ({type(e).__name__}); "
            "pass --tokenizer DIR"
        ) from e


def _gemma(weights: dict, prefix: str, head_dim: int | None, **extra) -> dict[str, Any]:
    """A Gemma config section from the layer weights under ``prefix`` (one K/V head)."""
    q, k = weights[f"{prefix}layers.0.self_attn.q_proj.weight"].shape, weights[f"{prefix}layers.0.self_attn.k_proj.weight"].shape
    hd = head_dim or k[0]  # MQA: the K projection is one head wide
    if q[0] % hd or k[0] % hd:
        raise BundleError(f"{prefix}: q_proj {list(q)} / k_proj {list(k)} are not multiples of head size {hd}")
    return {
        "model_type": "gemma", "hidden_size": int(q[1]), "intermediate_size": int(weights[f"{prefix}layers.0.mlp.gate_proj.weight"].shape[0]),
        "num_hidden_layers": _layers(weights, f"{prefix}layers."), "num_attention_heads": int(q[0] // hd),
        "num_key_value_heads": int(k[0] // hd), "head_dim": int(hd), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, **extra,
    }  # fmt: skip


def import_lerobot(
    policy_dir: str | Path, out: str | Path, *, tokenizer: str | Path | None = None, vision_heads: int | None = None,
    name: str | None = None, joint_names: tuple[str, ...] | None = None, fps: float = 50.0, default_instruction: str = "",
    **unused,
) -> Path:  # fmt: skip
    """Write a ``pi0`` bundle at ``out`` from LeRobot's saved pi0 policy at ``policy_dir``."""
    from transformers import AutoTokenizer

    policy_dir, out, cfg = open_checkpoint(policy_dir, out, "pi0")
    if cfg.get("use_delta_joint_actions_aloha"):
        raise ConfigError("use_delta_joint_actions_aloha=true: LeRobot itself does not implement it (NotImplementedError)")
    size = cfg.get("resize_imgs_with_padding")
    if size is None or len(size) != 2 or size[0] != size[1]:
        raise ConfigError(f"resize_imgs_with_padding={size}: pi0's SigLIP reads square images of its own size")
    for kind in ("VISUAL", "STATE", "ACTION"):
        mode = (cfg.get("normalization_mapping") or {}).get(kind, "IDENTITY")
        allowed = ("IDENTITY",) if kind == "VISUAL" else ("IDENTITY", "MEAN_STD", "MIN_MAX")
        if mode not in allowed:
            raise ConfigError(f"normalization_mapping.{kind}={mode}: LeRobot 0.3.3's pi0 path here supports {', '.join(allowed)}")
    weights, stats = map_weights(load_weights(policy_dir))
    cameras, state_dim, action_dim = features(cfg, "pi0")
    # Sizes from the weights (0.3.3 does not write them).
    vision = vision_from_weights(weights, vision_heads, int(size[0]))
    vision_heads = vision["num_attention_heads"]
    lm, expert = gemma_sections(weights)
    vocab = lm["vocab_size"]

    tok_dir = find_tokenizer(tokenizer)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    modes = cfg.get("normalization_mapping") or {}
    opts = Pi0Options(
        max_state_dim=int(cfg.get("max_state_dim", 32)), max_action_dim=int(cfg.get("max_action_dim", 32)),
        state_norm=modes.get("STATE", "MEAN_STD"), action_norm=modes.get("ACTION", "MEAN_STD"), norm_eps=1e-8,
        adapt_to_pi_aloha=bool(cfg.get("adapt_to_pi_aloha", False)),
    )  # fmt: skip
    # 0.3.3 reads n_action_steps actions (the noise's length and the action tokens), not chunk_size.
    chunk = int(cfg.get("n_action_steps", cfg.get("chunk_size", 50)))
    stats = {"state": stats.get("state", {}), "action": stats.get("action", {})}
    spec = BundleSpec(
        family="pi0", name=name or policy_dir.resolve().name, cameras=tuple(cameras.values()), image_size=int(size[0]),
        patch_size=vision["patch_size"], image_resize="pad", tokenizer="bundle", instruction_template="{instruction}",
        default_instruction=default_instruction, max_text_tokens=max(256, int(cfg.get("tokenizer_max_length", 48))),
        text_vocab=vocab, action_dim=action_dim, chunk_size=chunk, dt=1.0 / fps,
        joint_names=tuple(joint_names) if joint_names else demo.joint_names(action_dim), state_dim=state_dim,
        num_steps=int(cfg.get("num_steps", 10)), norm_stats=stats, vision=vision, lm=lm, expert=expert, options=opts.to_dict(),
    )  # fmt: skip
    spec_family(spec, out / CONFIG_FILE)
    check_weights(policy_dir / WEIGHTS_FILE, spec, {k: (tuple(v.shape), True) for k, v in weights.items()})
    source = {
        "lerobot_policy": str(policy_dir.resolve()), "tokenizer": str(tok_dir.resolve()), "cameras": cameras,
        "lerobot_config": cfg, "vision_heads": vision_heads,
        "no_effect_here": {k: cfg.get(k) for k in ("tokenizer_max_length", "empty_cameras", "chunk_size")},
    }  # fmt: skip
    return write_imported(out, spec, weights, tok, source)
