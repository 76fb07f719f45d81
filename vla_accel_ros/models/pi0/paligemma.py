"""What LeRobot's pi0 and pi0.5 share (the ``pi0`` and ``pi05`` families build on it).

PaliGemma's prefix: SigLIP, its one-map projector and a Gemma decoder over
``[image tokens per camera][language]`` with bidirectional attention among the valid tokens;
a Gemma action expert of the same depth, K/V heads and head size whose rows attend, layer by
layer, to the VLM's cached prefix K/V and to themselves (one KV cache, the flow family's
layout); the action projections in and out, padded to ``max_action_dim``; the plain
transformers reference of the prefix; the family's checks and cost. Stock transformers modules
(``SiglipVisionModel``, ``GemmaModel``) driven by the package's engine.

What differs lives in each family's module: where the state goes (pi0: a token of the
expert's suffix; pi0.5: discretized into the prompt), how the flow time enters (pi0: in the
action tokens; pi0.5: through adaptive norms of the expert), the image scaling and padding.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models.base import VisionPrefix
from vla_accel_ros.models.common import build_decoder
from vla_accel_ros.models.family import check_expert_shares_cache, check_vision_patch
from vla_accel_ros.models.flops import denoise_step_flops, prefix_flops
from vla_accel_ros.models.lerobot_compat import LeRobotFamily, LeRobotOptions, LeRobotPolicy, check_lerobot_io


class PaliGemmaVision(VisionPrefix):
    """SigLIP + PaliGemma's projector (one linear map): frames -> image-token embeddings.

    ``rescale``: pi0's rounding, kept: transformers' PaliGemma divides the projected features by
    sqrt(hidden) and pi0 multiplies them by it again (a 0-dim tensor of the embeddings' dtype).
    openpi's PaliGemma, which pi0.5 runs, does neither."""

    def __init__(self, spec: BundleSpec, lm_hidden: int, rescale: bool) -> None:
        super().__init__(spec, lm_hidden)
        self.projector = nn.Linear(self.vision.config.hidden_size, lm_hidden)
        self.rescale = rescale

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the reference's ``get_image_features`` returns (its fixtures carry it).  [C, T, H]"""
        x = self.projector(self.vision(pixel_values=pixels).last_hidden_state)
        return x / (self.out_dim**0.5) if self.rescale else x

    def _scaled(self, projected: torch.Tensor) -> torch.Tensor:
        if not self.rescale:
            return projected
        x = projected / (self.out_dim**0.5)
        return x * torch.tensor(self.out_dim**0.5, dtype=x.dtype, device=x.device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [C, 3, S, S] in [-1, 1] -> [C, T, H]"""
        return self._scaled(super().forward(pixels))

    def project_tokens(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self._scaled(super().project_tokens(feats, tokens))


class PaliGemmaModel(nn.Module):
    """The modules pi0 and pi0.5 share (names as the flow family's): ``vlm``, ``expert`` (its
    token embedding dropped: it reads embeddings), ``vis``, ``action_in``, ``action_out``."""

    vision_rescale = True

    def __init__(self, spec: BundleSpec, opts: LeRobotOptions) -> None:
        super().__init__()
        self.vlm = build_decoder(spec.lm, "lm", causal_lm=False)
        self.expert = build_decoder(spec.expert, "expert", causal_lm=False)
        self.expert.embed_tokens = None  # the expert reads embeddings, never ids
        hidden, width = self.vlm.config.hidden_size, self.expert.config.hidden_size
        self.vis = PaliGemmaVision(spec, hidden, self.vision_rescale)
        self.action_in = nn.Linear(opts.max_action_dim, width)
        self.action_out = nn.Linear(width, opts.max_action_dim)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        """The embedding table's rows (unscaled: the policy scales them by sqrt(hidden), as LeRobot)."""
        table = self.vlm.embed_tokens.weight
        return F.embedding(torch.as_tensor(ids, dtype=torch.long, device=table.device), table)


class PaliGemmaPolicy(LeRobotPolicy):
    """A policy of PaliGemma and a Gemma expert (``self.options`` set before ``__init__``)."""

    def prefix_capacity(self) -> int:
        return len(self.spec.cameras) * self.spec.grid**2 + self.spec.max_text_tokens

    def _make_layout(self, text_len: int) -> PrefixLayout:
        s = self.spec
        n_img = len(s.cameras) * s.grid * s.grid
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size, image_start=0,
            text_start=n_img, text_len=text_len, state_slot=None, length=n_img + text_len, fixed_slots=(),
            attention="bidirectional", num_layers=self.vlm_stack.num_layers,
        )  # fmt: skip

    # -- the plain reference (the core's, over the family's reference_velocity) -------------------
    @torch.inference_mode()
    def prefix_intermediates(self, obs: Observation, noise: np.ndarray) -> tuple[dict, PrefixLayout, torch.Tensor]:
        """The prefix's intermediates a reference fixture carries (ours, in pipeline order), with
        the prefix in the cache for the suffix's: (name -> tensor, layout, the noise [1, H, A])."""
        layout, frames, full, x0 = self.intermediate_prefix(obs, noise)
        ours = {f"image{i}_resized_padded_2x_minus_1": frames.pixels[i : i + 1] for i in range(len(layout.cameras))}
        ours["image0_features"] = self.model.vis.image_features(frames.pixels[:1])
        ours["prefix_embs"] = full[None]
        c = self.cache  # [L, B, Hkv, S, D] -> the fixture's [B, P, Hkv, D]
        ours["prefix_kv_layer0_keys"] = c.k[0, :, :, : layout.length].transpose(1, 2).float()
        ours["prefix_kv_layer0_values"] = c.v[0, :, :, : layout.length].transpose(1, 2).float()
        return ours, layout, x0

    @staticmethod
    def paired(ours: dict, fixture: dict) -> dict:
        """(ours, the fixture's) per name; the fixture's prefix rows of its language padding
        dropped (nobody attends to them; they are not computed here)."""
        valid = fixture["prefix_pad_masks"][0].bool() if "prefix_pad_masks" in fixture else None
        pairs = {}
        for name, value in ours.items():
            ref = fixture.get(name)
            if ref is not None and valid is not None and name.startswith("prefix_"):
                ref = ref[:, valid]
            pairs[name] = (value, ref)
        return pairs


class PaliGemmaFamily(LeRobotFamily):
    """The plug-in of a PaliGemma family: its model, policy and options classes (its importer: ``importer``)."""

    model_class: type[PaliGemmaModel]
    policy_class: type[PaliGemmaPolicy]
    options_class: type[LeRobotOptions]

    def options_of(self, spec: BundleSpec) -> LeRobotOptions:
        return self.options_class.from_dict(spec.options or {})

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        opts = self.options_of(spec)
        check_vision_patch(spec)
        check_expert_shares_cache(spec, f"{self.name}'s expert attends jointly with the VLM, layer by layer")
        for section in ("lm", "expert"):
            if getattr(spec, section).get("model_type") != "gemma":
                raise ConfigError(f"{section}.model_type must be gemma ({self.name}'s PaliGemma and its expert)")
        check_lerobot_io(spec, opts)

    def build_model(self, spec: BundleSpec) -> PaliGemmaModel:
        return self.model_class(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> PaliGemmaPolicy:
        return self.policy_class(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def suffix_rows(self, spec: BundleSpec) -> int:
        """Rows the expert computes per Euler step."""
        return spec.chunk_size

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        out = prefix_flops(spec, work, causal=False)
        dv, d = int(spec.vision["hidden_size"]), int(spec.lm["hidden_size"])
        out["projector"] = work.cameras_encoded * 2.0 * spec.grid * spec.grid * dv * d  # one linear map
        a = self.options_of(spec).max_action_dim
        out["denoise"] = flow_steps * denoise_step_flops(spec.expert, self.suffix_rows(spec), work.prefix_len, a)
        return out
