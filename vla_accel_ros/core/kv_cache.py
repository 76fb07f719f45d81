"""A preallocated, static-shape KV cache addressed by slot, and the attention layouts over it.

The cache owns the buffers (vLLM's split: model code never sees how they are laid out). A
*slot* is a row of the cache; each token of a sequence lives in one slot for every layer.
Its RoPE position is independent of its slot, so pruned or reused tokens keep their
original positions. Which slot may attend to which is a boolean matrix, ``allowed``, built
from a list of segments; one cache can hold several independent segments at once (a packed
forward over frames at different pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from vla_accel_ros.core.errors import PlanError

BlockKind = Literal["causal", "bidirectional"]


@dataclass(frozen=True)
class Block:
    """A run of consecutive slots. Tokens see every earlier block of their segment, and inside
    their own block either everything (bidirectional) or what precedes them (causal)."""

    length: int
    kind: BlockKind = "causal"


@dataclass(frozen=True)
class Segment:
    """An independent sequence stored in slots [start, start + sum(block lengths))."""

    start: int
    blocks: tuple[Block, ...]

    @property
    def length(self) -> int:
        return sum(b.length for b in self.blocks)


def build_allowed(max_slots: int, segments: Sequence[Segment]) -> torch.Tensor:
    """``allowed[q, k]``: query slot q may attend key slot k.  # [S, S] bool"""
    allowed = torch.zeros(max_slots, max_slots, dtype=torch.bool)
    taken = torch.zeros(max_slots, dtype=torch.bool)
    for seg in segments:
        end = seg.start + seg.length
        if seg.start < 0 or end > max_slots:
            raise PlanError(f"segment [{seg.start}, {end}) does not fit in {max_slots} slots")
        if taken[seg.start : end].any():
            raise PlanError(f"segment [{seg.start}, {end}) overlaps another segment")
        taken[seg.start : end] = True
        b0 = seg.start
        for block in seg.blocks:
            b1 = b0 + block.length
            allowed[b0:b1, seg.start : b0] = True  # every earlier block of the segment
            if block.kind == "bidirectional":
                allowed[b0:b1, b0:b1] = True
            elif block.kind == "causal":
                allowed[b0:b1, b0:b1] = torch.ones(block.length, block.length, dtype=torch.bool).tril()
            else:
                raise PlanError(f"unknown block kind {block.kind!r}")
            b0 = b1
    return allowed


class KVCache:
    """K/V for every layer, preallocated once and written in place by slot.

    k, v:    [L, B, Hkv, S, D]
    valid:   [L, S] slot s holds K/V of the current context at layer l. Writes set it; a
             dropped (pruned) token clears it from its drop layer on, and attention never reads
             an invalid slot.
    allowed: [S, S] the attention layout (see :func:`build_allowed`).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(num_layers, max_slots, dtype=torch.bool, device=device)
        self.allowed = torch.zeros(max_slots, max_slots, dtype=torch.bool, device=device)
        # One past the last key slot visible from each query slot, and the first slot of its
        # segment: attention reads keys [seg_start, visible_end) only, so empty tail slots and
        # other segments cost nothing.
        self.visible_end = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.seg_start = torch.zeros(max_slots, dtype=torch.long, device=device)
        # Counts set_layout calls: what an engine derived from ``allowed`` holds until it changes.
        self.layout_version = 0
        # Counts writes of K/V or valid flags (engine forwards, the methods below; any other
        # writer must bump it): what a reader derived from the cache (a compiled plan's window
        # check, the SmolVLA expert's prepared prefix) holds only while it is unchanged.
        self.writes = 0

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def max_slots(self) -> int:
        return self.k.shape[3]

    def set_layout(self, segments: Sequence[Segment]) -> None:
        allowed = build_allowed(self.max_slots, segments).to(self.allowed.device)
        self.allowed.copy_(allowed)
        idx = torch.arange(1, self.max_slots + 1, device=allowed.device)
        self.visible_end.copy_((allowed * idx).amax(dim=1))
        self.seg_start.zero_()
        self.writes += 1
        for seg in segments:
            self.seg_start[seg.start : seg.start + seg.length] = seg.start
        self.layout_version += 1

    def invalidate(self, slots: torch.Tensor | None = None, from_layer: int = 0) -> None:
        """Forget slots (all when None) from ``from_layer`` on."""
        self.writes += 1
        if slots is None:
            self.valid[from_layer:] = False
        else:
            self.valid[from_layer:, slots] = False

    def copy_slots(self, src: int, dst: int, length: int) -> None:
        """Move ``length`` slots' K/V and valid flags from ``src`` to ``dst`` (every layer)."""
        self.k[:, :, :, dst : dst + length] = self.k[:, :, :, src : src + length]
        self.v[:, :, :, dst : dst + length] = self.v[:, :, :, src : src + length]
        self.valid[:, dst : dst + length] = self.valid[:, src : src + length]
        self.writes += 1

    def is_valid(self, slots: torch.Tensor, layers: slice | int = slice(None)) -> bool:
        return bool(self.valid[layers][..., slots].all())

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
