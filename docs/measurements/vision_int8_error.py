"""How far is a vision graph from the eager fp32 tower, and how fast is it? (docs/runtime.md,
"OpenVINO int8: two departures from NNCF's defaults" and "CPUs without bf16").

Runs a bundle's vision tower + connector eagerly (fp32, the reference) on frames of one bag, then
on OpenVINO: the fp32 graph with fp32 and with bf16 kernels, NNCF's int8 with NNCF's own
defaults (quantized here from the fp32 graph, calibrated on the same frames ``vla-accel export``
used), the int8 graph ``vla-accel export --onnx --calibrate`` wrote, and the same with NNCF's
overflow fix on every layer (7-bit weights: what a CPU without VNNI needs to compute them
exactly). Prints the CPU's ISA, each one's RMS and max error as a share of the tokens' std, and
its median time per camera on one thread.

Then the other runners, interleaved (a slow moment of the machine hits each alike), p50 / p95
per camera: PyTorch's int8 tower (``vision: int8``), ONNX Runtime on the fp32 graph and on int8
graphs (the one ``vla-accel export --onnx`` wrote, and ``quantize_dynamic`` with 7-bit weights
and with u8 weights: the two ways around u8 x s8 saturation without VNNI); and the eager tower's
operators by self time (``torch.profiler``).

Usage, from the repository root (the shipped bundle: about 4 min)::

    MUJOCO_GL=egl .venv/bin/vla-accel export --bundle bundles/transfer_cube-smolvla --out graphs --onnx \\
        --calibrate CALIB_BAG --calibrate-frames 32
    MUJOCO_GL=egl .venv/bin/python docs/measurements/vision_int8_error.py --bundle bundles/transfer_cube-smolvla \\
        --graphs graphs --frames TEST_BAG
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--graphs", required=True, type=Path, help="a `vla-accel export --onnx --calibrate` directory")
    p.add_argument("--frames", required=True, type=Path, help="a bag other than the calibration bag")
    p.add_argument("--test-frames", type=int, default=24, help="observations of --frames (every 4th of the first 4x)")
    args = p.parse_args()

    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters, OverflowFix

    meta = json.loads((args.graphs / "export.json").read_text())
    policy = load_policy(args.bundle, PolicyConfig(parity_check=False))
    calibration = camera_inputs(_bag_pixels(policy, Path(meta["calibration"]), meta["calibration_frames"]))
    test = np.concatenate(camera_inputs(_bag_pixels(policy, args.frames, 4 * args.test_frames)[::4]))
    with torch.inference_mode():
        ref = torch.cat([policy.model.vis(torch.from_numpy(test[i : i + 1])) for i in range(len(test))]).numpy()
    core = ov.Core()

    def quantize(**kwargs):
        return nncf.quantize(
            core.read_model(str(args.graphs / "vision.onnx")), nncf.Dataset([{"input": c} for c in calibration]),
            model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration), preset=nncf.QuantizationPreset.MIXED, **kwargs,
        )  # fmt: skip

    overflow_fix = quantize(
        ignored_scope=nncf.IgnoredScope(types=["Convolution"], validate=False),
        advanced_parameters=AdvancedQuantizationParameters(
            overflow_fix=OverflowFix.ENABLE, smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1)),
    )  # fmt: skip
    defaults = quantize()
    runners = {  # (graph, the precision hint the policy's runner sets for it)
        "fp32 (vision.onnx, fp32 kernels)": (core.read_model(str(args.graphs / "vision.onnx")), "f32"),
        "bf16 (vision.onnx, bf16 kernels)": (core.read_model(str(args.graphs / "vision.onnx")), "bf16"),
        "int8, NNCF's defaults": (defaults, "bf16"),
        "int8, vla-accel export": (core.read_model(str(args.graphs / "vision.openvino-int8.xml")), "bf16"),
        "int8, export + overflow fix": (overflow_fix, "bf16"),
    }
    print(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}; OpenVINO's CPU runs "
          f"{', '.join(core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))}")  # fmt: skip
    print(f"{len(test)} camera frames of {args.frames}; calibration {len(calibration)} of {meta['calibration']}")
    for name, (model, hint) in runners.items():
        config = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": 1}
        request = core.compile_model(model, "CPU", config).create_infer_request()
        out = np.concatenate([np.array(request.infer({0: test[i : i + 1]})[0]) for i in range(len(test))])
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            request.infer({0: test[:1]})
            times.append(time.perf_counter() - t0)
        err = out - ref
        print(f"{name:34s} RMS {np.sqrt((err**2).mean()) / ref.std():.2%}  max {np.abs(err).max() / ref.std():.1%}  "
              f"{1000 * np.median(times):.0f} ms per camera")  # fmt: skip
    other_runners(args, policy, test, ref)


def other_runners(args, eager, test: np.ndarray, ref: np.ndarray, repeats: int = 30) -> None:
    """PyTorch int8 and ONNX Runtime against the eager tower, interleaved; then its profile."""
    import tempfile

    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    int8 = load_policy(args.bundle, PolicyConfig(parity_check=False, precision=PrecisionConfig(vision="int8")))
    tmp = Path(tempfile.mkdtemp())
    graphs = {"ORT fp32": args.graphs / "vision.onnx", "ORT int8, vla-accel export": args.graphs / "vision.int8.onnx"}
    for name, kwargs in {"7-bit weights": {"weight_type": QuantType.QInt8, "reduce_range": True},
                         "u8 weights": {"weight_type": QuantType.QUInt8}}.items():  # fmt: skip
        dst = tmp / f"{name.replace(' ', '_')}.onnx"
        quantize_dynamic(str(args.graphs / "vision.onnx"), str(dst), per_channel=True, op_types_to_quantize=["MatMul"], **kwargs)
        graphs[f"ORT int8, {name}"] = dst
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1

    def session(path: Path):
        s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        return lambda x: s.run(None, {name: x})[0]

    runners = {
        "torch fp32 (eager)": lambda x: eager.model.vis(torch.from_numpy(x)).numpy(),
        "torch int8 (vision: int8)": lambda x: int8.model.vis(torch.from_numpy(x)).numpy(),
        **{name: session(path) for name, path in graphs.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        outs = {name: np.concatenate([run(test[i : i + 1]) for i in range(len(test))]) for name, run in runners.items()}
        for _ in range(repeats):
            for name, run in runners.items():
                t0 = time.perf_counter()
                run(test[:1])
                times[name].append(time.perf_counter() - t0)
    for name, out in outs.items():
        err, t = out - ref, 1000 * np.array(times[name])
        print(f"{name:34s} RMS {np.sqrt((err**2).mean()) / ref.std():.2%}  max {np.abs(err).max() / ref.std():.1%}  "
              f"p50 {np.median(t):.0f} ms  p95 {np.percentile(t, 95):.0f} ms per camera (interleaved)")  # fmt: skip
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eager.model.vis(torch.from_numpy(test[:1]))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


if __name__ == "__main__":
    main()
