"""The Triton kernels (kernels/triton_ops.py) against the PyTorch reference, in Triton's CPU
interpreter, or compiled on a CUDA device. Not collected on its own (no ``test_`` prefix):
``test_triton_kernels.py`` runs it in a process of its own with TRITON_INTERPRET=1 set before
Triton is imported, which the interpreter needs (Triton decides per function, when it is
decorated, whether it interprets). On a machine with a GPU, ``VLA_TRITON_DEVICE=cuda python -m
pytest test/triton_interpreted.py`` runs the same checks compiled, every tensor on the GPU
(torch's default device; run on an H100 on 2026-11-27, docs/runtime.md).

Interpreted, this checks what the kernels compute (indexing, masking, the online softmax,
grouped heads, dtypes), not how fast they are."""

from __future__ import annotations

import os

import pytest
import torch

from vla_accel_ros.core.engine import DecoderStack, Engine, StepPlan
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.kernels import triton_ops as T_module
from vla_accel_ros.kernels.reference import ReferenceKernels as R

ON_GPU = os.environ.get("VLA_TRITON_DEVICE") == "cuda"
assert os.environ.get("TRITON_INTERPRET") == "1" or ON_GPU, "run through test_triton_kernels.py"
if ON_GPU:
    torch.set_default_device("cuda")  # every tensor the checks make, the model's weights too


