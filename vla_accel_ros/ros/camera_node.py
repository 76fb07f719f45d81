"""camera_node: N camera topics in, synchronized observations at the policy's image size out.

Subscribes ``cameras[i]`` on ``topics[i]`` (``sensor_msgs/Image`` or ``CompressedImage`` per
``transports``) with sensor-data QoS, converts each frame (cv_bridge when installed, else the
NumPy converter) and hands it to the image half of the one observation rule
(:class:`~vla_accel_ros.core.robot.observation.ObservationAssembler`: resized to ``image_size``,
latest per camera). When every camera has a new frame within ``max_age_ms`` / ``max_skew_ms``,
the observation goes to the
policy: on the ``observation`` topic, or straight into the shared latest-only buffer when both
nodes run in one process (``observation_transport: shared``). Frames that cannot be used are
dropped with a throttled warning and counted in ``/diagnostics``; the node keeps running. A
frame stamped more than ``max_future_ms`` ahead of the node's clock is dropped before it is
decoded (``future_stamp``): a camera with a wrong clock must not date observations in the future;
so is a frame of a topic with a publisher that is not this robot's (``unexpected_publisher``,
:mod:`~vla_accel_ros.core.robot.sources`): another robot's frames are never assembled.

Frames of several cameras are decoded in parallel; each is then handed to the assembler with the
clock read under the assembler's lock, so the assembler sees its clock in the order frames reach
it (read before decoding, a frame that decoded faster would make the clock look as if it jumped
back, and the assembler would forget every frame it holds). ``/diagnostics`` names a camera that
has sent no new frame for ``max_age_ms`` (WARN) or ``silent_error_s`` (ERROR), or that re-sends one
stamp; OK again once it streams.
"""

from __future__ import annotations

import threading
from collections import Counter
from functools import partial

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import CompressedImage, Image

from vla_accel_ros.core.robot.config import CameraConfig
from vla_accel_ros.core.robot.images import ImageError
from vla_accel_ros.core.robot.observation import AssembledObservation, ObservationAssembler, SharedChannels
from vla_accel_ros.msg import Observation as ObservationMsg
from vla_accel_ros.ros import graph, qos
from vla_accel_ros.ros.conversions import ImageConverter, observation_to_msg, stamp_to_ns
from vla_accel_ros.ros.diagnostics import ERROR, OK, WARN, diagnostics, status, status_name
from vla_accel_ros.ros.drops import DropCounter
from vla_accel_ros.ros.params import ConfigParameters
from vla_accel_ros.ros.sensor_input import SourceCheck
from vla_accel_ros.ros.spin import spin_node


