"""Triton compiles the GPU kernels (kernels/triton_ops.py) ahead of time for Ampere and Hopper,
down to a cubin (its bundled ptxas needs no GPU), and registering them needs CUDA. Not
collected on its own (no ``test_`` prefix): ``test_triton_kernels.py`` runs it in a process of
its own with Triton on the path (see requirements-triton.txt)."""

from __future__ import annotations

import pytest
import torch

from vla_accel_ros import kernels


def test_the_triton_kernels_are_opt_in_and_need_cuda():
    from vla_accel_ros.kernels import triton_ops

    assert kernels.available() == ["reference"]  # importing them registers nothing
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="CUDA"):
        triton_ops.register()
    assert kernels.available() == ["reference"]


def _signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    return {
        name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name == "scale" else "i32")
        for name in kernel.arg_names
    }  # fmt: skip


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernels_compile_for_the_gpu_ahead_of_time(arch, dtype):
    """Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, ptxas to a cubin) for sm_80 / sm_90,
    at the launch configuration the wrappers pick, for head dims 64, 128 and 256: what compiles
    here is what a GPU would load, and it fits the ~99 KB of shared memory a block gets on
    sm_86 / sm_89 (the smallest of these GPUs). Not run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vla_accel_ros.kernels import triton_ops

    target = GPUTarget("cuda", arch, 32)
    p = "*fp32" if dtype == torch.float32 else "*bf16"
    write = {"k_cache": p, "v_cache": p, "slots": "*i64", "k": p, "v": p, "cos": "*fp32", "sin": "*fp32"}
    for rope in (False, True):
        const = {"D": 64, "HALF": 32, "ROPE": rope}
        src = ASTSource(fn=triton_ops._write_kv_kernel, signature=_signature(triton_ops._write_kv_kernel, write, const), constexprs=const)
        assert triton.compile(src, target=target).asm["cubin"]
    attend = {"q": p, "k": p, "v": p, "mask": "*i8", "lo_hi": "*i32", "o": p}
    for head_dim in (64, 128, 256):
        cfg = triton_ops.attend_config(dtype, head_dim)
        stages = cfg.pop("num_stages")
        const = {"D": head_dim, **cfg, "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "WIDEN": False}
        src = ASTSource(fn=triton_ops._attend_kernel, signature=_signature(triton_ops._attend_kernel, attend, const), constexprs=const)
        compiled = triton.compile(src, target=target, options={"num_stages": stages})
        assert compiled.asm["cubin"] and f"sm_{arch}" in compiled.asm["ptx"]
        assert compiled.metadata.shared <= 99 * 1024, (head_dim, compiled.metadata.shared)
