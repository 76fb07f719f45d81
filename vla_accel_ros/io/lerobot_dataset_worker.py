"""LeRobot's own ``LeRobotDataset`` writer as a worker process, for ``vla-accel bag export-lerobot``.

Runs in the Python whose environment has LeRobot (its side venv: LeRobot pins torch and
transformers versions this package does not use), so it imports nothing of this package: only
the standard library, NumPy, safetensors and LeRobot. Started as

    PY lerobot_dataset_worker.py --root DIR --repo-id ID --fps N --features JSON [--video]

it creates the dataset with ``LeRobotDataset.create`` (``DIR`` must not exist), answers one JSON
line ``{"ready": ...}`` on stdout, then reads messages on stdin, each a JSON line (a header)
followed by ``size`` bytes:

- ``{"op": "frame", "task": TEXT, "size": N}`` + a safetensors blob of the frame's arrays
  (``observation.images.<camera>`` [H, W, 3] uint8, ``observation.state``, ``action``):
  ``add_frame``, no answer (a stream; the pipe's buffer is the back-pressure);
- ``{"op": "episode"}``: ``save_episode`` (LeRobot writes the rows, encodes the videos and
  computes the episode's statistics), answers ``{"episode": INDEX, "frames": N}``;
- ``{"op": "finish"}``: ``finalize``, then LeRobot's metadata reader reads the dataset back and
  the answer holds what it found (episodes, frames, fps, features, codebase version).

A failure ends the process with LeRobot's traceback on stderr (the parent shows its tail).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
from typing import BinaryIO, Iterator


def messages(stream: BinaryIO) -> Iterator[tuple[dict, bytes]]:
    """(header, body) of each message on ``stream`` until it closes."""
    while True:
        line = stream.readline()
        if not line:
            return
        head = json.loads(line)
        size = int(head.get("size", 0))
        body = stream.read(size) if size else b""
        if len(body) != size:
            raise SystemExit(f"a {head.get('op')!r} message ends after {len(body)} of its {size} bytes")
        yield head, body


def _load_torchvision_ops(torch) -> None:
    """LeRobot imports torchvision when it is imported (the datasets never call its compiled
    ops). Where torchvision's compiled part cannot load beside this torch (the side venv's CPU
    torch with PyPI's torchvision), declare the two op schemas its Python part registers
    kernels for, so that it imports; where it loads, its own ops are there and nothing is declared."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return
        except OSError:
            break
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--repo-id", required=True)
    ap.add_argument("--fps", type=int, required=True)
    ap.add_argument("--features", required=True, help="JSON: LeRobot's features dict")
    ap.add_argument("--robot-type", default="aloha")
    ap.add_argument("--video", action="store_true")
    ap.add_argument("--image-writer-threads", type=int, default=2)
    args = ap.parse_args()
    # Answers go to the real stdout; whatever LeRobot prints (progress bars, logs) to stderr.
    answers, sys.stdout = sys.stdout, sys.stderr

    import torch

    _load_torchvision_ops(torch)
    import lerobot
    from lerobot.datasets.lerobot_dataset import CODEBASE_VERSION, LeRobotDataset, LeRobotDatasetMetadata
    from safetensors.numpy import load as load_arrays

    def answer(obj: dict) -> None:
        print(json.dumps(obj), file=answers, flush=True)

    # LeRobot compares shapes as tuples; JSON has lists.
    features = {k: {**f, "shape": tuple(f["shape"])} for k, f in json.loads(args.features).items()}
    ds = LeRobotDataset.create(
        args.repo_id, fps=args.fps, features=features, root=args.root, robot_type=args.robot_type,
        use_videos=args.video, image_writer_threads=args.image_writer_threads,
    )  # fmt: skip
    answer({"ready": True, "lerobot": lerobot.__version__, "codebase_version": CODEBASE_VERSION})
    saved = 0
    for head, body in messages(sys.stdin.buffer):
        op = head.get("op")
        if op == "frame":
            frame = dict(load_arrays(body))
            frame["task"] = head["task"]
            ds.add_frame(frame)
        elif op == "episode":
            frames = ds.episode_buffer["size"]
            ds.save_episode()
            answer({"episode": saved, "frames": frames})
            saved += 1
        elif op == "finish":
            ds.finalize()
            ds.stop_image_writer()
            meta = LeRobotDatasetMetadata(args.repo_id, root=args.root)  # LeRobot's reader, as training opens it
            answer({
                "episodes": meta.total_episodes, "frames": meta.total_frames, "fps": meta.fps,
                "codebase_version": meta.info["codebase_version"], "features": sorted(meta.features),
                "lengths": [int(n) for n in meta.episodes["length"]], "stats": sorted(meta.stats),
            })  # fmt: skip
            return 0
        else:
            raise SystemExit(f"unknown message {head!r}")
    raise SystemExit("the exporter closed the stream before 'finish'")


if __name__ == "__main__":
    sys.exit(main())
