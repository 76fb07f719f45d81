"""Start the graph :func:`vla_accel_ros.ros.graph.describe` returns, in this process, without
launch_ros: one rclpy context, every node with its own callback groups, one
MultiThreadedExecutor, the parameter file passed exactly as ``ros2 launch`` passes it
(``--ros-args --params-file``) plus the description's overrides. ``vla-accel bringup
--one-process`` and the tests use it; ``vla-accel bringup`` runs each node in its own process
(:mod:`vla_accel_ros.ros.processes`), with the same interface (``wait_ready``, ``reset_stats``,
``exited``, ``stop``) and the same :func:`format_summary`.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import rclpy
from rclpy.context import Context
from rclpy.executors import Executor, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter

from vla_accel_ros.core.robot.observation import SharedChannels
from vla_accel_ros.ros.executors import drain_executor, make_executor
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, SIM, Graph, NodeSpec
from vla_accel_ros.ros.process_tuning import prefer_responsive_threads, return_freed_frames_to_the_system


def node_kwargs(graph: Graph, spec: NodeSpec, context: Context) -> dict:
    """What ``ros2 launch`` would give the node: name, namespace, parameter file, overrides."""
    overrides = [Parameter(k, value=v) for k, v in spec.parameters.items()]
    overrides.append(Parameter("use_sim_time", value=graph.use_sim_time))
    kwargs = dict(
        node_name=spec.name,
        context=context,
        cli_args=["--ros-args", "--params-file", graph.params_file, *(a for src, dst in spec.remappings for a in ("-r", f"{src}:={dst}"))],
        parameter_overrides=overrides,
    )
    if graph.namespace:
        kwargs["namespace"] = graph.namespace
    return kwargs


@dataclass
class RunningGraph:
    """The nodes of one graph in this process, spinning on a background thread."""

    graph: Graph
    context: Context
    nodes: dict[str, Node] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    executor: MultiThreadedExecutor | None = None
    thread: threading.Thread | None = None
    halt: threading.Event = field(default_factory=threading.Event)  # ends the spin thread
    started: float = 0.0
    threads: int = 8  # of the executor's callback pool

    def add_node(self, name: str, node: Node) -> None:
        """Run one more node (not of the description, e.g. a recorder) on this graph's executor."""
        self.nodes[name] = node
        self.executor.add_node(node)

    def add_recorder(self, name: str, module: str, node_class: str, parameters: dict) -> None:
        """One more node of ``module.node_class`` named ``name`` with ``parameters``."""
        cls = getattr(importlib.import_module(module), node_class)
        kwargs = dict(node_name=name, context=self.context, parameter_overrides=[Parameter(k, value=v) for k, v in parameters.items()],
                      cli_args=["--ros-args", *(a for src, dst in self.graph.remappings for a in ("-r", f"{src}:={dst}"))])
        if self.graph.namespace:
            kwargs["namespace"] = self.graph.namespace
        self.add_node(name, cls(**kwargs))

    def exited(self) -> str:
        """'' while the graph spins, else what stopped."""
        return "" if self.thread is None or self.thread.is_alive() else "the executor stopped"

    def stop(self) -> dict[str, object]:
        """Close every node (workers stop, the recorder writes what it buffered), then their
        summaries, then shut down: a summary counts what the bag holds."""
        for node in self.nodes.values():
            close = getattr(node, "close", None)
            if close is not None:
                close()
        out = self.summary()
        self.shutdown()
        return out

    def stop_node(self, name: str) -> None:
        """Stop one node while the others keep running (tests: a policy that dies).

        The executor is retired and the others move to a fresh one: rclpy's executor can resume
        a wait-set build from a node list taken before ``remove_node`` (it yields queued tasks
        first), so destroying a node under a live executor can raise InvalidHandle in the spin
        thread and stop every other node's callbacks. No amount of waiting makes that safe."""
        node = self.nodes.pop(name)
        close = getattr(node, "close", None)
        if close is not None:
            close()
        self._stop_spinning()
        node.destroy_node()
        self._start_spinning()

    def _stop_spinning(self) -> None:
        self.halt.set()
        if self.thread is not None:
            self.thread.join(timeout=10.0)
            if self.thread.is_alive():
                raise RuntimeError("the executor thread did not stop within 10 s")
        if self.executor is not None:
            drain_executor(self.executor)

    def _start_spinning(self) -> None:
        self.executor = make_executor(self.threads, self.context)
        for node in self.nodes.values():
            self.executor.add_node(node)
        self.halt = threading.Event()
        self.thread = threading.Thread(
            target=spin_until, args=(self.executor, self.context, self.halt), name="bringup-executor", daemon=True
        )
        self.thread.start()

    def shutdown(self) -> None:
        """Stop the workers, stop spinning, then destroy the nodes and the context."""
        for node in self.nodes.values():
            close = getattr(node, "close", None)
            if close is not None:
                close()
        self.halt.set()
        if self.thread is not None:
            self.thread.join(timeout=10.0)
        if self.executor is not None:
            drain_executor(self.executor)
        for node in self.nodes.values():
            node.destroy_node()
        self.nodes.clear()
        rclpy.try_shutdown(context=self.context)
        SharedChannels.drop(self.context)

    def wait_ready(self, timeout: float) -> str:
        """Wait until the policy node is ready; '' when it is, else why not (failed, timed out,
        no policy node in this graph)."""
        policy = self.nodes.get(POLICY)
        if policy is None:
            return ""
        return wait_until_ready(
            lambda: policy.ready, lambda: f"the policy did not start: {policy.failure}" if policy.failure else "", timeout
        )

    def reset_stats(self) -> None:
        """Zero the nodes' counters (the summary then covers only what follows)."""
        for node in self.nodes.values():
            fn = getattr(node, "reset_stats", None)
            if fn is not None:
                fn()
        self.started = time.monotonic()

    def summary(self) -> dict[str, object]:
        elapsed = time.monotonic() - self.started
        out: dict[str, object] = {"duration_s": elapsed}
        for name, node in self.nodes.items():
            fn = getattr(node, "summary", None)
            if fn is not None:
                out[name] = fn()
        return out


