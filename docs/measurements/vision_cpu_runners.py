"""Which runner makes a bundle's vision tower faster on this CPU, and where does its time go?
(docs/runtime.md, "CPUs without bf16").

On frames of one bag, one thread: the eager fp32 tower (the reference), PyTorch's int8 tower
(``vision: int8``, what ``auto`` runs without bf16), ONNX Runtime on the fp32 graph and on int8
graphs (the one ``vla-accel export --onnx`` wrote, and ``quantize_dynamic`` with 7-bit weights and
with unsigned weights: the two ways around u8 x s8 saturation without VNNI), each one's RMS and
max error as a share of the tokens' std and its p50 / p95 per camera, the runners interleaved.
Then the eager tower's operators by self time (``torch.profiler``).

Usage, from the repository root (the shipped bundle: about 3 min)::

    MUJOCO_GL=egl .venv/bin/vla-accel export --bundle bundles/transfer_cube-smolvla --out graphs --onnx \\
        --calibrate CALIB_BAG --calibrate-frames 32
    MUJOCO_GL=egl .venv/bin/python docs/measurements/vision_cpu_runners.py --bundle bundles/transfer_cube-smolvla \\
        --graphs graphs --frames TEST_BAG
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vla_accel_ros.cli.export_cmd import _bag_pixels
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import PrecisionConfig
from vla_accel_ros.models.factory import load_policy
from vla_accel_ros.models.graphs import camera_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--graphs", required=True, type=Path, help="a `vla-accel export --onnx` directory")
    p.add_argument("--frames", required=True, type=Path, help="a bag")
    p.add_argument("--test-frames", type=int, default=12, help="observations of --frames (every 4th of the first 4x)")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.set_num_threads(1)
    eager = load_policy(args.bundle, PolicyConfig(parity_check=False))
    int8 = load_policy(args.bundle, PolicyConfig(parity_check=False, precision=PrecisionConfig(vision="int8")))
    test = np.concatenate(camera_inputs(_bag_pixels(eager, args.frames, 4 * args.test_frames)[::4]))
    tmp = Path(tempfile.mkdtemp())
    graphs = {"ONNX Runtime fp32": args.graphs / "vision.onnx", "ONNX Runtime int8 (vla-accel export)": args.graphs / "vision.int8.onnx"}
    for name, kwargs in {"7-bit weights": {"weight_type": QuantType.QInt8, "reduce_range": True},
                         "u8 weights": {"weight_type": QuantType.QUInt8}}.items():  # fmt: skip
        dst = tmp / f"{name.replace(' ', '_')}.onnx"
        quantize_dynamic(str(args.graphs / "vision.onnx"), str(dst), per_channel=True, op_types_to_quantize=["MatMul"], **kwargs)
        graphs[f"ONNX Runtime int8 ({name})"] = dst
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1

    def session(path: Path):
        s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        return lambda x: s.run(None, {name: x})[0]

    runners = {
        "torch fp32 (eager, the reference)": lambda x: eager.model.vis(torch.from_numpy(x)).numpy(),
        "torch int8 (vision: int8)": lambda x: int8.model.vis(torch.from_numpy(x)).numpy(),
        **{name: session(path) for name, path in graphs.items()},
    }
    print(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}; {len(test)} camera frames of {args.frames}")
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        outs = {name: np.concatenate([run(test[i : i + 1]) for i in range(len(test))]) for name, run in runners.items()}
        for _ in range(args.repeats):  # interleaved: a slow moment of the machine hits every runner alike
            for name, run in runners.items():
                t0 = time.perf_counter()
                run(test[:1])
                times[name].append(time.perf_counter() - t0)
    ref = outs["torch fp32 (eager, the reference)"]
    for name, out in outs.items():
        err, t = out - ref, 1000 * np.array(times[name])
        print(f"{name:42s} RMS {np.sqrt((err**2).mean()) / ref.std():6.2%}  max {np.abs(err).max() / ref.std():6.1%}  "
              f"p50 {np.median(t):4.0f} ms  p95 {np.percentile(t, 95):4.0f} ms per camera")  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eager.model.vis(torch.from_numpy(test[:1]))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


if __name__ == "__main__":
    main()
