"""The layout every LeRobot checkpoint shares, read once for all the families that import it.

A saved LeRobot policy is a directory with ``config.json`` (its policy ``type`` is the family's
name), ``model.safetensors`` and, from LeRobot 0.4 on, the pre- and post-processor pipelines
(``policy_preprocessor.json`` / ``policy_postprocessor.json``) whose normalizer steps keep their
statistics in safetensors files beside them. :class:`Checkpoint` opens one for a family, runs
the checks every family makes, reads the features, weights and processors, and writes the
imported bundle (config.json, model.safetensors, the tokenizer and ``source.json``) without
ever leaving half a bundle. :class:`ImportOptions` are the import options every family takes;
a family's subclass adds its own, and an option it does not take is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from vla_accel_ros.core.bundle import CONFIG_FILE, WEIGHTS_FILE, BundleSpec
from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.lerobot_compat import NORM_MODES

PREPROCESSOR = "policy_preprocessor.json"
POSTPROCESSOR = "policy_postprocessor.json"
SOURCE_FILE = "source.json"  # an imported bundle's origin: the checkpoint, its config, its camera names
IMAGE_KEY = "observation.images."

# How ``vla-accel bundle import`` spells the options whose flag is not the field's name.
_FLAGS = {"joint_names": "--joints", "default_instruction": "--instruction"}


@dataclass(frozen=True)
class ImportOptions(Config):
    """What every family's import takes. A family's subclass (its options class names it as
    ``import_options``) adds what only its checkpoints need."""

    name: str | None = param(None, doc="bundle name (None: the checkpoint directory's name)")
    joint_names: tuple[str, ...] | None = param(None, doc="one joint name per action dimension (None: ALOHA's for 14)")
    fps: float = param(50.0, doc="control rate the actions were recorded at (dt = 1 / fps)", range=(1e-6, 1e6))
    default_instruction: str = param("", doc="the task used when the policy node is given none")

    @classmethod
    def parse(cls, family: str, given: Mapping[str, Any]):
        """The options from keyword arguments; ``None`` means not given (the CLI passes every
        flag). An option the family does not take is a :class:`ConfigError` naming the option,
        the family and what it takes, never silently ignored."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {k: v for k, v in given.items() if v is not None}
        for key in values:
            if key not in names:
                raise ConfigError(
                    f"import option {key} ({flag(key)}) does not apply to {family} checkpoints; "
                    f"{family} imports take: {', '.join(f'{n} ({flag(n)})' for n in names)}"
                )
        # Paths are given as Path objects by library callers; the options hold strings.
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}
        return cls(**values)

    def dt(self) -> float:
        return 1.0 / self.fps


def flag(option: str) -> str:
    """The ``vla-accel bundle import`` flag of an import option."""
    return _FLAGS.get(option, "--" + option.replace("_", "-"))


def renamed(key: str, key_map) -> str | None:
    """``key`` with the first matching prefix of ``key_map`` ((source, destination) pairs)
    replaced; None when no prefix matches (the caller says which checkpoint had no place for it)."""
    for src, dst in key_map:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise BundleError(f"{path}: missing (a LeRobot policy directory holds config.json, model.safetensors and the processors' JSON)") from e
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BundleError(f"{path}: top level must be an object")
    return data


def processor_step(pipeline: dict, name: str) -> dict | None:
    """The step of a saved processor pipeline with registry name ``name`` (None: absent)."""
    for step in pipeline.get("steps", []):
        if step.get("registry_name") == name:
            return step
    return None


def step_stats(policy_dir: Path, step: dict | None) -> dict[str, dict[str, list[float]]]:
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


