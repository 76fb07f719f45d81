"""Numeric precision per model component, the compile switch, and the gate's precision limits.

Components: ``vision`` (the SigLIP tower), ``projector``, ``lm`` (the decoder layers of the
language model; embeddings and the final norm stay fp32), ``expert`` (flow: the action
expert's decoder layers) and ``heads`` (the small input / output layers: state projection,
flow's action and time layers; an ar bundle's action rows of ``lm_head`` stay fp32).

Precisions (applied to every ``nn.Linear`` of a component; norms, rotary tables and the
residual stream stay fp32, so a component's error cannot leak into a discrete index such as a
position; attention stays fp32 too, except that with ``attention: bf16`` a ``bf16`` or ``hybrid``
component attends in bf16 in calls of more than ``few_rows`` rows, a prefill or a flow denoising
step, where SDPA's bf16 kernel is 1.3-1.7x faster than fp32 (not for a decode row, where it is
slower). ``attention: auto`` (the default) takes the family's choice: bf16, except where a
fallback of ``auto`` says fp32. The KV cache stays fp32, except for a flow policy whose LM and
expert both attend in bf16: it stores K/V in bf16, as its attention reads them):

* ``fp32``: as trained, the reference;
* ``bf16``: bf16 weights, inputs cast to bf16 at each matmul and outputs back to fp32 (oneDNN
  with AMX / AVX512-BF16: the fastest for many rows, e.g. a 274-row prefill);
* ``int8``: int8 weights (per output channel) with dynamic per-row int8 activations through
  PyTorch's quantized dynamic linear (fbgemm / oneDNN, the VNNI path): the fastest for a
  few rows (ar decode), about 4x less weight traffic than fp32. No backward: a flow expert in
  int8 cannot run Real-Time Chunking guidance;
* ``hybrid``: both copies of each weight (bf16 and int8, 3 bytes per weight against fp32's 4);
  a call with at most ``few_rows`` rows runs int8, a larger one bf16: an ar LM's
  decode steps take the int8 GEMV and its prefill the bf16 tiles, each the faster for its shape
  (on 2 Xeon cores with AMX one 768-wide layer: int8 2-3x faster than bf16 for one row, bf16
  2-3x faster than int8 for 280). Gradients (Real-Time Chunking) take bf16;
* ``auto``: the family's measured default (its ``precision_defaults``); where the parity gate
  refuses it, the first of its ``precision_fallbacks`` the gate accepts. The defaults were
  measured on CPUs with bf16 instructions and VNNI; on one without bf16 (AVX2 only) ``auto``
  takes :data:`WITHOUT_BF16`'s choice instead (bf16 -> fp32, hybrid -> int8), on one without
  VNNI an int8 vision graph on OpenVINO runs fp32 (:data:`GRAPH_INT8_WITHOUT_VNNI`; ONNX
  Runtime's is built with 7-bit weights there), and the policy's notes say so.

Every reduced-precision configuration passes the parity gate against the fp32 reference of the
same bundle (``gate_*`` limits below) or the policy refuses to start.

``backend``: the runtime of the exported graphs (:mod:`vla_accel_ros.core.backends`; today the
vision tower + connector, per camera): ``torch`` (eager, or compiled with ``compile``),
``onnxruntime`` or ``openvino``, the graph at ``vision``'s precision. A backend policy is gated
against the fp32 torch reference like a reduced precision; where the runtime is missing, does
not run that precision, or the gate refuses it, the same precisions are tried on torch
(:meth:`PrecisionConfig.candidates`) and the gate report says so. ``graphs``: a directory of
graphs written by ``vla-accel export --onnx`` (e.g. OpenVINO int8 calibrated on a bag's
frames) instead of an export at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "int8", "hybrid")
COMPONENTS = ("vision", "projector", "lm", "expert", "heads")
# The attention of bf16 / hybrid components in calls of more than ``few_rows`` rows.
ATTENTION = ("fp32", "bf16")
# Runtimes of the exported graphs (core/backends.py; this module stays free of torch).
BACKENDS = ("torch", "onnxruntime", "openvino")

class FamilyPrecision(Protocol):
    """What a model family (a plug-in of ``vla_accel_ros.models``) tells the precision config.

    ``precision_defaults``: component -> what ``auto`` resolves to, measured per family (the
    measurements of docs/runtime.md); components the family does not have are absent and always run
    fp32; an ``"attention"`` key (fp32 | bf16, default bf16) is what ``attention: auto`` runs.
    ``precision_fallbacks``: when the parity gate refuses ``auto``'s configuration on a
    bundle, these are tried next, in order (each takes more components back to fp32, and may set
    ``"attention"``; settings not ``auto`` keep their value): a trained model can be more
    sensitive than the random ones the defaults were measured on."""

    name: str
    precision_defaults: Mapping[str, str]
    precision_fallbacks: tuple[Mapping[str, str], ...]


# Named presets for the replay / eval mode suffix (``baseline@bf16``): overrides of
# PrecisionConfig. ``bf16`` / ``int8`` reduce the LM and the action expert only. A backend is
# its own suffix word (``baseline@auto+openvino``: :data:`BACKENDS`).
PRESETS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"lm": "bf16", "expert": "bf16"},
    "int8": {"lm": "int8", "expert": "int8"},
    "hybrid": {"lm": "hybrid", "expert": "hybrid"},
    "auto": {c: "auto" for c in COMPONENTS},
}


def _component(name: str) -> Any:
    return param(
        "fp32",
        doc=f"precision of the {name} component: fp32 | bf16 | int8 (dynamic activations) | hybrid (int8 for calls "
        "of few rows, bf16 for many) | auto (the family's measured default); the parity gate checks it against fp32",
        choices=(*PRECISIONS, "auto"),
        read_only=True,
    )


@dataclass(frozen=True)
class PrecisionConfig(Config):
    vision: str = _component("vision tower")
    projector: str = _component("projector")
    lm: str = _component("language model (decoder layers)")
    expert: str = _component("flow action expert (decoder layers)")
    heads: str = _component("heads (state projection; flow action / time layers)")
    compile: bool = param(
        False,
        doc="run the engine's static-shape steps (full prefill, ar decode, flow expert step) as torch.compile'd "
        "graphs over the custom ops; other steps (partial recompute, pruning, guidance) stay eager",
        read_only=True,
    )
    few_rows: int = param(
        32,
        doc="calls of at most this many rows count as few: hybrid layers run their int8 copy for them (bf16 "
        "above), and bf16 / hybrid components keep their attention fp32 for them (above: see attention); the crossover "
        "measured on a 2-core AMX Xeon is 32-50 rows for 768-wide layers",
        range=(0, 1_000_000),
        read_only=True,
    )
    attention: str = param(
        "auto",
        doc="attention of bf16 / hybrid components in calls of more than few_rows rows: bf16 (SDPA's bf16 kernel, "
        "1.3-1.7x faster) | fp32 | auto (the family's choice: bf16, except where a fallback of auto says fp32, as "
        "smolvla's does on torch: bf16 attention over a bf16 prefix lost the trained bundle's task)",
        choices=(*ATTENTION, "auto"),
        read_only=True,
    )
    backend: str = param(
        "torch",
        doc="runtime of the vision tower + connector on the uncached path: torch | onnxruntime | openvino (an ONNX "
        "graph per camera exported at start-up, at the vision precision: onnxruntime fp32 / int8, openvino fp32 / "
        "bf16 / int8); smolvla runs its expert's denoising pass there too (at the expert precision: openvino fp32, "
        "or bf16 where its attention is bf16; onnxruntime fp32; else on torch, with a note); gated against fp32 like "
        "a reduced precision, torch where the package is missing or the gate refuses; with cache.reuse_vision the "
        "vision cache runs the tower and the policy runs on torch",
        choices=BACKENDS,
        read_only=True,
    )
    graphs: str = param(
        "",
        doc="directory of exported graphs the backend loads (`vla-accel export --onnx --out DIR`: vision.onnx, "
        "vision.int8.onnx for onnxruntime int8, vision.openvino-int8.xml for openvino int8 calibrated on a bag's "
        "frames with --calibrate); empty: exported at start-up (openvino int8 then calibrates on the gate's frames); "
        "smolvla's expert graph is exported at start-up either way",
        read_only=True,
    )
    gate_ar_min_identical_tokens: float = param(
        0.99,
        doc="ar, reduced precision: least share of action tokens identical to the fp32 reference on the gate's frames",
        range=(0.0, 1.0),
    )
    gate_ar_max_abs: float = param(
        0.05,
        doc="ar, reduced precision: largest |action - fp32 action| on the gate's frames, in action units (rad, "
        "normalized gripper)",
        range=(0.0, 1e3),
    )
    gate_flow_max_over_std: float = param(
        0.02,
        doc="flow, reduced precision: largest |action - fp32 action| / action std on the gate's frames (same noise)",
        range=(0.0, 100.0),
    )

    def resolve(self, family: FamilyPrecision, *, native_bf16: bool = True, native_vnni: bool = True) -> "PrecisionConfig":
        """``auto`` replaced by the family's default; components the family lacks (its defaults
        do not name them, e.g. an ar bundle's expert) are fp32. ``native_bf16`` / ``native_vnni``:
        whether the CPU has bf16 instructions / an int8 dot product (models.precision checks
        both); without them ``auto`` runs what :meth:`_auto` says."""
        defaults = family.precision_defaults
        values = {c: self._auto(c, defaults[c], native_bf16, native_vnni) if getattr(self, c) == "auto" else getattr(self, c)
                  for c in COMPONENTS if c in defaults}  # fmt: skip
        attention = defaults.get("attention", "bf16") if self.attention == "auto" else self.attention
        return self.replace(**{c: values.get(c, "fp32") for c in COMPONENTS}, attention=attention)

    def candidates(self, family: FamilyPrecision, *, native_bf16: bool = True, native_vnni: bool = True) -> list["PrecisionConfig"]:
        """The resolved configurations to gate, in order: :meth:`resolve` first, then, for the
        components set to ``auto``, the family's ``precision_fallbacks`` (without repeats); with
        a backend, all of those on it first, then the same on torch."""
        first = self.resolve(family, native_bf16=native_bf16, native_vnni=native_vnni)
        auto = [c for c in COMPONENTS if getattr(self, c) == "auto"]
        settable = auto + (["attention"] if self.attention == "auto" else [])
        out = [first]
        for fallback in family.precision_fallbacks if auto else ():
            cand = first.replace(**{c: v if c == "attention" else self._auto(c, v, native_bf16, native_vnni)
                                    for c, v in fallback.items() if c in settable})  # fmt: skip
            if all(cand.settings() != o.settings() for o in out):
                out.append(cand)
        if self.backend != "torch":
            out += [c.replace(backend="torch") for c in out]
        return out

    def _auto(self, component: str, value: str, native_bf16: bool, native_vnni: bool) -> str:
        """What ``auto``'s ``value`` (a family's default or fallback) runs on this CPU: an int8
        vision graph on OpenVINO runs :data:`GRAPH_INT8_WITHOUT_VNNI` where the CPU has no VNNI;
        bf16 and hybrid run :data:`WITHOUT_BF16`'s choice where it has no bf16 instructions;
        the rest as it is."""
        if component == "vision" and self.backend == "openvino" and value == "int8":
            return value if native_vnni else GRAPH_INT8_WITHOUT_VNNI
        return value if native_bf16 else WITHOUT_BF16.get(value, value)

    def bf16_attention_above(self, component: str) -> int | None:
        """Row count above which ``component``'s attention runs in bf16 (None: always fp32)."""
        bf16 = self.attention != "fp32" and getattr(self, component) in ("bf16", "hybrid")
        return self.few_rows if bf16 else None

    def components(self) -> dict[str, str]:
        return {c: getattr(self, c) for c in COMPONENTS}

    def attention_matters(self) -> bool:
        """Whether ``attention`` changes anything: it governs the decoders' (lm, expert) attention
        only, and only where one of them runs bf16 or hybrid."""
        return any(getattr(self, c) in ("bf16", "hybrid") for c in ("lm", "expert"))

    def settings(self) -> dict[str, str]:
        """What tells two resolved configurations apart: the components, and the attention where
        it matters (an fp32 model with either attention is one configuration)."""
        return {**self.components(), "attention": self.attention if self.attention_matters() else "fp32"}

    @property
    def reduced(self) -> bool:
        """Some component runs below fp32 (``auto`` counts: it resolves to a reduced one)."""
        return any(p != "fp32" for p in self.components().values())

    @property
    def gated_against_fp32(self) -> bool:
        """Something runs other than the fp32 torch modules (a reduced precision, a backend):
        the gate compares the policy with the fp32 reference of its bundle."""
        return self.reduced or self.backend != "torch"

    def weights_label(self) -> str:
        """The torch weights' precisions, e.g. ``lm=int8,expert=bf16`` (``fp32`` when nothing is
        reduced): policies with the same label share one converted copy of the weights."""
        reduced = [f"{c}={p}" for c, p in self.components().items() if p != "fp32"]
        return ",".join(reduced) or "fp32"

    def label(self) -> str:
        """Short description: :meth:`weights_label`, fp32 attention where a bf16 / hybrid
        decoder would otherwise attend in bf16, and the backend when it is not torch
        (``vision=int8,lm=bf16 +openvino``, ``vision=bf16,lm=bf16 attention=fp32``)."""
        lowered = self.attention == "fp32" and self.attention_matters()
        return self.weights_label() + (" attention=fp32" if lowered else "") + ("" if self.backend == "torch" else f" +{self.backend}")


