"""The nodes' /diagnostics: status levels, a status's name (namespace and node, so robots on one
domain stay apart), a status with its key-value pairs, and the array a node publishes."""

from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.node import Node

from vla_accel_ros.ros.conversions import header

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def status_name(node: Node, component: str) -> str:
    """A status's name on /diagnostics, which every robot on the domain shares: the node's
    namespace and name (``r1/policy_node: policy``; ``policy_node: policy`` in the root one)."""
    return f"{node.get_fully_qualified_name().lstrip('/')}: {component}"


def status(name: str, level: int, message: str, values: dict[str, object], hardware_id: str = "") -> DiagnosticStatus:
    st = DiagnosticStatus(level=level, name=name, message=message, hardware_id=hardware_id)
    st.values = [KeyValue(key=k, value=_fmt(v)) for k, v in values.items()]
    return st


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def diagnostics(node: Node, statuses: list[DiagnosticStatus]) -> DiagnosticArray:
    arr = DiagnosticArray(header=header(node.get_clock().now().nanoseconds))
    arr.status = statuses
    return arr
