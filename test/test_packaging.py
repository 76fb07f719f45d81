"""Packaging: versions agree, interfaces built by rosidl import and serialize, CLI entry point,
CI calls the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

import vla_accel_ros

REPO = Path(__file__).resolve().parents[1]


def test_versions_agree():
    xml = re.search(r"<version>([^<]+)</version>", (REPO / "package.xml").read_text()).group(1)
    assert xml == vla_accel_ros.__version__ == metadata.version("vla_accel_ros")


def test_generated_messages_roundtrip_through_rclpy_serialization():
    from rclpy.serialization import deserialize_message, serialize_message

    from vla_accel_ros.msg import ActionChunk, InferenceStats, MotionState

    msg = ActionChunk()
    msg.header.stamp.sec, msg.header.stamp.nanosec = 12, 345
    msg.chunk_id, msg.horizon, msg.action_dim, msg.dt = 7, 2, 3, 0.02
    msg.joint_names = ["a", "b", "c"]
    msg.actions = np.arange(6, dtype=np.float32).tolist()
    back = deserialize_message(serialize_message(msg), ActionChunk)
    assert back.chunk_id == 7 and list(back.actions) == list(range(6)) and back.header.stamp.nanosec == 345
    stats = InferenceStats(stage_names=["prefill"], stage_ms=[1.5], reset_reason="episode")
    assert deserialize_message(serialize_message(stats), InferenceStats).reset_reason == "episode"
    assert MotionState.FINE == 1 and MotionState.COARSE == 0


def test_cli_entry_point_is_installed():
    exe = Path(sys.executable).with_name("vla-accel")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "bundle" in out.stdout and "parity" in out.stdout


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make test" in ci and "make test" in readme
