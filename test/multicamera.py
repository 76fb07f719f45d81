"""A multi-camera robot for the ROS tests, and the two-camera measurement of issue 33.

:class:`CameraRig` is the robot side of a graph whose bundle has several cameras: every camera
at ``rate_hz`` (each tick's frames carry one stamp, as a hardware-triggered rig), ALOHA joint
states at 50 Hz; a camera can go silent (``silent``) or re-send one frame with its old stamp
(``frozen``). It records what the graph says: chunk requests (with the controller's time of
issue), chunks, announced observation stamps and /diagnostics.

Run as a script it measures a two-camera graph (tiny flow bundle, nodes in this process as the
tests run them) in healthy running::

    .venv/bin/python test/multicamera.py --duration 15 [--cameras cam_high,cam_left_wrist]

and prints frames in per camera, observations out, observations per frame, and the age of the
source observation when each inference started (read as the policy's ``infer`` is called, so the
same figure before and after the worker measured it itself) and when each chunk was requested
(``ChunkRequest.issued - header.stamp``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.context import Context
from rclpy.node import Node
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Header

import helpers  # test/helpers.py
from vla_accel_ros.core.robot.images import encode_raw
from vla_accel_ros.core.robot.topics import image_topic
from vla_accel_ros.msg import ActionChunk, ChunkRequest
from vla_accel_ros.ros import qos
from vla_accel_ros.ros.conversions import stamp_to_ns

LEVELS = {0: "OK", 1: "WARN", 2: "ERROR", 3: "STALE"}


class CameraRig(Node):
    def __init__(self, context: Context, cameras: list[str], rate_hz: float = 30.0) -> None:
        super().__init__("camera_rig", context=context)
        self.cameras = list(cameras)
        self.lock = threading.Lock()
        self.silent: set[str] = set()
        self.frozen: dict[str, Image] = {}  # camera -> the message it re-sends
        self.published = {c: 0 for c in self.cameras}
        self.requests: list[ChunkRequest] = []
        self.chunks: list[tuple[float, ActionChunk]] = []  # (time.monotonic() at arrival, chunk)
        self.stamps: list[int] = []  # announced observation stamps
        self.diagnostics: list[tuple[float, str, str, str, dict[str, str]]] = []  # (t, name, level, message, values)
        self._pubs = {c: self.create_publisher(Image, image_topic(c), qos.SENSOR) for c in self.cameras}
        self._js = [self.create_publisher(JointState, f"/follower_{s}/joint_states", qos.RELIABLE) for s in ("left", "right")]
        self.create_subscription(ChunkRequest, "chunk_request", lambda m: self._add(self.requests, m), qos.RELIABLE)
        self.create_subscription(ActionChunk, "action_chunk", lambda m: self._add(self.chunks, (time.monotonic(), m)), qos.RELIABLE)
        self.create_subscription(Header, "observation_stamp", lambda m: self._add(self.stamps, stamp_to_ns(m.stamp)), qos.RELIABLE)
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, qos.RELIABLE)
        rng = np.random.default_rng(0)
        self._frames = {c: [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(4)] for c in self.cameras}
        self._k = 0
        self.create_timer(1.0 / rate_hz, self._publish_frames)
        self.create_timer(0.02, self._publish_joints)

    def _add(self, where: list, item) -> None:
        with self.lock:
            where.append(item)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        t = time.monotonic()
        with self.lock:
            for st in msg.status:
                level = LEVELS.get(st.level[0] if isinstance(st.level, bytes) else st.level, str(st.level))
                self.diagnostics.append((t, st.name, level, st.message, {kv.key: kv.value for kv in st.values}))

    def _publish_frames(self) -> None:
        stamp = self.get_clock().now().to_msg()
        self._k += 1
        for cam in self.cameras:
            with self.lock:
                if cam in self.silent:
                    continue
                msg = self.frozen.get(cam)
            if msg is None:
                h, w, step, data = encode_raw(self._frames[cam][self._k % 4], "rgb8")
                msg = Image(height=h, width=w, step=step, encoding="rgb8", is_bigendian=0, data=data)
                msg.header.stamp = stamp
            self._pubs[cam].publish(msg)
            with self.lock:
                self.published[cam] += 1

    def _publish_joints(self) -> None:
        helpers.publish_joint_states(self, self._js)

    def silence(self, camera: str) -> int:
        """``camera`` sends nothing from now on; returns the clock's time: every frame stamped
        since is missing it, so no observation may carry a stamp at or after it."""
        with self.lock:
            self.silent.add(camera)
        return self.get_clock().now().nanoseconds

    def since(self, stamp_ns: int, n_chunks: int = 0) -> tuple[list[int], list[int]]:
        """Announced observation stamps, and the stamps of chunks from index ``n_chunks``, at or after ``stamp_ns``."""
        with self.lock:
            stamps = [s for s in self.stamps if s >= stamp_ns]
            chunks = [stamp_to_ns(c.header.stamp) for _, c in self.chunks[n_chunks:]]
        return stamps, [s for s in chunks if s >= stamp_ns]

    def freeze(self, camera: str) -> int:
        """``camera`` re-sends its next frame, with that frame's stamp, from now on; returns the stamp."""
        h, w, step, data = encode_raw(self._frames[camera][0], "rgb8")
        msg = Image(height=h, width=w, step=step, encoding="rgb8", is_bigendian=0, data=data)
        msg.header.stamp = self.get_clock().now().to_msg()
        with self.lock:
            self.frozen[camera] = msg
        return stamp_to_ns(msg.header.stamp)

    def resume(self, camera: str) -> None:
        with self.lock:
            self.frozen.pop(camera, None)
            self.silent.discard(camera)

    def request_ages_ms(self, since: int = 0) -> list[float]:
        """Per chunk request from index ``since``: how old the observation it names was when the
        controller issued it."""
        with self.lock:
            reqs = self.requests[since:]
        return [(stamp_to_ns(r.issued) - stamp_to_ns(r.header.stamp)) / 1e6 for r in reqs]

    def diagnostics_of(self, name: str, since: float = 0.0) -> list[tuple[str, str, dict[str, str]]]:
        """(level, message, values) of every status named ``name`` received after ``since``."""
        with self.lock:
            return [(lvl, text, v) for t, n, lvl, text, v in self.diagnostics if n == name and t >= since]