def start(
    graph: Graph,
    *,
    domain_id: int | None = None,
    log: Callable[[str], None] = print,
    context: Context | None = None,
    threads: int = 8,
) -> RunningGraph:
    """Create every available node of ``graph`` and spin them on a background thread."""
    prefer_responsive_threads()
    return_freed_frames_to_the_system()
    if context is None:
        context = Context()
        rclpy.init(context=context, domain_id=domain_id)
    running = RunningGraph(graph=graph, context=context)
    try:
        for spec in graph.nodes:
            if spec.optional and not spec.available():
                log(
                    f"skipping {spec.name}: module {spec.module} is not installed yet "
                    "(no frames will come from it; --synthetic-camera closes the loop without a simulator)"
                )
                running.skipped.append(spec.name)
                continue
            module = importlib.import_module(spec.module)
            cls = getattr(module, spec.node_class, None)
            if cls is None:
                raise ImportError(
                    f"{spec.module} has no {spec.node_class}: the graph description (vla_accel_ros.ros.graph) "
                    f"expects that Node subclass for {spec.name}"
                )
            running.nodes[spec.name] = cls(**node_kwargs(graph, spec, context))
        running.threads = threads
        running.started = time.monotonic()
        running._start_spinning()
    except BaseException:
        running.shutdown()
        raise
    return running


