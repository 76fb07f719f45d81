"""The package's rooms import only downward: the layering, proved by walking every import.

kernels (the custom operators) import nothing of the package; core (engine, cache, scheduling,
robot logic) imports nothing else of the package but the kernels; models build on core; io and sim are ROS-free rooms on core; train learns bundles with
models and io; bench measures with all of those; ros is the only room with rclpy and never
imports a benchmark; cli ties them.
Function-level (lazy) imports count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "vla_accel_ros"
PKG = "vla_accel_ros"

# room -> the rooms it may import from (itself included)
ALLOWED: dict[str, set[str]] = {
    "kernels": {"kernels"},
    "core": {"core", "kernels"},
    "models": {"models", "core", "kernels"},
    "io": {"io", "core"},
    "sim": {"sim", "core"},
    "train": {"train", "models", "io", "core", "kernels"},
    "bench": {"bench", "models", "io", "sim", "core", "kernels"},
    "ros": {"ros", "msg", "models", "io", "sim", "core"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a source file."""
    module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
    return out


def test_rooms_import_only_downward():
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(ALLOWED) <= rooms, f"a room of the rule is gone: {set(ALLOWED) - rooms}"
    bad = []
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        room = path.relative_to(SRC).parts[0]
        if room not in ALLOWED:
            continue  # cli (ties everything together), msg (generated), top-level modules
        checked += 1
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] == PKG and len(parts) > 1 and parts[1] not in ALLOWED[room]:
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {name}")
    assert checked > 50
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_scheduling_is_a_floor_below_the_robot():
    """core.scheduling turns chunks into actions on a clock and knows nothing of the robot; the
    controller's tick that joins it with the safety filter and motion switch is core.robot's."""
    bad = [f"{path.relative_to(SRC.parent)}:{line} imports {name}"
           for path in sorted((SRC / "core" / "scheduling").rglob("*.py"))
           for line, name in _imports(path) if name.startswith(f"{PKG}.core.robot")]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_core_imports_no_third_party_robot_stack():
    """The core is plain Python, NumPy and torch: no ROS, no bag or simulator libraries."""
    bad = []
    for path in sorted((SRC / "core").rglob("*.py")):
        for line, name in _imports(path):
            if name.split(".")[0] in ("rclpy", "rosbags", "mujoco", "dm_control", "gym_aloha", "launch"):
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_camera_node_does_not_load_torch(tmp_path):
    pytest.importorskip("rclpy")
    code = "import sys, vla_accel_ros.ros.camera_node; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], "importing the camera node loads torch"


def test_the_family_registry_declares_what_each_plug_in_does_and_lists_without_torch():
    """family_names(can=...) answers from the registry alone (no family module, no torch), and
    every declaration matches the plug-in it names."""
    from vla_accel_ros.models.family import CAPABILITIES, family_names, get_family

    code = ("import sys; from vla_accel_ros.models.family import CAPABILITIES, family_names; "
            "[family_names(can=c) for c in CAPABILITIES]; print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], "listing the families that can do something loads torch"
    for name in family_names():
        fam = get_family(name)
        declared = {c for c in CAPABILITIES if name in family_names(can=c)}
        actual = {c for c, has in (("train", fam.trainable), ("demo", hasattr(fam, "demo_spec")),
                                   ("import_lerobot", hasattr(fam, "import_lerobot"))) if has}  # fmt: skip
        assert declared == actual, name
    assert family_names(can="import_lerobot") == ("smolvla", "pi0", "pi05")


def test_a_family_without_a_capability_is_refused_naming_those_with_it():
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.models.factory import demo_spec

    with pytest.raises(ConfigError, match=r"family='pi0' has no random-weight demo bundles; families that do: ar, flow, smolvla, pi05"):
        demo_spec("pi0", "tiny")
