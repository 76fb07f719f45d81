"""Triton kernels for the two engine operators, for CUDA devices. SLOWER THAN SDPA IN BF16.

Written without a GPU: the tests check them against the PyTorch reference (:mod:`.reference`)
in Triton's CPU interpreter (``TRITON_INTERPRET=1``), and Triton compiles them ahead of time for
sm_80 / sm_90 down to a cubin (no GPU needed). Run once on an H100 (docs/runtime.md): 13 of the
14 checks passed compiled, one failed on a tensor's device (not yet known where), and attention
was 1.7-3.2x slower than SDPA in bf16 at SmolVLA's sizes (faster in fp32). So nothing uses them
unless asked: :func:`register` (on a machine with CUDA) makes them the ``triton`` kernel set,
which ``kernels.get_kernels("cuda")`` then picks, and the CUDA kernels of the
``vla_accel::write_kv`` / ``vla_accel::attend`` custom ops (compiled and exported step graphs);
``kernels.get_kernels("cuda", prefer="reference")`` still gives the reference.

* :func:`write_kv`: the partial KV write, one program per (row, batch x kv head) writing that
  row's K and V at its slot; with ``cos`` / ``sin`` it applies the rotary embedding to K on the
  way (Llama's rotate-half form), so a decoder layer's K need not be rotated in a separate pass.
* :func:`attend`: packed multi-segment attention over the static cache (flash attention's
  online softmax, one program per block of query rows and query head). The boolean mask
  carries causality, segments and holes; each block of query rows only visits the key range
  its rows may read (computed from the mask on the host), so a packed forward over several
  frames' segments costs what the segments cost apart. Grouped-query heads read their kv head.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

# Whether this module's kernels were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1
# at import). The interpreter multiplies bf16 / fp16 dot operands as their raw bit patterns, so
# there they are widened to fp32 first (products of the same values; on a GPU the kernel
# multiplies them on the tensor cores as they are).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _write_kv_kernel(
    k_cache, v_cache, slots, k, v, cos, sin,
    s_kc_b, s_kc_h, s_kc_s, s_vc_b, s_vc_h, s_vc_s,  # cache strides (last dim contiguous)
    s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,  # row strides (last dim contiguous)
    s_cs_n, Hkv, D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # row
    bh = tl.program_id(1)
    b, h = bh // Hkv, bh % Hkv
    slot = tl.load(slots + i)
    d = tl.arange(0, HALF)
    keep = d < D // 2
    k_row = k + b * s_k_b + h * s_k_h + i * s_k_n
    v_row = v + b * s_v_b + h * s_v_h + i * s_v_n
    k1 = tl.load(k_row + d, mask=keep).to(tl.float32)
    k2 = tl.load(k_row + D // 2 + d, mask=keep).to(tl.float32)
    if ROPE:  # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        c1 = tl.load(cos + i * s_cs_n + d, mask=keep)
        c2 = tl.load(cos + i * s_cs_n + D // 2 + d, mask=keep)
        n1 = tl.load(sin + i * s_cs_n + d, mask=keep)
        n2 = tl.load(sin + i * s_cs_n + D // 2 + d, mask=keep)
        k1, k2 = k1 * c1 - k2 * n1, k2 * c2 + k1 * n2
    kc = k_cache + b * s_kc_b + h * s_kc_h + slot * s_kc_s
    vc = v_cache + b * s_vc_b + h * s_vc_h + slot * s_vc_s
    tl.store(kc + d, k1.to(k_cache.dtype.element_ty), mask=keep)
    tl.store(kc + D // 2 + d, k2.to(k_cache.dtype.element_ty), mask=keep)
    tl.store(vc + d, tl.load(v_row + d, mask=keep).to(v_cache.dtype.element_ty), mask=keep)
    tl.store(vc + D // 2 + d, tl.load(v_row + D // 2 + d, mask=keep).to(v_cache.dtype.element_ty), mask=keep)


def write_kv(k_cache, v_cache, slots, k, v, cos=None, sin=None) -> None:
    """``k_cache[:, :, slots] = rope(k)`` (or ``k`` without cos / sin) and ``v_cache[:, :, slots]
    = v``, cast to the cache dtype, in place.  k_cache / v_cache: [B, Hkv, S, D]; slots: [n]
    int64 in [0, S) (not checked: that would wait for the GPU; the engine's plans keep it);
    k / v: [B, Hkv, n, D] (any strides); cos / sin: [n, D]."""
    B, Hkv, n, D = k.shape
    if D % 2:
        raise ValueError(f"head dim {D} must be even")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[:2] != (B, Hkv) or c.shape[3] != D or c.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(c.shape)} does not hold rows {tuple(k.shape)} (or its last dim is strided)")
    if v.shape != k.shape or slots.shape != (n,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and slots {tuple(slots.shape)} disagree")
    if n == 0:
        return
    k, v = _last_contiguous(k), _last_contiguous(v)
    rope = cos is not None
    if rope:
        cos, sin = cos.reshape(n, D).float().contiguous(), sin.reshape(n, D).float().contiguous()
    else:
        cos = sin = k  # unused (ROPE is a compile-time switch)
    with _on(k.device):
        _write_kv_kernel[(n, B * Hkv)](
            k_cache, v_cache, slots.contiguous(), k, v, cos, sin,
            *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            D if rope else 0, Hkv, D=D, HALF=triton.next_power_of_2(D // 2), ROPE=rope,
        )  # fmt: skip


@triton.jit
def _attend_kernel(
    q, k, v, mask, lo_hi, o,
    s_q_b, s_q_h, s_q_n, s_k_b, s_k_h, s_k_s, s_v_b, s_v_h, s_v_s, s_m_n, s_o_b, s_o_h, s_o_n,
    n, Hq, GROUP, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // Hq, bh % Hq
    kvh = h // GROUP
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    d_ok = d < D
    qb = tl.load(q + b * s_q_b + h * s_q_h + rows[:, None] * s_q_n + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:
        qb = qb.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo = tl.load(lo_hi + 2 * blk)
    hi = tl.load(lo_hi + 2 * blk + 1)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        kb = tl.load(k + b * s_k_b + kvh * s_k_h + keys[:, None] * s_k_s + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        vb = tl.load(v + b * s_v_b + kvh * s_v_h + keys[:, None] * s_v_s + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if WIDEN:
            kb, vb = kb.to(tl.float32), vb.to(tl.float32)
        allowed = tl.load(mask + rows[:, None] * s_m_n + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
        s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no allowed key yet keep m = -inf: shift by 0 there, not by -inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that may read no key: zeros
    tl.store(o + b * s_o_b + h * s_o_h + rows[:, None] * s_o_n + d[None, :], acc.to(o.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def key_ranges(mask: torch.Tensor, block_m: int) -> torch.Tensor:
    """[blocks, 2] int32: per block of ``block_m`` query rows, the first and one past the last
    key any of its rows may read ((0, 0) for a block that may read none).  mask: [n, S] bool"""
    n, S = mask.shape
    blocks = triton.cdiv(n, block_m)
    pad = torch.zeros(blocks * block_m, S, dtype=torch.bool, device=mask.device)
    pad[:n] = mask
    any_key = pad.view(blocks, block_m, S).any(1)  # [blocks, S]
    idx = torch.arange(S, device=mask.device)
    lo = torch.where(any_key, idx, S).amin(1)
    hi = torch.where(any_key, idx + 1, 0).amax(1)
    lo = torch.minimum(lo, hi)
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


def attend_config(dtype: torch.dtype, head_dim: int) -> dict:
    """Block sizes and pipeline depth of :func:`attend` for a dtype and head dim: 32 x 32 tiles
    in 3 stages, or 32 x 16 in 2 where fp32 rows are long (head dim 256: 168 KB of shared memory
    in 3 stages, more than Ampere allows a block; 68 KB so), keeping every configuration under
    the ~99 KB that sm_86 / sm_89 allow (checked by the compile test)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    long_rows = torch.empty((), dtype=dtype).element_size() * block_d > 512
    return {"BLOCK_D": block_d, "BLOCK_M": 32, "BLOCK_N": 16 if long_rows else 32, "num_stages": 2 if long_rows else 3}


def attend(q, k, v, mask, scale) -> torch.Tensor:
    """Attention of the query rows over the keys their mask row allows.  q: [B, Hq, n, D];
    k / v: [B, Hkv, S, D]; mask: [n, S] bool -> [B, Hq, n, D] in q's dtype (a row whose mask
    allows no key gets zeros, as the reference gives)."""
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} kv heads")
    if mask.shape != (n, S):
        raise ValueError(f"mask is {tuple(mask.shape)}, expected ({n}, {S})")
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"head dims differ: q {D}, k {k.shape[-1]}, v {v.shape[-1]}")
    if n == 0 or S == 0:
        return torch.zeros(B, Hq, n, D, dtype=q.dtype, device=q.device)
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    o = torch.empty(B, Hq, n, D, dtype=q.dtype, device=q.device)
    cfg = attend_config(q.dtype, D)
    m = mask.to(torch.int8).contiguous()
    ranges = key_ranges(mask, cfg["BLOCK_M"])
    with _on(q.device):
        _attend_kernel[(ranges.shape[0], B * Hq)](
            q, k, v, m, ranges, o,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], m.stride(0), *o.stride()[:3],
            n, Hq, Hq // Hkv, float(scale),
            D=D, **cfg,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 rounding)
            WIDEN=q.dtype != torch.float32 and _INTERPRETED,
        )  # fmt: skip
    return o


def _on(device: torch.device):
    # Triton launches on the current CUDA device, not the tensors': make it theirs.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonKernels:
    """The :class:`~vla_accel_ros.kernels.KernelSet` of these kernels (CUDA tensors)."""

    name = "triton"
    write_kv = staticmethod(write_kv)
    attend = staticmethod(attend)


def register() -> None:
    """Opt in (unverified on any GPU, see the module docstring): the ``triton`` kernel set for
    CUDA devices and the CUDA kernels of the two custom ops."""
    if not torch.cuda.is_available():
        raise RuntimeError("the Triton kernels run on CUDA devices; none is available")
    from . import ops
    from . import register as register_set

    register_set("triton", TritonKernels, lambda device: device.type == "cuda")
    ops.write_kv.register_kernel("cuda")(lambda k_cache, v_cache, slots, k, v: write_kv(k_cache, v_cache, slots, k, v))
    ops.attend.register_kernel("cuda")(attend)
