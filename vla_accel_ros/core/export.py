"""Export the engine's static-shape steps with torch.export: what TensorRT (or another
ahead-of-time runtime) consumes.

Each program is one :class:`~vla_accel_ros.core.compiled.StaticStep` at a fixed row count, with
the model's weights as constants and the KV cache as inputs written in place:

    (x [1, n, H], slots [n] int64, positions [n] int64,
     k_cache [L, 1, Hkv, S, D], v_cache [L, 1, Hkv, S, D], valid [L, S] bool, allowed [S, S] bool)
    -> hidden [1, n, H] (final norm applied)

and for a decoder with adaptive norms (pi0.5's expert) one more input, ``cond`` [1, C] (the
condition of the step, e.g. the flow time's features).

The graph keeps ``vla_accel::write_kv`` and ``vla_accel::attend`` as single nodes (the custom
ops of ``vla_accel_ros.kernels.ops``), which is where a TensorRT plugin replaces them
(docs/runtime.md, "The TensorRT path"). A saved program is torch.export's ``.pt2`` archive: a zip of the graph in
JSON and the weights as raw tensor bytes (no pickle: the example inputs, which it would store
with torch.save, are dropped); loading it needs this package imported so
the two ops are registered.

Steps per family (its policy's ``static_steps``): ``ar``: ``prefill`` (the prefix of the default
instruction) and ``decode`` (one token); ``flow``: ``prefill`` and ``expert`` (the action chunk
over the cached prefix).
Only fp32 and bf16 components export: PyTorch's int8 dynamic linear holds packed weights that
live in the exporting process (compiled graphs reach them through ``vla_accel::int8_linear``).

The same steps export to ONNX (:func:`export_onnx_step`, ``vla-accel export --onnx --steps``):
a functional graph with the attention as standard ops (:class:`OnnxStep`), for ONNX Runtime,
OpenVINO and TensorRT; checked against the engine on ONNX Runtime. A policy runs SmolVLA's expert
pass this way (``precision.backend``: :class:`~vla_accel_ros.models.smolvla.expert.ExpertGraph`);
the engines' steps stay on torch.
A family whose step is not an engine's adds its own graph (``onnx_steps``: SmolVLA's expert,
:class:`~vla_accel_ros.models.smolvla.expert.OnnxExpertStep`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.compiled import StaticStep
from vla_accel_ros.core.engine import Engine
from vla_accel_ros.core.errors import ConfigError

INPUTS = ("x", "slots", "positions", "k_cache", "v_cache", "valid", "allowed", "cond")


def step_inputs(engine: Engine, slots: torch.Tensor, positions: torch.Tensor | None = None, x: torch.Tensor | None = None) -> tuple:
    """The step's arguments over ``engine``'s cache (the cache tensors themselves, not copies)."""
    c = engine.cache
    if x is None:
        x = torch.zeros(1, slots.numel(), engine.stack.hidden_size, dtype=engine.dtype, device=engine.device)
    positions = slots if positions is None else positions
    return (x, slots, positions, c.k, c.v, c.valid, c.allowed)


def step_kwargs(engine: Engine, cond: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The step's condition where its decoder's norms are adaptive (zeros unless given), else nothing."""
    if not engine.stack.adaptive:
        return {}
    if cond is None:
        cond = torch.zeros(1, engine.stack.cond_dim, dtype=engine.dtype, device=engine.device)
    return {"cond": cond}


def export_step(engine: Engine, slots: torch.Tensor, positions: torch.Tensor | None = None) -> torch.export.ExportedProgram:
    """``engine``'s static step for ``slots.numel()`` rows as an ExportedProgram (the example
    inputs are copies: exporting never writes the engine's cache)."""
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in engine.stack.model.modules()):
        # The int8 layers are an op over packed weights held by this process: not portable.
        raise ConfigError("int8 and hybrid components do not export (their packed weights live in this process); use fp32 or bf16")
    step = StaticStep(engine.stack, engine.cos, engine.sin, engine.bf16_attention_above).eval()
    args = tuple(a.clone() for a in step_inputs(engine, slots, positions))
    with torch.inference_mode(False), torch.no_grad():
        try:
            ep = torch.export.export(step, args, kwargs=step_kwargs(engine))
        except Exception as e:  # torch.export raises many types; say which layer kind blocked it
            raise ConfigError(f"torch.export of the {slots.numel()}-row step failed ({type(e).__name__}: {e}); "
                              "int8 components do not export, use fp32 or bf16") from e  # fmt: skip
    # torch.export.save would pickle the example inputs (torch.save): the program keeps none.
    ep.example_inputs = None
    return ep


