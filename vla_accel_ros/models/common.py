"""Building blocks of every family's model (``ar``, ``flow``, and LeRobot's ``smolvla`` and
``pi0``): transformers decoders and the SigLIP vision tower built from a bundle's config, the
projector, the tokenizers, image preprocessing, normalization and the flow time embedding."""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.errors import BundleError, ObservationError
from vla_accel_ros.core.interrupt import check as check_interrupt
from vla_accel_ros.core.robot.images import resize_rgb
from vla_accel_ros.core.text import words_of

# Language models the engine can drive, by the ``model_type`` a bundle names.
_LM_TYPES = ("llama", "qwen2", "gemma")


def _lm_classes(model_type: str):
    if model_type == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

        return LlamaConfig, LlamaModel, LlamaForCausalLM
    if model_type == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

        return Qwen2Config, Qwen2Model, Qwen2ForCausalLM
    if model_type == "gemma":  # (1 + w) RMSNorm, GeGLU, MQA: all inside its modules, which the engine drives as Llama's
        from transformers import GemmaConfig, GemmaForCausalLM, GemmaModel

        return GemmaConfig, GemmaModel, GemmaForCausalLM
    raise BundleError(f"lm.model_type={model_type!r} is not supported; use one of {', '.join(_LM_TYPES)}")


def lm_config(spec: Mapping[str, Any], where: str):
    """A transformers config from a bundle's ``lm`` / ``expert`` section (sdpa attention)."""
    spec = dict(spec)
    model_type = spec.pop("model_type", "llama")
    cfg_cls, _, _ = _lm_classes(model_type)
    try:
        cfg = cfg_cls(**spec)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{where}: invalid {model_type} config: {e}") from e
    cfg._attn_implementation = "sdpa"
    return cfg


def build_decoder(spec: Mapping[str, Any], where: str, *, causal_lm: bool) -> nn.Module:
    cfg = lm_config(spec, where)
    _, base_cls, lm_cls = _lm_classes(cfg.model_type)
    return lm_cls(cfg) if causal_lm else base_cls(cfg)



def interrupt_between_layers(tower: nn.Module) -> nn.Module:
    """A tower that transformers runs in one call (SigLIP, SmolVLM vision) stops before each of
    its layers once the node running it is ending (:mod:`vla_accel_ros.core.interrupt`; the
    engine's own layer loops check directly). Forward pre-hooks, so the stock modules stay as
    they are."""
    for name, module in tower.named_modules():
        if re.search(r"(^|\.)layers\.\d+$", name):
            module.register_forward_pre_hook(_check_interrupt)
    return tower


def _check_interrupt(module: nn.Module, args: tuple) -> None:
    check_interrupt()


# The key of a bundle's ``vision`` config that adds a convolutional stem (not a SigLIP setting).
CONV_STEM = "conv_stem"


def conv_stem_stride(spec: Mapping[str, Any]) -> int:
    """How much the stem of a ``vision`` config shrinks the image (1: no stem)."""
    return 2 ** len(spec.get(CONV_STEM) or ())


class ConvStem(nn.Sequential):
    """Stages of 2 x 2 convolutions with stride 2 and a GELU each, in front of the SigLIP patch
    embedding (``vision.conv_stem``: the channels of each stage). A linear patch embedding
    mixes a whole patch into one vector, and a few-pixel object (the 5 x 6 px cube of the 224 px
    ALOHA top view, a 28 px patch) barely moves it: regressing the cube's position from the
    first frame (docs/measurements/cube_localization_probe.py), a tower trained from scratch was
    at 1.2 cm after 600 steps, with two stages (32, 64) at 0.1 cm (docs/policy-experiments.md).
    The stages do not overlap patches, so a token still depends on its own patch's pixels only
    (what the token cache assumes)."""

    def __init__(self, channels: Sequence[int]) -> None:
        layers: list[nn.Module] = []
        c = 3
        for ch in channels:
            layers += [nn.Conv2d(c, int(ch), kernel_size=2, stride=2), nn.GELU()]
            c = int(ch)
        super().__init__(*layers)


