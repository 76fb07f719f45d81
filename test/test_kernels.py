"""Every registered kernel set agrees with the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from vla_accel_ros import kernels


@pytest.mark.parametrize("name", kernels.available())
def test_kernel_set_matches_reference(name):
    ks = kernels.get_kernels("cpu", prefer=name) if name == "reference" else pytest.skip(f"{name}: not on CPU")
    torch.manual_seed(0)
    B, Hq, Hkv, S, D, n = 1, 8, 2, 40, 16, 7
    kc, vc = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    slots = torch.tensor([0, 3, 4, 10, 11, 30, 39])
    k, v = torch.randn(B, Hkv, n, D), torch.randn(B, Hkv, n, D)
    ks.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc[:, :, slots], k) and torch.equal(vc[:, :, slots], v)
    assert kc[:, :, 1].abs().sum() == 0  # untouched slots stay as they were
    q = torch.randn(B, Hq, n, D)
    mask = torch.rand(n, S) > 0.3
    mask[:, 0] = True
    out = ks.attend(q, kc, vc, mask, 0.25)
    kr, vr = kc.repeat_interleave(Hq // Hkv, 1), vc.repeat_interleave(Hq // Hkv, 1)
    scores = (q @ kr.transpose(-1, -2)) * 0.25
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vr
    assert (out - ref).abs().max() <= 1e-5


def test_selection_and_errors():
    assert kernels.get_kernels("cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown kernel set"):
        kernels.get_kernels("cpu", prefer="nope")
