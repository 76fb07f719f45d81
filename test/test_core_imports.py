"""The ROS-free core imports no rclpy; kernels ship inside the installed package."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, cwd) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_core_imports_without_rclpy(tmp_path):
    code = """
import importlib, pkgutil, sys
import vla_accel_ros
# ros: rclpy is checked apart; triton_ops needs triton, installed only for its own tests
skip = ("vla_accel_ros.ros", "vla_accel_ros.msg", "vla_accel_ros.kernels.triton_ops")
names = []
for m in pkgutil.walk_packages(vla_accel_ros.__path__, "vla_accel_ros."):
    if m.name.startswith(skip) or m.name.endswith("__main__"):
        continue
    importlib.import_module(m.name)
    names.append(m.name)
assert "vla_accel_ros.core.engine" in names and "vla_accel_ros.models.flow" in names, names
bad = sorted(n for n in sys.modules if n.split(".")[0] in ("rclpy", "rosidl_runtime_py", "launch", "launch_ros"))
print(len(names), bad)
assert not bad, bad
"""
    out = _run(code, tmp_path)
    assert int(out.split()[0]) >= 15


def test_kernels_are_importable_from_the_installed_package(tmp_path):
    out = _run(
        "import vla_accel_ros.kernels as k, importlib.util as u; "
        "print(k.__file__); print(k.get_kernels('cpu').name); print(u.find_spec('kernels') is None or "
        "'vla_accel_ros' not in (u.find_spec('kernels').origin or ''))",
        tmp_path,
    )
    path, name, no_toplevel = out.split()
    assert "site-packages" in path or "dist-packages" in path
    assert name == "reference" and no_toplevel == "True"
