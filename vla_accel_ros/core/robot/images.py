"""Camera frames from message fields to RGB uint8 arrays, without cv_bridge.

:func:`decode_raw` reads the fields of a ``sensor_msgs/Image`` (encoding, height, width, step,
is_bigendian, data); it honours row padding (``step`` > width * pixel size) and the byte order
of 16-bit encodings. :func:`decode_compressed` decodes a ``sensor_msgs/CompressedImage``
payload with OpenCV when it is installed, else with Pillow, after reading the size from the
header: a frame of more than ``max_pixels`` is refused before a byte is decoded (a small PNG
can claim 30000 x 30000 pixels, 2.7 GB once decoded). Anything that cannot be a valid frame
raises :class:`ImageError` with a short ``reason`` the camera node counts and logs.

:func:`resize_rgb` is the one resize of the package (Pillow, no torch): the camera node, the
bag reader and the policies' preprocessing all call it, so a frame reaches the model with the
same pixels live, in replay, in training and in evaluation.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from vla_accel_ros.core.errors import ObservationError


class ImageError(ObservationError):
    """A frame that cannot be used. ``reason`` is a short key for drop counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class _Encoding:
    channels: int
    depth: int  # bytes per channel
    order: str  # channel order: "rgb", "bgr", "rgba", "bgra", "mono", or "uyvy"/"yuyv"


# sensor_msgs/image_encodings names (and the OpenCV type names cameras publish).
ENCODINGS: dict[str, _Encoding] = {
    "rgb8": _Encoding(3, 1, "rgb"),
    "bgr8": _Encoding(3, 1, "bgr"),
    "rgba8": _Encoding(4, 1, "rgba"),
    "bgra8": _Encoding(4, 1, "bgra"),
    "mono8": _Encoding(1, 1, "mono"),
    "8UC1": _Encoding(1, 1, "mono"),
    "8UC3": _Encoding(3, 1, "bgr"),  # no colour order given: OpenCV's (and cv_bridge's) BGR
    "8UC4": _Encoding(4, 1, "bgra"),
    "rgb16": _Encoding(3, 2, "rgb"),
    "bgr16": _Encoding(3, 2, "bgr"),
    "rgba16": _Encoding(4, 2, "rgba"),
    "bgra16": _Encoding(4, 2, "bgra"),
    "mono16": _Encoding(1, 2, "mono"),
    "16UC1": _Encoding(1, 2, "mono"),
    "uyvy": _Encoding(2, 1, "uyvy"),  # = yuv422 (U Y0 V Y1)
    "yuv422": _Encoding(2, 1, "uyvy"),
    "yuyv": _Encoding(2, 1, "yuyv"),  # = yuv422_yuy2 (Y0 U Y1 V)
    "yuv422_yuy2": _Encoding(2, 1, "yuyv"),
}

MAX_SIDE = 16384  # larger frames are a corrupt header, not a camera
MAX_PIXELS = 4096 * 4096  # default bound on width x height of a decoded frame (48 MiB as RGB)


def check_size(width: int, height: int, max_pixels: int = MAX_PIXELS) -> None:
    """Raise :class:`ImageError` unless a ``width`` x ``height`` frame may be decoded."""
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise ImageError("bad_size", f"{width}x{height} is not a valid frame size")
    if width * height > max_pixels:
        raise ImageError("too_large", f"{width}x{height} = {width * height} pixels > max_pixels {max_pixels}")


