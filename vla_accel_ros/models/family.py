"""Model families as plug-ins: what a family module implements, and the registry that finds it.

A *family* is one kind of policy a bundle can hold (``config.json``'s ``family``): the
package's own ``ar`` and ``flow``, and LeRobot's ``smolvla``, ``pi0`` and ``pi05``. Everything that differs between
families lives in the family's module, behind the small protocol of :class:`Family`; the rest
of the package (bundle loading, the parity gate, precision, replay, evaluation, training, the
nodes) asks the family and never branches on its name.

To add a family: write a module with a :class:`Family` subclass and a module-level ``FAMILY``
instance, and add its name, module and capabilities to :data:`_REGISTRY`. Its policy class implements the
policy interface of :mod:`vla_accel_ros.core.types` plus what :class:`~vla_accel_ros.models.base.PolicyBase`
asks of subclasses (see there), ``reference_infer`` (the plain, un-accelerated forward the
parity gate compares the engine with) and ``gate_noise`` / ``compare_precision``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from vla_accel_ros.core.bundle import BundleSpec, head_dim
from vla_accel_ros.core.errors import BundleError, ConfigError

if TYPE_CHECKING:  # the registry itself stays light: the CLI lists families without torch
    from torch import nn

@dataclass(frozen=True)
class Registered:
    """A family's entry in the registry: where its plug-in lives and what it can do, declared
    here so that listing the families that can do something imports none of their modules
    (each pulls in torch and transformers). ``test_family_registry`` checks every declaration
    against the plug-in itself."""

    module: str  # defines FAMILY
    train: bool = False  # `vla-accel train` trains it from bags (Family.trainable)
    demo: bool = False  # `vla-accel bundle create-demo` writes random-weight bundles (Family.demo_spec)
    import_lerobot: bool = False  # `vla-accel bundle import --lerobot` reads LeRobot's checkpoints (Family.import_lerobot)


# family name -> its entry. A module is imported on first use: a process that runs one family
# never imports the others' modules.
_REGISTRY = {
    "ar": Registered("vla_accel_ros.models.ar", train=True, demo=True),
    "flow": Registered("vla_accel_ros.models.flow", train=True, demo=True),
    "smolvla": Registered("vla_accel_ros.models.smolvla", train=True, demo=True, import_lerobot=True),
    "pi0": Registered("vla_accel_ros.models.pi0", import_lerobot=True),
    "pi05": Registered("vla_accel_ros.models.pi05", demo=True, import_lerobot=True),
}
CAPABILITIES = ("train", "demo", "import_lerobot")


def family_names(can: str = "") -> tuple[str, ...]:
    """Every family's name, or with ``can`` (one of :data:`CAPABILITIES`) those that declare it."""
    if can and can not in CAPABILITIES:
        raise ValueError(f"can={can!r}: one of {', '.join(CAPABILITIES)}")
    return tuple(n for n, r in _REGISTRY.items() if not can or getattr(r, can))