def measure(duration_s: float, cameras: list[str], threads: int = 6) -> dict[str, object]:
    """Run the graph with a two-camera tiny flow bundle and the rig for ``duration_s`` after the
    policy is ready; return what flowed and how old the observations were."""
    import tempfile
    from pathlib import Path

    import yaml

    from vla_accel_ros.core.params_file import default_params_file, node_section
    from vla_accel_ros.models.factory import create_demo_bundle
    from vla_accel_ros.ros import bringup
    from vla_accel_ros.ros.graph import CAMERA, CONTROLLER, POLICY, describe

    tmp = Path(tempfile.mkdtemp(prefix="multicam-"))
    bundle = create_demo_bundle("flow", "tiny", tmp / "bundle", seed=0, cameras=tuple(cameras))
    params = yaml.safe_load(default_params_file().read_text())
    node_section(params, "policy_node")["policy"]["parity_check"] = False
    node_section(params, "action_controller_node")["safety"]["start_enabled"] = True
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    with helpers.module_ros_context() as ctx:
        running = bringup.start(describe(params_file=tmp / "params.yaml", bundle=bundle), context=ctx, threads=threads)
        rig = CameraRig(ctx, cameras)
        running.add_node("rig", rig)
        try:
            assert running.wait_ready(300.0) == "", "the policy did not start"
            pol = running.nodes[POLICY]
            starts: list[float] = []
            infer = pol.worker.policy.infer

            def timed_infer(obs, **kwargs):  # the age of the observation as the model starts on it
                starts.append((pol.get_clock().now().nanoseconds - obs.stamp_ns) / 1e6)
                return infer(obs, **kwargs)

            pol.worker.policy.infer = timed_infer
            time.sleep(2.0)  # warm: the first chunks, the first diagnostics
            cam = running.nodes[CAMERA]
            frames0, obs0, n_req = dict(cam.frames), cam.observations, len(rig.requests)
            n_start, t0 = len(starts), time.monotonic()
            time.sleep(duration_s)
            frames = {c: cam.frames[c] - frames0.get(c, 0) for c in cameras}
            observations = cam.observations - obs0
            ages = starts[n_start:]
            req_ages = rig.request_ages_ms(n_req)
            diag = rig.diagnostics_of(f"{CAMERA}: cameras", t0)
            dropped = {n: dict(running.nodes[n].drops.counts) for n in (POLICY, CONTROLLER)}
        finally:
            running.shutdown()
    return {
        "duration_s": duration_s,
        "frames_in": frames,
        "observations_out": observations,
        "observations_per_frame": observations / max(1, min(frames.values())),
        "inferences": len(ages),
        "age_at_inference_start_ms": {"p50": float(np.median(ages)) if ages else None, "max": max(ages, default=None)},
        "inferences_on_older_than_100_ms": sum(a > 100.0 for a in ages),
        "requests": len(req_ages),
        "age_at_request_ms": {"p50": float(np.median(req_ages)) if req_ages else None, "max": max(req_ages, default=None)},
        "camera_diagnostics_not_ok": [(lvl, text) for lvl, text, _ in diag if lvl != "OK"],
        "dropped_since_start": dropped,
    }


if __name__ == "__main__":
    import argparse
    import json
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--cameras", default="cam_high,cam_left_wrist")
    a = p.parse_args()
    print(json.dumps(measure(a.duration, [c.strip() for c in a.cameras.split(",") if c.strip()]), indent=2))
