"""The Triton kernels for CUDA devices (kernels/triton_ops.py, opt-in with its register()).
No GPU here: they run in Triton's CPU interpreter against the PyTorch reference
(test/triton_interpreted.py, in a process of its own); they have never run on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vla_accel_ros import kernels


def test_the_triton_kernels_are_opt_in_and_need_cuda():
    from vla_accel_ros.kernels import triton_ops

    assert kernels.available() == ["reference"]  # importing them registers nothing
    assert kernels.get_kernels("cpu").name == "reference"
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="CUDA"):
        triton_ops.register()
    assert kernels.available() == ["reference"]


def test_the_triton_kernels_match_the_reference_in_the_interpreter():
    checks = Path(__file__).with_name("triton_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        env=env, capture_output=True, text=True, timeout=600, cwd=checks.parent.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout and "deselected" not in run.stdout