def policy_steps(policy) -> dict[str, tuple[Engine, torch.Tensor]]:
    """The static steps of a policy: name -> (engine, example slots), for the prefix of its
    default instruction (``policy.static_steps``: each family knows its steps)."""
    layout, _ = policy.layout_for(policy.spec.default_instruction)
    policy.prepare_cache(layout)
    return policy.static_steps(layout)


@dataclass(frozen=True)
class OnnxGraph:
    """One step of a policy as an ONNX graph: how to write it and how to check it against the
    eager step it replaces (max |graph - eager| of its output on ONNX Runtime)."""

    rows: int
    export: Callable[[Path], Path]
    check: Callable[[Path], float]


def engine_onnx_graph(engine: Engine, slots: torch.Tensor) -> OnnxGraph:
    return OnnxGraph(slots.numel(), lambda path: export_onnx_step(engine, slots, path), lambda path: check_onnx_step(path, engine, slots))


def policy_onnx_graphs(policy) -> dict[str, OnnxGraph]:
    """The steps of a policy as ONNX graphs, for the prefix of its default instruction: its
    engine steps (``static_steps``) and what a family runs outside an engine (``onnx_steps``:
    SmolVLA's expert over the prefix K/V)."""
    layout, _ = policy.layout_for(policy.spec.default_instruction)
    policy.prepare_cache(layout)
    return policy.onnx_steps(layout)


def export_policy(policy) -> dict[str, torch.export.ExportedProgram]:
    return {name: export_step(engine, slots) for name, (engine, slots) in policy_steps(policy).items()}


