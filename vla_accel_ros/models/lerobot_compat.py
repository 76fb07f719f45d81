"""What LeRobot computes around its policies (SmolVLA and pi0 alike), written from its
description: the normalization modes with its eps, the image resize that keeps the aspect and
pads on top and left, its frames as [0, 1] floats, the task text, the state and action padding,
and the optional pi-ALOHA joint maps. Every family that imports LeRobot checkpoints builds on
:class:`LeRobotPolicy`, so that the policies' inputs and outputs are LeRobot's to the last bit
(the reference fixtures check it). :class:`LeRobotCodec` is LeRobot's action codec for the
flow-matching core (:mod:`~vla_accel_ros.models.flow_core`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError, ObservationError
from vla_accel_ros.core.robot.config import ALOHA_GRIPPERS
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models.common import Frames, make_tokenizer
from vla_accel_ros.models.flow_core import FlowCore, FlowFamilyBase

NORM_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
# The statistics each normalization mode reads (LeRobot's NormalizerProcessorStep).
NORM_STATS = {"IDENTITY": (), "MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
              "QUANTILE10": ("q10", "q90")}  # fmt: skip


@dataclass(frozen=True)
class LeRobotOptions(Config):
    """What a LeRobot checkpoint's config says about its inputs and outputs (every family's)."""

    max_state_dim: int = param(32, doc="the state is zero-padded to this size before state_proj", range=(1, 4096))
    max_action_dim: int = param(32, doc="actions (and the noise) are this wide inside the model; the first action_dim are used", range=(1, 4096))
    state_norm: str = param("MEAN_STD", doc="normalization of the state (LeRobot NormalizationMode)", choices=NORM_MODES)
    action_norm: str = param("MEAN_STD", doc="normalization of the actions (LeRobot NormalizationMode)", choices=NORM_MODES)
    norm_eps: float = param(1e-8, doc="LeRobot's normalizer eps", range=(0.0, 1.0))
    adapt_to_pi_aloha: bool = param(False, doc="convert the ALOHA state and actions to and from pi's joint space (LeRobot's flip and gripper maps)")
    truncate_text: bool = param(True, doc="a prompt longer than max_text_tokens is cut there (LeRobot's tokenizer step truncates)")


def normalize(x: torch.Tensor, mode: str, stats: dict, eps: float, inverse: bool = False) -> torch.Tensor:
    """LeRobot's NormalizerProcessorStep (and its inverse) for one feature, in float32."""
    if mode == "IDENTITY" or not stats:
        return x
    s = {k: torch.as_tensor(np.asarray(v, dtype=np.float32), device=x.device) for k, v in stats.items()}
    if mode == "MEAN_STD":
        return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + eps)
    lo, hi = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[mode]
    denom = s[hi] - s[lo]
    denom = torch.where(denom == 0, torch.tensor(eps, dtype=x.dtype, device=x.device), denom)
    if mode == "MIN_MAX":
        return (x + 1) / 2 * denom + s[lo] if inverse else 2 * (x - s[lo]) / denom - 1
    return (x + 1.0) * denom / 2.0 + s[lo] if inverse else 2.0 * (x - s[lo]) / denom - 1.0


def _rescale(x: torch.Tensor, lo: float, hi: float, inverse: bool) -> torch.Tensor:
    return x * (hi - lo) + lo if inverse else (x - lo) / (hi - lo)


def _gripper_to_angular(x: torch.Tensor) -> torch.Tensor:
    # ALOHA's linear gripper positions back to pi's angular space (Interbotix's horn and arm
    # lengths; the 0.4 / 1.5 range measured on a Trossen robot), as LeRobot maps them.
    x = _rescale(x, 0.01844, 0.05800, inverse=True)
    r, arm = 0.022, 0.036
    x = torch.arcsin(torch.clamp((r**2 + x**2 - arm**2) / (2 * r * x), -1.0, 1.0))
    return _rescale(x, 0.4, 1.5, inverse=False)


def _gripper_from_angular(x: torch.Tensor) -> torch.Tensor:
    return _rescale(_rescale(x, 0.4, 1.5, inverse=True), -0.6213, 1.4910, inverse=False)


