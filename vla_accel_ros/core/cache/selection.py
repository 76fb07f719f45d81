"""Vectorized pieces of token selection: patch similarity, relevance, ranking.

Everything here is plain torch on small tensors ([C, T] scores, [C, T, p*p*3] patches) and
runs inside the policy's "select" timing stage.
"""

from __future__ import annotations

import torch


def patchify(frames: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, S, S, 3] uint8 -> [C, G*G, p*p*3] float32, row-major over the grid like the tokens."""
    C, S, _, ch = frames.shape
    g = S // patch
    x = frames.reshape(C, g, patch, g, patch, ch).permute(0, 1, 3, 2, 4, 5)  # [C, G, G, p, p, 3]
    return x.reshape(C, g * g, patch * patch * ch).float()


def patch_norms(patches: torch.Tensor) -> torch.Tensor:
    return patches.norm(dim=-1)  # [C, T]


def sub_patches(patches: torch.Tensor, patch: int, sub: int) -> torch.Tensor:
    """[C, T, p*p*3] (tokens of ``patch`` pixels) -> [C, T, (p/s)^2, s*s*3]: each token's
    ``sub`` x ``sub`` pixel blocks (the vision patches it merges), row-major."""
    C, T, _ = patches.shape
    n = patch // sub
    x = patches.reshape(C, T, n, sub, n, sub, 3).permute(0, 1, 2, 4, 3, 5, 6)  # [C, T, n, n, s, s, 3]
    return x.reshape(C, T, n * n, sub * sub * 3)


def cosine(new: torch.Tensor, new_norm: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor) -> torch.Tensor:
    """Raw-pixel cosine similarity per patch.  -> [C, T]

    Bit-identical patches score exactly 1 (float rounding could put them a hair under a
    threshold of 1.0); a black patch against a non-black one scores 0.
    """
    dot = (new * ref).sum(-1)
    sim = dot / (new_norm * ref_norm).clamp_min(1e-12)
    same = (new == ref).all(-1)
    return torch.where(same, torch.ones_like(sim), sim.clamp(-1.0, 1.0))


def relative_change(new: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor) -> torch.Tensor:
    """||new - ref|| / ||ref|| per patch (a black reference: the absolute change / 255).  -> [C, T]

    Unlike the cosine this sees a change of scale: every pixel halved scores 0.5."""
    diff = (new - ref).norm(dim=-1)
    return torch.where(ref_norm > 0, diff / ref_norm.clamp_min(1e-12), diff / 255.0)


def scaled_count(per_256: int, tokens: int) -> int:
    """A per-256-token count at this grid (the paper's 100 of 256 -> 39 of 100 tokens)."""
    return min(tokens, int(round(per_256 * tokens / 256)))


def topk_mask(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the ``k`` highest-scoring eligible entries (ties: lower index first).  [C, T] bool"""
    return eligible & (rank_within(scores, eligible) < k)


def rank_within(scores: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Rank of each member by descending score within its row (non-members: T).  [C, T] int64"""
    T = scores.shape[-1]
    s = torch.where(members, scores, torch.full_like(scores, float("-inf")))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(T).expand_as(order))
    return torch.where(members, rank, torch.full_like(rank, T))


def relevance_from_attention(attn: torch.Tensor, cameras: int) -> torch.Tensor:
    """Text-to-image attention [nq, C*T] (head-averaged) -> relevance per token [C, T]: the mean
    over the text queries (the paper's Mean_heads then per-token score)."""
    return attn.float().mean(0).reshape(cameras, -1)


def relevant_tokens(relevance: torch.Tensor, mode: str, threshold: float, k: int) -> torch.Tensor:
    """Which tokens are task-relevant (must be recomputed).  relevance [C, T] -> [C, T] bool"""
    if mode == "threshold":
        peak = relevance.amax(-1, keepdim=True).clamp_min(1e-30)
        return relevance / peak >= threshold
    if mode == "topk":
        return topk_mask(relevance, torch.ones_like(relevance, dtype=torch.bool), k)
    return torch.zeros_like(relevance, dtype=torch.bool)


def attention_entropy(attn: torch.Tensor) -> float:
    """Entropy (nats) of the mean text-to-image attention renormalized over the image keys
    (the paper's H^l: entropy of the head- and query-averaged distribution)."""
    p = attn.float().mean(0)
    p = p / p.sum().clamp_min(1e-30)
    return float(-(p * p.clamp_min(1e-30).log()).sum())
