"""Exported graphs on the runtimes users deploy: ONNX export of a module at fixed shapes, and
runners on ONNX Runtime and OpenVINO (TensorRT builds from the same ONNX: docs/runtime.md).

A graph is one module (a policy's vision tower + connector, per camera; SmolVLA's expert pass) exported with
``torch.onnx.export`` (the dynamo exporter, opset :data:`OPSET`) at the shapes its policy
calls it with; weights are constants of the graph. Every op is a standard ONNX op (the vision
tower has no custom op; the engine's ``vla_accel::*`` ops are not in it), so ONNX Runtime,
OpenVINO and TensorRT read the same file.

Precisions, per runtime (the component's ``precision.*`` value):

* ``onnxruntime``: ``fp32``; ``int8``: ONNX Runtime's dynamic quantization of the MatMuls
  (``onnxruntime.quantization.quantize_dynamic``: int8 weights per output channel, activations
  quantized per call, as PyTorch's dynamic int8 linear; no calibration data). No bf16 on CPU.
  For a CPU without VNNI the weights take 7 bits (``reduce_range``): its u8 x s8 products
  saturate their int16 pair sums otherwise (the shipped SmolVLA's tower: 7.75% RMS off, 135% of
  the std at worst, against 0.72% and 10.6% with 7 bits; docs/runtime.md, "CPUs without bf16").
* ``openvino``: ``fp32`` (``INFERENCE_PRECISION_HINT=f32``: OpenVINO's CPU plugin would
  otherwise run bf16 wherever the CPU has it), ``bf16`` (its bf16 kernels: AMX / AVX512-BF16),
  ``int8``: NNCF's post-training quantization of the graph (``nncf.quantize``, transformer
  preset, SmoothQuant off, the patch embedding left unquantized: :func:`quantize_openvino`) on
  calibration frames (the ``calibration`` inputs: a bag's frames through
  ``vla-accel export --onnx --calibrate BAG``; at start-up, the gate's two frames), the rest
  of the graph in bf16.

A runtime that is not installed, or a precision it does not run, raises
:class:`BackendUnavailable` naming the package or the choices; the policy builder then runs
the component on torch and says so (``models/factory.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.precision import BACKENDS  # noqa: F401  (the choices, re-exported)
# The ONNX opset: 18 is the dynamo exporter's floor and what both runtimes (ONNX Runtime 1.32,
# OpenVINO 2026.4) and TensorRT 10 read; LayerNormalization (17) is one op there.
OPSET = 18
# What each runtime runs, by the component's precision (see the module doc).
PRECISIONS = {"onnxruntime": ("fp32", "int8"), "openvino": ("fp32", "bf16", "int8")}
# The PyPI packages (pinned in requirements.txt) a backend needs, by import name.
PACKAGES = {
    "onnx": "onnx==1.23.2",
    "onnxscript": "onnxscript==0.7.2",  # torch.onnx's dynamo exporter translates with it
    "onnxruntime": "onnxruntime==1.32.0",
    "openvino": "openvino==2026.4.1",
    "nncf": "nncf==3.4.0",
}


class BackendUnavailable(ConfigError):
    """A runtime's package is missing, or the runtime does not run the requested precision."""


