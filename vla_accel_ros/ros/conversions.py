"""Messages <-> the core's types. No node state here; every function is a pure conversion."""

from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Time
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header

from vla_accel_ros.core.robot.images import MAX_PIXELS, ImageError, check_size, compressed_payload, decode_compressed, decode_raw
from vla_accel_ros.core.robot.motion import MotionEstimate
from vla_accel_ros.core.scheduling import InferenceRequest
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance
from vla_accel_ros.msg import ActionChunk as ActionChunkMsg
from vla_accel_ros.msg import ChunkRequest, InferenceStats, MotionState
from vla_accel_ros.msg import Observation as ObservationMsg


# -- time ------------------------------------------------------------------------------------
def stamp_to_ns(t: Time) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def ns_to_stamp(ns: int) -> Time:
    ns = int(ns)
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def header(ns: int, frame_id: str = "") -> Header:
    return Header(stamp=ns_to_stamp(ns), frame_id=frame_id)


# -- images ----------------------------------------------------------------------------------
class ImageConverter:
    """``sensor_msgs/Image`` / ``CompressedImage`` -> RGB uint8 [H, W, 3].

    ``mode``: cv_bridge (required), numpy (never cv_bridge) or auto (cv_bridge when it imports).
    Raises :class:`ImageError` for frames that cannot be used, whichever path decodes them; a
    frame of more than ``max_pixels`` (width x height; compressed ones by their header) is
    refused before it is decoded.
    """

    def __init__(self, mode: str = "auto", max_pixels: int = MAX_PIXELS) -> None:
        self.max_pixels = int(max_pixels)
        self.bridge = None
        if mode in ("auto", "cv_bridge"):
            try:
                from cv_bridge import CvBridge  # noqa: PLC0415 - only on a ROS install

                self.bridge = CvBridge()
            except ImportError:
                if mode == "cv_bridge":
                    raise
        self.mode = "cv_bridge" if self.bridge is not None else "numpy"

    def raw(self, msg: Image) -> np.ndarray:
        if self.bridge is not None:
            if not len(msg.data):
                raise ImageError("empty", f"{msg.encoding} {msg.width}x{msg.height} frame carries no data")
            check_size(msg.width, msg.height, self.max_pixels)
            try:
                out = self.bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8")
            except Exception as e:  # noqa: BLE001 - CvBridgeError, cv2.error, TypeError, ValueError
                raise ImageError("cv_bridge", f"{type(e).__name__}: {e}") from e
            return np.ascontiguousarray(out)
        return decode_raw(msg.encoding, msg.height, msg.width, msg.step, bool(msg.is_bigendian), msg.data, self.max_pixels)

    def compressed(self, msg: CompressedImage) -> np.ndarray:
        if self.bridge is not None:
            compressed_payload(msg.format, msg.data, self.max_pixels)  # the header first
            try:
                out = self.bridge.compressed_imgmsg_to_cv2(msg, desired_encoding="rgb8")
            except Exception as e:  # noqa: BLE001 - as above
                raise ImageError("cv_bridge", f"{type(e).__name__}: {e}") from e
            return np.ascontiguousarray(out)
        return decode_compressed(msg.format, msg.data, self.max_pixels)


def rgb_to_image(rgb: np.ndarray, stamp_ns: int, frame_id: str = "") -> Image:
    """RGB uint8 [H, W, 3] -> ``sensor_msgs/Image`` (rgb8, no padding)."""
    h, w = rgb.shape[:2]
    msg = Image(header=header(stamp_ns, frame_id), height=h, width=w, encoding="rgb8", is_bigendian=0, step=w * 3)
    msg.data = np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()
    return msg


# -- observations ----------------------------------------------------------------------------
def observation_to_msg(images: dict[str, np.ndarray], stamp_ns: int, seq: int, skew_ns: int, age_ns: int) -> ObservationMsg:
    msg = ObservationMsg(header=header(stamp_ns), seq=int(seq), skew_ms=skew_ns / 1e6, age_ms=age_ns / 1e6)
    msg.camera_names = list(images)
    msg.images = [rgb_to_image(img, stamp_ns, cam) for cam, img in images.items()]
    return msg


def observation_from_msg(msg: ObservationMsg) -> tuple[dict[str, np.ndarray], int]:
    """(camera -> RGB [H, W, 3], stamp ns). The images were written by this package (rgb8)."""
    if len(msg.camera_names) != len(msg.images):
        raise ImageError("bad_observation", f"{len(msg.camera_names)} camera names for {len(msg.images)} images")
    images = {
        cam: decode_raw(im.encoding, im.height, im.width, im.step, bool(im.is_bigendian), im.data)
        for cam, im in zip(msg.camera_names, msg.images)
    }
    return images, stamp_to_ns(msg.header.stamp)


# -- chunks ----------------------------------------------------------------------------------
def chunk_to_msg(chunk: ActionChunk, *, request_id: int, latency_ms: float) -> ActionChunkMsg:
    a = np.asarray(chunk.actions, np.float32)  # [H, D]
    msg = ActionChunkMsg(
        header=header(chunk.stamp_ns),
        chunk_id=int(chunk.chunk_id),
        request_id=int(request_id),
        horizon=int(a.shape[0]),
        action_dim=int(a.shape[1]),
        dt=float(chunk.dt),
        inference_latency_ms=float(latency_ms),
    )
    msg.joint_names = list(chunk.joint_names)
    msg.actions = a.reshape(-1)
    return msg


