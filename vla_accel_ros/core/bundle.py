"""Self-contained model bundles: ``config.json`` + ``model.safetensors`` (+ ``tokenizer/``).

A bundle carries everything a policy needs (vla.cpp's lesson): its family, architecture sizes,
camera names, image size and preprocessing, instruction template, tokenizer, chunking, joint
names and the normalization statistics. Weights load with safetensors only; nothing is
unpickled.

This module checks what every bundle shares. What a family adds (its own fields and their
consistency with the weights) is checked by the family's plug-in
(:mod:`vla_accel_ros.models.family`), which the model loaders consult; the core does not know
which families exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import BundleError, ConfigError

FORMAT = "vla_accel_ros.bundle/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"  # a bundle's own tokenizer files (``tokenizer: bundle``)


# What a bundle may declare for its modules. Far beyond the models this package runs (a few
# billion parameters on a robot's computer), short of what would end in an allocator traceback:
# a config outside these is refused with the field named.
_MODULE_LIMITS = {
    "num_hidden_layers": (1, 256),
    "hidden_size": (1, 32_768),
    "intermediate_size": (1, 131_072),
    "num_attention_heads": (1, 512),
    "num_key_value_heads": (1, 512),
    "head_dim": (1, 1024),
    "vocab_size": (1, 1_000_000),
    "max_position_embeddings": (1, 1_048_576),
}
_REQUIRED = {
    "vision": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "lm": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "expert": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
}
MAX_PARAMETERS = 20_000_000_000  # what the sizes may add up to (80 GB of float32 weights)


def _check_module(name: str, cfg: Mapping[str, Any]) -> None:
    """Sizes of one module config (vision, lm, expert): integers within :data:`_MODULE_LIMITS`."""
    for key in _REQUIRED[name]:
        if key not in cfg:
            raise ConfigError(f"{name}.{key} is required")
    for key, (lo, hi) in _MODULE_LIMITS.items():
        if key not in cfg or cfg[key] is None:
            continue
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}.{key}={v!r} must be an integer in [{lo}, {hi}]")
        if not lo <= v <= hi:
            raise ConfigError(f"{name}.{key}={v} is out of range [{lo}, {hi}]")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise ConfigError(f"{name}.num_attention_heads={heads} must be a multiple of {name}.num_key_value_heads={kv}")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ConfigError(f"{name}.hidden_size={cfg['hidden_size']} must be a multiple of {name}.num_attention_heads={heads}")


def _module_parameters(cfg: Mapping[str, Any]) -> int:
    """About how many weights a transformer module of these sizes has (attention, MLP, embeddings)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attention = h * hd * (2 * heads + 2 * kv)
    return n * (attention + 3 * h * i) + 2 * cfg.get("vocab_size", 0) * h


@dataclass(frozen=True)
class BundleSpec(Config):
    """The validated content of a bundle's config.json."""

    family: str = param(
        "", doc="policy family: a registered plug-in (vla_accel_ros.models.family), e.g. ar, flow, smolvla"
    )
    name: str = param("unnamed", doc="human-readable bundle name")
    cameras: tuple[str, ...] = param(("cam_high",), doc="camera names, in token order")
    image_size: int = param(224, doc="square image size fed to the vision tower", range=(14, 2048))
    patch_size: int = param(
        14, doc="pixels per image-token side at image_size (a vision patch, or a block of them merged into one token)",
        range=(1, 2048),
    )
    image_resize: str = param(
        "square",
        doc="how a camera frame becomes image_size x image_size: square (the package's one resize, Pillow, "
        "aspect not kept; frames arrive resized) | pad (aspect kept, bilinear on [0, 1] floats, zero padding on "
        "top and left, as LeRobot's SmolVLA; frames arrive at their own size and the policy resizes them)",
        choices=("square", "pad"),
    )
    tokenizer: str = param(
        "hash",
        doc="hash (the hash-word tokenizer of the demo families, text_vocab buckets) | bundle (a transformers "
        "tokenizer from the bundle's tokenizer/ directory, loaded offline)",
        choices=("hash", "bundle"),
    )
    instruction_template: str = param(
        "In: What action should the robot take to {instruction}?\nOut:", doc="prompt around the instruction"
    )
    default_instruction: str = param("transfer the cube", doc="instruction used when none was given")
    max_text_tokens: int = param(64, doc="longest tokenized prompt accepted", range=(1, 4096))
    text_vocab: int = param(512, doc="hash-word tokenizer buckets", range=(16, 10_000_000))
    action_dim: int = param(14, doc="D: action vector size", range=(1, 256))
    chunk_size: int = param(1, doc="H: actions per chunk", range=(1, 1024))
    dt: float = param(0.02, doc="seconds between consecutive actions", range=(1e-4, 10.0))
    joint_names: tuple[str, ...] = param((), doc="one name per action dimension")
    state_dim: int = param(0, doc="proprioceptive state size (0: no state input)", range=(0, 256))
    num_steps: int = param(10, doc="flow-matching families: Euler steps per chunk", range=(1, 1000))
    noise_scale: float = param(
        1.0,
        doc="flow-matching families: the multiple of the Gaussian noise a chunk starts from, where the policy's "
        "flow_noise_scale is -1 (1: the trained sampler, LeRobot's; 0: one deterministic chunk per observation)",
        range=(0.0, 2.0),
    )
    action_bins: int = param(256, doc="ar: action tokens = the last N vocabulary ids", range=(2, 65536))
    reasoning_words: tuple[str, ...] = param(
        (), doc="ar: the words a reasoning policy writes before <act> (ids just below the action bins; empty: no reasoning)"
    )
    max_reasoning_tokens: int = param(0, doc="ar: longest reasoning before <act> (0: no reasoning)", range=(0, 4096))
    norm_stats: dict | None = None  # {"action": {mean,std,q01,q99,...}, "state": {...}}
    vision: dict | None = None  # the vision tower's transformers config kwargs
    lm: dict | None = None  # the language model's decoder config kwargs + model_type
    expert: dict | None = None  # flow-matching families: the action expert's decoder config
    options: dict | None = None  # the family's own options (its plug-in validates them)

    def validate(self) -> None:
        if not self.family:
            raise ConfigError("family is required: the policy family of the bundle (e.g. ar, flow, smolvla)")
        if "{instruction}" not in self.instruction_template:
            raise ConfigError("instruction_template must contain '{instruction}'")
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if len(set(self.cameras)) != len(self.cameras) or not self.cameras:
            raise ConfigError(f"cameras={list(self.cameras)} must be a non-empty list of unique names")
        if len(self.joint_names) != self.action_dim:
            raise ConfigError(f"joint_names has {len(self.joint_names)} names but action_dim is {self.action_dim}")
        for key in ("vision", "lm", "norm_stats"):
            if not isinstance(getattr(self, key), dict):
                raise ConfigError(f"{key} must be a mapping")
        for key in ("expert", "options"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), dict):
                raise ConfigError(f"{key} must be a mapping when given")
        modules = {"vision": self.vision, "lm": self.lm, **({"expert": self.expert} if self.expert else {})}
        for name, cfg in modules.items():
            _check_module(name, cfg)
        total = sum(_module_parameters(cfg) for cfg in modules.values())
        if total > MAX_PARAMETERS:
            sizes = ", ".join(f"{n}: {c['num_hidden_layers']} layers x hidden {c['hidden_size']}" for n, c in modules.items())
            raise ConfigError(f"the module sizes ({sizes}) add up to about {total:.3g} parameters, more than {MAX_PARAMETERS:.3g}")
        if "action" not in self.norm_stats:
            raise ConfigError("norm_stats.action is required")
        if self.state_dim and "state" not in self.norm_stats:
            raise ConfigError("norm_stats.state is required when state_dim > 0")

    @property
    def grid(self) -> int:
        """Image tokens per side of a camera's image."""
        return self.image_size // self.patch_size

    @property
    def frame_size(self) -> int:
        """The square size the graph resizes camera frames to before the policy (0: frames keep
        their own size, the policy's preprocessing resizes them)."""
        return self.image_size if self.image_resize == "square" else 0

    @property
    def decoder_layers(self) -> int:
        """Layers of the VLM decoder (what a config's layer indices are checked against)."""
        return int(self.lm["num_hidden_layers"])


