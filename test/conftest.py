"""Shared fixtures. Tests run against the installed package (make test installs it first)."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest


def _stale_files() -> list[str]:
    """Source files of the package that differ from the installed copy the tests import (an
    edit without ``make setup``): the suite would test old code."""
    import vla_accel_ros

    src = Path(__file__).resolve().parents[1] / "vla_accel_ros"
    installed = Path(vla_accel_ros.__file__).parent
    if installed.resolve() == src.resolve():
        return []
    digest = lambda p: hashlib.sha1(p.read_bytes()).digest()  # noqa: E731
    return [str(p.relative_to(src.parent)) for p in sorted(src.rglob("*.py")) if "__pycache__" not in p.parts
            and p.name != "__init__.py" and not ((installed / p.relative_to(src)).is_file()
                                                 and digest(installed / p.relative_to(src)) == digest(p))]  # fmt: skip


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

    src = Path(__file__).resolve().parents[1] / "config" / "aloha.yaml"
    params = yaml.safe_load(src.read_text())
    params["policy_node"]["ros__parameters"]["policy"]["parity_check"] = False
    params["action_controller_node"]["ros__parameters"]["safety"]["start_enabled"] = True
    out = tmp_path_factory.mktemp("ros") / "aloha_test.yaml"
    out.write_text(yaml.safe_dump(params))
    return out
