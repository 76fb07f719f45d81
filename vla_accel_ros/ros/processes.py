"""Start the graph :func:`vla_accel_ros.ros.graph.describe` returns with each node in its own
process, as ``ros2 launch`` does (the default of ``vla-accel bringup``).

One process per node keeps the control loop away from inference: in one process the
controller's timer waits for the GIL behind the policy's Python between torch ops (measured:
39-41 Hz instead of 50, jitter up to ~300 ms, inference 174 ms p50 against 26 ms alone). Each
node runs ``python -m <its module>`` with the parameter file and, in a second parameter file
under the node's own name (which wins over the first, as launch_ros's node parameters do), the
description's overrides; observations go camera -> policy on the ``observation`` topic.

A small monitor node in this process follows ``policy_node/ready`` and ``/diagnostics``. The
nodes' statistics come from the nodes themselves (:func:`~vla_accel_ros.ros.spin.spin_node`):
SIGUSR1 resets them once the policy is ready, and each writes its ``summary()`` to a JSON file
when it stops (after its last message is written, for the recorder).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import rclpy
import yaml
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from std_msgs.msg import Bool

from vla_accel_ros.ros import qos
from vla_accel_ros.ros.bringup import spin_until, wait_until_ready
from vla_accel_ros.ros.executors import make_executor
from vla_accel_ros.ros.graph import POLICY, READY, Graph, NodeSpec
from vla_accel_ros.ros.spin import SUMMARY_OUT

STOP_TIMEOUT_S = 30.0  # a node that has not ended this long after Ctrl-C is killed


@dataclass
class NodeProcess:
    name: str
    popen: subprocess.Popen
    summary: Path


@dataclass
class ProcessGraph:
    """The nodes of one graph, one process each, and a monitor node in this process."""

    graph: Graph
    workdir: Path  # parameter overrides and summaries
    own_workdir: bool = False  # removed by stop()
    processes: dict[str, NodeProcess] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    started: float = 0.0
    domain_id: int | None = None  # the children's ROS_DOMAIN_ID (None: inherited)
    _context: Context | None = None
    _monitor: Node | None = None
    _executor: SingleThreadedExecutor | None = None
    _thread: threading.Thread | None = None
    _ready = False
    _policy_error = ""
    _policy_status = ""  # the name of this graph's policy status on /diagnostics

    # -- start ----------------------------------------------------------------------------------
    def spawn(self, name: str, module: str, parameters: dict[str, Any], remappings: tuple[tuple[str, str], ...] = ()) -> None:
        """``python -m module`` as node ``name`` with the parameter file and ``parameters``."""
        ns = f"/{self.graph.namespace}" if self.graph.namespace else ""
        overrides = self.workdir / f"{name}.yaml"
        overrides.write_text(yaml.safe_dump({f"{ns}/{name}": {"ros__parameters": parameters}}))
        summary = self.workdir / f"{name}.summary.json"
        cmd = [sys.executable, "-m", module, SUMMARY_OUT, str(summary), "--ros-args", "-r", f"__node:={name}"]
        if ns:
            cmd += ["-r", f"__ns:={ns}"]
        cmd += ["--params-file", self.graph.params_file, "--params-file", str(overrides)]
        for src, dst in remappings:
            cmd += ["-r", f"{src}:={dst}"]
        env = None if self.domain_id is None else {**os.environ, "ROS_DOMAIN_ID": str(self.domain_id)}
        popen = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509 - before any thread of ours runs
        self.processes[name] = NodeProcess(name, popen, summary)

    def add_recorder(self, name: str, module: str, node_class: str, parameters: dict[str, Any]) -> None:
        """One more node process (``node_class`` is the module's main's: unused here)."""
        self.spawn(name, module, parameters, self.graph.remappings)

    def _start_monitor(self, domain_id: int | None) -> None:
        self._context = Context()
        rclpy.init(context=self._context, domain_id=domain_id)
        node = self._monitor = Node("vla_bringup_monitor", context=self._context, namespace=self.graph.namespace or None)
        self._policy_status = f"{self.graph.namespace}/{POLICY}:".lstrip("/")  # as diagnostics.status_name names it
        node.create_subscription(Bool, f"{POLICY}/{READY.removeprefix('~/')}", self._on_ready, qos.LATCHED)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, qos.RELIABLE)
        self._executor = make_executor(1, self._context)
        self._executor.add_node(node)
        self._thread = threading.Thread(
            target=spin_until, args=(self._executor, self._context, threading.Event()), name="bringup-monitor", daemon=True
        )
        self._thread.start()

    def _on_ready(self, msg: Bool) -> None:
        self._ready = self._ready or bool(msg.data)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        for st in msg.status:
            # /diagnostics is shared by every robot on the domain: this graph's policy only.
            if st.name.startswith(self._policy_status) and _level(st) == DiagnosticStatus.ERROR:
                self._policy_error = st.message

    # -- run --------------------------------------------------------------------------------------
    def exited(self) -> str:
        """'' while every node runs, else which one ended and how."""
        for p in self.processes.values():
            code = p.popen.poll()
            if code is not None:
                return f"{p.name} exited with code {code}"
        return ""

    def wait_ready(self, timeout: float) -> str:
        """Wait until the policy node is ready; '' when it is, else why not."""
        if POLICY not in self.processes:
            return ""
        def why_not() -> str:
            return f"the policy did not start: {self._policy_error}" if self._policy_error else self.exited()

        return wait_until_ready(lambda: self._ready, why_not, timeout)

    def reset_stats(self) -> None:
        """Every node zeroes its counters (the summary then covers only what follows)."""
        for p in self.processes.values():
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGUSR1)
        self.started = time.monotonic()

    def stop(self) -> dict[str, object]:
        """Ctrl-C to every node, wait for each to end, and their summaries."""
        elapsed = time.monotonic() - self.started
        for p in self.processes.values():
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGINT)
        out: dict[str, object] = {"duration_s": elapsed}
        for p in self.processes.values():
            try:
                p.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            if p.summary.is_file():
                out[p.name] = json.loads(p.summary.read_text())
        if self._context is not None:
            rclpy.try_shutdown(context=self._context)
            if self._thread is not None:
                self._thread.join(timeout=5.0)
            self._monitor.destroy_node()
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return out


def start(graph: Graph, *, domain_id: int | None = None, log: Callable[[str], None] = print, workdir: Path | None = None) -> ProcessGraph:
    """Start every available node of ``graph`` in a process of its own."""
    running = ProcessGraph(
        graph=graph, workdir=Path(workdir or tempfile.mkdtemp(prefix="vla_bringup_")), own_workdir=workdir is None,
        domain_id=domain_id,
    )  # fmt: skip
    try:
        # The children get the domain in their environment; this process's stays as it was.
        running._start_monitor(domain_id if domain_id is not None else _int(os.environ.get("ROS_DOMAIN_ID")))  # noqa: SLF001
        for spec in graph.nodes:
            if spec.optional and not spec.available():
                log(f"skipping {spec.name}: module {spec.module} is not installed yet")
                running.skipped.append(spec.name)
                continue
            running.spawn(spec.name, spec.module, _parameters(graph, spec), spec.remappings)
    except BaseException:
        running.stop()
        raise
    running.started = time.monotonic()
    return running


def _parameters(graph: Graph, spec: NodeSpec) -> dict[str, Any]:
    return {**spec.parameters, "use_sim_time": graph.use_sim_time}


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _level(st: DiagnosticStatus) -> int:
    return st.level[0] if isinstance(st.level, (bytes, bytearray)) else int(st.level)


def _die_with_parent() -> None:
    """In the child: end (SIGTERM, an orderly stop) when bringup itself dies, even by SIGKILL."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
