"""The robot's sensor topics coming in: whether their publishers are this robot's
(:class:`SourceCheck`) and the JointState subscriptions that feed a node's state
(:func:`subscribe_joint_states`)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from rclpy.callback_groups import CallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import JointState

from vla_accel_ros.core.robot import sources
from vla_accel_ros.core.robot.observation import StateGate
from vla_accel_ros.core.robot.sources import Publisher
from vla_accel_ros.core.robot.state import StateAssembler
from vla_accel_ros.ros import qos
from vla_accel_ros.ros.conversions import stamp_to_ns
from vla_accel_ros.ros.diagnostics import ERROR
from vla_accel_ros.ros.drops import capped


class SourceCheck:
    """Whether the publishers of this node's sensor topics all belong to its robot
    (:mod:`~vla_accel_ros.core.robot.sources`), asked when a message arrives: rclpy names no
    publisher per message, so the ROS graph's list of the topic's publishers (a local query,
    ~20 us) decides. ``accept()`` returns the ``accept_publishers`` parameter's current value."""

    def __init__(self, node: Node, accept: Callable[[], Sequence[str]]) -> None:
        self.node, self.accept = node, accept
        self.topics: list[str] = []  # resolved names, for diagnostics

    def watch(self, subscription) -> str:
        """Check ``subscription``'s topic; returns its resolved name (remappings applied)."""
        self.topics.append(subscription.topic_name)
        return subscription.topic_name

    def refusal(self, topic: str, *, arrived: bool = True) -> tuple[str, str]:
        """('', '') when a message of ``topic`` (resolved) may be used, else (reason, why not)."""
        infos = self.node.get_publishers_info_by_topic(topic)
        pubs = [Publisher(i.node_name, i.node_namespace) for i in infos]
        return sources.refusal(topic, self.node.get_namespace(), pubs, self.accept(), arrived=arrived)

    def problems(self) -> list[str]:
        """For /diagnostics: each watched topic's unexpected publishers now, one line per topic."""
        return [why for t in self.topics if (why := self.refusal(t, arrived=False)[1])]

    def diagnose(self, level: int, message: str) -> tuple[int, str]:
        """A node's /diagnostics level and message, ERROR while a sensor topic has an unexpected
        publisher (named first: its messages are refused, so the robot cannot run on them)."""
        problems = self.problems()
        if not problems:
            return level, message
        return ERROR, "; ".join(problems) + (f"; {message}" if message else "")


def subscribe_joint_states(
    node: Node,
    topics: Sequence[str],
    state: StateAssembler | StateGate,
    lock: threading.Lock,
    group: CallbackGroup,
    *,
    max_future_ms: Callable[[], float],
    drop: Callable[[str, str], None],
    check: SourceCheck,
) -> None:
    """Feed ``state`` from the robot's JointState topics (message stamp, else receive time).
    Each message is judged where it arrives, and refused whole, counted and named: stamped more
    than ``max_future_ms()`` ahead of the node's clock (``future_stamp``), on a topic with a
    publisher that is not this robot's or not identified yet (``unexpected_publisher``,
    ``unidentified_publisher``: ``check``), naming none of the
    topic's joints (``unexpected_joint_names``), or with a joint the state uses NaN / inf
    (``nonfinite_joint_state``): no state assembled from it can hold a non-finite value."""

    def on_joint_state(index: int, topic: str, msg: JointState) -> None:
        now = node.get_clock().now().nanoseconds
        stamp = stamp_to_ns(msg.header.stamp) or now
        limit = max_future_ms()
        if stamp - now > limit * 1e6:
            drop("future_stamp", f"{topic}: stamped {(stamp - now) / 1e6:.1f} ms ahead of the clock > max_future_ms {limit:g}")
            return
        reason, why = check.refusal(topic)
        if reason:
            drop(reason, why)
            return
        reason, detail = state.refusal(index, msg.name, msg.position)  # the config only: no lock
        if reason:
            drop(reason, f"{topic}: {capped(detail)}")
        if reason != "unexpected_joint_names":
            with lock:  # refused for NaN / inf, it merges nothing but notes which joints were, for the reject's reason
                state.update(index, msg.name, msg.position, stamp)

    for i, topic in enumerate(topics):
        resolved: list[str] = []  # filled below: the callback needs the name the subscription resolved
        sub = node.create_subscription(
            JointState, topic, lambda m, i=i, r=resolved: on_joint_state(i, r[0], m), qos.SENSOR, callback_group=group
        )
        resolved.append(check.watch(sub))