@pytest.fixture
def T():
    assert T_module._INTERPRETED != ON_GPU
    return T_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_the_rows_at_their_slots(T, dtype):
    torch.manual_seed(0)
    B, Hkv, S, D, n = 2, 2, 40, 24, 6
    kc, vc = torch.randn(B, Hkv, S, D).to(dtype), torch.randn(B, Hkv, S, D).to(dtype)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.tensor([0, 3, 4, 17, 30, 39])
    # [B, n, Hkv, D] viewed as [B, Hkv, n, D]: the engine's layout after its projection
    k = torch.randn(B, n, Hkv, D).to(dtype).transpose(1, 2)
    v = torch.randn(B, n, Hkv, D).to(dtype).transpose(1, 2)
    T.write_kv(kc, vc, slots, k, v)
    R.write_kv(kr, vr, slots, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the rows, and every other slot untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_applies_the_rotary_embedding_on_the_way(T, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(1)
    B, Hkv, S, D, n = 1, 2, 32, 16, 5
    slots, positions = torch.tensor([2, 5, 6, 20, 31]), torch.tensor([2, 5, 6, 40, 63])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = positions[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()  # [n, D]
    k, v = torch.randn(B, Hkv, n, D), torch.randn(B, Hkv, n, D)
    kc, vc = torch.zeros(B, Hkv, S, D, dtype=dtype), torch.zeros(B, Hkv, S, D, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    T.write_kv(kc, vc, slots, k, v, cos, sin)
    _, k_rot = apply_rotary_pos_emb(k, k, cos[None], sin[None])
    R.write_kv(kr, vr, slots, k_rot.to(dtype), v.to(dtype))
    # fp32: the same products in another order; bf16: one rounding step at most (the
    # interpreter truncates fp32 -> bf16 where a GPU rounds to nearest)
    tol = 1e-6 if dtype == torch.float32 else 2.0**-7 * k_rot.abs().max().item()
    assert (kc.float() - kr.float()).abs().max() <= tol
    assert torch.equal(vc.float() == 0, vr.float() == 0) and (vc.float() - vr.float()).abs().max() <= tol


def _packed_mask(S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows of two packed segments (causal each, the second at slots 30..), with holes
    (dropped tokens) in the first: the mask the engine builds for a pipelined, pruned forward."""
    allowed = torch.zeros(S, S, dtype=torch.bool)
    allowed[:30, :30] = torch.ones(30, 30, dtype=torch.bool).tril()
    allowed[30:, 30:] = torch.ones(S - 30, S - 30, dtype=torch.bool).tril()
    allowed[:, [4, 5, 11]] = False
    rows = torch.cat([torch.arange(8, 30, 2), torch.arange(30, S)])
    return rows, allowed[rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "packed", "full"])
def test_attend_matches_the_reference(T, dtype, case):
    torch.manual_seed(2)
    B, Hq, Hkv, S, D = 2, 6, 2, 71, 48  # grouped heads; S, rows and D not multiples of a block
    if case == "packed":
        rows, mask = _packed_mask(S)
        n = rows.numel()
    else:
        n = 45
        mask = torch.rand(n, S) < 0.6 if case == "random" else torch.ones(n, S, dtype=torch.bool)
        mask[:, 0] = True
    q = torch.randn(B, Hq, n, D).to(dtype)
    k, v = torch.randn(B, Hkv, S, D).to(dtype), torch.randn(B, Hkv, S, D).to(dtype)
    out = T.attend(q, k, v, mask, 0.15)
    ref = R.attend(q.float(), k.float(), v.float(), mask, 0.15)
    assert out.dtype == dtype and out.shape == (B, Hq, n, D)
    # fp32: summation order only; bf16: the probabilities are rounded to bf16 before P @ V
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref).abs().max() <= tol


def test_attend_visits_only_the_keys_a_block_of_rows_may_read(T):
    S = 71
    rows, mask = _packed_mask(S)
    ranges = T.key_ranges(mask, 8)
    # rows of the first segment are at slots 8, 10, .., 28 (causal), the second's at 30..70:
    # block 0 (slots 8..22) reads keys [0, 23); block 1 (24, 26, 28, 30..34) spans both
    # segments; every later block reads only its own segment's keys
    assert ranges[0].tolist() == [0, 23] and ranges[1].tolist() == [0, 35]
    assert ranges[2:, 0].min() >= 30 and ranges[-1].tolist() == [30, S]
    # a block whose rows may read nothing visits nothing and writes zeros
    none = torch.zeros(3, S, dtype=torch.bool)
    assert T.key_ranges(none, 8).tolist() == [[0, 0]]
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, S, 16)
    assert torch.equal(T.attend(q, k, k, none, 0.25), torch.zeros(1, 2, 3, 16))
    # no keys at all (an empty window): zeros too, as the reference gives
    empty = torch.zeros(1, 2, 0, 16)
    assert torch.equal(T.attend(q, empty, empty, torch.zeros(3, 0, dtype=torch.bool), 0.25), torch.zeros(1, 2, 3, 16))
    assert torch.equal(R.attend(q, empty, empty, torch.zeros(3, 0, dtype=torch.bool), 0.25), torch.zeros(1, 2, 3, 16))


def test_attend_with_long_fp32_rows_takes_the_smaller_tiles(T):
    """Head dim 256 in fp32 runs 32 x 16 tiles (the shared memory of 32 x 32 in 3 stages is
    more than Ampere gives a block): the same results."""
    assert T.attend_config(torch.float32, 256)["BLOCK_N"] == 16 and T.attend_config(torch.bfloat16, 256)["BLOCK_N"] == 32
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 20, 256), torch.randn(1, 1, 40, 256), torch.randn(1, 1, 40, 256)
    mask = torch.ones(20, 40, dtype=torch.bool).tril(20)
    assert (T.attend(q, k, v, mask, 0.06) - R.attend(q, k, v, mask, 0.06)).abs().max() <= 1e-5


def test_write_kv_refuses_a_cache_that_cannot_hold_the_rows(T):
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="does not hold rows"):
        T.write_kv(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 16), torch.tensor([0, 1, 2]), k, k)
    with pytest.raises(ValueError, match="disagree"):
        T.write_kv(torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10, 16), torch.tensor([0, 1]), k, k)


def _decoder():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(3)
    return LlamaModel(cfg).eval()


def test_the_engine_gives_the_same_results_on_the_triton_kernels(T):
    """A packed two-segment forward, then a partial recompute with a dropped token, through the
    engine with the reference kernels and with the Triton ones (interpreted)."""
    model = _decoder()
    layout = [Segment(0, (Block(24, "causal"),)), Segment(24, (Block(20, "causal"),))]
    results = []
    for ks in (R(), T.TritonKernels()):
        stack = DecoderStack(model)
        cache = stack.make_cache(44)
        cache.set_layout(layout)
        eng = Engine(stack, cache, kernels=ks)
        torch.manual_seed(4)
        x = torch.randn(1, 44, 64)
        packed = StepPlan(slots=torch.arange(44), positions=torch.cat([torch.arange(24), torch.arange(20)]),
                          output_slots=torch.tensor([23, 43]))  # fmt: skip
        first = eng.forward(x, packed).hidden
        rows = torch.tensor([3, 7, 8, 20, 21, 22, 23])
        partial = StepPlan(slots=rows, positions=rows, drop={1: torch.tensor([5])}, output_slots=torch.tensor([23]))
        second = eng.forward(x[:, rows] * 0.5, partial).hidden
        results.append((first, second, cache.k.clone(), cache.valid.clone()))
    (a1, a2, ak, av), (b1, b2, bk, bv) = results
    assert (a1 - b1).abs().max() <= 1e-5 and (a2 - b2).abs().max() <= 1e-5
    assert torch.equal(av, bv) and (ak - bk).abs().max() <= 1e-5