def _gripper_from_angular_inv(x: torch.Tensor) -> torch.Tensor:
    return _rescale(_rescale(x, -0.6213, 1.4910, inverse=True), 0.4, 1.5, inverse=False)


_FLIPPED = (1, 2, 8, 9)
# What each direction does to a gripper: the state into pi's space; the model's actions out to
# ALOHA's; ALOHA's actions back into the model's (training targets, RTC's previous chunk: the
# exact inverse of the second, which LeRobot trains with, not the state's map).
_GRIPPER_MAPS = {"state": _gripper_to_angular, "actions_out": _gripper_from_angular, "actions_in": _gripper_from_angular_inv}


def pi_aloha(x: torch.Tensor, *, direction: str) -> torch.Tensor:
    """LeRobot's ``adapt_to_pi_aloha``: joints 1, 2, 8, 9 flipped, the grippers mapped;
    ``direction``: ``state`` (to pi's space), ``actions_out`` (the model's actions to ALOHA's),
    ``actions_in`` (ALOHA's actions to the model's). ``x``: [..., 14]"""
    gripper = _GRIPPER_MAPS[direction]
    x = x.clone()
    x[..., list(_FLIPPED)] *= -1
    for g in ALOHA_GRIPPERS:
        x[..., g] = gripper(x[..., g])
    return x


def resize_with_pad(img: torch.Tensor, size: int) -> torch.Tensor:
    """[C, 3, h, w] in [0, 1] -> [C, 3, size, size]: aspect kept (bilinear), zeros on top and left."""
    h, w = img.shape[-2:]
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(img, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(out, (max(0, size - rw), 0, max(0, size - rh), 0), value=0.0)


def frame_tensor(image: np.ndarray, camera: str) -> torch.Tensor:
    """A camera frame [h, w, 3] uint8 (0..255) or float (0..1) -> [3, h, w] float32 in [0, 1]."""
    a = np.asarray(image)
    if a.ndim != 3 or a.shape[2] != 3:
        raise ObservationError(f"camera {camera}: frame of shape {list(a.shape)}, expected [height, width, 3]")
    t = torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)
    if a.dtype == np.uint8:
        return t.float() / 255.0
    if a.dtype in (np.float32, np.float64):
        return t.float()
    raise ObservationError(f"camera {camera}: frames must be uint8 or float in [0, 1], got {a.dtype}")


def padded_frames(images, cameras: tuple[str, ...], size: int):
    """The cameras' frames resized with padding (LeRobot's rule) -> pixels in [-1, 1], and the
    same image as uint8 [C, S, S, 3] for the token cache's comparisons."""
    missing = [c for c in cameras if c not in images]
    if missing:
        raise ObservationError(f"observation lacks camera(s) {', '.join(missing)}; has {', '.join(images) or 'none'}")
    arrays = [np.asarray(images[c]) for c in cameras]
    if arrays and all(a.dtype == np.uint8 and a.ndim == 3 and a.shape == arrays[0].shape for a in arrays) and arrays[0].shape[2] == 3:
        # One resize for cameras of one size (the same values: bilinear works per image), from
        # the stacked bytes (channels-last strides, the interpolation's fast path).
        unit = resize_with_pad(torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div_(255.0), size)
    else:
        unit = torch.cat([resize_with_pad(frame_tensor(a, c)[None], size) for a, c in zip(arrays, cameras)])
    return Frames(cameras, pixels=unit * 2.0 - 1.0, unit=unit)  # [C, 3, S, S]