def wait_until_ready(ready: Callable[[], bool], why_not: Callable[[], str], timeout: float) -> str:
    """Poll until ``ready()``: '' then; ``why_not()`` as soon as it says something (the policy
    failed, a process ended); a timeout message after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return ""
        why = why_not()
        if why:
            return why
        time.sleep(0.05)
    return f"the policy was not ready after {timeout:g} s"


def spin_until(executor: Executor, context: Context, halt: threading.Event) -> None:
    """``executor.spin()`` that can be stopped from another thread (``halt``) without shutting
    the executor down under running callbacks (see :func:`drain_executor`)."""
    try:
        while not halt.is_set() and context.ok():
            executor.spin_once(timeout_sec=0.1)
    except rclpy.executors.ExternalShutdownException:
        pass


def format_summary(s: dict[str, object]) -> str:
    """The ``--duration`` report: what flowed through the graph and how fast."""
    cam = s.get(CAMERA, {}) or {}
    pol = s.get(POLICY, {}) or {}
    ctl = s.get(CONTROLLER, {}) or {}
    dur = float(s.get("duration_s", 0.0))
    lines = [f"ran {dur:.1f} s"]
    if cam:
        lines.append(
            f"camera      {cam.get('frames', 0)} frames in, {cam.get('observations', 0)} observations, {cam.get('dropped', 0)} dropped"
        )
    if pol:
        lines.append(
            f"policy      ready={pol.get('ready')}, {pol.get('chunks', 0)} chunks, inference p50 {_ms(pol.get('infer_p50_ms'))}, "
            f"obs->chunk p50 {_ms(pol.get('latency_p50_ms'))}, observation age at inference start "
            f"p50/max {_ms(pol.get('obs_age_p50_ms'))}/{_ms(pol.get('obs_age_max_ms'))}, errors {pol.get('errors', 0)}"
            + (f", dropped {pol['dropped']}" if pol.get("dropped") else "")
        )
    if ctl:
        cmds = int(ctl.get("commands", 0))
        lines.append(
            f"controller  {ctl.get('ticks', 0)} ticks at {float(ctl.get('loop_rate_hz', 0.0)):.1f} Hz "
            f"(jitter p50 {float(ctl.get('jitter_p50_ms', 0.0)):.2f} ms, p99 {float(ctl.get('jitter_p99_ms', 0.0)):.2f} ms, "
            f"max {float(ctl.get('jitter_max_ms', 0.0)):.1f} ms), "
            f"{ctl.get('chunks', 0)} chunks in, {ctl.get('requests', 0)} requests, {cmds} commands "
            f"({cmds / dur if dur else 0.0:.1f}/s), holding {100 * float(ctl.get('holding_fraction', 0.0)):.1f} %, "
            f"obs->chunk p50/p95 {_ms(ctl.get('latency_p50_ms'))}/{_ms(ctl.get('latency_p95_ms'))}, "
            f"watchdog trips {ctl.get('watchdog_trips', 0)}, mode {ctl.get('motion_mode')}"
            + (f", late actions {ctl['late_actions']}" if ctl.get("late_actions") else "")
            + (f", dropped {ctl['dropped']}" if ctl.get("dropped") else "")
        )
    sim = s.get(SIM, {}) or {}
    if sim:
        # Under use_sim_time the controller's latencies are sim time; the simulator measures
        # both clocks (it knows when each frame left it, in wall time).
        lines.append(
            f"sim         {sim.get('steps', 0)} steps = {float(sim.get('sim_s', 0.0)):.1f} s sim in "
            f"{float(sim.get('wall_s', 0.0)):.1f} s wall (real-time factor {float(sim.get('real_time_factor', 0.0)):.2f}); "
            f"control {float(sim.get('command_rate_sim_hz', 0.0)):.1f} Hz sim / {float(sim.get('command_rate_wall_hz', 0.0)):.1f} Hz wall "
            f"({sim.get('commands', 0)} commands, {sim.get('lockstep_timeouts', 0)} steps without one); "
            f"obs->chunk p50/p95 {_ms(sim.get('obs_to_chunk_sim_p50_ms'))}/{_ms(sim.get('obs_to_chunk_sim_p95_ms'))} sim, "
            f"{_ms(sim.get('obs_to_chunk_wall_p50_ms'))}/{_ms(sim.get('obs_to_chunk_wall_p95_ms'))} wall "
            f"({sim.get('chunks_measured', 0)} chunks); {sim.get('frames', 0)} frames"
        )
        lines.append(
            f"episodes    now #{sim.get('episode')} at step {sim.get('episode_step')}, reward {sim.get('reward')}; "
            f"{sim.get('episodes_finished', 0)} finished, {sim.get('successes', 0)} successes, best reward {sim.get('best_reward')}"
            + (f"; FAILED: {sim.get('failure')}" if sim.get("failure") else "")
        )
    for name, v in s.items():
        if name not in (CAMERA, POLICY, CONTROLLER, SIM, "duration_s") and isinstance(v, dict):
            lines.append(f"{name:<11} " + ", ".join(f"{k} {val}" for k, val in v.items()))
    return "\n".join(lines)


def _ms(v: object) -> str:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if f != f else f"{f:.1f} ms"