class Processors:
    """A 0.4 checkpoint's saved pre- and post-processor pipelines, as a reloaded one runs them."""

    def __init__(self, policy_dir: Path):
        self.policy_dir = policy_dir
        self.pre = read_json(policy_dir / PREPROCESSOR)
        self.post = read_json(policy_dir / POSTPROCESSOR)
        # The unnormalizer's statistics, then the normalizer's over them (the input side's win
        # where both hold a feature).
        self.stats = {**step_stats(policy_dir, processor_step(self.post, "unnormalizer_processor")),
                      **step_stats(policy_dir, processor_step(self.pre, "normalizer_processor"))}  # fmt: skip

    def step(self, name: str) -> dict | None:
        """A pre-processor step by registry name."""
        return processor_step(self.pre, name)

    def config(self, name: str) -> dict:
        """A pre-processor step's saved config ({} when the step or its config is absent)."""
        return (self.step(name) or {}).get("config") or {}

    @property
    def eps(self) -> float:
        return float(self.config("normalizer_processor").get("eps", 1e-8))

    def norm_stats(self, state_dim: int, action_dim: int) -> dict[str, dict[str, list[float]]]:
        """The bundle's ``norm_stats``: only statistics of the feature's size."""

        def of(feature: str, dim: int) -> dict[str, list[float]]:
            return {k: v for k, v in self.stats.get(feature, {}).items() if len(v) == dim}

        return {"state": of("observation.state", state_dim), "action": of("action", action_dim)}


