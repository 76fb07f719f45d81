"""``vla-accel export``: the static-shape step graphs of a bundle as torch.export programs, or
(``--onnx``) its vision tower + connector as ONNX graphs for ONNX Runtime, OpenVINO and TensorRT."""

from __future__ import annotations

import argparse
from pathlib import Path

from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    p = command(
        sub, "export", "export the static-shape steps (torch.export) or, with --onnx, the vision tower as ONNX graphs",
        "vla-accel export --bundle bundles/transfer_cube-flow --out steps --precision bf16\n"
        "  vla-accel export --bundle B --out graphs --onnx --calibrate BAG   # then policy.precision.graphs: graphs",
        details="Writes <step>.pt2 (torch.export archives: JSON graph, raw weights) and export.json into --out; "
        "each program is checked against the eager engine (max |delta| of the hidden states). With --onnx: vision.onnx "
        "(fp32, one camera, weights in vision.onnx.data), vision.int8.onnx (ONNX Runtime's dynamic int8) and, with "
        "--calibrate, vision.openvino-int8.xml (NNCF int8 calibrated on the bag's frames), each checked against the "
        "eager tower on every installed runtime; fp32 beyond --tolerance exits 1.",
    )
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--precision", default="fp32", help="precision preset of the weights (fp32, bf16; int8 and hybrid do not export)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max |exported - engine| accepted (exit 1 beyond)")
    p.add_argument("--onnx", action="store_true", help="the vision tower + connector as ONNX graphs (see above)")
    p.add_argument("--calibrate", type=Path, default=None, metavar="BAG",
                   help="--onnx: a bag whose frames calibrate OpenVINO's int8 graph (NNCF)")
    p.add_argument("--calibrate-frames", type=int, default=32, help="observations of --calibrate used (default %(default)s)")
    p.add_argument("--steps", action="store_true",
                   help="--onnx: also the prefix pass and one pass of the action expert (prefill.onnx, expert.onnx; "
                   "ar: prefill, decode), checked against the eager steps on ONNX Runtime; no policy runs them yet")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.onnx:
        return _onnx(args)
    import io

    import torch

    from vla_accel_ros.core.export import check_program, export_step, policy_steps, save_programs
    from vla_accel_ros.core.parity import fixed_observation, gate_noise
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.precision import preset
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(args.bundle, PolicyConfig.from_dict({"precision": preset(args.precision), "parity_check": False}))
    obs = fixed_observation(policy.spec)
    programs, worst = {}, 0.0
    for name, (engine, slots) in policy_steps(policy).items():
        policy.infer(obs, noise=gate_noise(policy))  # a realistic cache state for the check
        ep = export_step(engine, slots)
        buf = io.BytesIO()
        torch.export.save(ep, buf)  # the check runs the saved and reloaded program
        buf.seek(0)
        delta = check_program(torch.export.load(buf), engine, slots)
        worst = max(worst, delta)
        print(f"{name:8s} {slots.numel():4d} rows  max |exported - engine| {delta:.2e}")
        programs[name] = ep
    meta = {"bundle": str(args.bundle), "family": policy.spec.family, "precision": policy.precision.label(), "max_abs_delta": worst}
    for path in save_programs(programs, args.out, meta):
        print(f"wrote {path}")
    return 0 if worst <= args.tolerance else 1


