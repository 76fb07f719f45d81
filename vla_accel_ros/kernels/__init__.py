"""Custom operators behind one interface, installed as ``vla_accel_ros.kernels``.

The engine calls exactly two operators on its hot path:

* ``write_kv``: scatter the K/V of the rows computed this step into the static cache at
  their slots (partial KV write; everything else in the cache is left as it is);
* ``attend``: attention of a set of query rows over the cache under a boolean mask that
  encodes causality, bidirectional blocks, segments of a packed forward and dropped
  tokens (packed multi-segment attention).

:mod:`.reference` implements both with stock PyTorch and is what runs on CPU. GPU kernels
register themselves with :func:`register`; the package never imports them, so a missing
toolchain never breaks it, and the reference stays the fallback. :mod:`.triton_ops` holds
Triton kernels for both (a RoPE-applying KV write, block-sparse flash attention over packed
segments) that have run only in Triton's CPU interpreter: opt in with
``triton_ops.register()``.

:mod:`.ops` registers the same two operators as torch.library custom ops
(``torch.ops.vla_accel.write_kv`` / ``attend``, with fake implementations) for the compiled and
exported step graphs; a GPU implementation also registers its kernels there for its device type.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class KernelSet(Protocol):
    name: str

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [B, Hkv, S, D]
        v_cache: torch.Tensor,  # [B, Hkv, S, D]
        slots: torch.Tensor,  # [n] int64
        k: torch.Tensor,  # [B, Hkv, n, D]
        v: torch.Tensor,  # [B, Hkv, n, D]
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,  # [B, Hq, n, D]
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor,  # [n, S] bool, True = may attend
        scale: float,
    ) -> torch.Tensor: ...  # [B, Hq, n, D]


_FACTORIES: dict[str, tuple[Callable[[], KernelSet], Callable[[torch.device], bool]]] = {}


def register(name: str, factory: Callable[[], KernelSet], supports: Callable[[torch.device], bool]) -> None:
    """Make a kernel set selectable by name and, with ``prefer='auto'``, for the devices it supports."""
    _FACTORIES[name] = (factory, supports)


def available() -> list[str]:
    return sorted(_FACTORIES)


def get_kernels(device: torch.device | str = "cpu", prefer: str = "auto") -> KernelSet:
    """The kernel set for ``device``: ``prefer`` names one, ``auto`` picks the best supported."""
    device = torch.device(device)
    if prefer != "auto":
        if prefer not in _FACTORIES:
            raise ValueError(f"unknown kernel set {prefer!r}; available: {', '.join(available())}")
        factory, supports = _FACTORIES[prefer]
        if not supports(device):
            raise ValueError(f"kernel set {prefer!r} does not support device {device}")
        return factory()
    for name, (factory, supports) in _FACTORIES.items():
        if name != "reference" and supports(device):
            return factory()
    return _FACTORIES["reference"][0]()


# The reference set is registered here, not by its module: the module then needs nothing of
# this package's (no import cycle), and it runs on every device.
from .reference import ReferenceKernels  # noqa: E402

register("reference", ReferenceKernels, lambda device: True)

from . import ops  # noqa: E402,F401  (torch.ops.vla_accel.*)

__all__ = ["KernelSet", "available", "get_kernels", "register"]