def get_family(name: str) -> "Family":
    """The plug-in of family ``name``; :class:`BundleError` naming the known ones otherwise."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BundleError(f"family={name!r} is not a known model family; known: {', '.join(_REGISTRY)}")
    return importlib.import_module(entry.module).FAMILY


class Family:
    """The protocol of a model family (defaults shown; a family overrides what differs).

    Class attributes:

    * ``name``: the ``family`` field of its bundles;
    * ``precision_defaults`` / ``precision_fallbacks``: what ``precision: auto`` resolves to and
      what the gate tries next (:class:`~vla_accel_ros.core.precision.FamilyPrecision`);
    * ``heads``: attribute names of the model's small input / output ``nn.Linear`` layers (the
      ``heads`` precision component);
    * ``token_actions``: the policy decodes discrete action tokens (its chunks carry
      ``stats["action_tokens"]``; deviations then also count identical tokens);
    * ``writes_reasoning``: bundles may declare reasoning words (MEMO-VLM applies);
    * ``pipelines``: its policy pipelines decoding across frames (ActionFlow; ``policy.pipeline()``);
    * ``trainable``: ``vla-accel train`` can train it from bags (``default_chunk_size``);
    * ``state_required``: its checkpoints always read a joint state (LeRobot's policies do), so
      a policy trained without one keeps the input and learns nothing from it.

    Families with random-weight demo bundles also define ``demo_spec(size, **kwargs)``; families
    whose checkpoints LeRobot saves define ``import_lerobot(policy_dir, out, **options)`` (the
    family's name is LeRobot's policy ``type``; ``options`` are the fields of the family's typed
    import options, :class:`~vla_accel_ros.models.lerobot.reader.ImportOptions`, which refuse
    any other by name).
    """

    name = ""
    precision_defaults: Mapping[str, str] = {}
    precision_fallbacks: tuple[Mapping[str, str], ...] = ()
    heads: tuple[str, ...] = ()
    token_actions = False
    writes_reasoning = False
    pipelines = False
    trainable = False
    default_chunk_size = 1
    state_required = False

    # -- the bundle ---------------------------------------------------------------------------
    def validate_spec(self, spec: BundleSpec) -> None:
        """Raise :class:`ConfigError` for a spec this family cannot build (its own fields and
        their consistency). The default checks what every family of the package needs."""
        if (spec.reasoning_words or spec.max_reasoning_tokens) and not self.writes_reasoning:
            raise ConfigError(f"reasoning_words / max_reasoning_tokens: {self.name} bundles write no reasoning")

    def build_model(self, spec: BundleSpec) -> "nn.Module":
        """The family's modules with random weights (the loader loads the bundle's after)."""
        raise NotImplementedError

    def make_policy(self, spec: BundleSpec, model: "nn.Module", config, planner, *, bundle_path: str = "", precision=None):
        """The policy around ``model`` (weights already at ``precision``)."""
        raise NotImplementedError

    def describe(self, spec: BundleSpec) -> list[str]:
        """Lines of ``vla-accel bundle inspect`` particular to the family (after the common ones)."""
        return []

    def training_vision(self, spec: BundleSpec, image_size: int, patch_size: int, conv_stem: tuple[int, ...]) -> BundleSpec:
        """``spec`` (a size preset's) with a training run's image size, token grid and conv stem
        (0 / (): the preset's). The default: one vision patch per image token (ar, flow), the
        tower's sizes are the bundle's."""
        from vla_accel_ros.models.common import CONV_STEM

        if not (image_size or patch_size or conv_stem):
            return spec
        size, patch = image_size or spec.image_size, patch_size or spec.patch_size
        stem = {CONV_STEM: list(conv_stem)} if conv_stem else {}
        vision = {**spec.vision, "image_size": size, "patch_size": patch, **stem}
        return spec.replace(image_size=size, patch_size=patch, vision=vision)

    def init_for_training(self, model: "nn.Module") -> None:
        """Re-initialize what a run from scratch needs initialized otherwise than the modules'
        own defaults (which are meant for loading pretrained weights)."""

    def training_spec(self, spec: BundleSpec, out, instructions: list[str]) -> BundleSpec:
        """The spec ``vla-accel train`` trains, from the size preset's: a family whose bundles
        bring files besides the weights (a tokenizer) writes them into ``out`` here."""
        return spec

    # -- precision ----------------------------------------------------------------------------
    def decoder_layers(self, model: "nn.Module") -> "dict[str, nn.ModuleList]":
        """The decoder layers of each decoder component (``lm``, and ``expert`` where there is one)."""
        raise NotImplementedError

    def component_roots(self, model: "nn.Module") -> "dict[str, list[nn.Module]]":
        """The modules whose ``nn.Linear`` layers make the ``vision`` and ``projector`` components."""
        return {"vision": [model.vis.vision], "projector": [model.vis.projector]}

    # -- benchmarks -----------------------------------------------------------------------------
    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        """FLOPs of one inference by component (:mod:`vla_accel_ros.bench.flops` prices the parts)."""
        raise NotImplementedError


def check_vision_patch(spec: BundleSpec) -> None:
    """One image token per vision patch (the SigLIP towers of ar and flow): the tower's image
    and patch sizes are the bundle's; an optional convolutional stem (``vision.conv_stem``: the
    channels of its 2 x 2 / stride 2 stages) must divide the patch."""
    from vla_accel_ros.models.common import CONV_STEM, conv_stem_stride

    if (spec.vision.get("image_size"), spec.vision.get("patch_size")) != (spec.image_size, spec.patch_size):
        raise ConfigError("vision.image_size / vision.patch_size must equal image_size / patch_size")
    stem = spec.vision.get(CONV_STEM)
    if stem is None:
        return
    if (
        not isinstance(stem, (list, tuple)) or not 1 <= len(stem) <= 4
        or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 4096 for c in stem)
    ):  # fmt: skip
        raise ConfigError(f"vision.{CONV_STEM}={stem!r}: give 1 to 4 channel counts, integers in [1, 4096]")
    stride = conv_stem_stride(spec.vision)
    if spec.patch_size % stride:
        raise ConfigError(
            f"vision.{CONV_STEM}={list(stem)} shrinks the image {stride}x, which must divide patch_size={spec.patch_size}"
        )


def check_expert_shares_cache(spec: BundleSpec, what: str = "the expert attends to the VLM's K/V") -> None:
    """An expert whose layers write and read the VLM's KV cache layer by layer."""
    if not isinstance(spec.expert, dict):
        raise ConfigError(f"{spec.family} bundles need an 'expert' decoder config")
    for key in ("num_hidden_layers", "num_key_value_heads"):
        if spec.expert.get(key) != spec.lm.get(key):
            raise ConfigError(f"expert.{key} must equal lm.{key} ({what})")
    if head_dim(spec.expert) != head_dim(spec.lm):
        raise ConfigError("expert and lm must have the same head_dim")
