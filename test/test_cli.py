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


def test_arguments_are_checked_before_any_work(tmp_path, tiny_bundles):
    """Bad values end in one line naming them (exit 2, no traceback), before a model loads or a
    bundle is written."""
    flow = str(tiny_bundles["flow"])
    for args, words in (
        (("bench", "engine", "--bundle", flow, "--reuse", "abc"), "'abc' is not a number"),
        (("bench", "engine", "--bundle", flow, "--reuse", "1.5"), "1.5 is not a fraction in (0, 1)"),
        (("bench", "engine", "--bundle", flow, "--repeats", "0"), "--repeats must be >= 1"),
        (("bench", "cache", "--bundle", flow, "--json", str(tmp_path / "missing" / "r.json")), "does not exist"),
        (("bench", "engine", "--bundle", flow, "--json", str(tmp_path / "missing" / "r.json")), "does not exist"),
        (("demo", "--modes", "nope", "--workdir", str(tmp_path / "demo")), "unknown mode 'nope'"),
        (("demo", "--modes", ",", "--workdir", str(tmp_path / "demo")), "names no mode"),
        (("replay", str(tmp_path / "bag"), "--bundle", flow, "--report", str(tmp_path / "r"), "--sync", "cameras=cam_low"),
         "the cameras come from the bundle"),
    ):
        out = _run(*args)
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, (args, out.stderr[-2000:])
    assert not (tmp_path / "demo").exists()  # no bundle was written


def test_long_commands_show_progress_on_stderr_when_it_is_not_a_terminal(tmp_path, tiny_bundles):
    flow = str(tiny_bundles["flow"])
    out = _run("parity", "--bundle", flow)
    assert out.returncode == 0 and "parity" in out.stderr and "5/5" in out.stderr and "PASS" in out.stdout
    out = _run("bench", "cache", "--bundle", flow, "--frames", "2", "--warmup", "1", "--presets", "default")
    assert out.returncode == 0 and "bench cache" in out.stderr and "3/3" in out.stderr
    out = _run("bench", "engine", "--bundle", flow, "--repeats", "1", "--reuse", "0.5")
    assert out.returncode == 0 and "bench engine" in out.stderr and "comparison" in out.stderr


def test_parity_gates_on_the_frames_of_a_bag(tmp_path, tiny_bundles):
    import helpers
    import pytest

    pytest.importorskip("gym_aloha")

    flow = str(tiny_bundles["flow"])
    bag = helpers.record_sim_bag(tmp_path / "bag", episodes=1, steps=12)
    out = _run("parity", "--bundle", flow, "--accel", "cache", "--bag", str(bag))
    assert out.returncode == 0 and f"frames of {bag}" in out.stdout and "PASS" in out.stdout, out.stdout + out.stderr[-2000:]
    no_state = helpers.still_bag(tmp_path, camera="cam_high", joints=False)
    out = _run("parity", "--bundle", flow, "--bag", str(no_state))
    assert out.returncode == 2 and "no joint states" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
