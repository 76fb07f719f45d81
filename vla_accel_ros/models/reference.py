"""Parity against a reference implementation's own outputs (``vla-accel parity --reference DIR``).

A reference fixture (the format of ``../shared/fixtures/smolvla-lerobot/``, written in the
reference's own environment, e.g. LeRobot's) holds ``fixture.json`` (``task``, ``cameras``:
the reference's camera feature names) and ``fixture.safetensors``:

* ``raw.observation.images.<camera>`` [1, 3, h, w] float in [0, 1] and ``raw.observation.state``
  [1, S]: the observation as the robot gives it;
* ``input.noise`` [1, H, A]: the noise the reference started its flow from;
* ``output.actions`` [1, H, D]: its actions in robot units;
* ``debug.*``: optional intermediates; a family's policy computes those it knows
  (``reference_intermediates(obs, noise, debug) -> name -> (ours, the reference's)``, in
  pipeline order), and the first one that differs is reported.

The bundle's fp32 policy gets the observation as the policy node builds it (images as
[h, w, 3] arrays, the state vector, the task text) and the same noise; its actions are
compared with the reference's in units of the action spread (for mean/std normalization, the
normalized actions the model output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vla_accel_ros.core.errors import BundleError
from vla_accel_ros.core.parity import ParityReport
from vla_accel_ros.core.types import Observation

_IMAGE = "raw.observation.images."


@dataclass
class ReferenceFixture:
    path: Path
    task: str
    images: dict[str, np.ndarray]  # the reference's camera name -> [h, w, 3] float32 in [0, 1]
    state: np.ndarray | None
    noise: np.ndarray  # [H, A]
    actions: np.ndarray  # [H, D] robot units
    debug: dict[str, torch.Tensor] = field(default_factory=dict)


def load_fixture(path: str | Path) -> ReferenceFixture:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / "fixture.json").read_text())
        tensors = load_file(str(path / "fixture.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise BundleError(f"{path}: not a reference fixture (fixture.json + fixture.safetensors): {e}") from e
    for key in ("input.noise", "output.actions"):
        if key not in tensors:
            raise BundleError(f"{path}/fixture.safetensors: {key} is missing")
    images = {k[len(_IMAGE):]: v[0].permute(1, 2, 0).contiguous().numpy() for k, v in tensors.items() if k.startswith(_IMAGE)}
    state = tensors.get("raw.observation.state")
    return ReferenceFixture(
        path=path, task=str(meta.get("task", "")), images=images, state=None if state is None else state[0].numpy(),
        noise=tensors["input.noise"][0].numpy(), actions=tensors["output.actions"][0].numpy(),
        debug={k[len("debug."):]: v for k, v in tensors.items() if k.startswith("debug.")},
    )  # fmt: skip


def fixture_observation(policy, fx: ReferenceFixture, camera_map: dict[str, str] | None = None) -> Observation:
    """The fixture's observation under the bundle's camera names (``camera_map``: reference
    camera -> bundle camera, e.g. the import's; default: ``observation.images.`` dropped)."""
    images = {}
    for name, img in fx.images.items():
        cam = (camera_map or {}).get(f"observation.images.{name}") or name
        images[cam] = img
    missing = [c for c in policy.spec.cameras if c not in images]
    if missing:
        raise BundleError(f"{fx.path}: the fixture has no image for camera(s) {', '.join(missing)} (has {', '.join(images)})")
    return Observation(images=images, instruction=fx.task, stamp_ns=0, state=fx.state)


def check_fixture(policy, fx: ReferenceFixture, tolerance: float, camera_map: dict[str, str] | None = None) -> ParityReport:
    """The policy's actions on the fixture against the reference's, at ``tolerance`` in units of
    the action spread; with ``debug.*`` tensors, the intermediates the family computes too."""
    report = ParityReport(tolerance=tolerance)
    obs = fixture_observation(policy, fx, camera_map)
    noise = fx.noise
    if tuple(noise.shape) != tuple(policy.noise_shape or ()):
        raise BundleError(f"{fx.path}: input.noise has shape {list(noise.shape)}, the bundle's policy takes {list(policy.noise_shape or ())}")
    policy.reset()
    got = policy.infer(obs, noise=noise).actions
    if got.shape != fx.actions.shape:
        raise BundleError(f"{fx.path}: output.actions has shape {list(fx.actions.shape)}, the bundle's chunk is {list(got.shape)}")
    center, scale = policy.action_scale()
    report.check("actions_max_abs_norm", float(np.abs((got - fx.actions) / scale).max()))
    report.metrics["actions_max_abs"] = float(np.abs(got - fx.actions).max())
    compute = getattr(policy, "reference_intermediates", None)
    if fx.debug and compute is not None:
        for name, (value, ref) in compute(obs, noise, fx.debug).items():  # in pipeline order: the first that differs is where to look
            if ref is None:
                continue
            ref = ref.float()
            if tuple(ref.shape) != tuple(value.shape):
                report.failures.append(f"debug.{name}: shape {list(value.shape)} here, {list(ref.shape)} in the fixture")
                break
            rel = float((value.float() - ref).abs().max() / ref.abs().max().clamp_min(1.0))
            report.metrics[f"debug.{name}_rel"] = rel
            if not rel <= tolerance:
                report.notes.append(f"first intermediate that differs: debug.{name} (max |delta| / max(1, max |ref|) = {rel:.3g})")
                break
    policy.reset()
    return report
