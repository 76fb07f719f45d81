"""A synthetic camera stream: a two-link arm moving over a static textured table.

Until recorded or simulated frames are at hand, this is the honest stand-in for a robot
camera: most of the image is static (what a token cache can reuse), the arm sweeps across a
changing fraction of patches, and optional sensor noise keeps "static" from meaning
"bit-identical".
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from vla_accel_ros.core.types import Observation


def _background(size: int, rng: np.random.Generator) -> np.ndarray:
    low = rng.integers(40, 220, size=(size // 16 + 1, size // 16 + 1, 3)).astype(np.float32)
    bg = np.kron(low, np.ones((16, 16, 1), np.float32))[:size, :size]
    yy, xx = np.mgrid[0:size, 0:size]
    bg += 20.0 * np.sin(xx / 7.0)[..., None] * np.cos(yy / 11.0)[..., None]  # texture inside tiles
    return bg


def _draw_segment(img: np.ndarray, p0, p1, width: float, color) -> None:
    size = img.shape[0]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    d = np.asarray(p1, np.float32) - np.asarray(p0, np.float32)
    t = np.clip(((xx - p0[0]) * d[0] + (yy - p0[1]) * d[1]) / max(float(d @ d), 1e-6), 0.0, 1.0)
    dist = np.hypot(xx - (p0[0] + t * d[0]), yy - (p0[1] + t * d[1]))
    img[dist <= width] = color


def moving_arm_frames(
    n: int, size: int = 224, *, seed: int = 0, speed: float = 1.0, noise: float = 1.0
) -> Iterator[np.ndarray]:
    """``n`` frames [size, size, 3] uint8; ``speed`` scales the arm's angular velocity."""
    rng = np.random.default_rng(seed)
    bg = _background(size, rng)
    base = np.array([size * 0.5, size * 0.95])
    l1, l2 = size * 0.35, size * 0.28
    for i in range(n):
        a1 = -np.pi / 2 + 0.5 * np.sin(0.15 * speed * i)
        a2 = 0.8 * np.sin(0.23 * speed * i + 1.0)
        elbow = base + l1 * np.array([np.cos(a1), np.sin(a1)])
        hand = elbow + l2 * np.array([np.cos(a1 + a2), np.sin(a1 + a2)])
        img = bg.copy()
        _draw_segment(img, base, elbow, size * 0.035, (60, 60, 70))
        _draw_segment(img, elbow, hand, size * 0.03, (80, 80, 95))
        _draw_segment(img, hand, hand + 0.06 * size * np.array([np.cos(a1 + a2), np.sin(a1 + a2)]), size * 0.045, (200, 60, 40))
        if noise:
            img = img + rng.normal(0.0, noise, img.shape)
        yield np.clip(img, 0, 255).astype(np.uint8)


def synthetic_observations(spec, n: int, *, seed: int = 0, speed: float = 1.0, noise: float = 1.0) -> list[Observation]:
    """Observations for ``spec``'s cameras (each camera its own arm phase), 50 Hz stamps."""
    streams = [moving_arm_frames(n, spec.image_size, seed=seed + k, speed=speed, noise=noise) for k in range(len(spec.cameras))]
    out = []
    for i in range(n):
        images = {cam: next(s) for cam, s in zip(spec.cameras, streams)}
        state = None
        if spec.state_dim:
            mean = np.asarray(spec.norm_stats["state"]["mean"], np.float32)
            state = mean + 0.05 * np.sin(0.1 * i + np.arange(spec.state_dim, dtype=np.float32))
        out.append(Observation(images=images, instruction=spec.default_instruction, stamp_ns=i * 20_000_000, state=state))
    return out
