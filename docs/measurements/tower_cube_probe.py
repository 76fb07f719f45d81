"""Does a SmolVLA bundle's vision tower, frozen, still show where the cube is? (docs/policy-experiments.md,
"The trained tower lost the cube; a random one keeps it").

Renders the first frame of many transfer_cube seeds with the bundle's cameras (arms at home, so
only the cube differs), runs the bundle's tower and connector on them as the policy does
(LeRobot's resize with padding; the tokens the language model reads), then fits a small probe
(layer norm, attention pooling over one camera's tokens, an MLP) to the cube's x and y. The same
with the tower at the trainer's random initialization (``--random``) says what the training did
to the tower. Predicting the training mean scores ~5.1 cm (the cube is uniform on 20 x 20 cm).

Usage, from the repository root (rendering 1,200 seeds ~3 min, the tokens ~3-6 min, each fit ~1 min)::

    MUJOCO_GL=egl .venv/bin/python docs/measurements/tower_cube_probe.py --bundle bundles/transfer_cube-smolvla
    MUJOCO_GL=egl .venv/bin/python docs/measurements/tower_cube_probe.py --bundle bundles/transfer_cube-smolvla --random
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cube_localization_probe import CENTER, SPREAD, TEST_SEEDS  # noqa: E402

SIM_CAMERA = {"cam_high": "top", "cam_left_wrist": "left_wrist", "cam_right_wrist": "right_wrist"}


@torch.no_grad()
def first_frame_tokens(vis, cameras: tuple[str, ...], size: int, seeds) -> tuple[torch.Tensor, np.ndarray]:
    """[N, C, T, H] the tower's tokens of each seed's first frame, [N, 2] the cube's x, y."""
    from vla_accel_ros.models.lerobot_compat import padded_frames
    from vla_accel_ros.sim import AlohaSim, SimConfig

    sim_cams = tuple(SIM_CAMERA[c] for c in cameras)
    sim = AlohaSim(SimConfig(task="transfer_cube", cameras=sim_cams))
    tokens, xy = [], []
    for s in seeds:
        obs = sim.reset(seed=s, cameras=sim_cams)
        frames = padded_frames({c: obs.images[sc] for c, sc in zip(cameras, sim_cams)}, cameras, size)
        tokens.append(vis(frames.pixels).float())
        xy.append(sim.object_qpos[:2].copy())
    return torch.stack(tokens), np.stack(xy)


class Probe(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.score = nn.LayerNorm(width), nn.Linear(width, 1)
        self.out = nn.Sequential(nn.Linear(width, 256), nn.GELU(), nn.Linear(256, 2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, 2]
        t = self.norm(tokens)
        w = torch.softmax(self.score(t).squeeze(-1), -1)
        return self.out((w[..., None] * t).sum(1))


def fit(x_tr, y_tr, x_te, y_te, steps: int, label: str) -> None:
    torch.manual_seed(0)
    probe = Probe(x_tr.shape[-1])
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        rows = torch.randint(0, len(x_tr), (64,), generator=gen)
        loss = (probe(x_tr[rows]) - y_tr[rows]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 500 == 0:
            with torch.no_grad():
                err = [float((probe(x) - y).abs().mean()) * SPREAD * 100 for x, y in ((x_tr, y_tr), (x_te, y_te))]
            print(f"{label} step {step}: train {err[0]:.2f} cm, test {err[1]:.2f} cm", flush=True)


def main() -> None:
    from vla_accel_ros.core.bundle import load_bundle
    from vla_accel_ros.models.factory import build_model
    from vla_accel_ros.models.family import get_family

    p = argparse.ArgumentParser()
    p.add_argument("--bundle", type=Path, required=True, help="a smolvla bundle")
    p.add_argument("--random", action="store_true", help="the tower at the trainer's random initialization (seed 0)")
    p.add_argument("--train-seeds", type=int, default=1000, help="seeds 1000.. for the probe's training")
    p.add_argument("--steps", type=int, default=3000)
    a = p.parse_args()
    bundle = load_bundle(a.bundle)
    torch.manual_seed(0)
    model = build_model(bundle.spec)
    if a.random:
        get_family(bundle.spec.family).init_for_training(model)
    else:
        model.load_state_dict({k: v.float() for k, v in bundle.state_dict.items()})
    model.eval()
    cams, size = tuple(bundle.spec.cameras), int(bundle.spec.vision["image_size"])
    t0 = time.perf_counter()
    x_tr, xy_tr = first_frame_tokens(model.vis, cams, size, range(1000, 1000 + a.train_seeds))
    x_te, xy_te = first_frame_tokens(model.vis, cams, size, TEST_SEEDS)
    print(f"tokens {tuple(x_tr.shape)} of {len(x_tr) + len(x_te)} frames in {time.perf_counter() - t0:.0f} s", flush=True)
    y_tr, y_te = (torch.tensor((xy - CENTER) / SPREAD, dtype=torch.float32) for xy in (xy_tr, xy_te))
    print(f"the training mean: {float((y_te - y_tr.mean(0)).abs().mean()) * SPREAD * 100:.2f} cm")
    label = "random tower" if a.random else "trained tower"
    fit(x_tr[:, 0], y_tr, x_te[:, 0], y_te, a.steps, f"{label}, {cams[0]}")


if __name__ == "__main__":
    main()
