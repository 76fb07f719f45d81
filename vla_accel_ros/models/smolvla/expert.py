"""SmolVLA's action expert over the VLM's cached prefix, driven layer by layer from our loop.

LeRobot runs the expert beside the VLM's layers (``SmolVLMWithExpertModel.forward`` with the
prefix K/V cached): at a *self-attention* layer the action tokens attend to the VLM's rotated
prefix K/V of that layer and, causally, to their own K/V (RoPE positions after the prefix); at
a *cross-attention* layer they attend to the prefix only, through the expert's own K/V maps
applied to the VLM's cached keys and values (no rotation of those; the queries' positions
start at 0); a VLM layer without an expert layer leaves them unchanged
(:meth:`~vla_accel_ros.models.smolvla.configuration_smolvla.SmolVLAOptions.layer_plan`).

What we own: the prefix K/V are read in place from the policy's :class:`KVCache` (the VLM
engine wrote them, with the token cache's reuse and pruning's invalid slots), and the
cross-attention K/V maps run once per prefix, not once per Euler step as in LeRobot (the
prefix does not change between the steps: same values). The action tokens' own K/V are never
written to the cache: each step recomputes them. Dropped (pruned) prefix tokens are invalid in
the cache and masked out of every layer from the one that dropped them.

The stock ``LlamaDecoderLayer`` modules are used as they are (norms, projections, MLP, the
model's rotary embedding and ``apply_rotary_pos_emb``). One step is :class:`ExpertStep`, a
function of its inputs, so that ``precision.compile`` runs it as one torch.compile'd graph per
prefix length (inductor, frozen weights, the attention inlined) like the engine's static
steps; eager, its attention goes through the package's kernel set. ``forward`` mirrors
:meth:`Engine.forward`'s signature so the flow policy's Euler and Real-Time Chunking loops
drive it unchanged.
"""

from __future__ import annotations

import itertools
import logging
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from vla_accel_ros.core.backends import BackendUnavailable
from vla_accel_ros.core.compiled import compile_settings
from vla_accel_ros.core.engine import StepOutput, StepPlan, attention_dtype
from vla_accel_ros.core.interrupt import check as check_interrupt
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.kernels import get_kernels
from vla_accel_ros.kernels.reference import attend_masked, attend_shared
from vla_accel_ros.models.smolvla.configuration_smolvla import LayerStep

if TYPE_CHECKING:
    from vla_accel_ros.core.backends import StepRunner

_SERIALS = itertools.count()  # names an ExpertEngine (id() of a freed one is reused)


