"""LeRobot pi0.5 checkpoints -> ``pi05`` bundles (``vla-accel bundle import --lerobot DIR``).

LeRobot 0.4.4's saved layout: ``config.json`` (type ``pi05``), ``model.safetensors`` and the
pre- and post-processor pipelines (``policy_preprocessor.json`` / ``policy_postprocessor.json``
and their statistics files). What is read from where:

* weights: PaliGemma's and the expert's as pi0's (both key layouts, the token embedding stored as
  the tied ``lm_head``; :mod:`vla_accel_ros.models.pi0.lerobot_import`), the expert's adaptive
  norms (``*.input_layernorm.dense``, ``*.post_attention_layernorm.dense``, ``norm.dense``),
  the time MLP (``time_mlp_*``; ``action_time_mlp_*`` in older conversions, which LeRobot renames
  too). Sizes come from the shapes (LeRobot's config names variants, not sizes); SigLIP's head
  count is in no shape: So400m's 16 for its 1152-wide tower, else ``--vision-heads``;
* normalization: the modes from config.json, the statistics and eps from the processors;
* the prompt: the tokenizer step's ``max_length`` and ``truncation``; the state step's
  ``max_state_dim``, which LeRobot saves no config for, so that a reloaded pipeline pads the
  state to its default 32 whatever the policy's config says: that is what a user of the
  checkpoint runs, and what is imported (the fixture ``one_camera_meanstd`` shows it);
* the tokenizer: PaliGemma's, ``--tokenizer DIR`` else the local Hugging Face cache of
  ``google/paligemma-3b-pt-224`` (offline lookup).

Options without an effect on one inference (``n_action_steps``, ``rtc_config``: execution, which
the controller does here; ``empty_cameras``: blank cameras nobody attends to; ``dtype``: the
precision is this package's choice) are noted in ``source.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models import demo
from vla_accel_ros.models.factory import check_weights, spec_family
from vla_accel_ros.models.lerobot_compat import write_imported
from vla_accel_ros.models.pi0.lerobot_import import (
    PALIGEMMA_KEYS, features, find_tokenizer, gemma_sections, load_weights, map_weights, open_checkpoint, vision_from_weights,
)  # fmt: skip
from vla_accel_ros.models.pi05.configuration_pi05 import Pi05Options
from vla_accel_ros.models.smolvla.lerobot_import import _norm_mode, _processor_step, _read_json, _stats

_KEY_MAP = (
    *PALIGEMMA_KEYS,
    ("model.time_mlp_in.", "time_in."),
    ("model.time_mlp_out.", "time_out."),
    ("model.action_time_mlp_in.", "time_in."),  # older conversions' names (LeRobot renames them on load)
    ("model.action_time_mlp_out.", "time_out."),
)
# Never read by pi0.5: the expert's language head; a state projection (pi0's, which LeRobot skips too).
_UNUSED = ("model.paligemma_with_expert.gemma_expert.lm_head.", "model.state_proj.")
PROMPT_STATE_DIM = 32  # LeRobot's Pi05PrepareStateTokenizerProcessorStep default (rebuilt with it on load)


def _check_config(cfg: dict) -> int:
    """The image size; ConfigError naming what LeRobot itself cannot run or this path does not support."""
    if int(cfg.get("n_obs_steps", 1)) != 1:
        raise ConfigError(f"n_obs_steps={cfg.get('n_obs_steps')}: pi05 reads one observation step")
    size = cfg.get("image_resolution") or [224, 224]
    if len(size) != 2 or size[0] != size[1]:
        raise ConfigError(f"image_resolution={size}: PaliGemma reads square images (LeRobot refuses others)")
    if _norm_mode(cfg, "VISUAL") != "IDENTITY":
        raise ConfigError(
            f"normalization_mapping.VISUAL={_norm_mode(cfg, 'VISUAL')}: image normalization by dataset statistics is not "
            "supported by this importer (pi05's default is IDENTITY)"
        )
    return int(size[0])


def import_lerobot(
    policy_dir: str | Path, out: str | Path, *, tokenizer: str | Path | None = None, vision_heads: int | None = None,
    name: str | None = None, joint_names: tuple[str, ...] | None = None, fps: float = 50.0, default_instruction: str = "",
    **unused,
) -> Path:  # fmt: skip
    """Write a ``pi05`` bundle at ``out`` from LeRobot's saved pi05 policy at ``policy_dir``."""
    from transformers import AutoTokenizer

    policy_dir, out, cfg = open_checkpoint(policy_dir, out, "pi05")
    size = _check_config(cfg)
    pre = _read_json(policy_dir / "policy_preprocessor.json")
    post = _read_json(policy_dir / "policy_postprocessor.json")
    cameras, state_dim, action_dim = features(cfg, "pi05")

    weights, _ = map_weights(load_weights(policy_dir), _KEY_MAP, {}, _UNUSED, "pi05")
    if "expert.norm.dense.weight" not in weights:
        raise BundleError(f"{policy_dir / WEIGHTS_FILE}: the expert has no adaptive norms (expert.norm.dense): not a pi05 checkpoint")
    vision = vision_from_weights(weights, vision_heads, size)
    lm, expert = gemma_sections(weights)

    # Statistics, eps and the prompt as LeRobot's processors hold them (a reloaded pipeline).
    stats = {**_stats(policy_dir, _processor_step(post, "unnormalizer_processor")),
             **_stats(policy_dir, _processor_step(pre, "normalizer_processor"))}  # fmt: skip
    eps = float(((_processor_step(pre, "normalizer_processor") or {}).get("config") or {}).get("eps", 1e-8))

    def stats_of(feature: str, dim: int) -> dict[str, list[float]]:
        return {k: v for k, v in stats.get(feature, {}).items() if len(v) == dim}

    tok_step = (_processor_step(pre, "tokenizer_processor") or {}).get("config") or {}
    state_step = _processor_step(pre, "pi05_prepare_state_tokenizer_processor_step")
    if state_step is None:
        raise BundleError("policy_preprocessor.json: no pi05_prepare_state_tokenizer_processor_step (the state's prompt)")
    prompt_state = int((state_step.get("config") or {}).get("max_state_dim", PROMPT_STATE_DIM))
    opts = Pi05Options(
        # LeRobot pads the state up to this size and never cuts it: a longer state writes all its values.
        max_state_dim=max(prompt_state, state_dim), max_action_dim=int(cfg.get("max_action_dim", 32)),
        state_norm=_norm_mode(cfg, "STATE"), action_norm=_norm_mode(cfg, "ACTION"), norm_eps=eps,
        truncate_text=bool(tok_step.get("truncation", True)),
        min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
    )  # fmt: skip
    if opts.max_action_dim < action_dim:
        raise ConfigError(f"max_action_dim={opts.max_action_dim} is below the action size {action_dim}")
    tok_dir = find_tokenizer(tokenizer)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    spec = BundleSpec(
        family="pi05", name=name or policy_dir.resolve().name, cameras=tuple(cameras.values()), image_size=size,
        patch_size=vision["patch_size"], image_resize="pad", tokenizer="bundle", instruction_template="{instruction}",
        default_instruction=default_instruction, max_text_tokens=int(tok_step.get("max_length", cfg.get("tokenizer_max_length", 200))),
        text_vocab=int(lm["vocab_size"]), action_dim=action_dim, chunk_size=int(cfg.get("chunk_size", 50)), dt=1.0 / fps,
        joint_names=tuple(joint_names) if joint_names else demo.joint_names(action_dim), state_dim=state_dim,
        num_steps=int(cfg.get("num_inference_steps", 10)),
        norm_stats={"state": stats_of("observation.state", state_dim), "action": stats_of("action", action_dim)},
        vision=vision, lm=lm, expert=expert, options=opts.to_dict(),
    )  # fmt: skip
    spec_family(spec, out / CONFIG_FILE)
    check_weights(policy_dir / WEIGHTS_FILE, spec, {k: (tuple(v.shape), True) for k, v in weights.items()})
    source: dict[str, Any] = {
        "lerobot_policy": str(policy_dir.resolve()), "tokenizer": str(tok_dir.resolve()), "cameras": cameras,
        "lerobot_config": cfg, "vision_heads": vision["num_attention_heads"], "prompt_state_dim": prompt_state,
        "no_effect_here": {k: cfg.get(k) for k in ("n_action_steps", "rtc_config", "empty_cameras", "dtype")},
    }  # fmt: skip
    return write_imported(out, spec, weights, tok, source)
