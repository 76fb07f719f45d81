"""Helpers the tests share (importable because pytest puts test/ on sys.path)."""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

# Reference fixtures too large for the repository, in ../shared beside the checkout. CI has them
# and sets REQUIRE_SHARED=1 (.ci/run): there a missing one fails the tests that need it.
SHARED_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
REQUIRE_SHARED = "VLA_ACCEL_REQUIRE_SHARED"


def shared_fixture(name: str, untested: str) -> Path:
    """``../shared/fixtures/<name>``; when it is missing, a skip that says what goes untested
    without it (a failure where the environment sets ``VLA_ACCEL_REQUIRE_SHARED=1``)."""
    import pytest

    path = SHARED_FIXTURES / name
    if not path.is_dir():
        why = f"{path} is missing (../shared beside the checkout; CI has it): {untested} untested"
        if os.environ.get(REQUIRE_SHARED) == "1":
            pytest.fail(f"{REQUIRE_SHARED}=1: {why}", pytrace=False)
        pytest.skip(why)
    return path


# One ALOHA follower arm as its JointState names it, at the start pose (rad; fingers in m).
ARM = ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper", "left_finger", "right_finger"]
START = [0.0, -0.96, 1.16, 0.0, -0.3, 0.0, 1.1, 0.05, -0.05]


def publish_joint_states(node, publishers) -> None:
    """One JointState per arm publisher, both arms at the start pose, stamped with ``node``'s clock."""
    from sensor_msgs.msg import JointState

    now = node.get_clock().now().to_msg()
    for pub in publishers:
        msg = JointState(name=ARM, position=START)
        msg.header.stamp = now
        pub.publish(msg)


def wait_for(cond, timeout: float, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def record_sim_bag(out, episodes: int, steps: int):
    """Scripted transfer_cube episodes through `vla-accel sim record`, top camera at 240x320."""
    from vla_accel_ros.cli import main

    argv = ["sim", "record", "--task", "transfer_cube", "--episodes", str(episodes), "--steps", str(steps),
            "--cameras", "top", "--height", "240", "--width", "320", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


def still_bag(tmp_path, *, camera: str, joints: bool):
    """Four black 48 x 64 frames of one camera, with or without joint states (0.5 rad)."""
    import numpy as np

    from vla_accel_ros.core.robot.state import state_to_joint_states
    from vla_accel_ros.core.robot.topics import TopicLayout
    from vla_accel_ros.io.bag_file import robot_for
    from vla_accel_ros.io.bag_writer import BagWriter

    robot = robot_for(TopicLayout())  # the topics a bag reader takes the state from
    path = tmp_path / f"bag_{camera}_{joints}"
    with BagWriter(path) as w:
        for i in range(4):
            stamp = 1_000_000_000 + i * 20_000_000
            w.write_image(f"/{camera}/camera/color/image_rect_raw", stamp, np.zeros((48, 64, 3), np.uint8))
            if joints:
                msgs = state_to_joint_states(robot, np.full(robot.dim, 0.5))
                for topic, (names, pos, vel) in zip(robot.joint_state_topics, msgs):
                    w.write_joint_state(topic, stamp, names, pos, vel)
    return path


@contextlib.contextmanager
def context_on(domain: int):
    """An rclpy context of its own (its own DDS participant) on ``domain``, shut down after."""
    import rclpy
    from rclpy.context import Context

    ctx = Context()
    rclpy.init(context=ctx, domain_id=domain)
    try:
        yield ctx
    finally:
        rclpy.try_shutdown(context=ctx)


@contextlib.contextmanager
def module_ros_context(domain: int | None = None):
    """:func:`context_on` ``domain`` (default: a random one) kept on this machine, for
    module-scoped graphs (the function-scoped ``ros_context`` fixture cannot serve them); the
    environment is restored after."""
    domain = random.SystemRandom().randint(1, 100) if domain is None else domain
    saved = {k: os.environ.get(k) for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")}
    os.environ.update(ROS_DOMAIN_ID=str(domain), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    try:
        with context_on(domain) as ctx:
            yield ctx
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def spinning(context, *nodes):
    """Spin ``nodes`` on a MultiThreadedExecutor in a background thread; close and destroy them after."""
    import threading

    from rclpy.executors import MultiThreadedExecutor

    from vla_accel_ros.ros.executors import drain_executor

    executor = MultiThreadedExecutor(num_threads=4, context=context)
    for n in nodes:
        executor.add_node(n)
    stop = threading.Event()

    def spin() -> None:
        from rclpy._rclpy_pybind11 import InvalidHandle

        while not stop.is_set() and context.ok():
            try:
                executor.spin_once(timeout_sec=0.05)
            except InvalidHandle:
                # A test destroyed a publisher or client of a spun node while rclpy built its
                # wait set from the entity list taken before: the next spin builds it anew. Let
                # through, it would end this thread and every later callback of the module.
                continue

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield executor
    finally:
        for n in nodes:
            close = getattr(n, "close", None)
            if close is not None:
                close()
        stop.set()
        thread.join(timeout=10)
        drain_executor(executor)
        for n in nodes:
            n.destroy_node()


def bringup_summary(bundle, params_file, cwd, duration: float = 4.0, *, one_process: bool = True) -> dict:
    """``vla-accel bringup --synthetic-camera [--one-process]`` on ``bundle`` for ``duration``
    seconds (a random domain, discovery on this machine); its JSON summary, after checking that
    the policy node ran the bundle and an action of the policy reached the arm. The controller runs
    ``stale_chunks: execute_last``: a tiny imported bundle's chunk (10 actions, 200 ms) can be
    shorter than its latency on a loaded CPU, and with the default ``drop`` none of it would run
    (the commands counted would be the watchdog's hold)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from vla_accel_ros.core.params_file import node_section

    params = yaml.safe_load(Path(params_file).read_text())
    node_section(params, "action_controller_node")["stale_chunks"] = "execute_last"
    late_params = Path(cwd) / "bringup_params.yaml"
    late_params.write_text(yaml.safe_dump(params))
    out = Path(cwd) / "summary.json"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    cmd = [sys.executable, "-m", "vla_accel_ros.cli", "bringup", "--params", str(late_params), "--bundle", str(bundle),
           "--synthetic-camera", "--duration", str(duration), *(["--one-process"] if one_process else []),
           "--domain-id", str(random.SystemRandom().randint(1, 100)), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["policy_node"]["ready"] and s["policy_node"]["chunks"] > 0, s["policy_node"]
    ctl = s["action_controller_node"]
    # Some tick ran a planned action (on time, or a chunk's last one late), not only the hold.
    assert ctl["commands"] > 0 and ctl["holding_fraction"] < 1.0, ctl
    return s


def assert_same_actions_on_gate_frames(eager, other, atol: float = 1e-5):
    """``other`` (e.g. with a compiled step) gives ``eager``'s actions on the gate's two frames
    (the second with a moving block), with the gate's noise. Returns (first frame, noise, the
    last chunk)."""
    import numpy as np

    from vla_accel_ros.core.parity import changed_observation, fixed_observation, gate_noise

    obs = fixed_observation(eager.spec)
    noise = gate_noise(eager)
    for frame in (obs, changed_observation(obs, eager.spec)):
        a, c = eager.infer(frame, noise=noise), other.infer(frame, noise=noise)
        np.testing.assert_allclose(c.actions, a.actions, atol=atol)
    return obs, noise, a