def chunk_from_msg(msg: ActionChunkMsg) -> ActionChunk:
    h, d = int(msg.horizon), int(msg.action_dim)
    a = np.frombuffer(msg.actions, np.float32) if len(msg.actions) else np.zeros(0, np.float32)
    if a.size != h * d or h == 0 or d == 0:
        raise ValueError(f"ActionChunk {msg.chunk_id}: {a.size} values for horizon {h} x action_dim {d}")
    return ActionChunk(
        actions=a.reshape(h, d).copy(),
        stamp_ns=stamp_to_ns(msg.header.stamp),
        dt=float(msg.dt),
        chunk_id=int(msg.chunk_id),
        joint_names=tuple(msg.joint_names),
        stats={"request_id": int(msg.request_id), "inference_latency_ms": float(msg.inference_latency_ms)},
    )


def stats_to_msg(chunk: ActionChunk, *, motion_mode: str, resets_total: int, reset_reason: str) -> InferenceStats:
    s = chunk.stats
    timings = {k: v for k, v in chunk.timings_ms.items() if k != "total"}
    msg = InferenceStats(
        header=header(chunk.stamp_ns),
        chunk_id=int(chunk.chunk_id),
        mode=str(s.get("mode", "")),
        total_ms=float(chunk.timings_ms.get("total", sum(timings.values()))),
        tokens_total=int(s.get("tokens_total", 0)),
        tokens_recomputed=int(s.get("tokens_recomputed", 0)),
        tokens_pruned=int(s.get("tokens_pruned", 0)),
        reuse_fraction=float(s.get("reuse_fraction", 0.0)),
        decode_steps=int(s.get("decode_steps", 0)),
        draft_accepted=int(s.get("draft_accepted", 0)),
        cache_reset=bool(s.get("cache_reset", False) or reset_reason),
        reset_reason=str(reset_reason or s.get("reset_reason", "")),
        cache_resets_total=int(resets_total),
        motion_mode=motion_mode,
        pipeline_depth=int(s.get("pipeline_depth", 0)),
        staleness_frames=int(s.get("staleness_calls", 0)),
        staleness_ms=float(s.get("staleness_busy_ms", 0.0)),
    )
    msg.stage_names = list(timings)
    msg.stage_ms = [float(v) for v in timings.values()]
    msg.recomputed_per_layer = [int(x) for x in s.get("recomputed_per_layer", [])]
    return msg


# -- requests and guidance -------------------------------------------------------------------
def request_to_msg(
    req: InferenceRequest, *, request_id: int, motion_mode: int, replan: bool
) -> ChunkRequest:
    msg = ChunkRequest(
        header=header(req.stamp_ns),
        request_id=int(request_id),
        issued=ns_to_stamp(req.issued_ns),
        delay_steps=int(req.delay_steps),
        motion_mode=int(motion_mode),
        replan=bool(replan),
    )
    g = req.guidance
    if g is not None:
        prev = np.asarray(g.prev_actions, np.float32)  # [H, D]
        msg.has_guidance = True
        msg.horizon, msg.action_dim = int(prev.shape[0]), int(prev.shape[1])
        msg.prev_actions = prev.reshape(-1)
        msg.frozen = int(g.frozen)
        msg.weights = np.asarray(g.weights, np.float32).reshape(-1)
        msg.max_guidance = float(g.max_guidance)
    return msg


def guidance_from_msg(msg: ChunkRequest) -> ChunkGuidance | None:
    if not msg.has_guidance:
        return None
    h, d = int(msg.horizon), int(msg.action_dim)
    prev = np.frombuffer(msg.prev_actions, np.float32) if len(msg.prev_actions) else np.zeros(0, np.float32)
    w = np.frombuffer(msg.weights, np.float32) if len(msg.weights) else np.zeros(0, np.float32)
    if prev.size != h * d or w.size != h:
        raise ValueError(f"ChunkRequest {msg.request_id}: guidance sizes disagree (prev {prev.size}, weights {w.size}, H {h}, D {d})")
    return ChunkGuidance(prev_actions=prev.reshape(h, d).copy(), frozen=int(msg.frozen), weights=w.copy(), max_guidance=float(msg.max_guidance))


# -- motion ----------------------------------------------------------------------------------
def motion_to_msg(est: MotionEstimate, stamp_ns: int, joint_names: tuple[str, ...]) -> MotionState:
    msg = MotionState(
        header=header(stamp_ns),
        mode=int(est.mode),
        ee_linear_speed=est.ee_linear,
        ee_angular_speed=est.ee_angular,
        ee_xy_speed=est.ee_xy,
        ee_z_speed=est.ee_z,
        joint_speed=est.joint_speed,
        replan=est.replan,
    )
    msg.joint_names = list(joint_names)
    msg.joint_velocities = np.asarray(est.joint_velocities, np.float32)
    return msg
