"""`vla-accel bringup` closes the loop without launch_ros: synthetic camera and arm, the tiny
flow bundle, the shipped parameter file (parity gate off), a few seconds, a clean exit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from vla_accel_ros.core.params_file import node_section

pytest.importorskip("rclpy")

pytestmark = pytest.mark.ros


def test_bringup_runs_each_node_in_its_own_process_records_and_exits_with_a_summary(tmp_path, tiny_bundles, ros_params_file):
    """The default layout is ros2 launch's (one process per node); the summary carries the
    control loop's rate and jitter percentiles, and counts what the bag holds (after the
    recorder's reorder buffer was written out)."""
    from vla_accel_ros.io.bag_reader import BagReader

    out, bag = tmp_path / "summary.json", tmp_path / "bag"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    cmd = [
        sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(ros_params_file),
        "--bundle", str(tiny_bundles["flow"]), "--synthetic-camera", "--duration", "3", "--record", str(bag),
        "--domain-id", str(random.SystemRandom().randint(1, 100)), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "policy ready" in proc.stdout and "controller" in proc.stdout and "jitter p50" in proc.stdout
    assert "observation age at inference start" in proc.stdout
    s = json.loads(out.read_text())
    assert s["duration_s"] >= 3.0
    assert s["camera_node"]["observations"] > 0
    assert s["policy_node"]["ready"] and s["policy_node"]["chunks"] > 0
    assert 0.0 <= s["policy_node"]["obs_age_p50_ms"] <= s["policy_node"]["obs_age_max_ms"] <= 100.0  # max_age_ms
    ctl = s["action_controller_node"]
    # Its counters (chunks in, requests, drops by reason) say why, should the loop command nothing.
    assert ctl["commands"] > 0, json.dumps(s, indent=1, default=str) + proc.stdout[-2000:]
    assert ctl["loop_rate_hz"] > 0 and 0.0 <= ctl["jitter_p50_ms"] <= ctl["jitter_p99_ms"]
    assert s["synthetic_sensors_node"]["frames"] > 0
    nodes = ("camera_node", "policy_node", "action_controller_node", "synthetic_sensors_node", "vla_recorder")
    pids = {s[n]["pid"] for n in nodes}
    assert len(pids) == len(nodes) and os.getpid() not in pids
    with BagReader(bag) as r:
        assert s["vla_recorder"]["messages"] == r.message_count > 0


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
    the arm holds; 'execute_last' commands each new action once, late. All nodes in one process
    (--one-process) here."""
    import yaml

    params = yaml.safe_load(ros_params_file.read_text())
    node_section(params, "action_controller_node")["stale_chunks"] = "execute_last"
    pfile = tmp_path / "ar.yaml"
    pfile.write_text(yaml.safe_dump(params))
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(pfile),
        "--bundle", str(tiny_bundles["ar"]), "--synthetic-camera", "--duration", "2", "--one-process",
        "--domain-id", str(random.SystemRandom().randint(1, 100)), "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["policy_node"]["chunks"] > 0 and s["action_controller_node"]["commands"] > 0, proc.stdout[-3000:]


def test_starting_a_graph_on_a_domain_leaves_this_process_environment_alone(tmp_path, ros_params_file, monkeypatch):
    """The children get --domain-id in their environment; the starter's own ROS_DOMAIN_ID (which
    every later context of this process would use) is not rewritten."""
    import dataclasses

    from vla_accel_ros.ros import processes
    from vla_accel_ros.ros.graph import describe

    monkeypatch.setenv("ROS_DOMAIN_ID", "17")
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    graph = dataclasses.replace(describe(params_file=ros_params_file), nodes=())  # the monitor only
    running = processes.start(graph, domain_id=random.SystemRandom().randint(101, 200), workdir=tmp_path)
    try:
        assert os.environ["ROS_DOMAIN_ID"] == "17"
    finally:
        running.stop()
    assert os.environ["ROS_DOMAIN_ID"] == "17"
