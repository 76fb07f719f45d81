"""Two cameras end to end over DDS: the tiny flow bundle with cam_high and cam_left_wrist, real
rclpy nodes, a rig (test/multicamera.py) publishing both cameras at 30 Hz and the joint states.

Healthy running makes one observation per set of frames; a camera that goes silent or re-sends
one stamp is named in /diagnostics, the arm holds on its watchdog and no chunk is requested or
inferred on an observation older than ``max_age_ms``; the graph recovers when the camera does.
Waits are conditions with timeouts; the windows that count frames are a few seconds long.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")

import helpers  # noqa: E402  (test/helpers.py)
from multicamera import CameraRig  # noqa: E402  (test/multicamera.py)
from vla_accel_ros.ros import bringup  # noqa: E402
from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, describe  # noqa: E402

pytestmark = pytest.mark.ros

CAMERAS = ["cam_high", "cam_left_wrist"]
SILENT = "cam_left_wrist"
MAX_AGE_MS = 100.0  # config/aloha.yaml, every node
WATCHDOG = 25  # control periods: 0.5 s
SILENT_ERROR_S = 1.0  # the shipped 3 s would make the test wait longer
TIMEOUT = 120.0  # generous: the machine is shared; conditions usually hold within seconds
CAMERA_STATUS = f"{CAMERA}: cameras"
POLICY_STATUS = f"{POLICY}: policy"


def wait_for(cond, timeout: float = TIMEOUT, what: str = "condition") -> None:
    helpers.wait_for(cond, timeout, what)


@pytest.fixture(scope="module")
def rig_graph(tmp_path_factory, ros_params_file):
    from vla_accel_ros.models.factory import create_demo_bundle

    bundle = create_demo_bundle("flow", "tiny", tmp_path_factory.mktemp("multicam") / "flow2", seed=0, cameras=tuple(CAMERAS))
    with helpers.module_ros_context() as ctx:
        graph = describe(params_file=ros_params_file, bundle=bundle).with_parameters(
            {CONTROLLER: {"safety.watchdog_periods": WATCHDOG}, CAMERA: {"silent_error_s": SILENT_ERROR_S}}
        )
        running = bringup.start(graph, context=ctx, threads=6)
        rig = CameraRig(ctx, CAMERAS, rate_hz=30.0)
        running.add_node("rig", rig)
        try:
            assert running.wait_ready(TIMEOUT) == ""
            wait_for(lambda: len(rig.chunks) >= 2, what="the first chunks")
            yield running, rig
        finally:
            running.shutdown()


def _fresh_chunk_after(rig: CameraRig, stamp_ns: int) -> bool:
    with rig.lock:
        return any(c.header.stamp.sec * 10**9 + c.header.stamp.nanosec > stamp_ns for _, c in rig.chunks)


def _recovered(running, rig: CameraRig, since: float) -> None:
    """After the camera came back: the camera status is OK again, a chunk from an observation
    made after the recovery arrives and the controller no longer holds."""
    ctl = running.nodes[CONTROLLER]
    resumed_ns = rig.get_clock().now().nanoseconds
    past0 = ctl.drops.snapshot().get("stale_chunk", 0)
    wait_for(lambda: [lvl for lvl, _, _ in rig.diagnostics_of(CAMERA_STATUS, since)][-1:] == ["OK"], what="camera status OK")
    wait_for(lambda: _fresh_chunk_after(rig, resumed_ns), what="a chunk from a fresh observation")
    # The hold ends with the first chunk that has an action to come. On a machine too loaded to
    # infer within the chunk's span (1 s; seen in full-suite runs) every chunk lands past: the
    # controller is right to keep holding then, and counts each such chunk (stale_chunk).
    wait_for(lambda: not ctl.control.watchdog.tripped or ctl.drops.snapshot().get("stale_chunk", 0) > past0,
             what="the controller to leave its hold, or to count the chunks that came too late to run")  # fmt: skip


def test_two_cameras_at_30_hz_make_one_observation_per_set_of_frames(rig_graph):
    """Fault 1 of issue 33: frames of the two cameras are handled on parallel callback threads;
    none of them may make the camera node forget the frames it holds."""
    running, rig = rig_graph
    cam = running.nodes[CAMERA]
    frames0, obs0, n_req, t0 = dict(cam.frames), cam.observations, len(rig.requests), time.monotonic()
    wait_for(lambda: min(cam.frames[c] - frames0.get(c, 0) for c in CAMERAS) >= 120, what="120 frames per camera (4 s)")
    frames = min(cam.frames[c] - frames0.get(c, 0) for c in CAMERAS)
    observations = cam.observations - obs0
    # One observation per frame period; a frame set the load delayed past max_age_ms, or one
    # overtaken by the next frame of the other camera, may be lost (counted in the camera's rejects).
    assert observations >= 0.9 * frames, f"{observations} observations from {frames} frames per camera"
    assert observations <= frames + 1
    statuses = rig.diagnostics_of(CAMERA_STATUS, t0)
    assert not [text for _, text, _ in statuses if "no frames yet" in text], statuses  # both cameras stream
    ages = rig.request_ages_ms(n_req)
    assert ages and max(ages) <= MAX_AGE_MS, ages


def test_a_silent_camera_is_named_the_arm_holds_and_no_chunk_comes_from_a_stale_observation(rig_graph):
    """Faults 2 and 3: while cam_left_wrist sends nothing the controller asks for no chunk on
    the last observation once it is older than max_age_ms, the policy infers on none, the arm
    holds on its watchdog, and /diagnostics names the camera (WARN, then ERROR after
    silent_error_s); then the camera comes back and so does the loop."""
    running, rig = rig_graph
    ctl = running.nodes[CONTROLLER]
    n_req, n_chunks, t0 = len(rig.requests), len(rig.chunks), time.monotonic()
    silent_ns = rig.silence(SILENT)
    try:
        wait_for(lambda: ctl.control.watchdog.tripped, what="the controller to hold")
        # Every request names an observation at most max_age_ms old when the controller issued it.
        ages = rig.request_ages_ms(n_req)
        assert all(a <= MAX_AGE_MS for a in ages), ages
        wait_for(lambda: any(lvl == "ERROR" and SILENT in text for lvl, text, _ in rig.diagnostics_of(CAMERA_STATUS, t0)),
                 what=f"an ERROR naming {SILENT}")  # fmt: skip
        statuses = rig.diagnostics_of(CAMERA_STATUS, t0)
        named = [(lvl, text) for lvl, text, _ in statuses if SILENT in text]
        assert named and all(lvl in ("WARN", "ERROR") for lvl, _ in named), statuses
        assert not [text for _, text, _ in statuses if "cam_high" in text], statuses  # the streaming camera is not blamed
        # Nothing fresh came: no observation, so no chunk, is stamped after the camera fell silent.
        # A chunk from an inference in flight then may still arrive late (a loaded machine) with
        # actions to come, and release the hold for them: the hold is waited for, not read once.
        observations, chunks = rig.since(silent_ns, n_chunks)
        assert not observations and not chunks, (observations, chunks, silent_ns)
        wait_for(lambda: ctl.control.watchdog.tripped, what="the controller to hold after the last chunk in flight")
        # The policy never started an inference on an observation older than max_age_ms.
        wait_for(lambda: rig.diagnostics_of(POLICY_STATUS, t0), what="policy diagnostics")
        values = rig.diagnostics_of(POLICY_STATUS, t0)[-1][2]
        assert float(values["observation age at start ms max"]) <= MAX_AGE_MS, values
    finally:  # a failure here must not leave the camera silent for the next test
        t1 = time.monotonic()
        rig.resume(SILENT)
    _recovered(running, rig, t1)
    ages = rig.request_ages_ms(n_req)
    assert all(a <= MAX_AGE_MS for a in ages), ages


def test_a_camera_resending_one_stamp_is_named_and_its_frames_are_not_used(rig_graph):
    """Fault 3: cam_left_wrist re-sends one frame with its stamp at 30 Hz; /diagnostics names it,
    and no observation is made from a re-sent frame (the first one is a new frame)."""
    running, rig = rig_graph
    ctl = running.nodes[CONTROLLER]
    n_stamps, n_req, t0 = len(rig.stamps), len(rig.requests), time.monotonic()
    frozen = rig.freeze(SILENT)
    try:
        wait_for(lambda: ctl.control.watchdog.tripped, what="the controller to hold")
        with rig.lock:
            after = [s for s in rig.stamps[n_stamps:] if s >= frozen]
        assert len(after) <= 1, f"{len(after)} observations stamped with or after the re-sent frame"
        ages = rig.request_ages_ms(n_req)
        assert all(a <= MAX_AGE_MS for a in ages), ages
        wait_for(lambda: any(SILENT in text and "re-sending" in text for _, text, _ in rig.diagnostics_of(CAMERA_STATUS, t0)),
                 what=f"a status naming {SILENT} as re-sending one stamp")  # fmt: skip
    finally:
        t1 = time.monotonic()
        rig.resume(SILENT)
    _recovered(running, rig, t1)
