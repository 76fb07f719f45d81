"""PyTorch reference kernels: the CPU path and the ground truth for any GPU version."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        if bool(mask.all()):
            return attend_shared(q, k, v, None, scale)
        return attend_masked(q, k, v, mask, scale)


def attend_shared(q, k, v, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention where every row reads the same keys (a flow expert step, a bidirectional
    prefix, a decode row): each kv head's query heads stacked as rows, so its K/V are read
    once per group (1.6-1.9x faster than grouped SDPA in bf16, 50 rows over 340 keys), and
    SDPA's unmasked path when ``key_mask`` is None.  q: [B, Hq, n, D], k/v: [B, Hkv, S, D],
    key_mask: [S] bool or None -> [B, Hq, n, D]"""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    m = None if key_mask is None else key_mask.view(1, 1, 1, -1)
    o = F.scaled_dot_product_attention(q.reshape(B, Hkv, (Hq // Hkv) * n, D), k, v, attn_mask=m, scale=scale)
    return o.reshape(B, Hq, n, D)  # a copy where a backend's output is laid out otherwise


def attend_masked(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention under a per-row mask.  mask: [n, S] bool, True = may attend"""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
