"""SmolVLA's action expert over the VLM's cached prefix, driven layer by layer from our loop.

LeRobot runs the expert beside the VLM's layers (``SmolVLMWithExpertModel.forward`` with the
prefix K/V cached): at a *self-attention* layer the action tokens attend to the VLM's rotated
prefix K/V of that layer and, causally, to their own K/V (RoPE positions after the prefix); at
a *cross-attention* layer they attend to the prefix only, through the expert's own K/V maps
applied to the VLM's cached keys and values (no rotation of those; the queries' positions
start at 0); a VLM layer without an expert layer leaves them unchanged
(:meth:`~vla_accel_ros.models.smolvla.configuration_smolvla.SmolVLAOptions.layer_plan`).

What we own: the prefix K/V are read in place from the policy's :class:`KVCache` (the VLM
engine wrote them, with the token cache's reuse and pruning's invalid slots), and the
cross-attention K/V maps run once per prefix, not once per Euler step as in LeRobot (the
prefix does not change between the steps: same values). The action tokens' own K/V are never
written to the cache: each step recomputes them. Dropped (pruned) prefix tokens are invalid in
the cache and masked out of every layer from the one that dropped them.

The stock ``LlamaDecoderLayer`` modules are used as they are (norms, projections, MLP, the
model's rotary embedding and ``apply_rotary_pos_emb``); attention goes through the package's
kernel set (SDPA on CPU). ``forward`` mirrors :meth:`Engine.forward`'s signature so the flow
policy's Euler and Real-Time Chunking loops drive it unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from vla_accel_ros.core.engine import StepOutput, StepPlan, attention_dtype
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.kernels import get_kernels
from vla_accel_ros.models.smolvla.configuration_smolvla import LayerStep


class ExpertEngine:
    """The expert's layers of ``steps`` over the prefix K/V of ``cache``."""

    def __init__(
        self, expert: nn.Module, steps: list[LayerStep], cache: KVCache, *, max_positions: int,
        bf16_attention_above: int | None = None,
    ) -> None:  # fmt: skip
        self.model = expert
        self.layers = expert.layers
        self.norm = expert.norm
        self.steps = [s for s in steps if s.kind != "skip"]
        self.cache = cache
        self.device = cache.k.device
        attn = self.layers[0].self_attn
        cfg = expert.config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        probe = torch.empty(1, dtype=torch.float32, device=self.device)
        cos, sin = expert.rotary_emb(probe, torch.arange(max_positions, device=self.device)[None])
        self.cos, self.sin = cos[0].float(), sin[0].float()  # [positions, D]
        self.kernels = get_kernels(self.device)
        self.bf16_attention_above = bf16_attention_above
        S = cache.max_slots
        shape = (1, self.num_kv_heads, S, self.head_dim)
        # The cross-attention layers' K/V of the prefix (normal tensors written in place, so a
        # differentiable step may read them).
        self._cross = {s.vlm_layer: (torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                       for s in self.steps if s.kind == "cross"}  # fmt: skip
        self._prepared: tuple[int, int] | None = None  # (cache writes, prefix length) they hold
        self._tril: dict[int, torch.Tensor] = {}

    @property
    def num_layers(self) -> int:
        return len(self.steps)

    @torch.inference_mode()
    def _prepare(self, length: int) -> None:
        """The cross-attention layers' keys and values of the prefix's ``length`` slots."""
        for step in self.steps:
            if step.kind != "cross":
                continue
            attn = self.layers[step.expert_layer].self_attn
            ck, cv = self._cross[step.vlm_layer]
            for src, proj, dst in ((self.cache.k, attn.k_proj, ck), (self.cache.v, attn.v_proj, cv)):
                rows = src[step.vlm_layer, :1, :, :length].transpose(1, 2).reshape(1, length, -1).float()  # [1, P, Hkv*D]
                out = proj(rows).view(1, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                dst[:, :, :length] = out.to(dst.dtype)
        self._prepared = (self.cache.writes, length)

    def forward(self, x: torch.Tensor, plan: StepPlan, *, differentiable: bool = False) -> StepOutput:
        """x: [1, H, W] the action tokens' embeddings; ``plan.slots`` start after the prefix
        (the flow policy's expert plan) -> the expert's final normed hidden states [1, H, W]."""
        length = int(plan.slots[0])
        if self._prepared != (self.cache.writes, length):
            self._prepare(length)
        if differentiable:
            with torch.enable_grad():
                return self._forward(x, length)
        with torch.inference_mode():
            return self._forward(x, length)

    def _forward(self, x: torch.Tensor, length: int) -> StepOutput:
        B, H, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos_self, sin_self = self.cos[length : length + H][None], self.sin[length : length + H][None]
        cos_cross, sin_cross = self.cos[:H][None], self.sin[:H][None]
        tril = self._tril.get(H)
        if tril is None:
            tril = self._tril[H] = torch.ones(H, H, dtype=torch.bool, device=self.device).tril()
        low = attention_dtype(self.bf16_attention_above, H, x.dtype)
        dt = low or torch.float32
        for step in self.steps:
            layer = self.layers[step.expert_layer]
            attn = layer.self_attn
            prefix_ok = self.cache.valid[step.vlm_layer, :length]  # [P]: pruned tokens are not read
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, H, Hq, D).transpose(1, 2)  # [B, Hq, H, D]
            if step.kind == "self":
                k = attn.k_proj(h).view(B, H, Hkv, D).transpose(1, 2)
                v = attn.v_proj(h).view(B, H, Hkv, D).transpose(1, 2)
                q, k = self.apply_rope(q, k, cos_self, sin_self)
                keys = torch.cat([self.cache.k[step.vlm_layer, :B, :, :length].to(dt), k.to(dt)], dim=2)
                values = torch.cat([self.cache.v[step.vlm_layer, :B, :, :length].to(dt), v.to(dt)], dim=2)
                mask = torch.cat([prefix_ok.expand(H, length), tril], dim=1)  # [H, P + H]
            else:
                q, _ = self.apply_rope(q, q, cos_cross, sin_cross)
                ck, cv = self._cross[step.vlm_layer]
                keys, values = ck[:, :, :length].to(dt), cv[:, :, :length].to(dt)
                mask = prefix_ok.expand(H, length)
            o = self.kernels.attend(q.to(dt), keys, values, mask, self.scaling).to(x.dtype)  # [B, Hq, H, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, H, Hq * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return StepOutput(hidden=self.norm(x), taps=None, computed_per_layer=[H] * len(self.steps))