def decode_raw(
    encoding: str, height: int, width: int, step: int, is_bigendian: bool, data, max_pixels: int = MAX_PIXELS
) -> np.ndarray:
    """``sensor_msgs/Image`` fields -> RGB uint8 [height, width, 3] (a fresh array).

    ``data`` is anything exposing the buffer protocol (``bytes``, ``array.array``, NumPy).
    16-bit channels keep their most significant byte (a 0..65535 -> 0..255 scaling).
    """
    enc = ENCODINGS.get(encoding)
    if enc is None:
        raise ImageError("unknown_encoding", f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    check_size(width, height, max_pixels)
    if enc.order in ("uyvy", "yuyv") and width % 2:
        raise ImageError("bad_size", f"{encoding} needs an even width, got {width}")
    row = width * enc.channels * enc.depth  # bytes of pixel data per row
    if step < row:
        raise ImageError("bad_step", f"step {step} < width * pixel size = {row} ({encoding} {width}x{height})")
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if buf.size == 0:
        raise ImageError("empty", f"{encoding} {width}x{height} frame carries no data")
    if buf.size != step * height:
        raise ImageError("size_mismatch", f"data has {buf.size} bytes, step * height = {step * height}")
    rows = buf.reshape(height, step)[:, :row]  # drop row padding  # [H, row]
    if enc.depth == 2:
        dt = np.dtype(">u2" if is_bigendian else "<u2")
        px = np.ascontiguousarray(rows).view(dt).reshape(height, width, enc.channels)
        px = (px >> 8).astype(np.uint8)  # [H, W, C]
    else:
        px = rows.reshape(height, width, enc.channels)  # [H, W, C]
    return _to_rgb(px, enc.order)


def _to_rgb(px: np.ndarray, order: str) -> np.ndarray:
    if order == "rgb":
        return px.copy()
    if order == "bgr":
        return px[..., ::-1].copy()
    if order == "rgba":
        return px[..., :3].copy()
    if order == "bgra":
        return px[..., 2::-1].copy()
    if order == "mono":
        return np.repeat(px, 3, axis=2)
    return _yuv422_to_rgb(px, order)


def _yuv422_to_rgb(px: np.ndarray, order: str) -> np.ndarray:
    """Packed 4:2:2 (two bytes per pixel) -> RGB with BT.601 video-range coefficients."""
    h, w = px.shape[:2]
    quad = px.reshape(h, w // 2, 4).astype(np.float32)  # one (U,Y,V,Y) or (Y,U,Y,V) per 2 pixels
    if order == "uyvy":
        u, y0, v, y1 = (quad[..., i] for i in range(4))
    else:
        y0, u, y1, v = (quad[..., i] for i in range(4))
    y = np.stack([y0, y1], axis=-1).reshape(h, w) - 16.0  # [H, W]
    u = np.repeat(u, 2, axis=1) - 128.0
    v = np.repeat(v, 2, axis=1) - 128.0
    r = 1.164 * y + 1.596 * v
    g = 1.164 * y - 0.392 * u - 0.813 * v
    b = 1.164 * y + 2.017 * u
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).round().astype(np.uint8)


def compressed_payload(fmt: str, data, max_pixels: int = MAX_PIXELS) -> bytes:
    """The bytes of a ``sensor_msgs/CompressedImage`` once its header says it may be decoded:
    a colour format Pillow can read the size of, at most ``max_pixels``. Only the header is read
    (Pillow opens images lazily), so a frame that is refused costs no decoding memory."""
    raw = bytes(memoryview(data).cast("B"))
    if not raw:
        raise ImageError("empty", f"compressed frame ({fmt or 'no format'}) carries no data")
    if "compresseddepth" in fmt.lower().replace(" ", ""):
        raise ImageError("unknown_encoding", f"format {fmt!r} is a depth image, not a colour frame")
    from PIL import Image  # noqa: PLC0415 - a core dependency, loaded on the first compressed frame

    try:
        with Image.open(io.BytesIO(raw)) as im:
            width, height = im.size
    except Image.DecompressionBombError as e:  # Pillow's own bound (~179 M pixels), met first
        raise ImageError("too_large", str(e)) from e
    except (OSError, ValueError) as e:
        raise ImageError("decode_failed", f"no image header in a {len(raw)}-byte {fmt or 'frame'}: {e}") from e
    check_size(width, height, max_pixels)
    return raw


def decode_compressed(fmt: str, data, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """A ``sensor_msgs/CompressedImage`` payload (JPEG, PNG, ...) -> RGB uint8 [H, W, 3], refused
    by its header when larger than ``max_pixels`` (:func:`compressed_payload`)."""
    raw = compressed_payload(fmt, data, max_pixels)
    try:
        import cv2  # noqa: PLC0415 - optional
    except ImportError:
        cv2 = None
    if cv2 is not None:
        img = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise ImageError("decode_failed", f"OpenCV could not decode a {len(raw)}-byte {fmt or 'frame'}")
        return np.ascontiguousarray(img[..., ::-1])
    from PIL import Image  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError("decode_failed", f"Pillow could not decode a {len(raw)}-byte {fmt or 'frame'}: {e}") from e


def resize_rgb(image: np.ndarray, size: int) -> np.ndarray:
    """RGB uint8 [H, W, 3] -> [size, size, 3] uint8 with Pillow's antialiased bilinear filter;
    a frame already at ``size`` is returned as it is (no copy)."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        got = f"{image.dtype} {list(image.shape)}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ImageError("bad_image", f"image must be uint8 [H, W, 3], got {got}")
    if image.shape[0] == size and image.shape[1] == size:
        return image
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ImageError("empty", "cannot resize an empty image")
    from PIL import Image  # noqa: PLC0415 - a core dependency, loaded on the first resize

    out = Image.fromarray(np.ascontiguousarray(image)).resize((size, size), Image.Resampling.BILINEAR)
    return np.array(out, dtype=np.uint8)  # a writable array


def encode_raw(rgb: np.ndarray, encoding: str = "rgb8", *, pad: int = 0, bigendian: bool = False) -> tuple[int, int, int, bytes]:
    """The inverse of :func:`decode_raw` for tests and synthetic sources: RGB uint8 [H, W, 3]
    -> (height, width, step, data) in ``encoding`` with ``pad`` bytes of row padding."""
    enc = ENCODINGS[encoding]
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"encode_raw needs uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
    h, w = rgb.shape[:2]
    order = {"rgb": [0, 1, 2], "bgr": [2, 1, 0], "rgba": [0, 1, 2, None], "bgra": [2, 1, 0, None]}
    if enc.order == "mono":
        px = rgb[..., :1]
    elif enc.order in order:
        idx = order[enc.order]
        chans = [rgb[..., i] if i is not None else np.full((h, w), 255, np.uint8) for i in idx]
        px = np.stack(chans, axis=-1)
    else:
        raise ValueError(f"encode_raw does not write {encoding}")
    if enc.depth == 2:
        px = px.astype(np.uint16) * 257  # 0..255 -> 0..65535
        px = px.astype(">u2" if bigendian else "<u2")
    row = px.reshape(h, -1).view(np.uint8)  # [H, row bytes]
    step = row.shape[1] + pad
    out = np.zeros((h, step), np.uint8)
    out[:, : row.shape[1]] = row
    return h, w, step, out.tobytes()
