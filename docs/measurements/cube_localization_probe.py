"""Can a vision tower trained from scratch find the cube? (docs/policy-experiments.md, "The
policies were blind: a convolutional stem lets the tower see the cube").

Renders the first frame (arms at home, so only the cube differs) of many transfer_cube seeds
with the top camera at 224 px, then trains the ``mini`` SigLIP tower of the flow family (4 x 192,
28 px patches: 8 x 8 tokens), with or without the package's convolutional stem
(:class:`~vla_accel_ros.models.common.ConvStem`), plus a small head (attention pooling over the
tokens, an MLP) to regress the cube's x and y on the table. Supervised directly, with no
behaviour cloning around it: if the tower cannot learn this, no policy built on it can look.

Usage, from the repository root (one torch thread; rendering ~6 min, 500 steps ~6 min)::

    MUJOCO_GL=egl .venv/bin/python docs/measurements/cube_localization_probe.py --frames /tmp/cube0.npz
    MUJOCO_GL=egl .venv/bin/python docs/measurements/cube_localization_probe.py --frames /tmp/cube0.npz --stem 32,64

Prints the mean absolute test error in cm (200 held-out seeds) every 100 steps; predicting the
middle of the table scores ~5 cm (the cube is placed uniformly on a 20 x 20 cm square).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.robot.images import resize_rgb
from vla_accel_ros.models.common import CONV_STEM, ConvStem, build_vision, siglip_pixels

TRAIN_SEEDS, TEST_SEEDS = range(1000, 3000), range(5000, 5200)
CENTER, SPREAD = np.array([0.1, 0.5]), 0.0577  # the cube's x, y: uniform on [0, 0.2] x [0.4, 0.6] m


def render(path: Path) -> dict[str, np.ndarray]:
    from vla_accel_ros.sim import AlohaSim, SimConfig

    if path.is_file():
        return dict(np.load(path))
    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=("top",)))
    out: dict[str, list] = {}
    for name, seeds in (("train", TRAIN_SEEDS), ("test", TEST_SEEDS)):
        imgs, xy = [], []
        for s in seeds:
            obs = sim.reset(seed=s, cameras=("top",))
            imgs.append(resize_rgb(obs.images["top"], 224))
            xy.append(sim.object_qpos[:2].copy())
        out[f"{name}_images"], out[f"{name}_xy"] = np.stack(imgs), np.stack(xy)
    np.savez(path, **out)
    return out


class Probe(nn.Module):
    def __init__(self, stem: list[int]) -> None:
        super().__init__()
        vision = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
                      image_size=224, patch_size=28, **({CONV_STEM: stem} if stem else {}))  # fmt: skip
        self.stem, self.tower = ConvStem(stem), build_vision(vision)
        self.score = nn.Linear(192, 1)
        self.out = nn.Sequential(nn.Linear(192, 192), nn.GELU(), nn.Linear(192, 2))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [B, S, S, 3] uint8 -> [B, 2]
        tokens = self.tower(pixel_values=self.stem(siglip_pixels(frames[:, None])[:, 0])).last_hidden_state
        w = torch.softmax(self.score(tokens).squeeze(-1), -1)
        return self.out((w[..., None] * tokens).sum(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=Path, required=True, help=".npz of rendered frames (written on the first run)")
    p.add_argument("--stem", default="", help="conv stem channels, e.g. 32,64 (default: none)")
    p.add_argument("--steps", type=int, default=500)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = render(a.frames)
    x_tr, x_te = torch.from_numpy(data["train_images"]), torch.from_numpy(data["test_images"])
    y_tr, y_te = (torch.tensor((data[f"{k}_xy"] - CENTER) / SPREAD, dtype=torch.float32) for k in ("train", "test"))
    model = Probe([int(c) for c in a.stem.split(",") if c])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float()

    def test_cm() -> float:
        model.eval()
        with torch.no_grad():
            pred = torch.cat([predict(x_te[i : i + 50]) for i in range(0, len(x_te), 50)])
        model.train()
        return float((pred - y_te).abs().mean()) * SPREAD * 100

    print(f"stem {a.stem or 'none'}: test error {test_cm():.2f} cm before training", flush=True)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        rows = torch.randint(0, len(x_tr), (32,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = 3e-4 * min(1.0, step / 50)
        loss = (predict(x_tr[rows]) - y_tr[rows]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: train loss {loss.item():.3f}, test error {test_cm():.2f} cm "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
