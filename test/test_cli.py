"""The ``vla-accel`` commands a user runs first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).with_name("vla-accel"))


def _run(*args, timeout=300):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout)


def test_create_inspect_and_parity(tmp_path):
    out = _run("bundle", "create-demo", "--family", "flow", "--size", "tiny", "--out", str(tmp_path / "b"))
    assert out.returncode == 0, out.stderr
    assert "demo-flow-tiny" in out.stdout
    out = _run("bundle", "inspect", str(tmp_path / "b"))
    assert out.returncode == 0 and "chunk 50 x 14" in out.stdout
    out = _run("parity", "--bundle", str(tmp_path / "b"))
    assert out.returncode == 0 and "PASS" in out.stdout


def test_errors_are_one_line_and_non_zero(tmp_path):
    out = _run("bundle", "inspect", str(tmp_path))
    assert out.returncode == 2 and "not a bundle" in out.stderr and "Traceback" not in out.stderr