def require(package: str) -> Any:
    """The imported module ``package``, or :class:`BackendUnavailable` naming what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise BackendUnavailable(
            f"the Python package {package!r} is not installed ({e}); install {PACKAGES.get(package, package)} "
            "(requirements.txt: `make setup` installs it)"
        ) from e


def check_backend(backend: str, precision: str) -> None:
    """:class:`BackendUnavailable` unless ``backend`` runs ``precision`` (and is installed)."""
    if backend not in PRECISIONS:
        raise ConfigError(f"backend={backend!r}: exported graphs run on {', '.join(PRECISIONS)}")
    if precision not in PRECISIONS[backend]:
        raise BackendUnavailable(f"{backend} runs {', '.join(PRECISIONS[backend])} graphs on the CPU, not {precision}")
    require(backend)
    if backend == "openvino" and precision == "int8":
        require("nncf")


def export_onnx(module: nn.Module, example: Sequence[torch.Tensor], path: str | Path, *, input_names: Sequence[str],
                output_names: Sequence[str]) -> Path:  # fmt: skip
    """``module`` at the shapes of ``example`` as an ONNX file (weights beside it in
    ``<path>.data``: a graph over 2 GB cannot hold them inline). Raises BackendUnavailable when
    the exporter fails, with its reason."""
    require("onnx")
    require("onnxscript")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False), torch.no_grad(), _quiet_exporter():
        try:
            torch.onnx.export(
                module.eval(), tuple(example), str(path), dynamo=True, opset_version=OPSET, external_data=True,
                input_names=list(input_names), output_names=list(output_names), verbose=False,
            )  # fmt: skip
        except Exception as e:  # the exporter raises many types; say which module failed
            raise BackendUnavailable(f"ONNX export of {type(module).__name__} failed ({type(e).__name__}: {e})") from e
    return path


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter logs a warning per torchvision op it cannot register (torchvision is
    not a dependency), prints its progress and warns about torch internals; ONNX Runtime's
    quantizer logs advice to the root logger, NNCF to its own handler (which holds the real
    stdout): keep a policy's start-up output readable."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.onnx._internal.exporter._registration", "nncf", "")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quantize_onnx_dynamic(src: str | Path, dst: str | Path, *, reduce_range: bool = False) -> Path:
    """ONNX Runtime's dynamic int8 quantization of the MatMuls of ``src`` (weights per output
    channel; activations quantized per call) into ``dst``; ``reduce_range``: 7-bit weights, for
    a CPU without VNNI (the module doc)."""
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_exporter():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=reduce_range,
                         op_types_to_quantize=["MatMul"])  # fmt: skip
    return Path(dst)


def quantize_openvino(src: str | Path, dst: str | Path, calibration: Iterable[np.ndarray], input_name: str) -> Path:
    """NNCF's post-training int8 quantization of an ONNX graph for OpenVINO (``nncf.quantize``,
    transformer preset: activations int8 with scales from ``calibration``, the graph's inputs
    as numpy arrays), written as OpenVINO IR (``dst``: .xml with its .bin).

    Two departures from NNCF's defaults, measured on the shipped SmolVLA's vision tower (24
    held-out frames x 3 cameras, error of the image tokens against the fp32 tower; bf16 is
    0.22% RMS of their std): the defaults are 2.0% RMS off (49% of the std at worst), SmoothQuant
    off 1.5% (14%), and with the patch embedding (the Convolution on raw pixels) left in bf16
    too 0.74-0.79% (8.4-8.6%) at the same speed (32 ms a camera; bf16 43-44 ms). Only then did
    the start-up gate let int8 through on that policy. Leaving the connector, the MLPs' second
    layers or the attention unquantized as well moved the error by 0.1% RMS at most. On the
    full-size SmolVLA tower (random weights) the same settings give 2.9% RMS against 3.5%."""
    ov = require("openvino")
    nncf = require("nncf")
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    samples = [{input_name: np.ascontiguousarray(x, dtype=np.float32)} for x in calibration]
    if not samples:
        raise ConfigError("OpenVINO int8 needs calibration frames; none were given")
    model = ov.Core().read_model(str(src))
    with _quiet_exporter():  # NNCF draws progress bars
        quantized = nncf.quantize(
            model, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples),
            preset=nncf.QuantizationPreset.MIXED,
            ignored_scope=nncf.IgnoredScope(types=["Convolution"], validate=False),  # the patch embedding
            advanced_parameters=AdvancedQuantizationParameters(
                smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1)),  # -1: SmoothQuant off
        )  # fmt: skip
    ov.save_model(quantized, str(dst))
    return Path(dst)


def _open(path: str | Path, backend: str, precision: str, threads: int):
    """``path`` loaded on ``backend`` (checked to run ``precision``): an ONNX Runtime session or
    an OpenVINO compiled model, on ``threads`` threads."""
    check_backend(backend, precision)
    if backend == "onnxruntime":
        ort = require("onnxruntime")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads  # torch's count: the two never run at once
        opts.inter_op_num_threads = 1
        # Its idle threads would spin after each call, on the cores the engine's torch
        # steps run on next.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ov = require("openvino")
    hint = {"fp32": "f32", "bf16": "bf16", "int8": "bf16"}[precision]
    return ov.Core().compile_model(str(path), "CPU", {
        "INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
    })  # fmt: skip


class GraphRunner:
    """One exported graph on a runtime, called like the module it came from: a torch tensor in
    (its first dimension a batch: the graph is run once per ``batch``-sized slice, the shape it
    was exported at), a float32 torch tensor out. Built once per policy configuration; the
    runtime keeps its own copy of the weights (the file is not needed after construction)."""

    def __init__(self, path: str | Path, backend: str, precision: str, *, threads: int, batch: int = 1) -> None:
        self.backend, self.precision, self.batch = backend, precision, batch
        self.threads = max(1, threads)
        graph = _open(path, backend, precision, self.threads)
        if backend == "onnxruntime":
            name = graph.get_inputs()[0].name
            self.input_shape = tuple(graph.get_inputs()[0].shape)
            self._run = lambda x: graph.run(None, {name: x})[0]
        else:
            request = graph.create_infer_request()
            self.input_shape = tuple(graph.inputs[0].get_partial_shape().to_shape())
            # The output buffer is the request's: copied before the next call reuses it.
            self._run = lambda x: np.array(request.infer({0: x})[0], copy=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, ...] with B a multiple of ``batch`` -> the graph's output for each slice, concatenated."""
        a = x.detach().to(torch.float32).cpu().numpy()
        outs = [self._run(np.ascontiguousarray(a[i : i + self.batch])) for i in range(0, a.shape[0], self.batch)]
        return torch.from_numpy(np.concatenate(outs) if len(outs) > 1 else outs[0])

    def describe(self) -> str:
        return f"{self.backend} {self.precision}"