def build_vision(spec: Mapping[str, Any]) -> nn.Module:
    """The SigLIP tower of a ``vision`` config; with a ``conv_stem`` it sees the stem's feature
    map (image and patch sizes divided by the stem's stride, the stem's channels)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    kw = {k: v for k, v in spec.items() if k != CONV_STEM}
    stride = conv_stem_stride(spec)
    if stride > 1:
        kw.update(image_size=int(kw["image_size"]) // stride, patch_size=int(kw["patch_size"]) // stride,
                  num_channels=int(spec[CONV_STEM][-1]))  # fmt: skip
    try:
        cfg = SiglipVisionConfig(**{**kw, "vision_use_head": False})
    except (TypeError, ValueError) as e:
        raise BundleError(f"vision: invalid SigLIP config: {e}") from e
    cfg._attn_implementation = "sdpa"
    return SiglipVisionModel(cfg)


@contextlib.contextmanager
def skip_init():
    """Build modules without random init when weights are loaded right after (saves seconds)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: just initialize
        yield
        return
    with no_init_weights():
        yield


class Projector(nn.Module):
    """Vision features -> LM embedding space (OpenVLA/LLaVA-style 2-layer MLP)."""

    def __init__(self, vision_dim: int, lm_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_dim, lm_dim)
        self.fc2 = nn.Linear(lm_dim, lm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class HashWordTokenizer:
    """A deterministic word-level tokenizer that needs no vocabulary file.

    Demo bundles have random weights, so any stable text -> ids map serves; this one yields
    about as many tokens as a BPE tokenizer would (one per word or punctuation mark), which
    keeps prefix lengths realistic. Id 0 is padding, 1 BOS, 2 EOS; words hash (FNV-1a) into
    ``[offset, offset + text_vocab)``.
    """

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, text_vocab: int, offset: int = 3) -> None:
        if text_vocab < 16:
            raise BundleError(f"tokenizer.text_vocab={text_vocab} is too small (>= 16)")
        self.text_vocab = text_vocab
        self.offset = offset

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in words_of(text):
            h = 0xCBF29CE484222325
            for b in word.encode("utf-8"):
                h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
            ids.append(self.offset + h % self.text_vocab)
        return ids


class BundleTokenizer:
    """A checkpoint's own tokenizer: transformers' ``AutoTokenizer`` over the files in the
    bundle's ``tokenizer/`` directory, offline (never the network at run time). It encodes as
    LeRobot's tokenizer step does (special tokens as the tokenizer adds them, truncated to
    ``max_length`` when ``truncate``)."""

    def __init__(self, path: Path, max_length: int, truncate: bool) -> None:
        from transformers import AutoTokenizer

        if not path.is_dir():
            raise BundleError(f"{path}: the bundle's tokenizer directory is missing (tokenizer: bundle)")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise BundleError(f"{path}: cannot load the tokenizer: {e}") from e
        self.max_length, self.truncate = max_length, truncate

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, truncation=self.truncate, max_length=self.max_length)["input_ids"])


def make_tokenizer(spec, bundle_path: str | Path = "", *, truncate: bool = False):
    """The tokenizer a bundle declares: the hash-word tokenizer, or its own files (``truncate``:
    longer prompts are cut at ``max_text_tokens``, else the policy refuses them)."""
    if spec.tokenizer == "hash":
        return HashWordTokenizer(spec.text_vocab)
    if not bundle_path:
        raise BundleError(f"bundle {spec.name} brings its own tokenizer (tokenizer: bundle): load it from its directory")
    from vla_accel_ros.core.bundle import TOKENIZER_DIR

    return BundleTokenizer(Path(bundle_path) / TOKENIZER_DIR, spec.max_text_tokens, truncate)


def format_instruction(template: str, instruction: str) -> str:
    return template.replace("{instruction}", instruction.strip().rstrip(".?!").lower())


