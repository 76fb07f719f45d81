"""Every registered kernel set, on each device of this machine it supports, writes K/V and
attends as the formula says (softmax(q k^T * scale) v under the mask, per kv head group)."""

from __future__ import annotations

import pytest
import torch

from vla_accel_ros import kernels

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _supported() -> list[tuple[str, str]]:
    """(kernel set, device) for every registered set and every device here it supports."""
    out = []
    for name in kernels.available():
        for device in DEVICES:
            try:
                kernels.get_kernels(device, prefer=name)
            except ValueError:  # the set does not run on this device
                continue
            out.append((name, device))
    return out


SUPPORTED = _supported()


def test_the_reference_set_runs_everywhere():
    assert [(n, d) for n, d in SUPPORTED if n == "reference"] == [("reference", d) for d in DEVICES]


@pytest.mark.parametrize("name,device", SUPPORTED, ids=[f"{n}-{d}" for n, d in SUPPORTED])
def test_kernel_set_matches_the_formula(name, device):
    ks = kernels.get_kernels(device, prefer=name)
    torch.manual_seed(0)
    B, Hq, Hkv, S, D, n = 1, 8, 2, 40, 16, 7
    kc, vc = torch.zeros(B, Hkv, S, D, device=device), torch.zeros(B, Hkv, S, D, device=device)
    slots = torch.tensor([0, 3, 4, 10, 11, 30, 39], device=device)
    k, v = torch.randn(B, Hkv, n, D).to(device), torch.randn(B, Hkv, n, D).to(device)
    ks.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc[:, :, slots], k) and torch.equal(vc[:, :, slots], v)
    assert kc[:, :, 1].abs().sum() == 0  # untouched slots stay as they were
    q = torch.randn(B, Hq, n, D).to(device)
    mask = (torch.rand(n, S) > 0.3).to(device)
    mask[:, 0] = True
    kr, vr = kc.repeat_interleave(Hq // Hkv, 1), vc.repeat_interleave(Hq // Hkv, 1)
    scores = (q @ kr.transpose(-1, -2)) * 0.25
    for m in (mask, torch.ones(n, S, dtype=torch.bool, device=device)):  # a mask without holes takes the unmasked path
        out = ks.attend(q, kc, vc, m, 0.25)
        ref = scores.masked_fill(~m, float("-inf")).softmax(-1) @ vr
        assert (out - ref).abs().max() <= 1e-5
        # Each query head reads its own kv head (head h: kv head h // (Hq / Hkv)).
        assert (out[:, 1] - ks.attend(q[:, 1:2], kc[:, :1], vc[:, :1], m, 0.25)[:, 0]).abs().max() <= 1e-6


def test_selection_and_errors():
    assert kernels.get_kernels("cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown kernel set"):
        kernels.get_kernels("cpu", prefer="nope")


def _op_inputs():
    torch.manual_seed(1)
    B, Hq, Hkv, S, D, n = 1, 4, 2, 24, 8, 5
    slots = torch.tensor([1, 2, 7, 8, 20])
    mask = torch.rand(n, S) > 0.4
    mask[torch.arange(n), slots] = True  # every row sees itself
    return (torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), slots, torch.randn(B, Hkv, n, D),
            torch.randn(B, Hkv, n, D), torch.randn(B, Hq, n, D), mask)  # fmt: skip


def test_custom_ops_match_reference_and_have_fake_kernels():
    from vla_accel_ros.kernels import ops

    kc, vc, slots, k, v, q, mask = _op_inputs()
    ref = kernels.get_kernels("cpu", prefer="reference")
    kr, vr = kc.clone(), vc.clone()
    ref.write_kv(kr, vr, slots, k, v)
    torch.ops.vla_accel.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    out = torch.ops.vla_accel.attend(q, kc, vc, mask, 0.3)
    assert torch.equal(out, ref.attend(q, kr, vr, mask, 0.3).contiguous())
    # The schema, the fake (meta) kernels and the mutation annotations agree with the real ones.
    torch.library.opcheck(ops.write_kv, (kc.clone(), vc.clone(), slots, k, v))
    torch.library.opcheck(ops.attend, (q, kc, vc, mask, 0.3))


def test_custom_ops_under_torch_compile():
    """The two ops in one compiled graph (inductor, fullgraph: no break around them) give the
    reference's results, and write the cache in place."""
    kc, vc, slots, k, v, q, mask = _op_inputs()

    def step(kc, vc, slots, k, v, q, mask):
        torch.ops.vla_accel.write_kv(kc, vc, slots, k * 2.0, v)
        return torch.ops.vla_accel.attend(q, kc, vc, mask, 0.3) + 1.0

    kr, vr = kc.clone(), vc.clone()
    expected = step(kr, vr, slots, k, v, q, mask)
    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    got = compiled(kc, vc, slots, k, v, q, mask)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert (got - expected).abs().max() <= 1e-6
