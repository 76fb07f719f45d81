"""PyTorch reference kernels: the CPU path and the ground truth for any GPU version."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register


class ReferenceKernels:
    name = "reference"

    @staticmethod
    def write_kv(k_cache, v_cache, slots, k, v) -> None:
        # index_copy_ writes in place, so the cache keeps its storage and static shape.
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)

    @staticmethod
    def attend(q, k, v, mask, scale) -> torch.Tensor:
        # q: [B, Hq, n, D], k/v: [B, Hkv, S, D], mask: [n, S] (broadcast over batch and heads).
        B, Hq, n, D = q.shape
        Hkv = k.shape[1]
        if bool(mask.all()):
            # Every row reads every key (a flow expert step, a bidirectional prefix, a decode
            # row): SDPA's unmasked path, with each kv head's query heads stacked as rows, so
            # its K/V are read once per group. 1.6-1.9x faster in bf16 (50 rows, 340 keys).
            o = F.scaled_dot_product_attention(q.reshape(B, Hkv, (Hq // Hkv) * n, D), k, v, scale=scale)
            return o.reshape(B, Hq, n, D)  # a copy where a backend's output is laid out otherwise
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)


register("reference", ReferenceKernels, lambda device: True)