def save_programs(programs: dict[str, torch.export.ExportedProgram], out: str | Path, meta: dict[str, Any]) -> list[Path]:
    """``<name>.pt2`` per program and ``export.json`` (inputs, shapes, ops, ``meta``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths, steps = [], {}
    for name, ep in programs.items():
        path = out / f"{name}.pt2"
        torch.export.save(ep, path)
        paths.append(path)
        user = [s for s in ep.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
        vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in {s.arg.name for s in user}]
        steps[name] = {
            "file": path.name, "inputs": dict(zip(INPUTS, [list(v.shape) for v in vals])),
            "input_dtypes": dict(zip(INPUTS, [str(v.dtype).removeprefix("torch.") for v in vals])), "custom_ops": custom_ops(ep),
        }  # fmt: skip
    manifest = out / "export.json"
    manifest.write_text(json.dumps({**meta, "steps": steps}, indent=2) + "\n")
    return [*paths, manifest]


def custom_ops(ep: torch.export.ExportedProgram) -> dict[str, int]:
    """How many calls of each ``vla_accel`` op the graph holds."""
    counts: dict[str, int] = {}
    for node in ep.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and name.startswith("vla_accel."):
            counts[name] = counts.get(name, 0) + 1
    return counts


def check_program(program: torch.export.ExportedProgram, engine: Engine, slots: torch.Tensor, seed: int = 0) -> float:
    """max |program - engine| over the final hidden states of ``slots`` on the same random rows
    and the same cache state (the engine's cache as it is; the program writes a copy of it,
    the engine then its own cache)."""
    from vla_accel_ros.core.engine import StepPlan

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, slots.numel(), engine.stack.hidden_size, generator=g).to(engine.dtype)
    args = tuple(a.clone() for a in step_inputs(engine, slots, x=x))
    kwargs = step_kwargs(engine, torch.randn(1, engine.stack.cond_dim, generator=g).to(engine.dtype) if engine.stack.adaptive else None)
    with torch.inference_mode():
        got = program.module()(*args, **kwargs)
    ref = engine.forward(x, StepPlan(slots=slots, positions=slots, output_slots=slots), **kwargs).hidden
    return float((got - ref).abs().max())


class OnnxStep(nn.Module):
    """One static step as a functional graph for ONNX (``torch.onnx.export``): the step's rows,
    slots and positions fixed (constants), the attention inlined as standard ops (the
    reference implementation; the custom ops would need ONNX functions), every row reading the
    whole cache under ``allowed & valid``.

        (x [1, n, H], k_cache / v_cache [L, 1, Hkv, S, D], valid [L, S] bool, allowed [S, S] bool)
        -> (hidden [1, n, H], k_rows [L, 1, Hkv, n, D], v_rows [L, 1, Hkv, n, D])

    The caller writes the rows' K/V into its cache (as :class:`~vla_accel_ros.core.compiled.CompiledEngine`
    does): a prefix pass returns the prefix K/V a denoising step then takes as inputs."""

    def __init__(self, engine: Engine, slots: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        super().__init__()
        self.step = StaticStep(engine.stack, engine.cos, engine.sin, engine.bf16_attention_above, inline=True).eval()
        self.register_buffer("slots", slots.clone(), persistent=False)
        self.register_buffer("positions", (slots if positions is None else positions).clone(), persistent=False)

    def forward(self, x, k_cache, v_cache, valid, allowed, cond=None):
        return self.step(x, self.slots, self.positions, k_cache, v_cache, valid, allowed, None, "per_row", cond)


ONNX_INPUTS = ("x", "k_cache", "v_cache", "valid", "allowed")  # and "cond" where the norms are adaptive
ONNX_OUTPUTS = ("hidden", "k_rows", "v_rows")


def onnx_input_names(engine: Engine) -> tuple[str, ...]:
    return ONNX_INPUTS + (("cond",) if engine.stack.adaptive else ())


def export_onnx_step(engine: Engine, slots: torch.Tensor, path: str | Path) -> Path:
    """``engine``'s static step for ``slots`` as an ONNX file (:class:`OnnxStep`; the example
    inputs are copies of the engine's cache; a decoder with adaptive norms takes ``cond`` last)."""
    from vla_accel_ros.core.backends import export_onnx

    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in engine.stack.model.modules()):
        raise ConfigError("int8 and hybrid components do not export (their packed weights live in this process); use fp32 or bf16")
    args = tuple(a.clone() for i, a in enumerate(step_inputs(engine, slots)) if INPUTS[i] in ONNX_INPUTS)
    args += tuple(step_kwargs(engine).values())
    return export_onnx(OnnxStep(engine, slots), args, path, input_names=onnx_input_names(engine), output_names=ONNX_OUTPUTS)


def check_onnx_step(path: str | Path, engine: Engine, slots: torch.Tensor, seed: int = 0) -> float:
    """max |graph - engine| of the final hidden states of ``slots`` on the same random rows,
    condition and cache state, the graph on ONNX Runtime (the engine then writes its own cache)."""
    from vla_accel_ros.core.backends import require
    from vla_accel_ros.core.engine import StepPlan

    ort = require("onnxruntime")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, slots.numel(), engine.stack.hidden_size, generator=g).to(engine.dtype)
    kwargs = step_kwargs(engine, torch.randn(1, engine.stack.cond_dim, generator=g).to(engine.dtype)) if engine.stack.adaptive else {}
    c = engine.cache
    feeds = dict(zip(onnx_input_names(engine), (x, c.k, c.v, c.valid, c.allowed, *kwargs.values())))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(["hidden"], {k: v.detach().cpu().numpy() for k, v in feeds.items()})[0]
    ref = engine.forward(x, StepPlan(slots=slots, positions=slots, output_slots=slots), **kwargs).hidden
    return float(np.abs(got - ref.float().numpy()).max())