class Checkpoint:
    """A LeRobot checkpoint of policy type ``family`` being imported into a bundle at ``out``
    (``out`` must not exist: bundles are never overwritten). ``options_class`` is the family's
    bundle options class: its defaults are LeRobot's config defaults (normalization modes)."""

    def __init__(self, policy_dir: str | Path, out: str | Path, family: str, options_class: type):
        self.policy_dir, self.out, self.family = Path(policy_dir), Path(out), family
        self.options_class = options_class
        if self.out.exists():
            raise BundleError(f"{self.out} exists already; bundles are never overwritten")
        self.cfg = read_json(self.policy_dir / CONFIG_FILE)
        if self.cfg.get("type") != family:
            raise BundleError(f"config.json: type={self.cfg.get('type')!r}; this importer reads LeRobot {family} checkpoints")

    # -- config.json ------------------------------------------------------------------------------
    def norm_mode(self, kind: str) -> str:
        """The normalization mode of feature type ``kind`` (VISUAL, STATE, ACTION), as LeRobot
        reads it. A saved config.json always holds the whole ``normalization_mapping`` (LeRobot
        writes every field); when the mapping is absent LeRobot's config parser takes the policy
        config's default (the family's options class carries the same defaults: MEAN_STD for
        SmolVLA and pi0, QUANTILES for pi05; images IDENTITY), and a feature type missing from a
        mapping that is there is not normalized (its normalizer's rule: IDENTITY)."""
        mapping = self.cfg.get("normalization_mapping")
        if mapping is None:
            default = {f.name: f.default for f in dataclasses.fields(self.options_class)}
            mode = {"STATE": default["state_norm"], "ACTION": default["action_norm"]}.get(kind, "IDENTITY")
        else:
            mode = str(mapping.get(kind, "IDENTITY"))
        if mode not in NORM_MODES:
            raise ConfigError(f"normalization_mapping.{kind}={mode!r} is not a LeRobot normalization mode ({', '.join(NORM_MODES)})")
        return mode

    def refuse_image_norm(self) -> None:
        """Images normalized by dataset statistics: no family here does it (LeRobot's defaults never do)."""
        mode = self.norm_mode("VISUAL")
        if mode != "IDENTITY":
            raise ConfigError(
                f"normalization_mapping.VISUAL={mode}: image normalization by dataset statistics is not supported by "
                f"this importer ({self.family}'s default is IDENTITY)"
            )

    def refuse_obs_steps(self, what: str) -> None:
        if int(self.cfg.get("n_obs_steps", 1)) != 1:
            raise ConfigError(f"n_obs_steps={self.cfg.get('n_obs_steps')}: {what} reads one observation step")

    def refuse_delta_actions(self) -> None:
        if self.cfg.get("use_delta_joint_actions_aloha"):
            raise ConfigError("use_delta_joint_actions_aloha=true: LeRobot itself does not implement it (NotImplementedError)")

    def features(self) -> tuple[dict[str, str], int, int]:
        """LeRobot's camera feature -> camera name (blank ``empty_camera_*`` ones left out:
        nobody attends to them), the state and action sizes."""
        feats = self.cfg.get("input_features") or {}
        keys = [k for k, f in feats.items() if (f or {}).get("type") == "VISUAL" and not k.startswith(IMAGE_KEY + "empty_camera_")]
        cameras = {k: k.removeprefix(IMAGE_KEY) for k in keys}
        state_dim = int((feats.get("observation.state") or {}).get("shape", [0])[0])
        action_dim = int(((self.cfg.get("output_features") or {}).get("action") or {}).get("shape", [0])[0])
        if not cameras or not state_dim or not action_dim:
            raise BundleError(f"config.json: {self.family} needs camera (VISUAL) features, observation.state and an action output")
        return cameras, state_dim, action_dim

    # -- the other files ----------------------------------------------------------------------------
    def weights(self) -> dict:
        """model.safetensors as LeRobot saved it (its names)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(self.policy_dir / WEIGHTS_FILE))
        except (SafetensorError, OSError) as e:
            raise BundleError(f"{self.policy_dir / WEIGHTS_FILE}: unreadable safetensors file: {e}") from e

    def processors(self) -> Processors:
        return Processors(self.policy_dir)

    # -- the bundle ---------------------------------------------------------------------------------
    def spec_fields(self, opts: ImportOptions, cameras: dict[str, str], state_dim: int, action_dim: int) -> dict[str, Any]:
        """The BundleSpec fields every imported bundle sets alike (LeRobot resizes with padding;
        the tokenizer is the bundle's own; the task as given)."""
        from vla_accel_ros.models import demo

        return dict(
            family=self.family, name=opts.name or self.policy_dir.resolve().name, cameras=tuple(cameras.values()),
            image_resize="pad", tokenizer="bundle", instruction_template="{instruction}",
            default_instruction=opts.default_instruction, action_dim=action_dim, state_dim=state_dim, dt=opts.dt(),
            joint_names=tuple(opts.joint_names) if opts.joint_names else demo.joint_names(action_dim),
        )  # fmt: skip

    def source(self, cameras: dict[str, str], no_effect: tuple[str, ...], **extra) -> dict[str, Any]:
        """``source.json``: the checkpoint, where its other parts came from (``extra``), LeRobot's
        camera feature -> camera map, its config, and its options without an effect on one
        inference here (``no_effect``)."""
        return {
            "lerobot_policy": str(self.policy_dir.resolve()), **extra, "cameras": cameras, "lerobot_config": self.cfg,
            "no_effect_here": {k: self.cfg.get(k) for k in no_effect},
        }  # fmt: skip

    def write(self, spec: BundleSpec, weights: dict, tokenizer, source: dict) -> Path:
        """The bundle at ``out`` after the family checked its spec and the weights' names and
        shapes against it."""
        from vla_accel_ros.models.factory import check_weights, spec_family

        spec_family(spec, self.out / CONFIG_FILE)
        check_weights(self.policy_dir / WEIGHTS_FILE, spec, {k: (tuple(v.shape), True) for k, v in weights.items()})
        return write_imported(self.out, spec, weights, tokenizer, source)


def write_imported(out: Path, spec: BundleSpec, weights: dict, tokenizer, source: dict) -> Path:
    """An imported bundle written beside ``out`` and renamed into place (no half bundle): its
    weights, the tokenizer's files (saved by transformers) and ``source.json``."""
    from vla_accel_ros.core.bundle import TOKENIZER_DIR, save_bundle

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        raise BundleError(f"{tmp} exists (an interrupted import?): remove it first")
    save_bundle(tmp, spec, weights)
    tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
    os.replace(tmp, out)
    return out
