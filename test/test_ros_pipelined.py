"""policy_node ``trigger: pipelined`` in the graph: real nodes over DDS, the tiny ar bundle; the
stream's chunks come out depth - 1 frames after their observations, stamped with them, and the
pipeline shows in InferenceStats and /diagnostics."""

from __future__ import annotations

import pytest

rclpy = pytest.importorskip("rclpy")

from test_ros_graph import TIMEOUT, Probe, wait_for  # noqa: E402

import helpers  # noqa: E402
from vla_accel_ros.ros import bringup  # noqa: E402
from vla_accel_ros.ros.graph import POLICY, describe  # noqa: E402

pytestmark = pytest.mark.ros


def test_pipelined_trigger_streams_chunks_with_their_staleness(tiny_bundles, ros_params_file):
    with helpers.module_ros_context() as ctx:
        graph = describe(params_file=ros_params_file, bundle=tiny_bundles["ar"], shared_observations=False)
        graph = graph.with_parameters({POLICY: {"trigger": "pipelined", "pipeline_depth": 3}})
        running = bringup.start(graph, context=ctx, threads=6)
        probe = Probe(ctx)
        running.add_node("probe", probe)
        try:
            assert running.wait_ready(TIMEOUT) == ""
            wait_for(lambda: probe.count("stats") >= 4, what="4 pipelined inference stats")
            with probe.lock:
                stats = list(probe.stats)
                chunks = list(probe.chunks)
                frames = set(probe.frame_stamps)
            assert all(s.pipeline_depth == 3 and s.staleness_frames == 2 and s.staleness_ms > 0 for s in stats)
            assert all(c.request_id == 0 for c in chunks)  # streamed, not requested
            assert all(c.header.stamp.sec * 10**9 + c.header.stamp.nanosec in frames for c in chunks)
            wait_for(lambda: "pipeline depth" in probe.diagnostics.get(f"{POLICY}: policy", {}), what="pipeline diagnostics")
            assert probe.diagnostics[f"{POLICY}: policy"]["pipeline depth"] == "3"
        finally:
            running.shutdown()
