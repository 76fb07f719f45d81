"""Small pieces every node shares: the spin entry point, diagnostics helpers, drop counters."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.callback_groups import CallbackGroup
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import JointState

from vla_accel_ros.core.robot import sources
from vla_accel_ros.core.robot.observation import StateGate
from vla_accel_ros.core.robot.sources import Publisher
from vla_accel_ros.core.robot.state import StateAssembler
from vla_accel_ros.ros import qos
from vla_accel_ros.ros.conversions import header, stamp_to_ns

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR

# The control loop's timer thread needs the GIL within a fraction of its 20 ms period while the
# inference thread runs Python between torch ops; CPython's default switch interval (5 ms) makes
# it wait behind that thread several times per tick. 1 ms measured lower jitter (bringup, 2 cores).
GIL_SWITCH_INTERVAL_S = 0.001

MAX_LOGGED_CHARS = 200  # a text from the outside world is logged at most this long


def capped(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` for a log line: at most ``limit`` characters, saying how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def prefer_responsive_threads() -> None:
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


# glibc serves blocks of at least this size with mmap, so they go back to the system when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def return_freed_frames_to_the_system() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (its default, which glibc
    otherwise raises up to 32 MB each time a large block is freed). Without this, after the
    first frames are freed every later frame-sized buffer (decoded images, conversions, on up
    to 8 callback threads) comes from the heap arenas, and a storm of frames leaves hundreds of
    MB with the process for good (measured: a camera node 81 -> 413 MB, still 413 MB 30 s
    later). Returns whether it applied (glibc only)."""
    import ctypes  # noqa: PLC0415

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


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


class DropCounter:
    """Counts dropped inputs by reason and logs each reason at most once per throttle period
    (throttled per reason, so a flood of one kind cannot hide another). Callbacks on any thread
    drop; diagnostics read :meth:`snapshot` (a copy taken under the lock, never the live counter)."""

    def __init__(self, node: Node, what: str, throttle_s: float) -> None:
        self.node, self.what, self.throttle_s = node, what, throttle_s
        self.counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def drop(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            n = self.counts[reason]
            last = self._logged.get(reason)
            log = last is None or now - last >= self.throttle_s
            if log:
                self._logged[reason] = now
        if log:
            self.node.get_logger().warning(f"dropped {self.what} ({reason}, {n} so far): {capped(detail, 3 * MAX_LOGGED_CHARS)}")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def clear(self) -> None:
        with self._lock:
            self.counts.clear()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())



def drain_executor(executor: MultiThreadedExecutor, timeout_s: float | None = None) -> list[str]:
    """Shut ``executor`` down after it stopped spinning, so nodes can then be destroyed with no
    callback running. Callbacks already handed to its thread pool finish first: each one
    triggers the executor's guard condition when it ends, and rclpy 7's ``shutdown`` destroys
    that guard without waiting for them (its wait is skipped once the shutdown flag is set), so a
    late callback would raise into a future nobody reads ("exception was never retrieved").

    ``timeout_s`` bounds the wait for the pool's threads (None: as long as they take). Returns
    what still runs then, one line per thread (its innermost frames), or [] when every callback
    finished. A thread left running is not waited for here, but the interpreter still joins it
    at exit (concurrent.futures' atexit hook): the caller decides what to do about it."""
    pool = getattr(executor, "_executor", None)  # MultiThreadedExecutor's ThreadPoolExecutor
    running: list[str] = []
    if pool is not None and hasattr(pool, "shutdown"):
        threads = list(getattr(pool, "_threads", ()))
        pool.shutdown(wait=timeout_s is None)
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            running = [_where(t) for t in threads if t.is_alive()]
    executor.shutdown(timeout_sec=0.0 if running else (5.0 if timeout_s is None else timeout_s))
    return running


def _where(thread: threading.Thread, depth: int = 4) -> str:
    """``thread``'s name and innermost ``depth`` frames, innermost first, on one line."""
    frame = sys._current_frames().get(thread.ident or -1)
    stack = traceback.extract_stack(frame)[-depth:] if frame is not None else []
    return f"{thread.name}: " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))


# How long spin_node waits for callbacks still running once the node closed: they take
# milliseconds; with the policy's CLOSE_WAIT_S (3 s) it stays within the 5 s ros2 launch gives.
DRAIN_TIMEOUT_S = 2.0

SUMMARY_OUT = "--summary-out"  # a node's own argument (outside --ros-args): write summary() there at exit