class ExpertStep(nn.Module):
    """One pass of the expert over the prefix.

    forward(x [B, H, W], k_cache / v_cache [L, B, Hkv, S, D] (the VLM's), valid [L, S],
    cross_k / cross_v [X, B, Hkv, S, D] (the cross-attention layers' K/V of the prefix), length
    (static: the prefix's slots)) -> [B, H, W] the final normed hidden states."""

    def __init__(self, expert: nn.Module, steps: list[LayerStep], cos: torch.Tensor, sin: torch.Tensor,
                 bf16_attention_above: int | None, attend=None) -> None:  # fmt: skip
        super().__init__()
        self.layers, self.norm = expert.layers, expert.norm
        self.steps = [s for s in steps if s.kind != "skip"]
        self.cross_index = {s.vlm_layer: i for i, s in enumerate(s for s in self.steps if s.kind == "cross")}
        attn = self.layers[0].self_attn
        cfg = expert.config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.scaling = float(attn.scaling)
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.register_buffer("cos", cos, persistent=False)  # [positions, D]
        self.register_buffer("sin", sin, persistent=False)
        self.bf16_attention_above = bf16_attention_above
        self.attend = attend  # the kernel set's (eager); None: the reference inlined (compiled)

    def forward(self, x, k_cache, v_cache, valid, cross_k, cross_v, length: int) -> torch.Tensor:
        B, H, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos_self, sin_self = self.cos[length : length + H][None], self.sin[length : length + H][None]
        cos_cross, sin_cross = self.cos[:H][None], self.sin[:H][None]
        causal = torch.ones(H, H, dtype=torch.bool, device=x.device).tril()
        dt = attention_dtype(self.bf16_attention_above, H, x.dtype) or x.dtype
        for step in self.steps:
            layer = self.layers[step.expert_layer]
            attn = layer.self_attn
            prefix_ok = valid[step.vlm_layer, :length]  # [P]: pruned tokens are not read
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, H, Hq, D).transpose(1, 2)  # [B, Hq, H, D]
            if step.kind == "self":
                k = attn.k_proj(h).view(B, H, Hkv, D).transpose(1, 2)
                v = attn.v_proj(h).view(B, H, Hkv, D).transpose(1, 2)
                q, k = self.apply_rope(q, k, cos_self, sin_self)
                keys = torch.cat([k_cache[step.vlm_layer, :B, :, :length].to(dt), k.to(dt)], dim=2)
                values = torch.cat([v_cache[step.vlm_layer, :B, :, :length].to(dt), v.to(dt)], dim=2)
                mask = torch.cat([prefix_ok.expand(H, length), causal], dim=1)  # [H, P + H]
                o = (self.attend or attend_masked)(q.to(dt), keys, values, mask, self.scaling)
            else:
                q, _ = self.apply_rope(q, q, cos_cross, sin_cross)
                c = self.cross_index[step.vlm_layer]
                keys, values = cross_k[c, :B, :, :length].to(dt), cross_v[c, :B, :, :length].to(dt)
                if self.attend is not None:
                    o = self.attend(q.to(dt), keys, values, prefix_ok.expand(H, length), self.scaling)
                else:  # every row reads the same keys: one key mask, query heads stacked
                    o = attend_shared(q.to(dt), keys, values, prefix_ok, self.scaling)
            x = x + attn.o_proj(o.to(x.dtype).transpose(1, 2).reshape(B, H, Hq * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


class OnnxExpertStep(nn.Module):
    """One pass of the expert as a functional graph for ONNX: the prefix's length fixed (a
    constant), the attention inlined as standard ops.

        (x [1, H, W], k_cache / v_cache [L, 1, Hkv, S, D], valid [L, S], cross_k / cross_v
        [X, 1, Hkv, S, D]) -> hidden [1, H, W]

    The prefix pass writes k_cache / v_cache; cross_k / cross_v are the cross-attention layers'
    maps of them (once per prefix, :meth:`ExpertEngine._prepare`): a denoising step takes the
    prefix K/V as inputs and writes nothing."""

    def __init__(self, step: ExpertStep, length: int) -> None:
        super().__init__()
        self.step, self.length = step, length

    def forward(self, x, k_cache, v_cache, valid, cross_k, cross_v):
        return self.step(x, k_cache, v_cache, valid, cross_k, cross_v, self.length)


ONNX_INPUTS = ("x", "k_cache", "v_cache", "valid", "cross_k", "cross_v")


def export_expert_onnx(step: ExpertStep, length: int, args: tuple, path: str):
    """``step`` over a prefix of ``length`` slots written to ``path`` as ONNX, traced on ``args``
    (the :data:`ONNX_INPUTS`), its output named ``hidden``: the one way both the export command
    and :class:`ExpertGraph` make the graph."""
    from vla_accel_ros.core.backends import export_onnx

    return export_onnx(OnnxExpertStep(step, length), args, path, input_names=ONNX_INPUTS, output_names=("hidden",))


def expert_onnx_graph(engine: "ExpertEngine", length: int, rows: int):
    """The expert's pass over a prefix of ``length`` slots for ``rows`` action tokens as an
    :class:`~vla_accel_ros.core.export.OnnxGraph`, checked against the eager step on the same
    random rows and the cache as it stands."""
    from vla_accel_ros.core.backends import require
    from vla_accel_ros.core.export import OnnxGraph

    def inputs(seed: int = 0) -> tuple:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, rows, engine.model.config.hidden_size, generator=g).to(engine.model.norm.weight.dtype)
        return (x, *engine.prefix_inputs(length))

    def export(path):
        inline = ExpertStep(engine.model, engine.steps, engine.step.cos, engine.step.sin, engine.step.bf16_attention_above)
        return export_expert_onnx(inline, length, tuple(a.clone() for a in inputs()), path)

    def check(path) -> float:
        ort = require("onnxruntime")
        args = inputs()
        with torch.inference_mode():
            ref = engine.step(*args, length)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(["hidden"], {k: v.detach().cpu().numpy() for k, v in zip(ONNX_INPUTS, args)})[0]
        return float(abs(got - ref.float().numpy()).max())

    return OnnxGraph(rows, export, check)


class ExpertGraph:
    """The expert's pass on an exported-graph runtime (``precision.backend``: OpenVINO fp32 or
    bf16, ONNX Runtime fp32): :class:`OnnxExpertStep` of the fp32 expert, one graph per prefix
    length, exported the first time a length runs (the policy builder exports its default
    instruction's at start-up, where a failure leaves the expert on torch with a note). The
    prefix K/V, their cross-attention maps and the valid flags are bound once per prefix
    (cache write) and held between the Euler steps; each step feeds only the action rows. A
    runtime error at a later call puts that length on torch too (logged): the pass is a pure
    function of its inputs, so torch's step computes the same one.

    One graph serves the policies built from one bundle (the builder's ``converted``), with one
    infer request and one set of bound inputs: they must not run at the same time (a replay's
    modes run one after another; a policy node has one policy).

    Why: the shipped SmolVLA's expert pass (4 layers, 50 rows over a 212-slot prefix, bf16, one
    thread of an AVX-512 EPYC) took 3.7 ms compiled on torch and 2.5 ms with this graph on
    OpenVINO bf16 (its small heads on torch included): a chunk's 20 Euler steps 70-80 -> 51-67
    ms in ``vla-accel bench lerobot``. In fp32 (``auto`` without bf16; the exact modes) a pass
    took 3.6 ms against 5.2 compiled, and 62 against 103-121 ms at full size (two threads);
    full-size bf16 gained nothing measurable (37 against 39 ms)."""

    def __init__(self, expert: nn.Module, steps: list[LayerStep], cos: torch.Tensor, sin: torch.Tensor,
                 backend: str, precision: str, *, threads: int) -> None:  # fmt: skip
        from vla_accel_ros.core.backends import PRECISIONS, check_backend

        # The backend's precisions but int8, which on a runtime would need calibrated activations.
        runs = [p for p in PRECISIONS.get(backend, ()) if p != "int8"]
        if runs and precision not in runs:
            raise BackendUnavailable(f"policy.precision.expert={precision} with policy.precision.backend={backend}: "
                                     f"the expert's graph runs {', '.join(runs)} there")  # fmt: skip
        check_backend(backend, precision)
        # fp32 modules exported with the attention fp32: the runtime's precision hint decides.
        self.step = ExpertStep(expert, steps, cos, sin, None)
        self.backend, self.precision, self.threads = backend, precision, threads
        self.runners: dict[int, StepRunner] = {}
        self.failed: dict[int, str] = {}  # length -> why it runs on torch
        self.bound: tuple | None = None  # ((engine serial, cache writes), length) of the bound inputs
        self.calls = 0

    def describe(self) -> str:
        return f"{self.backend} {self.precision}"

    def prepare(self, length: int, args: tuple) -> bool:
        """The graph for a prefix of ``length`` slots, exported now unless it exists (``args``:
        the pass's inputs as :class:`ExpertStep` takes them); False (and ``failed`` says why)
        where the export or the runtime failed."""
        import tempfile

        from vla_accel_ros.core.backends import StepRunner

        if length in self.runners or length in self.failed:
            return length in self.runners
        example = tuple(a.detach().clone().float() if a.is_floating_point() else a.clone() for a in args)
        try:
            with tempfile.TemporaryDirectory(prefix="vla-onnx-") as tmp:
                path = export_expert_onnx(self.step, length, example, f"{tmp}/expert.onnx")
                self.runners[length] = StepRunner(path, self.backend, self.precision, threads=self.threads)
        except Exception as e:  # noqa: BLE001  (the exporter's and both runtimes' errors are of many types)
            self._fail(length, e)
        return length in self.runners

    def _fail(self, length: int, error: Exception) -> None:
        self.runners.pop(length, None)
        self.failed[length] = f"{type(error).__name__}: {error}" if not isinstance(error, BackendUnavailable) else str(error)
        # At start-up the builder's note says it; later (a new instruction, a runtime error) only this does.
        logging.getLogger(__name__).warning("the expert's pass over a %d-slot prefix runs on torch: %s", length,
                                            self.failed[length])  # fmt: skip

    def __call__(self, x: torch.Tensor, args: tuple, length: int, key: tuple) -> torch.Tensor | None:
        """The pass's final normed hidden states [1, H, W] (``x``'s dtype) for the action rows
        ``x`` over the prefix inputs ``args`` (k_cache, v_cache, valid, cross_k, cross_v; bound
        again when ``key`` changes), or None where this length has no graph (the caller runs
        torch's step)."""
        if not self.prepare(length, (x, *args)):
            return None
        runner = self.runners[length]
        try:
            if self.bound != (key, length):
                self.bound = None  # until the bind below went through
                runner.bind({name: (a.numpy() if a.dtype == torch.bool else a.float().numpy())
                             for name, a in zip(ONNX_INPUTS[1:], args)})  # fmt: skip
                self.bound = (key, length)
            hidden = runner({"x": x.detach().float().numpy()})
        except Exception as e:  # noqa: BLE001  (a runtime's error mid-chunk: torch computes the same pass)
            self._fail(length, e)
            return None
        self.calls += 1
        return torch.from_numpy(hidden).to(x.dtype)


class ExpertEngine:
    """The expert's layers of ``steps`` over the prefix K/V of ``cache``."""

    def __init__(
        self, expert: nn.Module, steps: list[LayerStep], cache: KVCache, *, max_positions: int,
        bf16_attention_above: int | None = None, compile: bool = False, backend: str = "inductor",
    ) -> None:  # fmt: skip
        """``compile``: eager steps (not differentiable ones) run as a torch.compile'd graph
        (``backend``: inductor, or another for tests that need no C++ toolchain)."""
        self.model = expert
        self.cache = cache
        device = cache.k.device
        probe = torch.empty(1, dtype=torch.float32, device=device)
        cos, sin = expert.rotary_emb(probe, torch.arange(max_positions, device=device)[None])
        self.step = ExpertStep(expert, steps, cos[0].float(), sin[0].float(), bf16_attention_above, get_kernels(device).attend)
        self.steps = self.step.steps
        self.num_heads, self.num_kv_heads, self.head_dim = self.step.num_heads, self.step.num_kv_heads, self.step.head_dim
        self.scaling, self.apply_rope = self.step.scaling, self.step.apply_rope
        # The cross-attention layers' K/V of the prefix (normal tensors written in place, so a
        # differentiable step may read them).
        shape = (max(1, len(self.step.cross_index)), cache.k.shape[1], self.num_kv_heads, cache.max_slots, self.head_dim)
        self.cross_k, self.cross_v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        self._prepared: tuple[int, int] | None = None  # (cache writes, prefix length) they hold
        self.compiled = None
        self.frozen = backend == "inductor" and device.type == "cpu"  # weights frozen into the graph (compile_settings)
        if compile:
            inline = ExpertStep(expert, steps, cos[0].float(), sin[0].float(), bf16_attention_above, attend=None)
            self.compiled = torch.compile(inline, backend=backend, dynamic=False, fullgraph=True)
        self.static_calls = 0  # forwards that took the compiled graph
        # The pass on an exported-graph runtime (set by the policy builder where
        # ``precision.backend`` runs the expert's precision): it replaces the torch step.
        self.graph: ExpertGraph | None = None
        self.serial = next(_SERIALS)

    @property
    def num_layers(self) -> int:
        return len(self.steps)

    @torch.inference_mode()
    def _prepare(self, length: int) -> None:
        """The cross-attention layers' keys and values of the prefix's ``length`` slots."""
        B = self.cache.k.shape[1]
        for step in self.steps:
            if step.kind != "cross":
                continue
            attn = self.step.layers[step.expert_layer].self_attn
            c = self.step.cross_index[step.vlm_layer]
            for src, proj, dst in ((self.cache.k, attn.k_proj, self.cross_k), (self.cache.v, attn.v_proj, self.cross_v)):
                rows = src[step.vlm_layer, :, :, :length].transpose(1, 2).reshape(B, length, -1).float()  # [B, P, Hkv*D]
                out = proj(rows).view(B, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                dst[c, :, :, :length] = out.to(dst.dtype)
        self._prepared = (self.cache.writes, length)

    def prefix_inputs(self, length: int) -> tuple[torch.Tensor, ...]:
        """The pass's inputs besides the action rows (``ONNX_INPUTS[1:]``: k_cache, v_cache, valid,
        cross_k, cross_v) for a prefix of ``length`` slots, the cross-attention maps made current."""
        if self._prepared != (self.cache.writes, length):
            self._prepare(length)
        c = self.cache
        return (c.k, c.v, c.valid, self.cross_k, self.cross_v)

    def forward(self, x: torch.Tensor, plan: StepPlan, *, differentiable: bool = False) -> StepOutput:
        """x: [1, H, W] the action tokens' embeddings; ``plan.slots`` start after the prefix
        (the flow policy's expert plan) -> the expert's final normed hidden states [1, H, W]."""
        check_interrupt()  # a node that is ending stops its inference here (between two Euler steps)
        length = int(plan.slots[0])
        prefix = self.prefix_inputs(length)
        args = (*prefix, length)
        if differentiable:
            with torch.enable_grad():
                return self._out(self.step(x, *args))
        if self.graph is not None:
            # Keyed by this engine and its cache's writes: the prefix the bound inputs hold (one
            # graph serves the policies of a replay, each with its own cache).
            hidden = self.graph(x, prefix, length, (self.serial, self.cache.writes))
            if hidden is not None:
                return self._out(hidden)
        if self.compiled is not None:
            with torch.inference_mode(), compile_settings(frozen=self.frozen):
                if not x.is_inference():  # one kind of input tensor: dynamo guards on it (a second graph)
                    x = x.clone()
                hidden = self.compiled(x, *args)
            self.static_calls += 1
        else:
            with torch.inference_mode():
                hidden = self.step(x, *args)
        return self._out(hidden)

    def _out(self, hidden: torch.Tensor) -> StepOutput:
        return StepOutput(hidden=hidden, taps=None, computed_per_layer=[hidden.shape[1]] * len(self.steps))
