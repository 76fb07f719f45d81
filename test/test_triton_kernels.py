"""The Triton kernels for CUDA devices (kernels/triton_ops.py, opt-in with its register()).
No GPU here: they run in Triton's CPU interpreter against the PyTorch reference
(test/triton_interpreted.py) and Triton compiles them ahead of time for sm_80 / sm_90 down to a
cubin (test/triton_aot.py); on a GPU they ran once, by hand (docs/runtime.md). Both run in processes of their own
with Triton on the path: it is installed apart (.venv/triton, see requirements-triton.txt),
because torch imports it into every process once it is importable, and importing it after the
simulator rendered through EGL crashes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vla_accel_ros import kernels

TRITON = Path(sys.prefix) / "triton"  # make setup installs it there


def _pytest(checks: str, **env) -> None:
    if not (TRITON / "triton").is_dir():
        pytest.fail(f"Triton is not installed in {TRITON} (run make setup)")
    path = os.pathsep.join(p for p in (str(TRITON), os.environ.get("PYTHONPATH", "")) if p)
    test_dir = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_dir / checks)],
        env={**os.environ, "PYTHONPATH": path, **env}, capture_output=True, text=True, timeout=600, cwd=test_dir.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout and "deselected" not in run.stdout


def test_the_package_does_not_need_triton():
    import importlib.util

    assert importlib.util.find_spec("triton") is None  # kept out of the venv's site-packages
    assert kernels.available() == ["reference"] and kernels.get_kernels("cpu").name == "reference"


def test_the_triton_kernels_match_the_reference_in_the_interpreter():
    _pytest("triton_interpreted.py", TRITON_INTERPRET="1")


def test_the_triton_kernels_compile_for_the_gpu_ahead_of_time():
    _pytest("triton_aot.py")
