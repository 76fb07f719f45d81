"""``flow``: a SmolVLA / pi0-style flow-matching policy.

The VLM encodes ``[image tokens per camera] [prompt tokens] [state token]`` into a prefix
with bidirectional attention. A smaller action expert (same depth, K/V heads and head size,
narrower) embeds the noisy chunk x_t [H, D] with the flow time and, at every layer, attends to
the VLM's cached prefix K/V plus its own chunk tokens. Euler integration runs from t = 1
(noise) to t = 0 (actions): x <- x - (1/T) v(x, t). The flow-matching part is the core every
flow family shares (:mod:`~vla_accel_ros.models.flow_core`); what is here is the package's own
prefix, its modules and its training loss.

Invariant: the prefix K/V is computed once per observation and only read during the T
solver steps (the expert computes the suffix rows only); ``test_flow_prefix_not_recomputed``
proves it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.models import demo
from vla_accel_ros.models.base import VisionPrefix
from vla_accel_ros.models.common import build_decoder
from vla_accel_ros.models.family import check_expert_shares_cache, check_vision_patch
from vla_accel_ros.models.flops import denoise_step_flops, prefix_flops
from vla_accel_ros.models.flow_core import FlowCore, FlowFamilyBase, TimeMLPHeads


class FlowVLA(TimeMLPHeads, nn.Module):
    """The modules of a ``flow`` bundle (stock transformers decoders for VLM and expert)."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        self.vlm = build_decoder(spec.lm, "lm", causal_lm=False)
        self.expert = build_decoder(spec.expert, "expert", causal_lm=False)
        hidden, width = self.vlm.config.hidden_size, self.expert.config.hidden_size
        self.vis = VisionPrefix(spec, hidden)
        self.state_proj = nn.Linear(spec.state_dim, hidden) if spec.state_dim else None
        self.add_action_heads(spec.action_dim, width)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        return self.vlm.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=self.vlm.embed_tokens.weight.device))  # [T, H]


