"""What LeRobot's PaliGemma checkpoints (pi0, pi05) share: the weights' names in both layouts,
the sizes read from their shapes, the tokenizer, and the import options they take.

LeRobot does not save the PaliGemma and expert sizes in config.json (it names variants, or
hard-codes them), so they come from the weights' shapes: widths, depths, MLP sizes and the
vocabulary from the tensors; the Gemma head size from its K/V projection (the VLM and the expert
have one K/V head); SigLIP's head count is in no shape: So400m's 16 for its 1152-wide tower,
else ``--vision-heads``. Two key layouts are read: transformers 4.53's
(``...paligemma.model.{vision_tower,multi_modal_projector,language_model}``, the token
embedding stored only as the tied ``...paligemma.lm_head.weight``) and the older one of the
published checkpoints (``...paligemma.{vision_tower,multi_modal_projector}``,
``...paligemma.language_model.model``, ``...paligemma.language_model.lm_head``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vla_accel_ros.core.config import param
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.lerobot.reader import ImportOptions, renamed

TOKENIZER_ID = "google/paligemma-3b-pt-224"  # what LeRobot's pi0 and pi05 load by name
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


@dataclass(frozen=True)
class PaliGemmaImport(ImportOptions):
    """The import options of the PaliGemma families (pi0, pi05)."""

    tokenizer: str | None = param(None, doc=f"PaliGemma's tokenizer directory (None: {TOKENIZER_ID} in the local Hugging Face cache)")
    vision_heads: int | None = param(None, doc="SigLIP's head count when its width is not So400m's 1152", range=(1, 4096))


def _layers(weights: dict[str, torch.Tensor], prefix: str) -> int:
    return 1 + max((int(k[len(prefix):].split(".")[0]) for k in weights if k.startswith(prefix)), default=-1)


def map_weights(
    state: dict[str, torch.Tensor], key_map, stats_keys: dict[str, str], unused: tuple[str, ...], what: str
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list[float]]]]:  # fmt: skip
    """Our names (either layout accepted; ``key_map``: prefix -> ours, the first that matches)
    and the normalization statistics the state dict holds (``stats_keys``: prefix -> feature;
    pi0.5 keeps them in its processors instead); ``unused`` prefixes are dropped."""
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
        ours = renamed(key, key_map)
        if ours is None:
            raise BundleError(f"model.safetensors: unexpected weight {key} for a LeRobot {what} checkpoint")
        weights[ours] = value.float().contiguous()
    return weights, stats


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


def find_tokenizer(tokenizer: str | Path | None, family: str) -> Path:
    """PaliGemma's tokenizer directory: ``tokenizer``, else the local Hugging Face cache of
    :data:`TOKENIZER_ID` (an offline lookup; nothing is downloaded)."""
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
            f"{family} reads PaliGemma's tokenizer ({TOKENIZER_ID}): not in the local Hugging Face cache ({type(e).__name__}); "
            "pass --tokenizer DIR"
        ) from e


def load_tokenizer(tokenizer: str | Path | None, family: str):
    """(the tokenizer's directory, the tokenizer transformers loads from it)."""
    from transformers import AutoTokenizer

    path = find_tokenizer(tokenizer, family)
    return path, AutoTokenizer.from_pretrained(str(path), local_files_only=True)
