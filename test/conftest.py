"""Shared fixtures. Tests run against the installed package (make test installs it first)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")


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