class FlowPolicy(FlowCore):
    """The ``flow`` family's policy: the flow-matching core (:mod:`~vla_accel_ros.models.flow_core`)
    with the package's own prefix ``[images][prompt][state]``, its mean/std action codec (the
    core's default) and its training loss."""

    family = "flow"

    @property
    def action_norm(self):
        """The actions' :class:`~vla_accel_ros.models.common.Normalizer` (the codec's)."""
        return self.codec.norm

    def prefix_capacity(self) -> int:
        """The longest prefix a layout of this bundle can have (slots the cache holds for it)."""
        g = self.spec.grid
        return len(self.spec.cameras) * g * g + self.spec.max_text_tokens + (1 if self.spec.state_dim else 0)

    def _make_layout(self, text_len: int) -> PrefixLayout:
        s = self.spec
        n_img = len(s.cameras) * s.grid * s.grid
        state_slot = n_img + text_len if s.state_dim else None
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size,
            image_start=0, text_start=n_img, text_len=text_len, state_slot=state_slot,
            length=n_img + text_len + (1 if s.state_dim else 0), fixed_slots=(), attention="bidirectional",
            num_layers=self.vlm_stack.num_layers,
        )  # fmt: skip

    def _static_prefix(self, layout: PrefixLayout, ids: list[int]) -> torch.Tensor:
        static = torch.zeros(layout.length, self.model.vlm.config.hidden_size, device=self.model.vlm.embed_tokens.weight.device)
        static[layout.text_start : layout.text_start + layout.text_len] = self.model.embed_ids(ids)
        return static

    # -- training ---------------------------------------------------------------------------------
    def training_loss(
        self,
        pixels: torch.Tensor,
        states: torch.Tensor | None,
        instruction: str,
        actions: torch.Tensor,
        valid: torch.Tensor,
        generator: torch.Generator,
        *,
        image_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Flow matching on a batch (pi0 / SmolVLA): x_t = t * noise + (1 - t) * a, the expert
        predicts u = noise - a, with t ~ 0.999 * Beta(1.5, 1) + 0.001 (more weight on noisy t).

        The expert attends to the prefix K/V through transformers' own cache, the path the parity
        gate proves equal to the engine's inference.  pixels: [B, C, 3, S, S] (or ``image_tokens``, a
        frozen tower's: :meth:`batch_prefix`); states: [B, D_s];
        actions: [B, H, D] robot units; valid: [B, H] (False: padding past the episode's end)."""
        layout, prefix = self.batch_prefix(pixels, states, instruction, image_tokens=image_tokens)  # [B, P, W]
        b, p = prefix.shape[:2]
        h = self.spec.chunk_size
        st = self.action_norm.stats
        mean = torch.as_tensor(st["mean"], device=actions.device)
        std = torch.as_tensor(np.maximum(st["std"], 1e-6), device=actions.device)
        a = (actions - mean) / std  # [B, H, D]
        dev = prefix.device
        noise = torch.randn(a.shape, generator=generator).to(dev)
        u = torch.rand(b, generator=generator).to(dev)
        t = 0.999 * u ** (1.0 / 1.5) + 0.001  # inverse CDF of Beta(1.5, 1)
        x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * a
        target = noise - a
        pkv = self.model.vlm(
            inputs_embeds=prefix, attention_mask=torch.ones(b, 1, p, p, dtype=torch.bool, device=dev), use_cache=True
        ).past_key_values
        hid = self.model.expert(
            inputs_embeds=self.model.suffix_embeddings(x_t, t),
            attention_mask=torch.ones(b, 1, h, p + h, dtype=torch.bool, device=dev),
            position_ids=torch.arange(p, p + h, device=dev)[None].expand(b, h),
            past_key_values=pkv,
            use_cache=True,
        ).last_hidden_state
        v = self.model.action_out(hid).float()  # [B, H, D]
        err = (v - target).pow(2).mean(-1)  # [B, H]
        w = valid.to(err.dtype)
        loss = (err * w).sum() / w.sum().clamp_min(1.0)
        return loss, {"loss": float(loss.detach())}


class FlowFamily(FlowFamilyBase):
    """``flow`` bundles: a SmolVLA / pi0-style flow-matching policy (the package's own, trained here)."""

    name = "flow"
    trainable = True
    default_chunk_size = 50

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        check_vision_patch(spec)
        check_expert_shares_cache(spec)

    def build_model(self, spec: BundleSpec) -> FlowVLA:
        return FlowVLA(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> FlowPolicy:
        return FlowPolicy(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def describe(self, spec: BundleSpec) -> list[str]:
        return [f"denoising   {spec.num_steps} Euler steps"]

    def demo_spec(
        self, size: str, *, cameras: tuple[str, ...] = ("cam_high",), action_dim: int = 14, chunk_size: int | None = None,
        lm_type: str = "llama", state_dim: int | None = None, norm_stats: dict | None = None, name: str | None = None,
        default_instruction: str | None = None, reasoning_words: tuple[str, ...] = (), max_reasoning_tokens: int = 0,
    ) -> BundleSpec:  # fmt: skip
        """A random-weight ``size`` bundle; the state input is the action size unless ``state_dim``."""
        sz = demo.size_table(size)
        vocab = sz["vocab"]
        lm = {"model_type": lm_type, **sz["lm"], "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0}
        state_dim = action_dim if state_dim is None else state_dim
        expert = {
            "model_type": lm_type, **sz["expert"], "num_hidden_layers": lm["num_hidden_layers"],
            "num_key_value_heads": lm["num_key_value_heads"], "vocab_size": 1, "max_position_embeddings": 4096,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "rope_theta": 10000.0,
        }  # fmt: skip
        return BundleSpec(
            family="flow", name=name or f"demo-flow-{size}", cameras=cameras, image_size=224, patch_size=14,
            action_dim=action_dim, joint_names=demo.joint_names(action_dim), dt=0.02, state_dim=state_dim,
            norm_stats=norm_stats or demo.demo_norm_stats(action_dim, state_dim),
            vision={**sz["vision"], "image_size": 224, "patch_size": 14}, text_vocab=vocab - 3,
            chunk_size=chunk_size or 50, num_steps=10, instruction_template="{instruction}", lm=lm, expert=expert,
            reasoning_words=tuple(reasoning_words), max_reasoning_tokens=max_reasoning_tokens,
            **({"default_instruction": default_instruction} if default_instruction is not None else {}),
        )  # fmt: skip

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        out = prefix_flops(spec, work, causal=False)
        out["denoise"] = flow_steps * denoise_step_flops(spec.expert, spec.chunk_size, work.prefix_len, spec.action_dim)
        out["state"] = 2.0 * spec.state_dim * int(spec.lm["hidden_size"])  # the state token's projection
        return out


FAMILY = FlowFamily()
