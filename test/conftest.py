"""Shared fixtures. Tests run against the installed package (make test installs it first)."""

from __future__ import annotations

import os
import signal

import pytest

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
