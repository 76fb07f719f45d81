"""The two engine operators as torch.library custom ops: ``vla_accel::write_kv`` and
``vla_accel::attend``.

Registered ops are opaque to torch.compile and torch.export: a compiled or exported step graph
keeps them as single nodes (their fake implementations give the shapes), so a backend can swap
in its own kernel for each (a TensorRT plugin, a Triton kernel) without touching the graph.
The CPU implementation is the PyTorch reference (:mod:`.reference`); it is written in plain
tensor ops, so it also runs on any other device. A GPU kernel registers itself for its device
type with ``write_kv.register_kernel("cuda")`` / ``attend.register_kernel("cuda")``.

The eager engine calls a :class:`~vla_accel_ros.kernels.KernelSet` directly (no dispatcher
round trip per layer); the static-shape step graphs (``vla_accel_ros.core.compiled``) call
these ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import ReferenceKernels

NAMESPACE = "vla_accel"


@torch.library.custom_op(f"{NAMESPACE}::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Partial KV write: ``k_cache[:, :, slots] = k`` (and v), in place; every other slot keeps
    its K/V.  k_cache/v_cache: [B, Hkv, S, D]; slots: [n] int64; k/v: [B, Hkv, n, D]"""
    ReferenceKernels.write_kv(k_cache, v_cache, slots, k, v)


@write_kv.register_fake
def _write_kv_fake(k_cache, v_cache, slots, k, v) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::attend", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Packed multi-segment attention over the static cache: query rows attend the keys their
    mask row allows (causality, bidirectional blocks, segments and dropped tokens are all in
    the mask).  q: [B, Hq, n, D]; k/v: [B, Hkv, S, D]; mask: [n, S] bool -> [B, Hq, n, D]"""
    # Contiguous: a custom op's output layout must be what its fake promises, whatever layout
    # the attention backend picked.
    return ReferenceKernels.attend(q, k, v, mask, scale).contiguous()


@attend.register_fake
def _attend_fake(q, k, v, mask, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


OPS = (write_kv, attend)