def _pop_option(argv: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` from ``argv`` (before any --ros-args) and return VALUE."""
    end = argv.index("--ros-args") if "--ros-args" in argv else len(argv)
    for i in range(1, end - 1):
        if argv[i] == name:
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
    return None


def stop_on_sigint() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt in this process, whatever it inherited. A
    process started in the background of a script inherits SIGINT ignored, and Python then
    never installs its handler: a recorder or node started that way would ignore the SIGINT
    a launcher or ``ros2 launch`` stops it with (rclcpp nodes install theirs regardless)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


def make_executor(threads: int = 1, context=None) -> SingleThreadedExecutor | MultiThreadedExecutor:
    """An executor built with SIGINT/SIGTERM held back: a Ctrl-C inside rclpy's constructor
    would leave it half-built, and its ``__del__`` then prints a traceback."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if threads > 1:
            return MultiThreadedExecutor(num_threads=threads, context=context)
        return SingleThreadedExecutor(context=context)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def spin_node(
    factory: Callable[..., Node], args: list[str] | None = None, *, threads: int = 4, prepare: Callable[[Node], None] | None = None
) -> None:
    """``main()`` of every node: init, build, spin on a MultiThreadedExecutor, shut down.

    Errors are not swallowed: a node that cannot start raises (non-zero exit). Ctrl-C (SIGINT)
    and SIGTERM, whenever they come (while the node starts, or during an inference), end it
    quietly and in order: rclpy's own signal handler is off, so the context stays valid until
    the node has closed (its worker stopped) and the executor drained, and nothing publishes
    into a context that is already shut down. ``rclpy.init()`` with try/finally (not ``with``),
    which works from Humble on.

    While the node starts they raise KeyboardInterrupt; once it spins they only ask the loop to
    stop (a flag it reads between two ``spin_once``). A KeyboardInterrupt raised wherever the
    spinning thread happens to be lands inside the executor's dispatch: in
    ``ThreadPoolExecutor.submit``, whose idle semaphore is a pure-Python ``threading.Condition``,
    it can leave that lock taken for good (raised in ``Condition.__enter__`` after the lock was
    taken), so every pool thread blocks on it once its callback returns and the drain (and the
    interpreter's exit, which joins the pool too) waits forever; in a finalizer (rclpy's
    ``Future.__del__``) it is printed as "Exception ignored" and the Ctrl-C is lost.

    For a launcher that runs each node in its own process (``vla-accel bringup``): SIGUSR1
    resets the node's statistics (``reset_stats``) and ``--summary-out PATH`` (before
    ``--ros-args``) writes ``summary()`` (with the process id) as JSON to PATH once the node has
    closed. ``threads`` 1 spins a SingleThreadedExecutor (less overhead per callback than a
    thread pool); ``prepare(node)`` runs in this (the spinning) thread before it spins.

    A callback still running :data:`DRAIN_TIMEOUT_S` after the node closed is logged (where it
    is) and the process ends with status 1 without waiting for it (no thread could join it).
    """
    argv = list(sys.argv if args is None else args)
    summary_out = _pop_option(argv, SUMMARY_OUT)
    prefer_responsive_threads()
    return_freed_frames_to_the_system()
    # Set by the signal handlers, read by the loop: plain assignments, no lock a handler could
    # wait on while the interrupted thread holds it (threading.Event.set takes one).
    asked = types.SimpleNamespace(stop=False, reset=False)
    stop_on_sigint()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the same orderly end as Ctrl-C
    signal.signal(signal.SIGUSR1, lambda *_: setattr(asked, "reset", True))
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    node = executor = None
    still_running: list[str] = []
    try:
        executor = make_executor(threads)
        node = factory()
        executor.add_node(node)
        if prepare is not None:
            prepare(node)
        for sig in (signal.SIGINT, signal.SIGTERM):  # from here on: stop at the loop's check (see above)
            signal.signal(sig, lambda *_: setattr(asked, "stop", True))
        while rclpy.ok() and not asked.stop:
            executor.spin_once(timeout_sec=0.1)
            if asked.reset:
                asked.reset = False
                getattr(node, "reset_stats", lambda: None)()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # launch's escalation still can
        if node is not None:
            getattr(node, "close", lambda: None)()  # the worker stops while the context is valid
        if executor is not None:
            still_running = drain_executor(executor, DRAIN_TIMEOUT_S)
        if node is not None:
            if still_running:
                node.get_logger().error(
                    f"{len(still_running)} callback thread(s) still running {DRAIN_TIMEOUT_S:g} s after the node closed, "
                    f"exiting without them: {'; '.join(still_running)}"
                )
            if summary_out:
                summary = {**getattr(node, "summary", dict)(), "pid": os.getpid()}
                Path(summary_out).write_text(json.dumps(summary, default=str) + "\n")
            if not still_running:  # a callback still in it may use it
                node.destroy_node()
        rclpy.try_shutdown()
        if still_running:  # the interpreter's exit would join the stuck thread: end here instead
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        # The interpreter's finalization then skips the collector's passes over every object still
        # alive (torch, transformers, a loaded model): 1.5 s for the small bundle on an idle
        # machine, 2-3 s on a loaded one (measured), most of the 5 s ros2 launch waits after Ctrl-C.
        gc.freeze()
