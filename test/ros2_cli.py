"""`ros2 launch` and the `ros2` command from a colcon install space, as a ROS user runs them:
``source install/setup.bash``, then ``ros2 ...`` (test/test_ros2_launch*.py).

The upstream launch stack (launch, launch_ros, ros2cli: not on PyPI) comes from a sourced ROS 2
install or from ``../shared/ros2-jazzy`` (``make setup`` installs it into the venv when it is
beside the checkout); :func:`missing` says in one line what is absent, and the tests skip with it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# launch's default sigterm_timeout: `ros2 launch` escalates to SIGTERM this long after SIGINT.
LAUNCH_SIGINT_TIMEOUT_S = 5.0
# What `ros2 launch vla_accel_ros aloha.launch.py` needs besides rclpy (ros2launch is `ros2 launch`).
LAUNCH_STACK = ("launch", "launch_ros", "ros2cli", "ros2launch", "ros2node", "ros2param", "ros2topic", "composition_interfaces")
# A line Fast DDS logs itself (to stdout, in colour), e.g. "2026-11-28 19:48:11.194
# [RTPS_TRANSPORT_SHM Error] Failed init_port ...: open_and_lock_file failed": a long-lived
# machine's /dev/shm keeps stale port files, and the CLI then prints this before its answer.
DDS_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ \[RTPS_\w+ (Error|Warning|Info)\].*$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def without_dds_log(text: str) -> str:
    """``text`` without the lines Fast DDS logs itself: what the command answered."""
    return "".join(line for line in text.splitlines(keepends=True) if not DDS_LOG_LINE.match(ANSI.sub("", line)))


def missing() -> str:
    """'' when ``ros2 launch`` can run here, else one line saying what is missing."""
    if shutil.which("ros2", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        return ("no `ros2` command: neither a sourced ROS 2 install nor ../shared/ros2-jazzy beside the checkout "
                "(make setup installs its launch and ros2cli wheels into the venv)")  # fmt: skip
    absent = [m for m in LAUNCH_STACK if importlib.util.find_spec(m) is None]
    if absent:
        return f"`ros2` is there but {', '.join(absent)} cannot be imported by {sys.executable}"
    return ""


def underlay_env() -> dict[str, str]:
    """This venv as the ament prefix (its ROS 2 wheels and the launch stack) in front of any
    sourced ROS 2 install, its bin/ first on PATH; nothing from the test's own PYTHONPATH."""
    prefix = Path(sys.executable).parents[1]
    underlay = os.pathsep.join(p for p in (str(prefix), os.environ.get("AMENT_PREFIX_PATH", "")) if p)
    env = {**os.environ, "AMENT_PREFIX_PATH": underlay, "PATH": f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return env


class Ros2:
    """``ros2`` commands after ``source install/setup.bash``, on a ROS domain of their own kept
    on this machine. CLI calls pass ``--no-daemon`` where the verb has it: a ros2 daemon would
    outlive the test."""

    def __init__(self, install: Path) -> None:
        self.install = install
        self.domain = random.SystemRandom().randint(1, 100)
        self.env = {**underlay_env(), "ROS_DOMAIN_ID": str(self.domain), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
                    "PYTHONUNBUFFERED": "1", "RCUTILS_COLORIZED_OUTPUT": "0"}  # fmt: skip

    def argv(self, command: str) -> list[str]:
        return ["bash", "-c", f"source {shlex.quote(str(self.install))}/setup.bash && exec {command}"]

    def run(self, command: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return self.run_all([command], timeout)[0]

    def run_all(self, commands: list[str], timeout: float = 60.0, retries: int = 1) -> list[subprocess.CompletedProcess]:
        """Several commands at once: each spends its seconds waiting for discovery, not computing.
        A command still running after ``timeout`` is killed and run again (``retries`` times): the
        ros2 CLI waits without a limit for a service response, which a loaded machine can lose
        when the reply is sent before discovery matched the CLI's reader (seen once in ~30 runs
        of `ros2 param dump`, under a full test suite and a training job). Fast DDS's own log
        lines are left out of the outputs."""
        procs = [subprocess.Popen(self.argv(c), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
        done = []
        for command, p in zip(commands, procs):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                if retries > 0:
                    done.append(self.run_all([command], timeout, retries - 1)[0])
                    continue
                out, err = "", f"`{command}` did not end within {timeout:g} s"
            done.append(subprocess.CompletedProcess(p.args, p.returncode, without_dds_log(out), without_dds_log(err)))
        return done

    def run_for(self, command: str, seconds: float) -> str:
        """A command that runs until stopped (``ros2 topic hz``): its output after ``seconds``
        and a Ctrl-C."""
        proc = subprocess.Popen(self.argv(command), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(seconds)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        return out

    def launch(self, arguments: str) -> Launched:
        return Launched(self, f"ros2 launch vla_accel_ros aloha.launch.py {arguments}")

    def node_list(self, expected: set[str], timeout: float = 60.0) -> set[str]:
        """``ros2 node list`` until it shows ``expected`` (discovery takes a moment) or ``timeout``."""
        deadline, seen = time.monotonic() + timeout, set()
        while time.monotonic() < deadline:
            seen = set(self.run("ros2 node list --no-daemon --spin-time 2").stdout.split())
            if expected <= seen:
                break
            time.sleep(0.5)
        return seen


class Launched:
    """One ``ros2 launch`` process (its own session: a Ctrl-C to pytest does not reach it);
    its output is collected line by line."""

    def __init__(self, ros2: Ros2, command: str) -> None:
        self.command = command
        self.popen = subprocess.Popen(ros2.argv(command), env=ros2.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching ``pattern``; fails when the launch ends or after ``timeout``."""
        rx, deadline, i = re.compile(pattern), time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            while i < len(self.lines):
                m = rx.search(self.lines[i])
                i += 1
                if m:
                    return m
            if self.popen.poll() is not None and i >= len(self.lines):
                self._reader.join(timeout=5)
                if i >= len(self.lines):
                    raise AssertionError(f"`{self.command}` ended (code {self.popen.returncode}) before {pattern!r}:\n{self.output[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout:g} s from `{self.command}`:\n{self.output[-4000:]}")

    def interrupt(self, timeout: float = 60.0) -> tuple[int, float]:
        """Ctrl-C as a user gives it; (exit code, seconds until ``ros2 launch`` ended)."""
        t0 = time.monotonic()
        self.popen.send_signal(signal.SIGINT)
        code = self.popen.wait(timeout=timeout)
        elapsed = time.monotonic() - t0
        self._reader.join(timeout=10)
        return code, elapsed

    def kill(self) -> None:
        """Teardown: whatever still runs of this launch's process group ends."""
        if self.popen.poll() is None:
            try:
                self.interrupt(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