# What ``auto`` runs where a family's measured default is bf16 or hybrid but the CPU has no bf16
# instructions (AVX2 without AVX-512): oneDNN then emulates bf16, and the shipped SmolVLA's bf16
# fast mode ran 1.6x slower than its fp32 baseline; PyTorch's int8 linear (fbgemm, 7-bit
# activations) does not saturate and is 1.4-2.6x faster than fp32 for many rows (docs/runtime.md, "CPUs
# without bf16"). Explicit bf16 still runs there, with a note.
WITHOUT_BF16 = {"bf16": "fp32", "hybrid": "int8"}
# Without VNNI (AVX2 only, as on that CPU; also AVX-512 before VNNI) an OpenVINO int8 graph's
# MatMuls saturate (the shipped tower: 6.8% RMS off, 99% of the std at worst) and ran slower than
# its fp32 (211 against 158 ms a camera), so ``auto`` runs the graph in fp32 there; NNCF's
# overflow fix (7-bit weights) ends the saturation and is no faster. ONNX Runtime's int8 graph
# keeps int8: built there with 7-bit weights (core.backends), it is 0.7% RMS off and the fastest
# accurate runner of that tower (1.23-1.27x its eager fp32). The rule follows VNNI, not bf16: a CPU
# with AVX-VNNI and no bf16 (Intel's client parts) keeps the int8 graph and its gate (not
# measured on one).
GRAPH_INT8_WITHOUT_VNNI = "fp32"


def preset(name: str) -> dict[str, Any]:
    """The PrecisionConfig overrides of a named preset (ConfigError naming the choices)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown precision preset {name!r}; choose from {', '.join(PRESETS)}")
    return dict(PRESETS[name])