class CameraNode(Node):
    def __init__(self, node_name: str = "camera_node", **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        self.params = ConfigParameters(self, CameraConfig, on_staged=self._apply)
        cfg: CameraConfig = self.params.config
        self.converter = ImageConverter(cfg.converter, cfg.max_pixels)
        self.assembler = ObservationAssembler(cfg.cameras, image_size=cfg.image_size, **_limits(cfg))
        self._lock = threading.Lock()  # the assembler
        self.drops = DropCounter(self, "camera frame", cfg.warn_throttle_s)
        self.frames: Counter[str] = Counter()
        self.observations = 0
        self._unstamped_warned = False

        frames_group = ReentrantCallbackGroup()  # decode + resize in parallel; assembly locks
        self.sources = SourceCheck(self, lambda: self.params.config.accept_publishers)
        self._subs = []
        self._resolved: dict[str, str] = {}  # camera -> its topic as resolved (namespace, remappings)
        for i, (cam, topic) in enumerate(zip(cfg.cameras, cfg.topics)):
            compressed = cfg.transport(i) == "compressed"
            sub = self.create_subscription(
                CompressedImage if compressed else Image,
                topic,
                partial(self._on_frame, cam, compressed),
                qos.SENSOR,
                callback_group=frames_group,
            )
            self._subs.append(sub)
            self._resolved[cam] = self.sources.watch(sub)
        self._pub = None
        self._channel = None
        if cfg.observation_transport == "topic":
            self._pub = self.create_publisher(ObservationMsg, graph.OBSERVATION, qos.LATEST)
        else:
            self._channel = SharedChannels.get(self.context, cfg.shared_channel)
        self._diag_pub = self.create_publisher(DiagnosticArray, graph.DIAGNOSTICS, qos.RELIABLE)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup())
        self.get_logger().info(
            f"cameras {', '.join(f'{c} <- {t}' for c, t in self._resolved.items())}; converter {self.converter.mode}; "
            f"observations via {cfg.observation_transport}"
        )

    # -- parameters ---------------------------------------------------------------------------
    def _apply(self, cfg: CameraConfig) -> None:
        with self._lock:
            self.assembler.set_limits(**_limits(cfg))
        self.drops.throttle_s = cfg.warn_throttle_s
        self.converter.max_pixels = cfg.max_pixels

    # -- frames -------------------------------------------------------------------------------
    def _on_frame(self, camera: str, compressed: bool, msg) -> None:
        now = self.get_clock().now().nanoseconds
        stamp = stamp_to_ns(msg.header.stamp)
        if stamp == 0:  # some drivers do not stamp; the arrival time is the best we have
            stamp = now
            if not self._unstamped_warned:
                self._unstamped_warned = True
                self.get_logger().warning(f"{camera}: frames carry no header stamp; using arrival time")
        why = self.assembler.too_new(stamp, now)  # before decoding: a wrong clock costs nothing
        if why:
            self.drops.drop("future_stamp", f"{camera}: {why}")
            return
        reason, why = self.sources.refusal(self._resolved[camera])  # another robot's frames are never assembled
        if reason:
            self.drops.drop(reason, why)
            return
        try:
            rgb = self.converter.compressed(msg) if compressed else self.converter.raw(msg)
            rgb = self.assembler.prepare(rgb)  # the policy's size; outside the lock (parallel)
        except ImageError as e:
            self.drops.drop(e.reason, f"{camera}: {e}")
            return
        with self._lock:
            self.frames[camera] += 1
            # The clock is read here, in the order frames are added: a clock that jumped back
            # (sim time restarted) makes the assembler start over, a decode that ran long must not.
            obs = self.assembler.add(camera, rgb, stamp, self.get_clock().now().nanoseconds)
            if obs is not None:
                self.observations += 1
        if obs is not None:
            self._emit(obs)

    def _emit(self, obs: AssembledObservation) -> None:
        if self._channel is not None:
            self._channel.put(obs.stamp_ns, obs)
        else:
            self._pub.publish(observation_to_msg(obs.images, obs.stamp_ns, obs.seq, obs.skew_ns, obs.age_ns))

    # -- diagnostics --------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        error_ns = int(self.params.config.silent_error_s * 1e9)
        with self._lock:
            cams = self.assembler.health(self.get_clock().now().nanoseconds, error_ns=error_ns)
            reject = self.assembler.last_reject
            rejects = dict(self.assembler.rejects)
        bad = [c for c in cams if c.level != "ok"]
        level, message = OK, "streaming"
        if bad:  # the cameras by name, each with what is wrong
            level = ERROR if any(c.level == "error" for c in bad) else WARN
            message = "; ".join(f"{c.camera}: {c.message}" for c in bad)
        elif reject:
            level, message = WARN, reject
        level, message = self.sources.diagnose(level, message)
        values: dict[str, object] = {f"frames {c}": self.frames[c] for c in self.assembler.cameras}
        values.update({f"ms since new frame {c.camera}": c.since_new_ms for c in cams})
        values.update({f"re-sent frames {c.camera}": c.resent for c in cams})
        values.update({"observations": self.observations, "dropped": self.drops.total})
        values.update({f"dropped {k}": v for k, v in self.drops.snapshot().items()})
        values.update({f"rejected {k}": v for k, v in rejects.items()})
        self._diag_pub.publish(diagnostics(self, [status(status_name(self, "cameras"), level, message, values)]))

    def reset_stats(self) -> None:
        self.frames.clear()
        self.observations = 0
        self.drops.clear()

    def summary(self) -> dict[str, object]:
        return {"frames": sum(self.frames.values()), "observations": self.observations, "dropped": self.drops.total}


def _limits(cfg: CameraConfig) -> dict[str, int]:
    """The image half's limits in ns, as :class:`ObservationAssembler` takes them."""
    return dict(
        max_age_ns=int(cfg.max_age_ms * 1e6), max_skew_ns=int(cfg.max_skew_ms * 1e6), max_future_ns=int(cfg.max_future_ms * 1e6)
    )


def main(args: list[str] | None = None) -> None:
    spin_node(CameraNode, args)


if __name__ == "__main__":
    main()

