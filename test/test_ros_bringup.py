"""`vla-accel bringup` closes the loop without launch_ros: synthetic camera and arm, the tiny
flow bundle, the shipped parameter file (parity gate off), a few seconds, a clean exit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")

pytestmark = pytest.mark.ros


def test_bringup_runs_the_closed_loop_and_exits_with_a_summary(tmp_path, tiny_bundles, ros_params_file):
    out = tmp_path / "summary.json"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    cmd = [
        sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(ros_params_file),
        "--bundle", str(tiny_bundles["flow"]), "--synthetic-camera", "--duration", "3",
        "--domain-id", str(random.SystemRandom().randint(1, 100)), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "policy ready" in proc.stdout and "controller" in proc.stdout
    s = json.loads(out.read_text())
    assert s["duration_s"] >= 3.0
    assert s["camera_node"]["observations"] > 0
    assert s["policy_node"]["ready"] and s["policy_node"]["chunks"] > 0
    assert s["action_controller_node"]["commands"] > 0 and s["action_controller_node"]["loop_rate_hz"] > 0
    assert s["synthetic_sensors_node"]["frames"] > 0


def test_bringup_says_why_the_policy_did_not_start(tmp_path, ros_params_file):
    cmd = [
        sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(ros_params_file),
        "--bundle", str(tmp_path), "--duration", "1", "--domain-id", str(random.SystemRandom().randint(1, 100)),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "not a bundle" in proc.stdout + proc.stderr


def test_an_autoregressive_bundle_commands_with_stale_chunks_execute_last(tmp_path, tiny_bundles, ros_params_file):
    """A 1-action chunk is in the past when it lands (honest stamps): with the default 'drop'
    the arm holds; 'execute_last' commands each new action once, late."""
    import yaml

    params = yaml.safe_load(ros_params_file.read_text())
    params["action_controller_node"]["ros__parameters"]["stale_chunks"] = "execute_last"
    pfile = tmp_path / "ar.yaml"
    pfile.write_text(yaml.safe_dump(params))
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(pfile),
        "--bundle", str(tiny_bundles["ar"]), "--synthetic-camera", "--duration", "2",
        "--domain-id", str(random.SystemRandom().randint(1, 100)), "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["policy_node"]["chunks"] > 0 and s["action_controller_node"]["commands"] > 0
