"""VLA-Cache applied to the vision tower: the encoder runs over the patches of the image tokens
a frame recomputes, every other patch keeps the K/V, features and token embedding of the frame
that last computed it.

The token cache (``core/cache``) reuses the decoder K/V of image tokens whose pixels did not
change; their vision features are the same approximation one stage earlier. A reused patch's
features would have moved a little with the patches around it (the encoder attends over the
whole image), exactly as a reused decoder K/V would; the benchmarks measure both together.
Which tokens are recomputed is the plan's decision (``PrefixPlan.vision_fresh``), so the
policy only executes it.

A family's vision module tells the cache how its tokens come from patches (the small protocol
of :class:`VisionTower`): one patch per token (the SigLIP towers of ar and flow, a 2-layer
projector per patch) or a block of patches per token (SmolVLM: a pixel shuffle, then one linear
map per token). A fresh token's whole block of patches is recomputed.

We drive the stock encoder modules (each layer's norms, projections and MLP, the post layer
norm) from this loop; nothing in transformers is patched. Per camera and encoder layer the K/V
of every patch stay in a preallocated cache; a frame's fresh patches are computed at every
layer, attending to all patches of their camera (their own new K/V and the cached K/V of the
others); their final features are kept per patch and the fresh tokens' embeddings computed
from them.

Exactness: with every token fresh the result is the stock tower's (tested bit for bit); a patch
recomputed over the same pixels as before gets the same features in fp32 and bf16, while int8
and hybrid layers quantize the activations of the rows they are given, so a partial pass there
differs from a full one by the quantization (max 0.02 on an output RMS of 0.22, tiny bundle).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.interrupt import check as check_interrupt


class VisionTower(Protocol):
    """What :class:`VisionCache` needs of a family's vision module (``policy.model.vis``)."""

    num_patches: int  # N: patches per camera
    num_tokens: int  # T: image tokens per camera
    out_dim: int  # H: the decoder's width (token embeddings)
    encoder_layers: nn.ModuleList  # SigLIP-style layers: layer_norm1, self_attn (q/k/v/out_proj), layer_norm2, mlp

    def patch_embeddings(self, pixels: torch.Tensor) -> torch.Tensor: ...  # [1, 3, S, S] -> [1, N, W]

    def post_norm(self, x: torch.Tensor) -> torch.Tensor: ...

    def token_patches(self, tokens: torch.Tensor) -> torch.Tensor: ...  # token rows -> their patch rows (ascending)

    def project_tokens(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...  # [N, W], rows -> [n, H]


class VisionCache:
    """Per-patch vision-tower state of one policy (its cameras), and the partial forward."""

    def __init__(self, vis: VisionTower, cameras: int) -> None:
        self.vis = vis
        self.layers = vis.encoder_layers
        attn = self.layers[0].self_attn
        width = self.layers[0].layer_norm1.normalized_shape[0]
        self.patches, self.tokens = vis.num_patches, vis.num_tokens
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        L, N, Hh, D = len(self.layers), self.patches, self.num_heads, self.head_dim
        self.k = torch.zeros(L, cameras, Hh, N, D)  # [layers, cameras, heads, patches, head_dim]
        self.v = torch.zeros(L, cameras, Hh, N, D)
        self.feats = torch.zeros(cameras, N, width)  # [cameras, patches, W]: final (normed) features
        self.embeds = torch.zeros(cameras, self.tokens, vis.out_dim)  # [cameras, tokens, H]
        self.have = torch.zeros(cameras, self.tokens, dtype=torch.bool)  # the token's state is complete
        self.computed = 0  # patches run through the tower by the last call (for stats)

    def reset(self) -> None:
        self.have = torch.zeros_like(self.have)  # a new tensor: the old one may be an inference tensor

    @torch.inference_mode()
    def embed(self, pixels: torch.Tensor, cams: list[int], fresh: torch.Tensor | None) -> torch.Tensor:
        """Image-token embeddings of cameras ``cams``: fresh tokens' patches through the tower,
        the others from the cache.  pixels: [c, 3, S, S] (those cameras' frames); fresh: [C, T]
        bool over every camera, or None (every token) -> [c, T, H]"""
        self.computed = 0
        for j, cam in enumerate(cams):
            if fresh is None:
                rows = torch.arange(self.tokens)
            else:  # and the tokens with no state yet
                rows = torch.nonzero(fresh[cam] | ~self.have[cam]).flatten()
            if rows.numel():
                patches = self.vis.token_patches(rows)
                self._forward(pixels[j : j + 1], cam, patches)
                self.embeds[cam, rows] = self.vis.project_tokens(self.feats[cam], rows).to(self.embeds.dtype)
                self.have[cam, rows] = True
                self.computed += patches.numel()
        return self.embeds[cams]

    def _forward(self, pixels: torch.Tensor, cam: int, rows: torch.Tensor) -> None:
        """Patches ``rows`` of one camera through every encoder layer.  pixels: [1, 3, S, S]"""
        n, Hh, D = rows.numel(), self.num_heads, self.head_dim
        x = self.vis.patch_embeddings(pixels)[:, rows]  # [1, n, W] (patch conv + position)
        for l, layer in enumerate(self.layers):
            check_interrupt()  # a node that is ending stops its inference here
            attn = layer.self_attn
            h = layer.layer_norm1(x)
            q = attn.q_proj(h).view(1, n, Hh, D).transpose(1, 2)  # [1, heads, n, D]
            k = attn.k_proj(h).view(1, n, Hh, D).transpose(1, 2)
            v = attn.v_proj(h).view(1, n, Hh, D).transpose(1, 2)
            keys, values = self.k[l, cam], self.v[l, cam]  # [heads, N, D]
            keys.index_copy_(1, rows, k[0].to(keys.dtype))
            values.index_copy_(1, rows, v[0].to(values.dtype))
            o = F.scaled_dot_product_attention(q, keys[None].to(q.dtype), values[None].to(q.dtype), scale=attn.scale)
            x = x + attn.out_proj(o.transpose(1, 2).reshape(1, n, Hh * D))
            x = x + layer.mlp(layer.layer_norm2(x))
        self.feats[cam, rows] = self.vis.post_norm(x)[0].to(self.feats.dtype)
