"""Single nodes under hostile input, over real DDS (issue 12): each test starts the real node
with its parameters and a probe node that plays the rest of the graph, no mocks."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from sensor_msgs.msg import CompressedImage  # noqa: E402

from vla_accel_ros.msg import Observation  # noqa: E402
from vla_accel_ros.ros import graph, qos  # noqa: E402
from vla_accel_ros.ros.common import drain_executor  # noqa: E402
import helpers  # noqa: E402  (test/helpers.py)
from test_robot_images import _bilevel_png  # noqa: E402

pytestmark = pytest.mark.ros
TIMEOUT = 60.0


@contextlib.contextmanager
def spinning(context, *nodes: Node):
    """Spin ``nodes`` on a MultiThreadedExecutor in a background thread; close and destroy them after."""
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    for n in nodes:
        executor.add_node(n)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set() and context.ok():
            executor.spin_once(timeout_sec=0.05)

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


def _collect(node: Node, msg_type, topic: str, profile) -> list:
    got: list = []
    node.create_subscription(msg_type, topic, got.append, profile)
    return got


def test_camera_node_refuses_a_compressed_frame_by_its_header_size(ros_context):
    from vla_accel_ros.ros.camera_node import CameraNode

    topic = "/cam_high/image/compressed"
    cam = CameraNode(
        context=ros_context,
        parameter_overrides=[
            Parameter("cameras", value=["cam_high"]), Parameter("topics", value=[topic]),
            Parameter("transports", value=["compressed"]), Parameter("image_size", value=16),
            Parameter("max_age_ms", value=60_000.0), Parameter("max_pixels", value=640 * 480),
        ],
    )  # fmt: skip
    probe = Node("probe", context=ros_context)
    pub = probe.create_publisher(CompressedImage, topic, qos.SENSOR)
    observations = _collect(probe, Observation, graph.OBSERVATION, qos.LATEST)

    def frame(png: bytes) -> CompressedImage:
        msg = CompressedImage(format="png", data=png)
        msg.header.stamp = probe.get_clock().now().to_msg()
        return msg

    huge, small = _bilevel_png(9000, 9000), _bilevel_png(64, 48)
    with spinning(ros_context, cam, probe):

        def sent_huge() -> bool:
            pub.publish(frame(huge))
            return cam.drops.counts.get("too_large", 0) >= 1

        helpers.wait_for(sent_huge, TIMEOUT, "the oversized frame to be refused")
        assert not observations and cam.frames["cam_high"] == 0

        def sent_small() -> bool:
            pub.publish(frame(small))
            return len(observations) >= 1

        helpers.wait_for(sent_small, TIMEOUT, "an observation from a frame within the bound")
        img = observations[0].images[0]
        assert (img.width, img.height) == (16, 16)
        # The bound is a parameter: lowered at run time, the small frame is refused too.
        assert cam.set_parameters([Parameter("max_pixels", value=64 * 47)])[0].successful
        before = cam.drops.counts.get("too_large", 0)

        def refused_small() -> bool:
            pub.publish(frame(small))
            return cam.drops.counts.get("too_large", 0) > before

        helpers.wait_for(refused_small, TIMEOUT, "the lowered bound to apply")
