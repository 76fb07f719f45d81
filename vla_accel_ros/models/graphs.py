"""A policy's exported graphs on a backend (:mod:`vla_accel_ros.core.backends`): its
vision tower + connector (``model.vis``), one graph per camera at the bundle's image size, which
:meth:`~vla_accel_ros.models.base.PolicyBase.prefix_embeddings` runs on the uncached path (every
patch of a camera). The vision cache's partial passes (a fresh token's patches attending to the
cached K/V of the others) have no fixed shape and stay on the torch modules.

Every family's ``model.vis`` maps pixels [C, 3, S, S] to image-token embeddings [C, T, H], so
nothing here depends on the family. (SmolVLA's expert pass, the one decoder step a policy runs
on a backend, is :class:`~vla_accel_ros.models.smolvla.expert.ExpertGraph`.)"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.backends import GraphRunner, build_runner
from vla_accel_ros.core.precision import PrecisionConfig

VISION = "vision"  # the graph's name: vision.onnx, ... (core.backends.graph_file)


def vision_fingerprint(model: nn.Module) -> str:
    """Which vision tower a graph was exported from: a hash of every parameter's name, shape and
    first 256 values (a sample: cheap at full size, and no two trained or random towers share
    it), written into export.json and compared when a policy loads ``precision.graphs``."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.vis.state_dict().items()):
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def vision_example(spec) -> torch.Tensor:
    """The vision graph's input: one camera's pixels [1, 3, S, S] in [-1, 1]."""
    return torch.zeros(1, 3, spec.image_size, spec.image_size)


def reduce_range_here() -> bool:
    """Whether ONNX Runtime's int8 graphs take 7-bit weights on this CPU: where it has no VNNI
    (core.backends' module doc), for the policy's graph and ``vla-accel export``'s alike."""
    from vla_accel_ros.models import precision

    return not precision.native_vnni()


def vision_runner(model: nn.Module, spec, precision: PrecisionConfig, *, threads: int,
                  calibration: Iterable[torch.Tensor] = ()) -> GraphRunner:  # fmt: skip
    """``model.vis`` (fp32 modules) exported and loaded on ``precision.backend`` at
    ``precision.vision``; ``calibration``: pixels [C, 3, S, S] of frames (OpenVINO int8)."""
    return build_runner(model.vis, vision_example(spec), precision.backend, precision.vision, threads=threads,
                        calibration=camera_inputs(calibration), reduce_range=reduce_range_here())  # fmt: skip


def camera_inputs(pixels: Iterable[torch.Tensor]) -> list[np.ndarray]:
    """The vision graph's inputs (one camera each, [1, 3, S, S]) of frames' pixels [C, 3, S, S]."""
    return [np.asarray(p[i : i + 1], dtype=np.float32) for p in pixels for i in range(p.shape[0])]


def check_vision_runner(runner: GraphRunner, model: nn.Module, pixels: torch.Tensor) -> float:
    """max |graph - fp32 torch| of the image-token embeddings of ``pixels`` [C, 3, S, S]."""
    with torch.inference_mode():
        return float((runner(pixels) - model.vis(pixels)).abs().max())
