"""LeRobot pi0.5 checkpoints -> ``pi05`` bundles (``vla-accel bundle import --lerobot DIR``).

LeRobot 0.4.4's saved layout: ``config.json`` (type ``pi05``), ``model.safetensors`` and the
pre- and post-processor pipelines (``policy_preprocessor.json`` / ``policy_postprocessor.json``
and their statistics files). What is read from where:

* weights: PaliGemma's and the expert's as pi0's (both key layouts, the token embedding stored as
  the tied ``lm_head``; :mod:`vla_accel_ros.models.lerobot.paligemma`), the expert's adaptive
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

The layout every family shares (config.json, the processors, their statistics, the bundle
written) is read by :mod:`vla_accel_ros.models.lerobot.reader`. Options without an effect on
one inference (``n_action_steps``, ``rtc_config``: execution, which the controller does here;
``empty_cameras``: blank cameras nobody attends to; ``dtype``: the precision is this package's
choice) are noted in ``source.json``.
"""

from __future__ import annotations

from pathlib import Path

from vla_accel_ros.core.bundle import WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.lerobot.paligemma import PALIGEMMA_KEYS, gemma_sections, load_tokenizer, map_weights, vision_from_weights
from vla_accel_ros.models.lerobot.reader import Checkpoint
from vla_accel_ros.models.pi05.configuration_pi05 import Pi05Options

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


def _check_config(ckpt: Checkpoint) -> int:
    """The image size; ConfigError naming what LeRobot itself cannot run or this path does not support."""
    ckpt.refuse_obs_steps("pi05")
    size = ckpt.cfg.get("image_resolution") or [224, 224]
    if len(size) != 2 or size[0] != size[1]:
        raise ConfigError(f"image_resolution={size}: PaliGemma reads square images (LeRobot refuses others)")
    ckpt.refuse_image_norm()
    return int(size[0])


def import_lerobot(policy_dir: str | Path, out: str | Path, **options) -> Path:
    """Write a ``pi05`` bundle at ``out`` from LeRobot's saved pi05 policy at ``policy_dir``
    (``options``: :class:`~vla_accel_ros.models.lerobot.paligemma.PaliGemmaImport`'s fields)."""
    opts = Pi05Options.import_options.parse("pi05", options)
    ckpt = Checkpoint(policy_dir, out, "pi05", Pi05Options)
    cfg = ckpt.cfg
    size = _check_config(ckpt)
    proc = ckpt.processors()
    cameras, state_dim, action_dim = ckpt.features()

    weights, _ = map_weights(ckpt.weights(), _KEY_MAP, {}, _UNUSED, "pi05")
    if "expert.norm.dense.weight" not in weights:
        raise BundleError(f"{ckpt.policy_dir / WEIGHTS_FILE}: the expert has no adaptive norms (expert.norm.dense): not a pi05 checkpoint")
    vision = vision_from_weights(weights, opts.vision_heads, size)
    lm, expert = gemma_sections(weights)

    # Eps and the prompt as LeRobot's processors hold them (a reloaded pipeline).
    tok_step = proc.config("tokenizer_processor")
    state_step = proc.step("pi05_prepare_state_tokenizer_processor_step")
    if state_step is None:
        raise BundleError("policy_preprocessor.json: no pi05_prepare_state_tokenizer_processor_step (the state's prompt)")
    prompt_state = int((state_step.get("config") or {}).get("max_state_dim", PROMPT_STATE_DIM))
    bundle_opts = Pi05Options(
        # LeRobot pads the state up to this size and never cuts it: a longer state writes all its values.
        max_state_dim=max(prompt_state, state_dim), max_action_dim=int(cfg.get("max_action_dim", 32)),
        state_norm=ckpt.norm_mode("STATE"), action_norm=ckpt.norm_mode("ACTION"), norm_eps=proc.eps,
        truncate_text=bool(tok_step.get("truncation", True)),
        min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
    )  # fmt: skip
    if bundle_opts.max_action_dim < action_dim:
        raise ConfigError(f"max_action_dim={bundle_opts.max_action_dim} is below the action size {action_dim}")
    tok_dir, tok = load_tokenizer(opts.tokenizer, "pi05")
    spec = BundleSpec(
        **ckpt.spec_fields(opts, cameras, state_dim, action_dim), image_size=size, patch_size=vision["patch_size"],
        max_text_tokens=int(tok_step.get("max_length", cfg.get("tokenizer_max_length", 200))), text_vocab=int(lm["vocab_size"]),
        chunk_size=int(cfg.get("chunk_size", 50)), num_steps=int(cfg.get("num_inference_steps", 10)),
        norm_stats=proc.norm_stats(state_dim, action_dim), vision=vision, lm=lm, expert=expert, options=bundle_opts.to_dict(),
    )  # fmt: skip
    source = ckpt.source(
        cameras, ("n_action_steps", "rtc_config", "empty_cameras", "dtype"),
        tokenizer=str(tok_dir.resolve()), vision_heads=vision["num_attention_heads"], prompt_state_dim=prompt_state,
    )  # fmt: skip
    return ckpt.write(spec, weights, tok, source)
