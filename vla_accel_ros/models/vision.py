"""VLA-Cache applied to the vision tower: the SigLIP encoder runs over the patches a frame
recomputes, every other patch keeps the K/V and the image-token embedding of the frame that
last computed it.

The token cache (``core/cache``) reuses the decoder K/V of image tokens whose pixels did not
change; their vision features are the same approximation one stage earlier. A reused patch's
features would have moved a little with the patches around it (the encoder attends over the
whole image), exactly as a reused decoder K/V would; the benchmarks measure both together.
Which patches are recomputed is the plan's decision (``PrefixPlan.vision_fresh``), so the
policy only executes it.

We drive the stock ``SiglipVisionModel`` modules (embeddings, each encoder layer's norms,
projections and MLP, the post layer norm) from this loop; nothing in transformers is patched.
Per camera and encoder layer the K/V of every patch stay in a preallocated cache; a frame's
fresh patches are computed at every layer, attending to all patches of their camera (their
own new K/V and the cached K/V of the others), and the projector maps their features into the
decoder's embedding space, kept per patch too.

Exactness: with every patch fresh the result is the stock tower's (tested bit for bit); a
patch recomputed over the same pixels as before gets the same features in fp32 and bf16, while
int8 and hybrid layers quantize the activations of the rows they are given, so a partial pass
there differs from a full one by the quantization (max 0.02 on an output RMS of 0.22, tiny
bundle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionCache:
    """Per-patch vision-tower state of one policy (its cameras), and the partial forward."""

    def __init__(self, vis: nn.Module, cameras: int) -> None:
        """``vis``: the policy's VisionPrefix (``.vision``: SiglipVisionModel, ``.projector``)."""
        self.vis = vis
        self.vision = vis.vision
        self.layers = self.vision.encoder.layers
        attn = self.layers[0].self_attn
        cfg = self.vision.config
        grid = cfg.image_size // cfg.patch_size
        self.tokens = grid * grid
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        L, T, Hh, D = len(self.layers), self.tokens, self.num_heads, self.head_dim
        lm_hidden = vis.projector.fc2.out_features
        self.k = torch.zeros(L, cameras, Hh, T, D)  # [layers, cameras, heads, patches, head_dim]
        self.v = torch.zeros(L, cameras, Hh, T, D)
        self.embeds = torch.zeros(cameras, T, lm_hidden)  # [cameras, patches, H]: projector output
        self.have = torch.zeros(cameras, T, dtype=torch.bool)  # the patch's state is complete
        self.computed = 0  # patches run through the tower by the last call (for stats)

    def reset(self) -> None:
        self.have = torch.zeros_like(self.have)  # a new tensor: the old one may be an inference tensor

    @torch.inference_mode()
    def embed(self, pixels: torch.Tensor, cams: list[int], fresh: torch.Tensor | None) -> torch.Tensor:
        """Image-token embeddings of cameras ``cams``: fresh patches through the tower, the others
        from the cache.  pixels: [c, 3, S, S] (those cameras' frames); fresh: [C, T] bool over
        every camera, or None (every patch) -> [c, T, H]"""
        self.computed = 0
        for j, cam in enumerate(cams):
            if fresh is None:
                rows = torch.arange(self.tokens)
            else:  # and the patches with no state yet
                rows = torch.nonzero(fresh[cam] | ~self.have[cam]).flatten()
            if rows.numel():
                self._forward(pixels[j : j + 1], cam, rows)
                self.computed += rows.numel()
        return self.embeds[cams]

    def _forward(self, pixels: torch.Tensor, cam: int, rows: torch.Tensor) -> None:
        """Patches ``rows`` of one camera through every encoder layer.  pixels: [1, 3, S, S]"""
        n, Hh, D = rows.numel(), self.num_heads, self.head_dim
        x = self.vision.embeddings(pixels)[:, rows]  # [1, n, W] (patch conv + position)
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.layer_norm1(x)
            q = attn.q_proj(h).view(1, n, Hh, D).transpose(1, 2)  # [1, heads, n, D]
            k = attn.k_proj(h).view(1, n, Hh, D).transpose(1, 2)
            v = attn.v_proj(h).view(1, n, Hh, D).transpose(1, 2)
            keys, values = self.k[l, cam], self.v[l, cam]  # [heads, T, D]
            keys.index_copy_(1, rows, k[0].to(keys.dtype))
            values.index_copy_(1, rows, v[0].to(values.dtype))
            o = F.scaled_dot_product_attention(q, keys[None].to(q.dtype), values[None].to(q.dtype), scale=attn.scale)
            x = x + attn.out_proj(o.transpose(1, 2).reshape(1, n, Hh * D))
            x = x + layer.mlp(layer.layer_norm2(x))
        feats = self.vision.post_layernorm(x)
        self.embeds[cam, rows] = self.vis.projector(feats)[0].to(self.embeds.dtype)
        self.have[cam, rows] = True
