"""A real colcon build of the package in a workspace, and its install space.

colcon from PyPI (colcon-core, colcon-ros, colcon-cmake, colcon-python-setup-py,
colcon-package-selection; `make setup` installs them) builds the source tree as a ROS user's
``colcon build --packages-select vla_accel_ros`` would, with this venv's ROS 2 wheels as the
underlay (``AMENT_PREFIX_PATH``, as the Makefile's msg build). The install space must hold the
interfaces, the Python package, the node executables, the launch file and the config,
``setup.bash`` (colcon-bash) beside ``setup.sh``, and a node must start from it. ``ros2 launch``
from this install space: test_ros2_launch.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ros2_cli

NODES = ("camera_node", "policy_node", "action_controller_node", "aloha_sim_node", "synthetic_sensors_node", "recorder")

pytestmark = pytest.mark.ros


@pytest.fixture(scope="module")
def install(colcon_install) -> Path:
    return colcon_install


def _env() -> dict[str, str]:
    """This venv's ROS 2 wheels as the underlay (the venv is the ament prefix)."""
    return ros2_cli.underlay_env()


def _in_install(install: Path, command: str) -> list[str]:
    """bash for ``command`` after sourcing the install space's setup.sh, as a user would."""
    return ["bash", "-c", f". {install}/setup.sh && {command}"]


def test_install_space_holds_executables_launch_and_config(install):
    share = install / "vla_accel_ros" / "share" / "vla_accel_ros"
    lib = install / "vla_accel_ros" / "lib" / "vla_accel_ros"
    for node in NODES:
        exe = lib / node
        assert exe.is_file() and os.access(exe, os.X_OK), f"{exe} missing or not executable"
    assert (install / "setup.bash").is_file() and (install / "setup.sh").is_file()  # `source install/setup.bash`
    assert (share / "launch" / "aloha.launch.py").is_file()
    assert (share / "config" / "aloha.yaml").is_file()
    assert (share / "package.xml").is_file()
    assert (share / "msg" / "ActionChunk.msg").is_file()
    assert (install / "vla_accel_ros" / "share" / "ament_index" / "resource_index" / "packages" / "vla_accel_ros").is_file()


def test_python_package_and_interfaces_import_from_the_install_space(install):
    code = (
        "import vla_accel_ros, vla_accel_ros.msg as m, vla_accel_ros.kernels, vla_accel_ros.ros.policy_node\n"
        "from rclpy.serialization import serialize_message, deserialize_message\n"
        "from vla_accel_ros.ros.graph import default_params_file\n"
        "c = m.ActionChunk(chunk_id=3)\n"
        "assert deserialize_message(serialize_message(c), m.ActionChunk).chunk_id == 3\n"
        "print(vla_accel_ros.__file__); print(m.__file__); print(vla_accel_ros.ros.policy_node.__file__)\n"
        "print(default_params_file())\n"
    )
    out = subprocess.run(
        _in_install(install, f"{sys.executable} -c '{code}'"), cwd=install, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    paths = out.stdout.split()
    assert len(paths) == 4 and all(p.startswith(str(install)) for p in paths), paths


def test_a_node_starts_from_the_install_space_and_stops_on_ctrl_c(install):
    exe = install / "vla_accel_ros" / "lib" / "vla_accel_ros" / "camera_node"
    domain = random.SystemRandom().randint(1, 100)
    cmd = (f"ROS_DOMAIN_ID={domain} ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST exec {exe} "
           f"--ros-args --params-file {install}/vla_accel_ros/share/vla_accel_ros/config/aloha.yaml")  # fmt: skip
    proc = subprocess.Popen(_in_install(install, cmd), cwd=install, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "cameras cam_high" in line:
                break
        assert any("cameras cam_high" in ln for ln in lines), "".join(lines)[-3000:]
        time.sleep(1.0)  # the constructor has returned: the node spins
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "Traceback" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
