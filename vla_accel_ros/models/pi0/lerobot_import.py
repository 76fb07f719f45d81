"""LeRobot pi0 checkpoints -> ``pi0`` bundles (``vla-accel bundle import --lerobot DIR``).

LeRobot 0.3.3's saved layout: ``config.json`` (type ``pi0``) and ``model.safetensors``, whose
state dict also holds the normalization statistics (``normalize_inputs.buffer_observation_state``,
``unnormalize_outputs.buffer_action``); no processors. The checkpoint layout every family shares
is read by :mod:`vla_accel_ros.models.lerobot.reader`; PaliGemma's weights (both key layouts),
the sizes from their shapes (0.3.3 hard-codes them: its config.json does not carry them) and
the tokenizer (``--tokenizer DIR``, else the local Hugging Face cache of
``google/paligemma-3b-pt-224``) by :mod:`vla_accel_ros.models.lerobot.paligemma`. What is
pi0's own is here: its weight names, where its statistics are, what 0.3.3 supports.
"""

from __future__ import annotations

from pathlib import Path

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.models.lerobot.paligemma import PALIGEMMA_KEYS, gemma_sections, load_tokenizer, map_weights, vision_from_weights
from vla_accel_ros.models.lerobot.reader import Checkpoint
from vla_accel_ros.models.pi0.configuration_pi0 import Pi0Options

_KEY_MAP = (
    *PALIGEMMA_KEYS,
    ("model.state_proj.", "state_proj."),
    ("model.action_time_mlp_in.", "time_in."),
    ("model.action_time_mlp_out.", "time_out."),
)
_STATS = {"normalize_inputs.buffer_observation_state.": "state", "unnormalize_outputs.buffer_action.": "action"}
_UNUSED = ("model.paligemma_with_expert.gemma_expert.lm_head.", "normalize_targets.")
# The normalization modes 0.3.3's pi0 normalizes with (its Normalize module has no quantiles).
_MODES_033 = ("IDENTITY", "MEAN_STD", "MIN_MAX")


def import_lerobot(policy_dir: str | Path, out: str | Path, **options) -> Path:
    """Write a ``pi0`` bundle at ``out`` from LeRobot's saved pi0 policy at ``policy_dir``
    (``options``: :class:`~vla_accel_ros.models.lerobot.paligemma.PaliGemmaImport`'s fields)."""
    opts = Pi0Options.import_options.parse("pi0", options)
    ckpt = Checkpoint(policy_dir, out, "pi0", Pi0Options)
    cfg = ckpt.cfg
    ckpt.refuse_delta_actions()
    size = cfg.get("resize_imgs_with_padding")
    if size is None or len(size) != 2 or size[0] != size[1]:
        raise ConfigError(f"resize_imgs_with_padding={size}: pi0's SigLIP reads square images of its own size")
    ckpt.refuse_image_norm()
    for kind in ("STATE", "ACTION"):
        if ckpt.norm_mode(kind) not in _MODES_033:
            raise ConfigError(
                f"normalization_mapping.{kind}={ckpt.norm_mode(kind)}: LeRobot 0.3.3's pi0 path here supports {', '.join(_MODES_033)}"
            )
    weights, stats = map_weights(ckpt.weights(), _KEY_MAP, _STATS, _UNUSED, "pi0")
    cameras, state_dim, action_dim = ckpt.features()
    # Sizes from the weights (0.3.3 does not write them).
    vision = vision_from_weights(weights, opts.vision_heads, int(size[0]))
    lm, expert = gemma_sections(weights)

    tok_dir, tok = load_tokenizer(opts.tokenizer, "pi0")
    bundle_opts = Pi0Options(
        max_state_dim=int(cfg.get("max_state_dim", 32)), max_action_dim=int(cfg.get("max_action_dim", 32)),
        state_norm=ckpt.norm_mode("STATE"), action_norm=ckpt.norm_mode("ACTION"), norm_eps=1e-8,
        adapt_to_pi_aloha=bool(cfg.get("adapt_to_pi_aloha", False)),
    )  # fmt: skip
    # 0.3.3 reads n_action_steps actions (the noise's length and the action tokens), not chunk_size.
    chunk = int(cfg.get("n_action_steps", cfg.get("chunk_size", 50)))
    spec = BundleSpec(
        **ckpt.spec_fields(opts, cameras, state_dim, action_dim), image_size=int(size[0]), patch_size=vision["patch_size"],
        max_text_tokens=max(256, int(cfg.get("tokenizer_max_length", 48))), text_vocab=lm["vocab_size"], chunk_size=chunk,
        num_steps=int(cfg.get("num_steps", 10)), norm_stats={"state": stats.get("state", {}), "action": stats.get("action", {})},
        vision=vision, lm=lm, expert=expert, options=bundle_opts.to_dict(),
    )  # fmt: skip
    source = ckpt.source(
        cameras, ("tokenizer_max_length", "empty_cameras", "chunk_size"),
        tokenizer=str(tok_dir.resolve()), vision_heads=vision["num_attention_heads"],
    )  # fmt: skip
    return ckpt.write(spec, weights, tok, source)
