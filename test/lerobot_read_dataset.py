"""Read a LeRobotDataset the way a LeRobot user does, in LeRobot's Python, and dump what it holds
for test/test_lerobot_export.py to compare with the bags (imports nothing of vla_accel_ros).

    PY test/lerobot_read_dataset.py --root DIR --out PREFIX [--rows 0,9]

writes PREFIX.json (counts, fps, episodes, tasks, features, stats) and PREFIX.safetensors
(every row's state, action, timestamp, frame and episode index; each camera's image [H, W, 3]
uint8 at the ``--rows``). Images come from ``LeRobotDataset.__getitem__``; for a video dataset
this venv has none of LeRobot's decoders (no torchcodec, and torchvision 0.28 has no
VideoReader), so its frames are decoded with PyAV at the timestamp LeRobot would seek
(the episode's ``from_timestamp`` + the row's ``timestamp``).
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="0")
    args = ap.parse_args()
    import importlib.util
    from pathlib import Path

    import numpy as np
    import torch

    # The writer worker's own torchvision shim (LeRobot imports torchvision at import time).
    here = Path(__file__).resolve().parents[1] / "vla_accel_ros" / "io" / "lerobot_dataset_worker.py"
    spec = importlib.util.spec_from_file_location("lerobot_dataset_worker", here)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker._load_torchvision_ops(torch)
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from safetensors.numpy import save_file

    ds = LeRobotDataset("local/check", root=args.root)
    meta = ds.meta
    names = ("observation.state", "action", "timestamp", "frame_index", "episode_index", "index", "task_index")
    hf = ds.hf_dataset.select_columns(list(names))  # not the images: every row's would be decoded
    cols = {k: np.stack([np.asarray(v) for v in hf[k]]) for k in names}
    arrays = {k: np.ascontiguousarray(v) for k, v in cols.items()}
    rows = [int(r) for r in args.rows.split(",")]
    video = bool(meta.video_keys)
    for r in rows:
        if not video:
            item = ds[r]
            for cam in meta.camera_keys:
                arrays[f"{cam}@{r}"] = _hwc_uint8(item[cam])
        else:
            ep = int(cols["episode_index"][r])
            for cam in meta.video_keys:
                t = meta.episodes[ep][f"videos/{cam}/from_timestamp"] + float(cols["timestamp"][r])
                arrays[f"{cam}@{r}"] = _pyav_frame(Path(args.root) / meta.get_video_file_path(ep, cam), t, 1 / meta.fps)
    episodes = [{"from": int(e["dataset_from_index"]), "to": int(e["dataset_to_index"]), "tasks": list(e["tasks"]),
                 "length": int(e["length"])} for e in meta.episodes]  # fmt: skip
    tasks = {int(i): name for name, i in zip(meta.tasks.index, meta.tasks["task_index"])}
    summary = {
        "num_frames": ds.num_frames, "num_episodes": ds.num_episodes, "fps": ds.fps, "len": len(ds),
        "codebase_version": meta.info["codebase_version"], "features": meta.features, "episodes": episodes,
        "tasks": tasks, "video_keys": list(meta.video_keys), "camera_keys": list(meta.camera_keys),
        "row_task": [ds[r]["task"] for r in rows] if not video else [tasks[int(cols["task_index"][r])] for r in rows],
        "stats": {k: {s: np.asarray(v).tolist() for s, v in meta.stats[k].items()}
                  for k in ("observation.state", "action")},  # fmt: skip
    }
    Path(args.out + ".json").write_text(json.dumps(summary))
    save_file(arrays, args.out + ".safetensors")
    return 0


def _hwc_uint8(chw01):
    """LeRobot's [3, H, W] float in [0, 1] -> [H, W, 3] uint8 (exact for a PNG image)."""
    import numpy as np

    return np.ascontiguousarray((chw01.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


def _pyav_frame(path, t: float, period: float):
    import av

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        for frame in c.decode(stream):
            if abs(float(frame.pts * stream.time_base) - t) < period / 2:
                return frame.to_ndarray(format="rgb24")
    raise SystemExit(f"{path}: no frame at {t:.4f} s")


if __name__ == "__main__":
    sys.exit(main())
