"""Camera frame decoding from message fields (no ROS, no cv_bridge)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vla_accel_ros.core.robot.images import ENCODINGS, ImageError, decode_compressed, decode_raw, encode_raw


@pytest.fixture
def rgb():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8", "rgb16", "bgr16", "rgba16", "bgra16"])
@pytest.mark.parametrize("pad", [0, 7])
@pytest.mark.parametrize("bigendian", [False, True])
def test_colour_encodings_round_trip_with_padding_and_endianness(rgb, encoding, pad, bigendian):
    h, w, step, data = encode_raw(rgb, encoding, pad=pad, bigendian=bigendian)
    assert step == w * ENCODINGS[encoding].channels * ENCODINGS[encoding].depth + pad
    out = decode_raw(encoding, h, w, step, bigendian, data)
    np.testing.assert_array_equal(out, rgb)


def test_sixteen_bit_byte_order_is_honoured():
    # One mono16 pixel of value 0x1234: its high byte (0x12 = 18) is what survives.
    big, little = b"\x12\x34", b"\x34\x12"
    assert decode_raw("mono16", 1, 1, 2, True, big)[0, 0, 0] == 0x12
    assert decode_raw("mono16", 1, 1, 2, False, little)[0, 0, 0] == 0x12
    assert decode_raw("mono16", 1, 1, 2, False, big)[0, 0, 0] == 0x34


@pytest.mark.parametrize("encoding", ["mono8", "8UC1", "mono16", "16UC1"])
def test_mono_becomes_grey_rgb(rgb, encoding):
    h, w, step, data = encode_raw(rgb, encoding, pad=3)
    out = decode_raw(encoding, h, w, step, False, data)
    assert out.shape == (6, 10, 3)
    np.testing.assert_array_equal(out[..., 0], rgb[..., 0])
    np.testing.assert_array_equal(out[..., 0], out[..., 2])


def test_yuv422_decodes_grey_to_grey():
    # U = V = 128 is colourless; Y = 16 + 219 * k maps to 255 * k.
    h, w = 2, 4
    y = np.array([[16, 126, 235, 16], [235, 235, 16, 16]], np.uint8)
    uyvy = np.empty((h, w * 2), np.uint8)
    uyvy[:, 0::4], uyvy[:, 2::4] = 128, 128
    uyvy[:, 1::4], uyvy[:, 3::4] = y[:, 0::2], y[:, 1::2]
    out = decode_raw("uyvy", h, w, w * 2, False, uyvy.tobytes())
    assert out.shape == (h, w, 3)
    assert np.all(np.abs(out[..., 0].astype(int) - out[..., 2]) <= 1)
    assert out[0, 0, 0] == 0 and out[0, 2, 0] == 255


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (dict(encoding="32FC1"), "unknown_encoding"),
        (dict(encoding="bayer_rggb8"), "unknown_encoding"),
        (dict(step=20), "bad_step"),  # < 10 * 3
        (dict(data=b""), "empty"),
        (dict(data=b"\0" * 100), "size_mismatch"),
        (dict(height=0), "bad_size"),
        (dict(width=-4), "bad_size"),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(rgb, fields, reason):
    h, w, step, data = encode_raw(rgb, "rgb8")
    args = dict(encoding="rgb8", height=h, width=w, step=step, is_bigendian=False, data=data) | fields
    with pytest.raises(ImageError) as e:
        decode_raw(**args)
    assert e.value.reason == reason


def test_compressed_png_decodes_and_garbage_is_rejected(rgb):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    np.testing.assert_array_equal(decode_compressed("png", buf.getvalue()), rgb)
    with pytest.raises(ImageError) as e:
        decode_compressed("jpeg", b"not a jpeg at all")
    assert e.value.reason == "decode_failed"
    with pytest.raises(ImageError):
        decode_compressed("jpeg", b"")


def _bilevel_png(width: int, height: int) -> bytes:
    """A valid black PNG of ``width`` x ``height`` at 1 bit per pixel: a few kB of file for
    any size (what an attacker sends), written row by row without the pixels in memory."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_small_png_claiming_a_huge_size_is_refused_by_its_header_without_decoding(tmp_path):
    """9000 x 9000 would be 243 MB as RGB: refused from the header, in a process whose peak
    memory stays far below that (the decoder never ran)."""
    import subprocess
    import sys

    png = tmp_path / "huge.png"
    png.write_bytes(_bilevel_png(9000, 9000))
    assert png.stat().st_size < 50_000
    code = (
        "import resource, sys\n"
        "from vla_accel_ros.core.robot.images import ImageError, decode_compressed\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    decode_compressed('png', open(sys.argv[1], 'rb').read())\n"
        "    print('decoded')\n"
        "except ImageError as e:\n"
        "    print(e.reason)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(png)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    reason, grown_mb = out.stdout.split()
    assert reason == "too_large", out.stdout + out.stderr
    assert int(grown_mb) < 100  # MB: the pixels were never allocated
    with pytest.raises(ImageError) as e:  # past Pillow's own bound too: the same reason
        decode_compressed("png", _bilevel_png(20000, 20000))
    assert e.value.reason == "too_large"
    # A frame within the bound still decodes; the bound is a parameter.
    small = _bilevel_png(64, 32)
    assert decode_compressed("png", small).shape == (32, 64, 3)
    with pytest.raises(ImageError) as e:
        decode_compressed("png", small, max_pixels=64 * 31)
    assert e.value.reason == "too_large" and "max_pixels" in str(e.value)
    with pytest.raises(ImageError) as e:
        decode_raw("rgb8", 32, 64, 192, False, b"\0" * 192 * 32, max_pixels=100)
    assert e.value.reason == "too_large"