class LeRobotFamily(FlowFamilyBase):
    """What the families of LeRobot checkpoints share: a VLM and an action expert, the flow-matching
    heads, the defaults of ``precision: auto`` (the flow family's measured ones; the gate
    decides per bundle)."""

    state_required = True  # LeRobot's SmolVLA and pi0 always read observation.state
    # The module whose ``import_lerobot(policy_dir, out, **options)`` reads the family's
    # checkpoints (on models/lerobot/'s reader); imported only when a checkpoint is.
    importer = ""

    def import_lerobot(self, policy_dir, out, **options):
        """A bundle at ``out`` from LeRobot's saved policy at ``policy_dir`` (``options``: the
        family's typed import options, :class:`~vla_accel_ros.models.lerobot.reader.ImportOptions`)."""
        import importlib

        return importlib.import_module(self.importer).import_lerobot(policy_dir, out, **options)

    @staticmethod
    def padding_line(spec, opts: LeRobotOptions) -> str:
        return (f"padding     state {spec.state_dim} -> {opts.max_state_dim}, actions {spec.action_dim} -> {opts.max_action_dim}; "
                f"normalization state {opts.state_norm}, action {opts.action_norm}")  # fmt: skip


def check_lerobot_io(spec, opts: LeRobotOptions) -> None:
    """What every LeRobot family's spec must hold: frames resized with padding, the state and
    action inside the padded sizes, the statistics the normalization modes read."""
    if spec.image_resize != "pad":
        raise ConfigError(f"image_resize={spec.image_resize!r}: LeRobot resizes with padding (image_resize: pad)")
    if not 1 <= spec.state_dim <= opts.max_state_dim or spec.action_dim > opts.max_action_dim:
        raise ConfigError(
            f"state_dim={spec.state_dim} / action_dim={spec.action_dim} must fit options.max_state_dim="
            f"{opts.max_state_dim} / max_action_dim={opts.max_action_dim}"
        )
    for feature, mode in (("state", opts.state_norm), ("action", opts.action_norm)):
        missing = [k for k in NORM_STATS[mode] if k not in spec.norm_stats.get(feature, {})]
        if missing:
            raise ConfigError(f"options.{feature}_norm={mode} needs norm_stats.{feature}.{', '.join(missing)}")
    if opts.adapt_to_pi_aloha and (spec.state_dim, spec.action_dim) != (14, 14):
        raise ConfigError("options.adapt_to_pi_aloha maps ALOHA's 14 joints: state_dim and action_dim must be 14")


