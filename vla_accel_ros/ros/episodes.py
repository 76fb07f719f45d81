"""Closed-loop episodes through the ROS graph: ``vla-accel eval --through-ros``.

The graph :func:`vla_accel_ros.ros.graph.describe` returns (with the simulator) is started by
the same starters as ``vla-accel bringup`` (:mod:`~vla_accel_ros.ros.bringup` in one process,
:mod:`~vla_accel_ros.ros.processes` one process per node); a watcher node of its own (its own
context and DDS participant, as any other observer on the domain) counts the simulator's
``/episode/success`` outcomes and keeps every ``inference_stats`` the policy node publishes.
Once ``episodes`` outcomes are in, the graph stops and the nodes' summaries (the simulator's
holds each episode's seed and best grade) come back with what the watcher saw.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from std_msgs.msg import Bool

from vla_accel_ros.core.errors import VlaAccelError
from vla_accel_ros.core.robot.topics import TopicLayout
from vla_accel_ros.msg import InferenceStats
from vla_accel_ros.ros import bringup, processes, qos
from vla_accel_ros.ros.graph import INFERENCE_STATS, SIM, Graph, relative


class GraphEpisodeError(VlaAccelError):
    """The graph did not run the episodes (the policy did not start, a node ended, a timeout)."""


@dataclass
class GraphEpisodes:
    summary: dict[str, object]  # the nodes' summaries, as ``vla-accel bringup --json`` writes them
    outcomes: list[bool] = field(default_factory=list)  # /episode/success, in order
    inference_ms: list[float] = field(default_factory=list)  # InferenceStats.total_ms, one per chunk
    startup_s: float = 0.0  # start to policy_node/ready
    wall_s: float = 0.0  # ready to the last outcome


class _Watcher:
    """The episodes' outcomes and the policy's statistics, as any subscriber on the graph sees them."""

    def __init__(self, namespace: str, domain_id: int | None) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[bool] = []
        self.inference_ms: list[float] = []
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = Node("vla_eval_watcher", context=self.context, namespace=namespace or None)
        # Keep every outcome even when this thread falls behind: an episode missed is a run that never ends.
        self.node.create_subscription(Bool, relative(TopicLayout().success_topic), self._outcome, qos.RELIABLE)
        self.node.create_subscription(InferenceStats, INFERENCE_STATS, self._stats, qos.STATS)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.halt = threading.Event()
        self.thread = threading.Thread(
            target=bringup.spin_until, args=(self.executor, self.context, self.halt), name="eval-watcher", daemon=True
        )
        self.thread.start()

    def _outcome(self, msg: Bool) -> None:
        with self.lock:
            self.outcomes.append(bool(msg.data))

    def _stats(self, msg: InferenceStats) -> None:
        with self.lock:
            self.inference_ms.append(float(msg.total_ms))

    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def close(self) -> None:
        self.halt.set()
        self.thread.join(timeout=10.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def run_episodes(
    graph: Graph,
    episodes: int,
    *,
    one_process: bool = False,
    domain_id: int | None = None,
    startup_timeout_s: float = 300.0,
    episode_timeout_s: float = 600.0,
    log: Callable[[str], None] = print,
) -> GraphEpisodes:
    """Start ``graph`` (which must hold the simulator), wait for ``episodes`` outcomes, stop it.

    Raises :class:`GraphEpisodeError` when the policy does not become ready within
    ``startup_timeout_s``, a node ends, or an episode takes longer than ``episode_timeout_s``
    of wall time."""
    if SIM not in {n.name for n in graph.nodes}:
        raise GraphEpisodeError("the graph has no aloha_sim_node: describe(sim=True)")
    # The watcher subscribes before the simulator publishes anything, so no outcome is missed.
    watcher = _Watcher(graph.namespace, domain_id)
    out = GraphEpisodes(summary={})
    running = None
    try:
        t0 = time.monotonic()
        running = (bringup if one_process else processes).start(graph, domain_id=domain_id, log=log)
        if SIM in running.skipped:
            raise GraphEpisodeError("aloha_sim_node could not start: the simulator (gym_aloha, dm_control) is not installed")
        why = running.wait_ready(startup_timeout_s)
        if why:
            raise GraphEpisodeError(why)
        ready = time.monotonic()
        out.startup_s = ready - t0
        done, last = 0, ready
        while done < episodes:
            time.sleep(0.05)
            n = watcher.count()
            if n > done:
                done, last = n, time.monotonic()
                log(f"  episode {done}/{episodes} ended")
            ended = running.exited()
            if ended:
                raise GraphEpisodeError(ended)
            if time.monotonic() - last > episode_timeout_s:
                raise GraphEpisodeError(f"no episode ended within {episode_timeout_s:g} s (episode {done + 1} of {episodes})")
        out.wall_s = time.monotonic() - ready
    finally:
        if running is not None:
            out.summary = running.stop()
        watcher.close()
    with watcher.lock:
        out.outcomes = watcher.outcomes[:episodes]
        out.inference_ms = list(watcher.inference_ms)
    return out
