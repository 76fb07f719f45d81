"""Shared fixtures. Tests run against the installed package (make test installs it first)."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest


# What setup.py installs beside the package (data_files: share/vla_accel_ros/<dir>), which the
# package reads from there once installed (config/aloha.yaml, the shipped bundles).
SHARED_DIRS = ("config", "launch", "bundles")


def _stale_files() -> list[str]:
    """Files of the source tree that differ from the installed copy the tests use (an edit
    without ``make setup``): the package's modules (kernels included) and the data files
    setup.py installs to ``share/vla_accel_ros``. The suite would test old code otherwise."""
    import sys

    import vla_accel_ros

    repo = Path(__file__).resolve().parents[1]
    installed = Path(vla_accel_ros.__file__).parent
    if installed.resolve() == (repo / "vla_accel_ros").resolve():
        return []
    digest = lambda p: hashlib.sha1(p.read_bytes()).digest()  # noqa: E731
    pairs = [(p, installed / p.relative_to(repo / "vla_accel_ros")) for p in (repo / "vla_accel_ros").rglob("*.py")
             if "__pycache__" not in p.parts]  # fmt: skip
    share = Path(sys.prefix) / "share" / "vla_accel_ros"
    pairs += [(p, share / p.relative_to(repo)) for d in SHARED_DIRS for p in (repo / d).rglob("*") if p.is_file()]
    return sorted(str(src.relative_to(repo)) for src, dst in pairs if not (dst.is_file() and digest(dst) == digest(src)))


def pytest_sessionstart(session):
    stale = _stale_files()
    if stale:
        pytest.exit(
            f"the installed vla_accel_ros is older than the source ({', '.join(stale[:5])}"
            f"{' ...' if len(stale) > 5 else ''}): run `make setup` (make test does) before pytest",
            returncode=2,
        )

os.environ.setdefault("MUJOCO_GL", "egl")
# A suite started in a script's background inherits SIGINT ignored, and so would every process
# it starts; the tests stop nodes, bringup and the recorder with SIGINT as a launcher does.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture
def bf16_cpu(monkeypatch):
    """``precision: auto`` as on a CPU with bf16 instructions and VNNI, whatever this one has (an
    AVX2-only CPU runs fp32 instead: core.precision.WITHOUT_BF16): for the tests of auto's
    defaults and fallbacks. bf16 layers still run here, emulated where the CPU lacks the
    instructions."""
    import vla_accel_ros.models.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    monkeypatch.setattr(precision, "native_vnni", lambda: True)


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory):
    """Random-weight tiny bundles of both families, written once per test session."""
    from vla_accel_ros.models.factory import create_demo_bundle

    root = tmp_path_factory.mktemp("bundles")
    return {fam: create_demo_bundle(fam, "tiny", root / fam, seed=0) for fam in ("ar", "flow")}


@pytest.fixture(scope="session")
def tiny_policies(tiny_bundles):
    from vla_accel_ros.models.factory import load_policy

    return {fam: load_policy(path) for fam, path in tiny_bundles.items()}


# -- ROS 2 tests (test/test_ros_*.py) ---------------------------------------------------------------
@pytest.fixture
def ros_domain(monkeypatch):
    """A random ROS_DOMAIN_ID per test with discovery kept on this machine: other engineers run
    ROS tests here at the same time, and their graphs must not meet ours."""
    import random

    domain = random.SystemRandom().randint(1, 100)
    monkeypatch.setenv("ROS_DOMAIN_ID", str(domain))
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")  # Jazzy and newer
    return domain


@pytest.fixture
def ros_context(ros_domain):
    """An rclpy context of its own (its own DDS participant) on the test's domain."""
    import helpers  # test/helpers.py

    with helpers.context_on(ros_domain) as ctx:
        yield ctx


@pytest.fixture(scope="session")
def ros_params_file(tmp_path_factory):
    """config/aloha.yaml with the parity gate off (the tiny bundles pass it; tests save the
    seconds) and command output enabled: everything else is the shipped configuration."""
    from pathlib import Path

    import yaml

    from vla_accel_ros.core.params_file import node_section

    src = Path(__file__).resolve().parents[1] / "config" / "aloha.yaml"
    params = yaml.safe_load(src.read_text())
    node_section(params, "policy_node")["policy"]["parity_check"] = False
    node_section(params, "action_controller_node")["safety"]["start_enabled"] = True
    out = tmp_path_factory.mktemp("ros") / "aloha_test.yaml"
    out.write_text(yaml.safe_dump(params))
    return out


@pytest.fixture(scope="session")
def colcon_install(tmp_path_factory):
    """``colcon build --packages-select vla_accel_ros`` of a copy of the source tree in a fresh
    workspace, this venv's ROS 2 wheels as the underlay (as the Makefile's msg build): the
    install space (``install/``), built once per session (test_colcon_build, test_ros2_launch*)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import ros2_cli  # test/ros2_cli.py

    colcon = shutil.which("colcon", path=str(Path(sys.executable).parent))
    assert colcon, "colcon is not installed in this venv (make setup installs requirements-ros.txt)"
    ws = tmp_path_factory.mktemp("colcon_ws")
    pkg = ws / "src" / "vla_accel_ros"
    pkg.mkdir(parents=True)
    repo = Path(__file__).resolve().parents[1]
    for name in ("CMakeLists.txt", "package.xml", "cmake", "msg", "vla_accel_ros", "launch", "config", "resource"):
        src = repo / name
        if src.is_dir():
            shutil.copytree(src, pkg / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, pkg / name)
    prefix = Path(sys.executable).parents[1]
    cmd = [colcon, "build", "--packages-select", "vla_accel_ros", "--cmake-args", f"-DCMAKE_PREFIX_PATH={prefix}",
           "-DBUILD_TESTING=OFF", f"-DPython3_EXECUTABLE={sys.executable}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ws, env=ros2_cli.underlay_env(), capture_output=True, text=True, timeout=900)
    log = ws / "log" / "latest_build" / "vla_accel_ros" / "stdout_stderr.log"
    detail = log.read_text()[-4000:] if log.is_file() else out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, f"colcon build failed:\n{detail}"
    return ws / "install"