class Frames:
    """Preprocessed camera frames of one observation.

    pixels: [C, 3, S, S] float32 normalized for the vision tower.
    raw:    [C, S, S, 3] uint8 at the model's resolution, what the token methods compare: given,
            or made on first use from ``unit`` ([C, 3, S, S] in [0, 1]), since the full
            recompute never reads it (a quarter of the preprocessing of three 512 px cameras).
    """

    __slots__ = ("cameras", "pixels", "_raw", "_unit")

    def __init__(self, cameras: tuple[str, ...], pixels: torch.Tensor, raw: torch.Tensor | None = None,
                 unit: torch.Tensor | None = None) -> None:  # fmt: skip
        if (raw is None) == (unit is None):
            raise ValueError("Frames takes raw or unit, one of them")
        self.cameras, self.pixels, self._raw, self._unit = cameras, pixels, raw, unit

    @property
    def raw(self) -> torch.Tensor:
        if self._raw is None:  # two first reads at once compute it twice, the same
            self._raw = (self._unit * 255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        return self._raw


def resize_uint8(image: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [size, size, 3] uint8 tensor through the package's one resize
    (:func:`~vla_accel_ros.core.robot.images.resize_rgb`; no-op at size)."""
    return torch.from_numpy(np.ascontiguousarray(resize_rgb(image, size)))


def preprocess_frames(images: Mapping[str, np.ndarray], cameras: tuple[str, ...], size: int) -> Frames:
    missing = [c for c in cameras if c not in images]
    if missing:
        raise ObservationError(f"observation lacks camera(s) {', '.join(missing)}; has {', '.join(images) or 'none'}")
    raw = torch.stack([resize_uint8(images[c], size) for c in cameras])  # [C, S, S, 3]
    return Frames(cameras, pixels=siglip_pixels(raw), raw=raw)


def siglip_pixels(raw: torch.Tensor) -> torch.Tensor:
    """Frames [..., S, S, 3] uint8 -> the vision tower's input [..., 3, S, S] float in [-1, 1]
    (SigLIP: mean 0.5, std 0.5). Training and inference both normalize here."""
    return raw.movedim(-1, -3).float().div_(127.5).sub_(1.0)


class Normalizer:
    """Maps between robot units and the model's normalized space with the bundle's statistics."""

    def __init__(self, stats: Mapping[str, Any], dim: int, where: str) -> None:
        self.where = where
        arrays = {}
        for key, value in stats.items():
            arr = np.asarray(value, dtype=np.float32)
            if arr.shape != (dim,):
                raise BundleError(f"{where}.{key} has shape {list(arr.shape)}, expected [{dim}]")
            if not np.isfinite(arr).all():
                raise BundleError(f"{where}.{key} contains non-finite values")
            arrays[key] = arr
        self.stats = arrays

    def _need(self, *keys: str) -> list[np.ndarray]:
        missing = [k for k in keys if k not in self.stats]
        if missing:
            raise BundleError(f"{self.where} lacks {', '.join(missing)}")
        return [self.stats[k] for k in keys]

    def normalize_meanstd(self, x: np.ndarray) -> np.ndarray:
        mean, std = self._need("mean", "std")
        return (x - mean) / np.maximum(std, 1e-6)

    def unnormalize_meanstd(self, x: np.ndarray) -> np.ndarray:
        mean, std = self._need("mean", "std")
        return x * np.maximum(std, 1e-6) + mean

    def unnormalize_bounds(self, x: np.ndarray) -> np.ndarray:
        """[-1, 1] -> [q01, q99] (OpenVLA's BOUNDS_Q99 scheme)."""
        lo, hi = self._need("q01", "q99")
        return 0.5 * (x + 1.0) * (hi - lo) + lo


def sincos_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Flow time t in [0, 1] -> [.., dim] sine-cosine features (pi0's scheme)."""
    if dim % 2:
        raise BundleError(f"time embedding dim {dim} must be even")
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    ang = (2 * math.pi / period)[None] * t.double()[..., None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1).to(torch.float32)
