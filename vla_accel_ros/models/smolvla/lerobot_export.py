"""``smolvla`` bundles -> LeRobot SmolVLA checkpoints (``vla-accel bundle export-lerobot``).

The inverse of :mod:`~vla_accel_ros.models.smolvla.lerobot_import`: writes what LeRobot 0.4.4's
``SmolVLAPolicy.from_pretrained(DIR)`` and its processor pipelines read, so that a policy trained
here runs in LeRobot's own runtime (and a LeRobot user can fine-tune it there):

* ``config.json`` (type ``smolvla``): the features (cameras as ``observation.images.<camera>``,
  ``observation.state``, ``action``), the normalization modes and every option the bundle keeps
  (:class:`~vla_accel_ros.models.smolvla.configuration_smolvla.SmolVLAOptions`), the image size
  as ``resize_imgs_with_padding``, ``load_vlm_weights: false`` (every weight is in the file);
* ``model.safetensors``: the weights in fp32 under LeRobot's module names (the VLM's language
  head, which SmolVLA never reads, as zeros so the names are LeRobot's complete set);
* ``policy_preprocessor.json`` / ``policy_postprocessor.json`` and their statistics files,
  LeRobot's pipelines (rename, batch, newline, tokenizer, device, normalizer; unnormalizer,
  device);
* ``vlm/``: the SmolVLM directory ``vlm_model_name`` names (config with the text and vision
  configs, the bundle's tokenizer, the processor files ``AutoProcessor`` reads). LeRobot resolves
  that name as a path; it is written absolute (``--vlm-name`` writes another).

Only what one inference depends on is carried; LeRobot's training settings (optimizer,
schedule, which parts train) are its defaults, set for fine-tuning from scratch here:
``freeze_vision_encoder`` and ``train_expert_only`` false.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from vla_accel_ros.core.bundle import CONFIG_FILE, TOKENIZER_DIR, WEIGHTS_FILE
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.lerobot.reader import IMAGE_KEY, POSTPROCESSOR, PREPROCESSOR, renamed
from vla_accel_ros.models.smolvla.lerobot_import import _KEY_MAP as IMPORT_KEY_MAP

# Ours -> LeRobot's module names: the import's map, the other way round.
_KEY_MAP = tuple((ours, theirs) for theirs, ours in IMPORT_KEY_MAP)
PRE_STATS = "policy_preprocessor_step_5_normalizer_processor.safetensors"
POST_STATS = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


def lerobot_weights(state: dict[str, torch.Tensor], vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        theirs = renamed(key, _KEY_MAP)
        if theirs is None:
            raise BundleError(f"weight {key} has no place in LeRobot's SmolVLA")
        out[theirs] = value.float().contiguous()
    out["model.vlm_with_expert.vlm.lm_head.weight"] = torch.zeros(vocab, hidden)
    return out


def _features(spec, image_hw: tuple[int, int]) -> tuple[dict, dict]:
    inputs = {f"{IMAGE_KEY}{c}": {"type": "VISUAL", "shape": [3, *image_hw]} for c in spec.cameras}
    inputs["observation.state"] = {"type": "STATE", "shape": [spec.state_dim]}
    return inputs, {"action": {"type": "ACTION", "shape": [spec.action_dim]}}


def policy_config(spec, opts, vlm_name: str, image_hw: tuple[int, int]) -> dict:
    """LeRobot's SmolVLAConfig as it saves it (every field; the forward pass's from the bundle)."""
    inputs, outputs = _features(spec, image_hw)
    layers = int(spec.lm["num_hidden_layers"])
    width = int(spec.expert["hidden_size"]) / int(spec.lm["hidden_size"])
    return {
        "type": "smolvla", "n_obs_steps": 1, "input_features": inputs, "output_features": outputs, "device": "cpu",
        "use_amp": False, "use_peft": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None,
        "license": None, "pretrained_path": None, "chunk_size": spec.chunk_size, "n_action_steps": spec.chunk_size,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": opts.state_norm, "ACTION": opts.action_norm},
        "max_state_dim": opts.max_state_dim, "max_action_dim": opts.max_action_dim,
        "resize_imgs_with_padding": [spec.image_size, spec.image_size], "empty_cameras": 0,
        "adapt_to_pi_aloha": opts.adapt_to_pi_aloha, "use_delta_joint_actions_aloha": False,
        "tokenizer_max_length": spec.max_text_tokens, "num_steps": spec.num_steps, "use_cache": True,
        "freeze_vision_encoder": False, "train_expert_only": False, "train_state_proj": True,
        "optimizer_lr": 0.0001, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 1e-10,
        "optimizer_grad_clip_norm": 10, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000,
        "scheduler_decay_lr": 2.5e-06, "vlm_model_name": vlm_name, "load_vlm_weights": False,
        "add_image_special_tokens": opts.add_image_special_tokens, "attention_mode": opts.attention_mode,
        "prefix_length": -1, "pad_language_to": "longest", "num_expert_layers": opts.num_expert_layers,
        "num_vlm_layers": layers, "self_attn_every_n_layers": opts.self_attn_every_n_layers,
        "expert_width_multiplier": width, "min_period": opts.min_period, "max_period": opts.max_period,
        "rtc_config": None, "compile_model": False, "compile_mode": "max-autotune",
    }  # fmt: skip


def processor_configs(spec, opts, vlm_name: str, image_hw: tuple[int, int]) -> tuple[dict, dict]:
    """LeRobot's SmolVLA pre- and post-processor pipelines as it saves them."""
    inputs, outputs = _features(spec, image_hw)
    norm_map = {"VISUAL": "IDENTITY", "STATE": opts.state_norm, "ACTION": opts.action_norm}
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "smolvla_new_line_processor", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": spec.max_text_tokens, "task_key": "task", "padding_side": "right", "padding": "longest",
            "truncation": opts.truncate_text, "tokenizer_name": vlm_name}},
        device,
        {"registry_name": "normalizer_processor", "config": {"eps": opts.norm_eps, "features": {**inputs, **outputs},
                                                             "norm_map": norm_map}, "state_file": PRE_STATS},
    ]}  # fmt: skip
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {"eps": opts.norm_eps, "features": outputs, "norm_map": norm_map},
         "state_file": POST_STATS},
        device,
    ]}  # fmt: skip
    return pre, post