class LeRobotCodec:
    """LeRobot's action codec: actions normalized by its modes and eps (and mapped to pi's joint
    space with ``adapt_to_pi_aloha``), zero-padded to ``max_action_dim`` inside the model, cut
    back and unnormalized as its postprocessor does. ``pi_aloha_on_normalized``: where the
    family's LeRobot version applies the pi-ALOHA maps (SmolVLA 0.4.x on normalized values, in
    the policy after its preprocessor; pi0 0.3.3 on robot units)."""

    def __init__(self, spec, options: LeRobotOptions, pi_aloha_on_normalized: bool) -> None:
        self.spec, self.options, self.pi_aloha_on_normalized = spec, options, pi_aloha_on_normalized
        self.width = options.max_action_dim  # the noise's and the model's action width

    def to_model(self, x: torch.Tensor, feature: str, mode: str) -> torch.Tensor:
        """Robot units -> the model's space: LeRobot's normalization and, with
        ``adapt_to_pi_aloha``, the map to pi's joint space (before or after normalizing, as the
        family's LeRobot version does)."""
        o = self.options
        stats = self.spec.norm_stats.get(feature, {})
        direction = "state" if feature == "state" else "actions_in"
        if o.adapt_to_pi_aloha and not self.pi_aloha_on_normalized:
            x = pi_aloha(x, direction=direction)
        x = normalize(x, mode, stats, o.norm_eps)
        return pi_aloha(x, direction=direction) if o.adapt_to_pi_aloha and self.pi_aloha_on_normalized else x

    def actions_out(self, x: torch.Tensor) -> np.ndarray:
        """The model's padded chunk [1, H, A] -> actions [H, action_dim] in robot units (the
        inverse of :meth:`to_model`)."""
        s, o = self.spec, self.options
        a = x[:, :, : s.action_dim].detach().float()
        aloha = o.adapt_to_pi_aloha
        if aloha and self.pi_aloha_on_normalized:
            a = pi_aloha(a, direction="actions_out")
        a = normalize(a, o.action_norm, s.norm_stats["action"], o.norm_eps, inverse=True)
        if aloha and not self.pi_aloha_on_normalized:
            a = pi_aloha(a, direction="actions_out")
        return a[0].numpy().astype(np.float32)

    def guidance_targets(self, prev: np.ndarray, weights: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """RTC targets in the model's action space (normalized, padded; the padding unweighted)
        from the previous chunk's first n actions [n, action_dim] and their weights [n]."""
        s, o = self.spec, self.options
        h, d, n = s.chunk_size, s.action_dim, prev.shape[0]
        y = torch.zeros(1, h, o.max_action_dim)
        y[:, :n, :d] = self.to_model(torch.from_numpy(prev)[None], "action", o.action_norm)
        w = torch.zeros(1, h, o.max_action_dim)
        w[0, :n, :d] = torch.from_numpy(weights)[:, None]
        return y, w

    def scale(self) -> tuple[np.ndarray, np.ndarray]:
        """Deviations in units of the actions' spread: their std, else half the range the
        normalization maps to [-1, 1], else 1 (identity without statistics)."""
        st = self.spec.norm_stats["action"]
        if "mean" in st and "std" in st:
            return np.asarray(st["mean"], np.float32), np.maximum(np.asarray(st["std"], np.float32), 1e-6)
        for lo, hi in ("min", "max"), ("q01", "q99"), ("q10", "q90"):
            if lo in st and hi in st:
                a, b = np.asarray(st[lo], np.float32), np.asarray(st[hi], np.float32)
                return (a + b) / 2, np.maximum((b - a) / 2, 1e-6)
        return np.zeros(self.spec.action_dim, np.float32), np.ones(self.spec.action_dim, np.float32)


class LeRobotPolicy(FlowCore):
    """The flow-matching core with LeRobot's inputs and outputs: its frames (resized with
    padding), the task text as its preprocessor passes it, the state normalized, mapped and
    padded, the actions through :class:`LeRobotCodec`. ``self.options`` (a
    :class:`LeRobotOptions`) must be set before ``__init__`` runs."""

    options: LeRobotOptions
    # Where LeRobot applies ``adapt_to_pi_aloha``: SmolVLA (0.4.x, in the policy after its
    # preprocessor) on normalized values, pi0 (0.3.3) on robot units.
    pi_aloha_on_normalized = True

    def make_codec(self) -> LeRobotCodec:
        return LeRobotCodec(self.spec, self.options, self.pi_aloha_on_normalized)

    def make_tokenizer(self):
        return make_tokenizer(self.spec, self.bundle_path, truncate=self.options.truncate_text)

    def _static_prefix(self, layout, ids: list[int]) -> torch.Tensor:
        """The language rows: the embedding table's rows times sqrt(hidden), as LeRobot scales them."""
        m = self.model
        hidden = m.vlm.config.hidden_size
        static = torch.zeros(layout.length, hidden, device=m.vlm.embed_tokens.weight.device)
        if ids:
            static[layout.text_start : layout.text_start + layout.text_len] = m.embed_ids(ids) * math.sqrt(hidden)
        return static

    def prompt(self, instruction: str) -> str:
        """The task as LeRobot's preprocessor hands it to the tokenizer: unchanged, ending in a newline."""
        text = self.spec.instruction_template.replace("{instruction}", instruction or self.spec.default_instruction)
        return text if text.endswith("\n") else text + "\n"

    def model_state(self, state: np.ndarray | None) -> torch.Tensor:
        """The state as the model reads it: normalized, mapped to pi's joint space with
        ``adapt_to_pi_aloha``, zero-padded.  -> [1, max_state_dim]"""
        return self.model_states(torch.from_numpy(self.checked_state(state))[None])

    def model_states(self, states: torch.Tensor) -> torch.Tensor:
        """A batch of states [B, state_dim] in robot units -> [B, max_state_dim]."""
        x = self.codec.to_model(states.float(), "state", self.options.state_norm)
        return F.pad(x, (0, self.options.max_state_dim - self.spec.state_dim))

    def frames(self, obs: Observation) -> Frames:
        return padded_frames(obs.images, self.spec.cameras, self.spec.image_size)