def head_dim(module: Mapping[str, Any]) -> int:
    """Head size of a decoder config section (``head_dim``, else hidden / heads)."""
    return int(module.get("head_dim") or module["hidden_size"] // module["num_attention_heads"])


@dataclass
class Bundle:
    path: Path
    spec: BundleSpec
    state_dict: dict  # name -> torch.Tensor


def read_spec(path: str | Path) -> BundleSpec:
    path = Path(path)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise BundleError(f"{path}: not a bundle (no {CONFIG_FILE})")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{cfg_path}: invalid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise BundleError(f"{cfg_path}: top level must be an object")
    fmt = raw.pop("format", None)
    if fmt != FORMAT:
        raise BundleError(f"{cfg_path}: field 'format' is {fmt!r}, expected {FORMAT!r}")
    if "family" not in raw:
        raise BundleError(f"{cfg_path}: field 'family' is missing (the policy family of the bundle, e.g. ar, flow, smolvla)")
    try:
        return BundleSpec.from_dict(raw)
    except ConfigError as e:
        raise BundleError(f"{cfg_path}: {e}") from e


def load_bundle(path: str | Path) -> Bundle:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    spec = read_spec(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise BundleError(f"{path}: missing {WEIGHTS_FILE}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise BundleError(f"{weights}: unreadable safetensors file: {e}") from e
    return Bundle(path=path, spec=spec, state_dict=state)


def save_bundle(path: str | Path, spec: BundleSpec, state_dict: Mapping[str, Any]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    # Written beside and renamed into place: a reader never sees half a file.
    save_file(tensors, str(path / (WEIGHTS_FILE + ".tmp")), metadata={"format": "pt", "bundle": FORMAT})
    (path / (CONFIG_FILE + ".tmp")).write_text(json.dumps({"format": FORMAT, **spec.to_dict()}, indent=2) + "\n")
    os.chmod(path / (WEIGHTS_FILE + ".tmp"), 0o644)  # safetensors writes 0600; a bundle is shared data
    os.replace(path / (WEIGHTS_FILE + ".tmp"), path / WEIGHTS_FILE)
    os.replace(path / (CONFIG_FILE + ".tmp"), path / CONFIG_FILE)
    return path


SHIPPED = ("transfer_cube-ar", "transfer_cube-flow", "transfer_cube-ar-reasoning", "transfer_cube-smolvla")  # trained bundles in the repository's bundles/


def shipped_bundle(name: str) -> Path:
    """A trained bundle the package ships (``bundles/<name>``, installed to share/vla_accel_ros/bundles)."""
    from vla_accel_ros.core.params_file import find_shared

    try:
        path = find_shared(f"bundles/{name}")
    except FileNotFoundError as e:
        raise BundleError(f"shipped bundle {name!r} not found: {e}") from e
    if not (path / CONFIG_FILE).is_file():
        raise BundleError(f"{path}: not a bundle (no {CONFIG_FILE})")
    return path