def _stats(spec) -> dict[str, torch.Tensor]:
    out = {}
    for feature, key in (("action", "action"), ("state", "observation.state")):
        for stat, values in spec.norm_stats.get(feature, {}).items():
            out[f"{key}.{stat}"] = torch.tensor(values, dtype=torch.float32)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=4) + "\n")


def write_vlm_dir(path: Path, spec, model, bundle_path: Path) -> None:
    """The SmolVLM directory LeRobot builds its VLM and reads its tokenizer from. The tokenizer
    is the bundle's ``tokenizer.json`` with a ``tokenizer_config.json`` of the class every
    transformers release reads (``PreTrainedTokenizerFast``)."""
    from vla_accel_ros.models.smolvla.modeling_smolvla import vision_config

    tok_dir = bundle_path / TOKENIZER_DIR
    if not (tok_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{tok_dir}: no tokenizer.json; only bundles with their own fast tokenizer export to LeRobot")
    path.mkdir(parents=True)
    shutil.copyfile(tok_dir / "tokenizer.json", path / "tokenizer.json")
    stored = json.loads((tok_dir / "tokenizer_config.json").read_text()) if (tok_dir / "tokenizer_config.json").is_file() else {}
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    special = {k: stored[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "fake_image_token", "image_token",
                                       "end_of_utterance_token", "global_image_token") if k in stored}  # fmt: skip
    extra = [t for t in ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>") if t in ids]
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192, **special,
        "additional_special_tokens": extra,
        "extra_special_tokens": {k: special[k] for k in ("fake_image_token", "image_token", "end_of_utterance_token",
                                                         "global_image_token") if k in special},
    })  # fmt: skip
    _write_json(path / "special_tokens_map.json", {**special, "additional_special_tokens": extra})
    cfg = model.vlm.config
    # The bundle's text config (an imported one keeps the checkpoint's keys), completed with what
    # the model ran with where the bundle left a field at transformers' default.
    text = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                          "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias")}  # fmt: skip
    text.update({"pad_token_id": ids.get("<|im_end|>", 2), **spec.lm})
    text.update(model_type="llama", rope_theta=10000.0)  # SmolVLA's own RoPE base, whatever the config says
    vcfg = vision_config(spec)
    vision = {k: getattr(vcfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                             "image_size", "patch_size", "num_channels", "hidden_act", "layer_norm_eps")}  # fmt: skip
    vision.update({k: v for k, v in spec.vision.items() if k != "scale_factor"}, model_type="smolvlm_vision")
    _write_json(path / CONFIG_FILE, {
        "architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm",
        "image_token_id": ids.get("<image>", 0), "pad_token_id": text["pad_token_id"],
        "scale_factor": int(spec.vision["scale_factor"]), "vocab_size": text["vocab_size"], "tie_word_embeddings": False,
        "text_config": text, "vision_config": vision,
    })  # fmt: skip
    image = {"longest_edge": spec.image_size}
    _write_json(path / "preprocessor_config.json", {
        "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_image_size": image,
        "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor", "resample": 1,
        "rescale_factor": 1 / 255, "size": {"longest_edge": 4 * spec.image_size},
    })  # fmt: skip
    _write_json(path / "video_preprocessor_config.json", {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
        "do_sample_frames": False, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_image_size": image,
        "processor_class": "SmolVLMProcessor", "resample": 1, "rescale_factor": 1 / 255,
        "size": {"longest_edge": 4 * spec.image_size}, "video_processor_type": "SmolVLMVideoProcessor",
    })  # fmt: skip
    _write_json(path / "processor_config.json", {"image_seq_len": spec.grid * spec.grid, "processor_class": "SmolVLMProcessor"})


