"""Apply a :class:`~vla_accel_ros.core.precision.PrecisionConfig` to a model's components.

Only ``nn.Linear`` layers change; the model is copied first, so policies of other precisions
(the replay's modes, the gate's fp32 reference) keep sharing the original fp32 weights.

* ``bf16``: :class:`Bf16Linear` (bf16 weights; bf16 matmul, fp32 in and out);
* ``hybrid``: :class:`HybridLinear`, both of the above, chosen per call by its row count;
* ``int8``: PyTorch's quantized dynamic linear (``torch.ao.quantization.quantize_dynamic``,
  int8 weights per output channel, activations quantized per call: fbgemm / oneDNN with
  VNNI). torchao 0.18 works with our torch but its CPU int8 linears measured slower than fp32
  for one row and no faster than this path for many (eager and compiled), so the package
  uses PyTorch's own quantized linear; it is deprecated upstream, pinned with torch==2.13.

In the decoders (lm; flow's expert) of those precisions, each layer's q/k/v and gate/up
projections are also grouped into a :class:`FusedLinear` the engine calls as one matmul.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.precision import COMPONENTS, PrecisionConfig


class Bf16Linear(nn.Module):
    """``nn.Linear`` with bf16 weights: the input is cast to bf16 for the matmul and the output
    back to the input's dtype, so the residual stream and the norms stay fp32.

    On CPU with oneDNN, eager calls run on a copy of the weight prepacked once into oneDNN's
    blocked layout (PyTorch's own ``mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the
    pair torch.compile's weight freezing uses): a plain bf16 ``F.linear`` repacks the weight at
    every call, which cost 1.2-1.8x on the 50-row flow expert matmuls. Same results. The plain
    weight stays the parameter (state_dict, export, compiled graphs and gradients use it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = bias
        self._packed: torch.Tensor | None = None  # built at the first eager CPU call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if _PREPACK and self.weight.device.type == "cpu" and not torch.compiler.is_compiling() and not (
            x.requires_grad and torch.is_grad_enabled()
        ):
            if self._packed is None:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            return torch.ops.mkldnn._linear_pointwise(xb, self._packed, self.bias, "none", [], "").to(x.dtype)
        return F.linear(xb, self.weight, self.bias).to(x.dtype)

    def __getstate__(self) -> dict:
        # A oneDNN blocked tensor has no storage to copy: copies repack on their first call.
        return {**self.__dict__, "_packed": None}

    def _apply(self, fn, recurse=True):
        self._packed = None  # moved or cast: repack from the new weight
        group = self.__dict__.get("fused")
        if group is not None:
            group.unpack()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (its check: AVX-512 BW/VL/DQ, the base of
    AVX512-BF16 and AMX, or AVX-NE-CONVERT); on an AVX2-only CPU it does not, and
    ``precision: auto`` runs fp32 instead of bf16 (core.precision.WITHOUT_BF16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache  # the CPU does not change; policies are built many times per process
def native_vnni() -> bool:
    """Whether the CPU has an int8 dot product that accumulates u8 x s8 in int32 (AVX512-VNNI,
    AVX-VNNI or AMX), from /proc/cpuinfo's flags. Without one, oneDNN's int8 kernels (OpenVINO's)
    sum the products in int16 pairs that saturate: an AVX2-only CPU, also an AVX-512 one older
    than VNNI. Where /proc/cpuinfo cannot be read (not Linux), :func:`native_bf16` stands in:
    every CPU with it measured here had VNNI. A Linux CPU without these x86 flags (ARM) counts as
    without: the int8 graph was measured on x86 only."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return native_bf16()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def _prepack_available() -> bool:
    """oneDNN's bf16 prepacking runs only where :func:`native_bf16`: on an AVX2-only CPU
    ``_reorder_linear_weight`` raises, and a bf16 layer takes ``F.linear`` instead."""
    try:
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
                and native_bf16())  # fmt: skip
    except (AttributeError, RuntimeError):
        return False


_PREPACK = _prepack_available()


def component_linears(model: nn.Module, family) -> dict[str, list[tuple[nn.Module, str]]]:
    """Per component, the Linear layers its precision applies to, as (parent, attribute);
    ``family``: the model's :class:`~vla_accel_ros.models.family.Family` (its decoders, towers and heads)."""
    roots = {"vision": [], "projector": [], "expert": [], **family.component_roots(model)}
    roots.update({c: [layers] for c, layers in family.decoder_layers(model).items()})
    out = {c: [(parent, name) for root in mods for parent in root.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)] for c, mods in roots.items()}  # fmt: skip
    out["heads"] = [(model, n) for n in family.heads if isinstance(getattr(model, n, None), nn.Linear)]
    return {c: out[c] for c in COMPONENTS}


# Int8Linear's packed layers by handle: the custom op below finds its layer here (weakly held:
# a layer lives as long as its model).
_PACKED: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("vla_accel::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """PyTorch's int8 dynamic linear of layer ``handle`` as one opaque op (its packed weights
    are not a tensor torch.compile can trace).  x: [..., in] -> [..., out_features]"""
    return _PACKED[handle](x)


@int8_linear.register_fake
def _int8_linear_fake(x, handle, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class Int8Linear(nn.Module):
    """``nn.Linear`` as int8 weights (per output channel) with dynamic int8 activations
    (``torch.ao.nn.quantized.dynamic.Linear``). Eager calls run the layer directly; inside a
    compiled graph it is the custom op ``vla_accel::int8_linear``, so the graph stays whole."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        self.in_features, self.out_features = linear.in_features, linear.out_features
        with warnings.catch_warnings():
            # torch.ao.quantization announces its move to torchao; we pin torch (see module doc).
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*")
            linear.qconfig = per_channel_dynamic_qconfig
            self.packed = DynamicInt8Linear.from_float(linear)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self.packed
        if self.packed._packed_params.dtype != torch.qint8:
            raise TypeError("Int8Linear expects qint8 packed weights")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.vla_accel.int8_linear(x, self.handle, self.out_features)
        if x.dtype != torch.float32:
            return self.packed(x)
        # Straight to the op the module would call: its wrapper and the op packet's dispatch
        # cost ~10 us a call (0.5 ms of each small ar decode step).
        packed = self.packed
        version = getattr(packed, "version", None)  # the stock module's rule: reduce_range from version 4 on
        return torch.ops.quantized.linear_dynamic.default(x, packed._packed_params._packed_params, version is not None and version >= 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class HybridLinear(nn.Module):
    """``nn.Linear`` kept both in bf16 and in int8, each call run by the faster one for its
    row count: int8 for at most ``int8_max_rows`` rows (a decode step: a GEMV, where the VNNI
    path reads 4x fewer weight bytes and bf16 gains nothing), bf16 above (a prefill: AMX tiles).
    Calls that need a gradient (Real-Time Chunking) take bf16, which has a backward. The row
    count is a static shape, so a compiled step keeps one branch."""

    def __init__(self, linear: nn.Linear, int8_max_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.int8_max_rows = int8_max_rows
        self.bf16 = Bf16Linear(linear)
        self.int8 = Int8Linear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few = x.numel() <= self.int8_max_rows * self.in_features
        if few and not (x.requires_grad and torch.is_grad_enabled()):
            return self.int8(x if x.dtype == torch.float32 else x.float())
        return self.bf16(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8_max_rows={self.int8_max_rows}"


class FusedLinear:
    """Linears of one input (q/k/v; gate/up) as one matmul, for the engine (its
    :class:`~vla_accel_ros.core.engine.FusedProjection`): one input cast or quantization,
    one call, one output split into views. bf16: one oneDNN call on a weight prepacked once
    (13% less time per small flow expert layer at 50 rows); int8: one dynamic int8 linear over
    the stacked weights, same per-channel scales and the same quantized input as the members
    (the q/k/v + gate/up GEMVs of the small ar LM's 12 layers: 6.4 -> 5.0 ms alone; in a whole
    decode step, whose weights stream from memory, 0-6%); hybrid: the int8 one for at most its
    few rows, else the bf16 one.

    Not a module: the members keep their parameters (the state_dict is unchanged) and still
    run alone; their ``fused`` attribute points here. The int8 form costs a second int8 copy
    of the members' weights. Calls needing a gradient, int8 / hybrid layers in compiled graphs,
    and bf16 without oneDNN run the members one by one. The stacked weights are taken once: a
    converted model's weights are fixed (loading new weights means converting again), as for
    ``Int8Linear``."""

    def __init__(self, members: list[nn.Module], originals: list[nn.Linear]) -> None:
        kinds = {type(m) for m in members}
        if len(kinds) != 1 or not kinds <= {Bf16Linear, Int8Linear, HybridLinear}:
            raise TypeError(f"cannot fuse {sorted(k.__name__ for k in kinds)}")
        if len({m.in_features for m in members}) != 1 or len(originals) != len(members):
            raise TypeError("fused linears must share their input")
        kind = kinds.pop()
        self.members = tuple(members)
        self.in_features = members[0].in_features
        self.sizes = [m.out_features for m in members]
        self._bf16 = None if kind is Int8Linear else [m.bf16 if kind is HybridLinear else m for m in members]
        self._few_rows = members[0].int8_max_rows if kind is HybridLinear else None
        self._int8 = None
        if kind is not Bf16Linear:
            stacked = nn.Linear(self.in_features, sum(self.sizes), bias=any(o.bias is not None for o in originals))
            with torch.no_grad():
                stacked.weight.copy_(torch.cat([o.weight for o in originals]))
                if stacked.bias is not None:
                    stacked.bias.copy_(torch.cat([o.bias if o.bias is not None else torch.zeros(o.out_features) for o in originals]))
            self._int8 = Int8Linear(stacked)
        self._packed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias), built at the first call
        for m in [*members, *(self._bf16 or [])]:
            object.__setattr__(m, "fused", self)  # a plain attribute, not a submodule

    def unpack(self) -> None:
        self._packed = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}

    def __call__(self, x: torch.Tensor, *, low: bool = False) -> tuple[torch.Tensor, ...]:
        """Each member's output of ``x``; with ``low`` the bf16 path leaves them in bf16."""
        if torch.compiler.is_compiling() and self._int8 is None:
            # In a graph: one matmul over the stacked weights, which a frozen graph (CPU:
            # core.compiled) folds into one constant and prepacks once.
            bias = None
            if any(m.bias is not None for m in self._bf16):
                bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in self._bf16])
            y = F.linear(x.to(torch.bfloat16), torch.cat([m.weight for m in self._bf16]), bias)
            return (y if low else y.to(x.dtype)).split(self.sizes, -1)
        if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
            return tuple(m(x) for m in self.members)
        if self._int8 is not None and (self._bf16 is None or x.numel() <= self._few_rows * self.in_features):
            return self._int8(x).split(self.sizes, -1)
        if not _PREPACK or self._bf16[0].weight.device.type != "cpu":  # a GPU, or a CPU without oneDNN's bf16
            outs = tuple(m(x) for m in self.members)  # each rounded to bf16 and back: the same values
            return tuple(o.to(torch.bfloat16) for o in outs) if low else outs
        packed = self._packed
        if packed is None:
            bias = None
            if any(m.bias is not None for m in self._bf16):
                bias = torch.cat([
                    m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=torch.bfloat16) for m in self._bf16
                ])  # fmt: skip
            packed = (torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in self._bf16])), bias)
            self._packed = packed  # weight and bias published together: policies on other threads share the model
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed[0], packed[1], "none", [], "")
        return (y if low else y.to(x.dtype)).split(self.sizes, -1)