class StepRunner:
    """A graph of several named inputs on a runtime (an exported decoder step), some of them
    bound once and held between calls: a denoising step's prefix K/V are the same for every
    Euler step of a chunk, so only the action rows are fed per step (on OpenVINO the bound
    inputs stay set on the infer request, not copied again). Returns the first output, float32."""

    def __init__(self, path: str | Path, backend: str, precision: str, *, threads: int) -> None:
        self.backend, self.precision = backend, precision
        self._graph = _open(path, backend, precision, max(1, threads))
        self._request = self._graph.create_infer_request() if backend == "openvino" else None
        self._tensor = require("openvino").Tensor if backend == "openvino" else None  # looked up once, not per step
        self._bound: dict[str, np.ndarray] = {}

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        """Inputs held for the following calls (replacing those of the same names)."""
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        if self._request is not None:
            for name, a in feeds.items():
                self._request.set_tensor(name, self._tensor(a))
        self._bound.update(feeds)  # ONNX Runtime takes them with each call's feeds

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The first output for ``feeds`` and the bound inputs."""
        if self._request is None:
            feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
            return self._graph.run(None, {**self._bound, **feeds})[0]
        # set_tensor + infer(): infer(feeds) wraps its inputs and outputs in Python objects,
        # 0.3 ms a call, a tenth of a small expert's pass.
        self.bind(feeds)
        self._request.infer()
        # The output buffer is the request's: copied before the next call reuses it.
        return np.array(self._request.get_output_tensor(0).data, copy=True)


def graph_file(name: str, backend: str, precision: str) -> str:
    """The file of graph ``name`` a backend loads at a precision: ``<name>.onnx`` (fp32; OpenVINO
    bf16 compiles it with bf16 kernels), ``<name>.int8.onnx`` (ONNX Runtime's dynamic int8),
    ``<name>.openvino-int8.xml`` (NNCF's int8 as OpenVINO IR, with its .bin)."""
    if precision != "int8":
        return f"{name}.onnx"
    return f"{name}.int8.onnx" if backend == "onnxruntime" else f"{name}.openvino-int8.xml"


def write_graph(module: nn.Module, example: torch.Tensor, out: str | Path, name: str, backend: str, precision: str, *,
                calibration: Iterable[np.ndarray] = (), reduce_range: bool = False) -> Path:  # fmt: skip
    """Graph ``name`` of ``module`` for ``backend`` at ``precision`` in directory ``out`` (the
    fp32 ONNX export first, when ``out`` lacks it; int8 quantized from it as the module doc
    says, OpenVINO's calibrated on ``calibration``: inputs of ``example``'s shape; ONNX
    Runtime's with 7-bit weights where ``reduce_range``)."""
    check_backend(backend, precision)
    out = Path(out)
    fp32 = out / graph_file(name, backend, "fp32")
    if not fp32.is_file():
        export_onnx(module, (example,), fp32, input_names=("input",), output_names=("output",))
    path = out / graph_file(name, backend, precision)
    if precision == "int8" and backend == "onnxruntime":
        quantize_onnx_dynamic(fp32, path, reduce_range=reduce_range)
    elif precision == "int8":
        quantize_openvino(fp32, path, [np.asarray(c, dtype=np.float32) for c in calibration], "input")
    return path


def load_runner(path: str | Path, backend: str, precision: str, *, threads: int, shape: Sequence[int]) -> GraphRunner:
    """A written graph (:func:`write_graph`, ``vla-accel export --onnx``) on ``backend``;
    BackendUnavailable when the file is missing or was exported for another input shape."""
    path = Path(path)
    if not path.is_file():
        raise BackendUnavailable(f"{path} does not exist (vla-accel export --onnx writes it)")
    runner = GraphRunner(path, backend, precision, threads=threads, batch=int(shape[0]))
    if list(runner.input_shape) != list(shape):
        raise BackendUnavailable(f"{path} takes inputs of shape {list(runner.input_shape)}, the policy's are {list(shape)}")
    return runner


def build_runner(module: nn.Module, example: torch.Tensor, backend: str, precision: str, *, threads: int,
                 calibration: Iterable[np.ndarray] = (), reduce_range: bool = False) -> GraphRunner:  # fmt: skip
    """``module`` exported at ``example``'s shape and loaded on ``backend`` at ``precision``
    (:func:`write_graph` into a temporary directory, removed once the runtime holds the graph)."""
    check_backend(backend, precision)  # before the export: a missing package fails in a second
    with tempfile.TemporaryDirectory(prefix="vla-onnx-") as tmp:
        path = write_graph(module, example, tmp, "graph", backend, precision, calibration=calibration,
                           reduce_range=reduce_range)  # fmt: skip
        return GraphRunner(path, backend, precision, threads=threads, batch=example.shape[0])
