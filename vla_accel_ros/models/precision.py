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
"""

from __future__ import annotations

import copy
import itertools
import warnings
import weakref

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
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _prepack_available() -> bool:
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


_PREPACK = _prepack_available()


_HEADS = {"ar": ("state_proj",), "flow": ("state_proj", "action_in", "time_in", "time_out", "action_out")}


def component_linears(model: nn.Module, family: str) -> dict[str, list[tuple[nn.Module, str]]]:
    """Per component, the Linear layers its precision applies to, as (parent, attribute)."""
    if family not in _HEADS:
        raise ConfigError(f"no precision components for family {family!r}")
    roots = {"vision": [model.vis.vision], "projector": [model.vis.projector]}
    if family == "ar":
        roots.update(lm=[model.lm.model.layers], expert=[])
    else:
        roots.update(lm=[model.vlm.layers], expert=[model.expert.layers])
    out = {c: [(parent, name) for root in mods for parent in root.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)] for c, mods in roots.items()}  # fmt: skip
    out["heads"] = [(model, n) for n in _HEADS[family] if isinstance(getattr(model, n, None), nn.Linear)]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.vla_accel.int8_linear(x, self.handle, self.out_features)
        return self.packed(x)

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
            return self.int8(x)
        return self.bf16(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8_max_rows={self.int8_max_rows}"


def _converter(p: str, precision: PrecisionConfig):
    if p == "hybrid":
        return lambda linear: HybridLinear(linear, precision.few_rows)
    return {"bf16": Bf16Linear, "int8": Int8Linear}[p]


def convert_model(model: nn.Module, family: str, precision: PrecisionConfig) -> nn.Module:
    """A copy of ``model`` with each component at its precision (``precision`` resolved: no
    ``auto``); ``model`` itself when every component is fp32."""
    if not precision.reduced:
        return model
    out = copy.deepcopy(model)
    for component, linears in component_linears(out, family).items():
        p = getattr(precision, component)
        if p == "auto":
            raise ConfigError(f"precision.{component}=auto: resolve the config for the family first")
        if p == "fp32":
            continue
        convert = _converter(p, precision)
        for parent, name in linears:
            setattr(parent, name, convert(getattr(parent, name)))
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