_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def projection_groups(model: nn.Module, family, precision: PrecisionConfig) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, names) of the q/k/v and gate/up projections of each decoder layer of the
    reduced-precision decoders (lm; an expert): what :class:`FusedLinear` groups. Projections
    of different inputs (a cross-attention layer's k/v read the VLM's keys) stay apart."""
    out = []
    for component, layers in family.decoder_layers(model).items():
        if getattr(precision, component) not in ("bf16", "int8", "hybrid"):
            continue
        for layer in layers:
            for attr, names in _PROJECTIONS:
                parent = getattr(layer, attr, None)
                members = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, nn.Linear) for m in members) and len({m.in_features for m in members}) == 1:
                    out.append((parent, names))
    return out


def _converter(p: str, precision: PrecisionConfig):
    if p == "hybrid":
        return lambda linear: HybridLinear(linear, precision.few_rows)
    return {"bf16": Bf16Linear, "int8": Int8Linear}[p]


def convert_model(model: nn.Module, family, precision: PrecisionConfig) -> nn.Module:
    """A copy of ``model`` with each component at its precision (``precision`` resolved: no
    ``auto``); ``model`` itself when every component is fp32."""
    if not precision.reduced:
        return model
    # New module objects that share every tensor with ``model``: weights are only read at
    # inference and a converted layer gets tensors of its own. A full fp32 copy first doubled
    # the peak memory (a 3.2 B pi0: 13 GB more, and the process was killed on a 24 GiB machine).
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    out = copy.deepcopy(model, memo)
    groups = [(parent, names, [getattr(parent, n) for n in names]) for parent, names in projection_groups(out, family, precision)]
    for component, linears in component_linears(out, family).items():
        p = getattr(precision, component)
        if p == "auto":
            raise ConfigError(f"precision.{component}=auto: resolve the config for the family first")
        if p == "fp32":
            continue
        convert = _converter(p, precision)
        for parent, name in linears:
            setattr(parent, name, convert(getattr(parent, name)))
    for parent, names, originals in groups:
        FusedLinear([getattr(parent, n) for n in names], originals)
    return out.eval()


def linear_precisions(model: nn.Module) -> dict[str, int]:
    """How many Linear layers of each kind a model has (fp32 / bf16 / int8 / hybrid): what ran."""
    counts = {"fp32": 0, "bf16": 0, "int8": 0, "hybrid": 0}
    hybrid_parts = {id(m) for h in model.modules() if isinstance(h, HybridLinear) for m in (h.bf16, h.int8)}
    for m in model.modules():
        if id(m) in hybrid_parts:
            continue
        if isinstance(m, HybridLinear):
            counts["hybrid"] += 1
        elif isinstance(m, Bf16Linear):
            counts["bf16"] += 1
        elif isinstance(m, Int8Linear):
            counts["int8"] += 1
        elif isinstance(m, nn.Linear):
            counts["fp32"] += 1
    return counts
