"""The adaptive RMSNorm of pi0.5's action expert (openpi's adaRMS), ours: transformers has none.

Where Gemma's RMSNorm scales the normalized row by (1 + w), this one reads a condition c (the
flow time's features, [B, C]) and modulates the row by it: (scale, shift, gate) = W c + b,

    norm(x, c) = x * rsqrt(mean(x^2) + eps) * (1 + scale) + shift,

and returns the gate, which scales the residual branch the norm feeds (attention or MLP:
``x + branch * gate``; the final norm's gate is unused). The engine drives it as the
``adaptive`` norm of :mod:`vla_accel_ros.core.engine`. Computed as openpi computes it: the mean
square in fp32, the modulation applied in fp32, the result in the input's dtype.

The modulation's weights are plain parameters, not an ``nn.Linear``: precision conversion
(``precision.expert: bf16``) then leaves them in fp32, as LeRobot keeps its norms in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Modulation(nn.Module):
    """W c + b: a condition [B, C] -> (scale, shift, gate) [B, 3 * D] (LeRobot's ``dense``)."""

    def __init__(self, cond_dim: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3 * dim, cond_dim))
        self.bias = nn.Parameter(torch.empty(3 * dim))
        # nn.Linear's random init, not openpi's zeros (a training start where every gate is 0):
        # a demo bundle's expert must hear its prefix. A loaded bundle overwrites both.
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        nn.init.uniform_(self.bias, -(cond_dim**-0.5), cond_dim**-0.5)

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        return F.linear(cond, self.weight, self.bias)


class AdaRMSNorm(nn.Module):
    """RMSNorm conditioned per forward: ``norm(x [B, N, D], cond [B, C]) -> (normed, gate [B, 1, D])``."""

    adaptive = True  # the engine passes the condition and gates the residual branch

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.cond_dim = cond_dim
        self.dense = Modulation(cond_dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cond.shape[-1] != self.cond_dim:
            raise ValueError(f"adaptive norm: condition of width {cond.shape[-1]}, expected {self.cond_dim}")
        dtype = x.dtype
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        mod = self.dense(cond)
        if x.dim() == 3:
            mod = mod[:, None]  # [B, 1, 3D]: one modulation for every row of a sample
        scale, shift, gate = torch.chunk(mod, 3, dim=-1)
        normed = normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)
        return normed.to(dtype), gate.to(dtype)

    def extra_repr(self) -> str:
        return f"cond_dim={self.cond_dim}, eps={self.eps}"
