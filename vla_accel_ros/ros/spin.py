"""``main()`` of every node (:func:`spin_node`): init, build, spin, and an orderly end on
Ctrl-C or SIGTERM, whenever it comes; :func:`stop_on_sigint` for the processes that start nodes."""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import threading
import types
from pathlib import Path
from typing import Callable

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions

from vla_accel_ros.ros.executors import drain_executor, make_executor
from vla_accel_ros.ros.process_tuning import prefer_responsive_threads, return_freed_frames_to_the_system

# How long spin_node waits for callbacks still running once the node closed: they take
# milliseconds; with the policy's CLOSE_WAIT_S (3 s) it stays within the 5 s ros2 launch gives.
DRAIN_TIMEOUT_S = 2.0

# From the first Ctrl-C or SIGTERM, the longest an orderly end may take: past it, every thread's
# stack is printed and the process ends with status 1. A callback that never returns on a
# single-threaded executor (the controller's) keeps the loop from ever reading the stop flag,
# and then only ros2 launch's SIGKILL, 15 s after its SIGINT, ended the process, with no word on
# where it was. Twice the policy's CLOSE_WAIT_S and DRAIN_TIMEOUT_S together, so a slow but
# orderly end (a recorder closing its bag) is not cut, and still before that SIGKILL.
SHUTDOWN_DEADLINE_S = 10.0

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


class _StopDeadline:
    """Arms :data:`SHUTDOWN_DEADLINE_S` at the first SIGINT or SIGTERM, wherever the main thread
    is. Python runs signal handlers only in the main thread, between two bytecodes, and the
    loop's handlers only set a flag: a main thread stuck in a callback or inside rclpy never acts
    on it, or never even runs the handler. The interpreter's C handler still writes the signal's
    number to the wakeup fd; a daemon thread reading it arms faulthandler's watchdog, a C thread
    that prints every stack and exits without the main thread. (Arming needs the GIL: a main
    thread stuck in C code that holds it stays out of reach, as before.)"""

    def __init__(self, deadline_s: float) -> None:
        self._read, write = socket.socketpair()
        write.setblocking(False)
        self._write = write  # kept open as long as the wakeup fd points at it
        self._lock = threading.Lock()
        self._done = False
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(deadline_s,), name="stop-deadline", daemon=True).start()

    def _watch(self, deadline_s: float) -> None:
        stops = {signal.SIGINT, signal.SIGTERM}
        while True:
            got = self._read.recv(64)
            if not got:  # cancelled: the write end is closed
                return
            if any(b in stops for b in got):  # SIGUSR1 (reset_stats) is not a stop
                break
        with self._lock:
            if not self._done:
                faulthandler.dump_traceback_later(deadline_s, exit=True)

    def cancel(self) -> None:
        """The orderly end is over (what is left is the interpreter's exit): no deadline."""
        with self._lock:
            self._done = True
            faulthandler.cancel_dump_traceback_later()
        signal.set_wakeup_fd(-1)  # (the main thread, as set_wakeup_fd requires)
        self._write.close()  # ends the watching thread


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
    Whatever else keeps the end from coming (a callback stuck in the spinning thread itself, so
    the loop never reads its flag) meets :data:`SHUTDOWN_DEADLINE_S`: every thread's stack on
    stderr ("Timeout"), status 1.
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
    deadline = _StopDeadline(SHUTDOWN_DEADLINE_S)
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
        deadline.cancel()
        if still_running:  # the interpreter's exit would join the stuck thread: end here instead
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        # The interpreter's finalization then skips the collector's passes over every object still
        # alive (torch, transformers, a loaded model): 1.5 s for the small bundle on an idle
        # machine, 2-3 s on a loaded one (measured), most of the 5 s ros2 launch waits after Ctrl-C.
        gc.freeze()