def _onnx(args: argparse.Namespace) -> int:
    """The vision graphs of ``args.bundle`` into ``args.out``, checked on every installed runtime."""
    import json

    import torch

    from vla_accel_ros.core.backends import BackendUnavailable, GraphRunner, graph_file, write_graph
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.core.parity import changed_observation, fixed_observation
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy
    from vla_accel_ros.models.graphs import (
        VISION, camera_inputs, check_vision_runner, reduce_range_here, vision_example, vision_fingerprint,
    )  # fmt: skip

    if args.precision != "fp32":
        raise ConfigError(f"--precision {args.precision} with --onnx: the graphs are exported from the fp32 weights; "
                          "the runtime's precision is policy.precision.vision (int8 graphs are written here too)")  # fmt: skip
    if args.calibrate_frames < 1:
        raise ConfigError(f"--calibrate-frames must be >= 1, got {args.calibrate_frames}")
    if args.calibrate is not None and not args.calibrate.exists():
        raise ConfigError(f"--calibrate {args.calibrate}: no such bag")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; graphs are never overwritten")
    policy = load_policy(args.bundle, PolicyConfig(parity_check=False))
    spec, model = policy.spec, policy.model
    example = vision_example(spec)
    obs = fixed_observation(spec)
    pixels = torch.cat([policy.frames(o).pixels for o in (obs, changed_observation(obs, spec))])
    calibration = _bag_pixels(policy, args.calibrate, args.calibrate_frames) if args.calibrate else []
    wanted = [("onnxruntime", "fp32"), ("openvino", "fp32"), ("onnxruntime", "int8")]
    wanted += [("openvino", "int8")] if calibration else []
    graphs, worst = {}, 0.0
    # ONNX Runtime's int8 graph takes 7-bit weights where this CPU has no VNNI; a graph written
    # here for a CPU with VNNI runs there too, a little less exactly.
    reduce_range = reduce_range_here()
    for backend, precision in wanted:
        try:
            path = write_graph(model.vis, example, out, VISION, backend, precision, calibration=camera_inputs(calibration),
                               reduce_range=reduce_range)  # fmt: skip
            delta = check_vision_runner(GraphRunner(path, backend, precision, threads=torch.get_num_threads()), model, pixels)
        except BackendUnavailable as e:
            print(f"{VISION} {backend:11s} {precision}: not written or checked: {e}")
            continue
        if precision == "fp32":
            worst = max(worst, delta)
        entry = graphs[f"{backend}/{precision}"] = {"file": path.name, "max_abs_vs_eager": delta}
        if (backend, precision) == ("onnxruntime", "int8"):
            entry["reduce_range"] = reduce_range
        print(f"{VISION} {backend:11s} {precision}  {path.name}  max |graph - eager| {delta:.2e}"
              + ("  (7-bit weights: this CPU has no VNNI)" if entry.get("reduce_range") else ""))  # fmt: skip
    if not graphs:
        print("no graph written: install the runtimes of requirements.txt (onnx, onnxscript, onnxruntime, openvino, nncf)")
        return 1
    if not calibration:
        print(f"{VISION} openvino int8: needs --calibrate BAG (NNCF calibrates on its frames)")
    if args.steps:
        worst = max(worst, _onnx_steps(policy, obs, out, graphs))
    meta = {
        "bundle": str(args.bundle), "family": spec.family, "graph": VISION, "vision_fingerprint": vision_fingerprint(model),
        "input": {"shape": list(example.shape)},
        "output": {"shape": [1, spec.grid**2, int(policy.model.vis(example).shape[-1])]}, "graphs": graphs,
        "files": {f"{b}/{p}": graph_file(VISION, b, p) for b, p in wanted}, "calibration": str(args.calibrate or ""),
        "calibration_frames": len(calibration), "max_abs_fp32": worst,
    }  # fmt: skip
    (out / "export.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out}; run with policy.precision.graphs: {out} (and backend, vision precision)")
    return 0 if worst <= args.tolerance else 1


def _onnx_steps(policy, obs, out: Path, graphs: dict) -> float:
    """The engine's static steps as ONNX graphs into ``out``; the largest |graph - engine|."""
    from vla_accel_ros.core.export import policy_onnx_graphs
    from vla_accel_ros.core.parity import gate_noise

    worst = 0.0
    for name, graph in policy_onnx_graphs(policy).items():
        policy.infer(obs, noise=gate_noise(policy))  # a realistic cache state for the check
        path = graph.export(out / f"{name}.onnx")
        delta = graph.check(path)
        worst = max(worst, delta)
        print(f"{name:8s} {graph.rows:4d} rows  {path.name}  max |graph - engine| {delta:.2e} (ONNX Runtime)")
        graphs[f"step/{name}"] = {"file": path.name, "rows": graph.rows, "max_abs_vs_engine": delta}
    return worst


def _bag_pixels(policy, bag: Path, frames: int) -> list:
    """Pixels [C, 3, S, S] of the first ``frames`` observations of ``bag`` (the policy node's rule)."""
    from vla_accel_ros.core.robot.config import SyncConfig
    from vla_accel_ros.io.bag_reader import BagReader

    out = []
    with BagReader(bag) as reader:
        for sample in reader.samples(SyncConfig(cameras=tuple(policy.spec.cameras))):
            out.append(policy.frames(sample.observation).pixels)
            if len(out) >= frames:
                break
    return out