def export_lerobot(bundle: str | Path, out: str | Path, *, vlm_name: str = "", image_hw: tuple[int, int] = (480, 640)) -> Path:
    """Write LeRobot's saved SmolVLA at ``out`` (never overwritten) from the ``smolvla`` bundle at
    ``bundle``. ``image_hw``: the camera frames' size the features declare (LeRobot resizes
    whatever arrives)."""
    from safetensors.torch import save_file

    from vla_accel_ros.models.factory import load_bundle, model_from_bundle
    from vla_accel_ros.models.smolvla.modeling_smolvla import options_of

    bundle, out = Path(bundle), Path(out)
    if out.exists():
        raise BundleError(f"{out} exists already; exports are never overwritten")
    b = load_bundle(bundle)
    spec = b.spec
    if spec.family != "smolvla":
        raise ConfigError(f"--bundle {bundle}: family {spec.family!r}; export-lerobot writes smolvla bundles")
    if spec.tokenizer != "bundle":
        raise ConfigError(f"--bundle {bundle}: tokenizer {spec.tokenizer!r}; LeRobot reads a real tokenizer (tokenizer: bundle)")
    opts = options_of(spec)
    model = model_from_bundle(b)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        raise BundleError(f"{tmp} exists (an interrupted export?): remove it first")
    tmp.mkdir(parents=True)
    name = vlm_name or str(out.resolve() / "vlm")
    write_vlm_dir(tmp / "vlm", spec, model, bundle)
    hidden, vocab = int(model.vlm.config.hidden_size), int(model.vlm.config.vocab_size)
    save_file(lerobot_weights(model.state_dict(), vocab, hidden), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(tmp / CONFIG_FILE, policy_config(spec, opts, name, image_hw))
    pre, post = processor_configs(spec, opts, name, image_hw)
    _write_json(tmp / PREPROCESSOR, pre)
    _write_json(tmp / POSTPROCESSOR, post)
    stats = _stats(spec)
    save_file(stats, str(tmp / PRE_STATS))
    save_file(stats, str(tmp / POST_STATS))
    os.replace(tmp, out)
    return out
