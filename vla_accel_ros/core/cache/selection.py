"""Vectorized pieces of token selection: patch similarity, relevance, ranking.

Everything here is plain torch on small tensors ([C, T] scores, [C, T, p*p*3] patches) and
runs inside the policy's "select" timing stage.
"""

from __future__ import annotations

import torch


def patchify(frames: torch.Tensor, patch: int, sub: int = 0) -> torch.Tensor:
    """[C, S, S, 3] uint8 -> [C, G*G, p*p*3] float32, row-major over the grid like the tokens.

    With ``sub`` (a divisor of ``patch``) each row lists its ``sub`` x ``sub`` blocks one after
    the other, so :func:`sub_patches` is a view, not a copy of every frame's pixels (norms and
    cosines over a whole row do not depend on the order)."""
    C, S, _, ch = frames.shape
    g = S // patch
    if sub and sub < patch:
        n = patch // sub
        x = frames.reshape(C, g, n, sub, g, n, sub, ch).permute(0, 1, 4, 2, 5, 3, 6, 7)  # [C, G, G, n, n, s, s, 3]
    else:
        x = frames.reshape(C, g, patch, g, patch, ch).permute(0, 1, 3, 2, 4, 5)  # [C, G, G, p, p, 3]
    return x.reshape(C, g * g, -1).float()


def patch_norms(patches: torch.Tensor) -> torch.Tensor:
    return patches.norm(dim=-1)  # [C, T]


def sub_patches(patches: torch.Tensor, patch: int, sub: int) -> torch.Tensor:
    """[C, T, p*p*3] of :func:`patchify` with ``sub`` -> [C, T, (p/s)^2, s*s*3]: each token's
    ``sub`` x ``sub`` pixel blocks (the vision patches it merges), row-major."""
    C, T, _ = patches.shape
    return patches.view(C, T, (patch // sub) ** 2, sub * sub * 3)


def compare(new: torch.Tensor, new_norm: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch, the raw-pixel cosine and the relative change ||new - ref|| / ||ref|| (a black
    reference: the absolute change / 255), in one pass over the difference.  -> [C, T] each

    Bit-identical patches score a cosine of exactly 1 (float rounding could put them a hair
    under a threshold of 1.0), a black patch against a non-black one 0. Unlike the cosine, the
    relative change sees a change of scale: every pixel halved scores 0.5."""
    dist = (new - ref).norm(dim=-1)
    sim = ((new * ref).sum(-1) / (new_norm * ref_norm).clamp_min(1e-12)).clamp(-1.0, 1.0)
    # Pixels are whole numbers: a distance of 0 means identical, any other is at least 1.
    sim = torch.where(dist == 0, torch.ones_like(sim), sim)
    change = torch.where(ref_norm > 0, dist / ref_norm.clamp_min(1e-12), dist / 255.0)
    return sim, change


def cosine(new: torch.Tensor, new_norm: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor) -> torch.Tensor:
    return compare(new, new_norm, ref, ref_norm)[0]


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
