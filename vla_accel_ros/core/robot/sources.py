"""Who may publish a robot's sensor topics (cameras, joint states).

Several robots can share one ROS domain, each graph in its own namespace. A subscriber cannot
tell which publisher sent a message (rclpy hands no publisher id to a callback), so the nodes
check the publishers the ROS graph lists for the topic when a message arrives and refuse the
message while any of them is not this robot's: data of two robots is never merged.

A publisher belongs to the robot whose graph runs in namespace ``own`` when

* its node's namespace is ``own`` or lies below it (``/r1``, ``/r1/follower_left``; for a graph in
  the root namespace only ``/`` itself, since every namespace lies below the root), or
* the topic lies in the publisher's own namespace: a driver publishing its own topics
  (``/follower_left/xs_sdk`` on ``/follower_left/joint_states``; a node in the root namespace
  may publish anywhere), or
* its namespace is one of ``accept`` or lies below one (the ``accept_publishers`` parameters).

Anything else, typically another robot's node publishing into this robot's topic, is
unexpected; so is a publisher whose node the graph has not named yet (discovery under way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from vla_accel_ros.core.errors import ConfigError

# What rmw reports for an endpoint whose node it has not learnt yet.
UNKNOWN_NAMESPACE = "_NODE_NAMESPACE_UNKNOWN_"
UNKNOWN_NAME = "_NODE_NAME_UNKNOWN_"


def within(name: str, namespace: str) -> bool:
    """``name`` (a topic or a namespace) is ``namespace`` or lies below it; all lies in ``/``."""
    ns = namespace.rstrip("/")
    return not ns or name == ns or name.startswith(ns + "/")


@dataclass(frozen=True)
class Publisher:
    node: str  # the node's name, as the graph lists it
    namespace: str  # its namespace (``/`` for the root)

    @property
    def known(self) -> bool:
        return self.node != UNKNOWN_NAME and self.namespace != UNKNOWN_NAMESPACE

    @property
    def fully_qualified(self) -> str:
        return f"{self.namespace.rstrip('/')}/{self.node}" if self.known else "an unidentified node"


def check_accept(name: str, accept: Sequence[str]) -> None:
    """``accept`` (a parameter called ``name``) holds absolute namespaces, or a ConfigError says why not."""
    bad = [a for a in accept if not a.startswith("/")]
    if bad:
        raise ConfigError(f"{name}={list(accept)}: {bad} are not absolute namespaces; write them as '/r1', '/follower_left', '/'")


def why_unexpected(topic: str, own: str, publisher: Publisher, accept: Iterable[str] = ()) -> str:
    """'' when ``publisher`` may publish ``topic`` (resolved) to the robot in namespace ``own``,
    else why not, in a few words."""
    if not publisher.known:
        return "its node is not identified yet"
    ns = publisher.namespace
    own_ns = own.rstrip("/")
    if (own_ns and within(ns, own_ns)) or ns.rstrip("/") == own_ns or within(topic, ns):
        return ""
    if any(within(ns, a) for a in accept):
        return ""
    return f"in namespace {ns}, neither this robot's ({own or '/'}) nor the topic's"


def refusal(topic: str, own: str, publishers: Sequence[Publisher], accept: Iterable[str] = (), *, arrived: bool = True) -> tuple[str, str]:
    """('', '') when every publisher of ``topic`` belongs to this robot; else (reason, one line
    naming the publishers that do not): then no message of ``topic`` is used, since which
    publisher sent it is unknown. ``unexpected_publisher``: the graph names a node that is not
    this robot's. ``unidentified_publisher``: it does not name the sender yet (discovery under
    way), a publisher without its node or, with a message at hand (``arrived``), no publisher at
    all (diagnostics ask with ``arrived=False``: a silent topic is not a publisher problem)."""
    if not publishers:
        if not arrived:
            return "", ""
        return "unidentified_publisher", (
            f"{topic}: the graph lists no publisher yet, so the sender is not identified; its messages are refused until it is"
        )  # fmt: skip
    accept = tuple(accept)
    bad = [(p, why) for p in publishers if (why := why_unexpected(topic, own, p, accept))]
    if not bad:
        return "", ""
    reason = "unexpected_publisher" if any(p.known for p, _ in bad) else "unidentified_publisher"
    named = ", ".join(f"{p.fully_qualified} ({why})" for p, why in bad)
    return reason, (f"{topic} has an unexpected publisher: {named}; its messages are refused until it is gone "
                    "(accept_publishers names namespaces to trust)")  # fmt: skip
