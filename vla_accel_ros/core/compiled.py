"""The engine's static-shape steps as one graph each: torch.compile on CPU, torch.export for
other runtimes (TensorRT, see :mod:`vla_accel_ros.core.export`).

A *static step* computes every row it is given through every layer: the full prefill of a
prefix (no reuse, no pruning), one ar decode token, one flow expert pass over the cached
prefix. Its shapes depend only on the row count, so one graph serves every call:

* K/V of the rows go into the static cache by slot (``vla_accel::write_kv``);
* attention reads the cache under ``allowed[slots] & valid[layer]`` (``vla_accel::attend``):
  the *whole* cache by default, because the eager engine cuts the keys at the last visible
  slot, a data dependent length that would give every decode step a new shape (masked keys
  weigh exactly zero, so the results agree to float rounding, measured in the tests); a plan
  whose keys lie in a fixed window (``StepPlan.key_window``: a flow policy's Euler steps, the
  same prefix every step) reads only that window, so a prefix whose keys are all valid takes
  the attention's unmasked path;
* the q/k/v and gate/up projections a reduced-precision decoder fuses run as one matmul each,
  as in the eager engine;
* the cache tensors are arguments, not attributes, so an exported graph takes them as inputs
  and writes them in place (the cache stays owned by :class:`~vla_accel_ros.core.kv_cache.KVCache`).

:class:`CompiledEngine` is an :class:`~vla_accel_ros.core.engine.Engine` that runs plans of this
shape through the compiled graph and every other plan (partial recompute, pruning, taps,
guidance with autograd) through the eager loop; both write the same cache.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from vla_accel_ros.core.errors import PlanError
from vla_accel_ros.core.interrupt import check as check_interrupt
from vla_accel_ros.core.engine import (
    DecoderStack, Engine, StepOutput, StepPlan, _rel_index, adaptive_norm, attention_dtype, check_cond, gated,
)  # fmt: skip
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.kernels import KernelSet
from vla_accel_ros.kernels import ops  # noqa: F401  (registers torch.ops.vla_accel.*)
from vla_accel_ros.kernels.reference import attend_masked, attend_shared


class StaticStep(nn.Module):
    """Every given row through every layer of a decoder, over a static KV cache.

    forward(x [B, n, H], slots [n], positions [n], k_cache / v_cache [L, B, Hkv, S, D],
    valid [L, S] bool, allowed [S, S] bool, window, reads, cond) -> [B, n, H] final normed
    hidden states; writes the rows' K/V into the cache and marks them valid. ``window`` (a
    static int): the rows attend only to slots [0, window) (None: the whole cache). ``cond``
    [B, C]: the condition of a decoder with adaptive norms (an input of the graph, not a
    constant: it changes at every call, e.g. with the flow time).

    The K/V write and the attention are the custom ops ``vla_accel::write_kv`` / ``attend``
    (opaque nodes: what an export hands a TensorRT plugin, what a GPU kernel registers for),
    or with ``inline`` their reference implementation in the graph itself, so that inductor
    fuses around it and calls the attention from its generated code (the CPU build). Inline,
    the step is functional: it attends over the window with its rows' K/V put in a copy, and
    returns ``(hidden, k_rows, v_rows)`` ([L, B, Hkv, n, D] each) for the caller to write
    (a write into the cache input inside the graph copied the whole cache at every layer:
    8 -> 12 ms a small flow expert step); ``reads`` (a static string the caller derives from
    the cache) picks the attention's path: ``all`` (every row reads every key of the window:
    no mask), ``shared`` (every row reads the same keys: one key mask, query heads stacked)
    or ``per_row``.
    """

    def __init__(
        self, stack: DecoderStack, cos: torch.Tensor, sin: torch.Tensor, bf16_attention_above: int | None = None, *,
        inline: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.bf16_attention_above = bf16_attention_above  # as Engine's
        self.inline = inline
        self.layers = stack.layers
        self.qkv, self.gate_up = stack.qkv, stack.gate_up  # fused projections (None: one by one)
        self.norm = stack.norm
        self.adaptive = stack.adaptive
        self.apply_rope = stack.apply_rope
        self.num_heads, self.num_kv_heads, self.head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
        self.scaling = float(stack.scaling)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, x, slots, positions, k_cache, v_cache, valid, allowed, window: int | None = None, reads: str = "per_row",
        cond: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        B, n, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        W = k_cache.shape[3] if window is None else window
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # [1, n, D]
        allowed_rows = allowed[slots, :W]  # [n, W]
        low = attention_dtype(self.bf16_attention_above, n, x.dtype)
        new_k: list[torch.Tensor] = []  # inline: the rows' K/V per layer, [B, Hkv, n, D] each
        new_v: list[torch.Tensor] = []
        for l, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h, gate = adaptive_norm(layer.input_layernorm, x, cond)
            fused = self.qkv[l]
            q, k, v = fused(h) if fused is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            q = q.view(B, n, Hq, D).transpose(1, 2)  # [B, Hq, n, D]
            k = k.view(B, n, Hkv, D).transpose(1, 2)  # [B, Hkv, n, D]
            v = v.view(B, n, Hkv, D).transpose(1, 2)
            q, k = self.apply_rope(q, k, cos, sin)
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            if self.inline:  # the window with the rows' K/V in it; the caller writes the cache
                keys, values = k_cache[l, :, :, :W].index_copy(2, slots, k), v_cache[l, :, :, :W].index_copy(2, slots, v)
                valid_l = valid[l, :W].index_fill(0, slots, True)
                new_k.append(k)
                new_v.append(v)
            else:
                torch.ops.vla_accel.write_kv(k_cache[l], v_cache[l], slots, k, v)
                valid[l].index_fill_(0, slots, True)
                keys, values, valid_l = k_cache[l, :, :, :W], v_cache[l, :, :, :W], valid[l, :W]  # [B, Hkv, W, D], [W]
            dt = low or q.dtype
            q, keys, values = q.to(dt), keys.to(dt), values.to(dt)
            if not self.inline:
                o = torch.ops.vla_accel.attend(q, keys, values, allowed_rows & valid_l, self.scaling)  # [B, Hq, n, D]
            elif reads == "all":
                o = attend_shared(q, keys, values, None, self.scaling)
            elif reads == "shared":
                o = attend_shared(q, keys, values, allowed_rows[0] & valid_l, self.scaling)
            else:
                o = attend_masked(q, keys, values, allowed_rows & valid_l, self.scaling)
            o = o.to(x.dtype)
            x = x + gated(attn.o_proj(o.transpose(1, 2).reshape(B, n, Hq * D)), gate)
            h, gate = adaptive_norm(layer.post_attention_layernorm, x, cond)
            fused = self.gate_up[l]
            if fused is None:
                x = x + gated(mlp(h), gate)
            else:
                g, up = fused(h, low=True)
                x = x + gated(mlp.down_proj(mlp.act_fn(g) * up), gate)
        x = adaptive_norm(self.norm, x, cond)[0]
        if self.inline:
            return x, torch.stack(new_k), torch.stack(new_v)
        return x


def is_static_plan(plan: StepPlan) -> bool:
    """Every row of one run of consecutive slots through every layer: no per-layer sets, drops,
    taps or prune hook. A full prefill, a decode token, a flow expert pass; not a partial
    recompute whose rows happen to be the same at every layer (its row count changes from
    frame to frame, and each new count would compile a graph)."""
    if plan.taps is not None or plan.prune is not None or plan.drop:
        return False
    n = plan.slots.numel()
    if n == 0 or int(plan.slots[-1]) - int(plan.slots[0]) != n - 1:  # ascending: consecutive iff the span is n
        return False
    return plan.layer_slots is None or all(s is plan.slots or torch.equal(s, plan.slots) for s in plan.layer_slots)


class CompiledEngine(Engine):
    """An :class:`Engine` whose static plans run as a torch.compile'd :class:`StaticStep`
    (one graph per row count, key window and attention path; the first call of a new one
    compiles, seconds to minutes).

    With inductor on the CPU the step inlines the reference ops and compiles with its weights
    frozen (constants inductor folds, e.g. the fused projections' stacked weights, and
    prepacks for oneDNN once: unfrozen, a bf16 matmul repacks its weight at every call) and
    a C++ wrapper (no Python between the graph's kernels): one step of the small flow expert
    (bf16, 50 rows over a 274-slot prefix, one thread of a 2-core AMX Xeon) took 16.5-17.3 ms
    eager, 8.8 ms compiled this way and 22.0 ms compiled over the custom ops and the whole
    cache, unfrozen (the build before this one). Frozen weights are fixed: a compiled engine belongs
    to one converted model, as a policy's engines do."""

    def __init__(
        self,
        stack: DecoderStack,
        cache: KVCache,
        *,
        max_positions: int | None = None,
        kernels: KernelSet | None = None,
        bf16_attention_above: int | None = None,
        backend: str = "inductor",
        inline: bool | None = None,
    ) -> None:
        """``inline``: the step inlines the reference ops (None: with inductor on the CPU)."""
        super().__init__(stack, cache, max_positions=max_positions, kernels=kernels, bf16_attention_above=bf16_attention_above)
        self.frozen = backend == "inductor" and self.device.type == "cpu"  # built with compile_settings' options
        self.inline = self.frozen if inline is None else inline
        self.step = StaticStep(stack, self.cos, self.sin, bf16_attention_above, inline=self.inline)
        self.compiled = torch.compile(self.step, backend=backend, dynamic=False, fullgraph=True)
        self.static_calls = 0  # how many forwards took the compiled graph

    def forward(
        self, x: torch.Tensor, plan: StepPlan, *, differentiable: bool = False, cond: torch.Tensor | None = None
    ) -> StepOutput:
        check_interrupt()  # between two compiled steps (the graph itself runs through)
        if differentiable or not is_static_plan(plan):
            return super().forward(x, plan, differentiable=differentiable, cond=cond)
        check_cond(self.stack, cond)
        c, n = self.cache, plan.slots.numel()
        if x.shape[1] != n or plan.positions.numel() != n:
            return super().forward(x, plan, cond=cond)  # the eager loop reports the malformed plan
        window = plan.key_window
        # The window check and the attention path depend on the cache's layout and valid flags
        # only: a plan run again (a flow policy's Euler steps) keeps them while nothing but its
        # own compiled steps wrote the cache.
        seen = plan.memo.get("compiled")
        if seen is not None and seen[0] is c and seen[1] == c.writes:
            reads = seen[2]
        else:
            if window is not None:
                inside = 0 < window <= c.max_slots and int(plan.slots[-1]) < window
                if not inside or bool(c.allowed[plan.slots, window:].any()):
                    raise PlanError(f"key_window={window}: the rows (slots up to {int(plan.slots[-1])}) may read keys beyond it")
            reads = self._reads(plan.slots, window) if self.inline else "per_row"
        with torch.inference_mode(), compile_settings(self.frozen):
            if not x.is_inference():  # one kind of input tensor: dynamo guards on it (a second graph)
                x = x.clone()
            if cond is not None and not cond.is_inference():
                cond = cond.clone()
            hidden = self.compiled(x, plan.slots, plan.positions, c.k, c.v, c.valid, c.allowed, window, reads, cond)
            if self.inline:
                hidden, k_rows, v_rows = hidden  # [L, B, Hkv, n, D] each
                c.k.index_copy_(3, plan.slots, k_rows)
                c.v.index_copy_(3, plan.slots, v_rows)
                c.valid[:, plan.slots] = True
            c.writes += 1  # what a reader derived from the cache is stale now (KVCache.writes)
            plan.memo["compiled"] = (c, c.writes, reads)  # its own rows were counted valid already
            if plan.output_slots is not None:
                hidden = hidden[:, _rel_index(plan.slots, plan.output_slots, "output_slots")]
        self.static_calls += 1
        return StepOutput(
            hidden=hidden if plan.output_slots is not None else None, taps=None,
            computed_per_layer=[n] * self.stack.num_layers,
        )  # fmt: skip

    def _reads(self, slots: torch.Tensor, window: int | None) -> str:
        """Which keys the rows read at each layer once the step wrote them (see StaticStep)."""
        c = self.cache
        W = c.max_slots if window is None else window
        valid = c.valid[:, :W].clone()
        valid[:, slots] = True  # [L, W]
        mask = c.allowed[slots, :W][None] & valid[:, None]  # [L, n, W]
        if bool(mask.all()):
            return "all"
        return "shared" if bool((mask == mask[:, :1]).all()) else "per_row"


@contextlib.contextmanager
def compile_settings(frozen: bool):
    """The settings a compiled step is built with (read when a call compiles; torch.compile's
    ``options`` did not reach freezing). Every engine's graphs share StaticStep.forward's
    graph slots, and frozen weights make dynamo guard each on its own parameters, so the
    engines of one process (a replay's modes, a test session) need more than its default 8.
    The patches are process-wide while a call runs: another thread compiling at that moment
    (no path of the package does: a policy's steps run on its worker thread) sees them too."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=_GRAPHS))
        if frozen:
            stack.enter_context(torch._inductor.config.patch(freezing=True, cpp_wrapper=True))
        yield


_GRAPHS = 128


def build_engine(
    stack: DecoderStack, cache: KVCache, *, max_positions: int | None = None, compile: bool = False,
    bf16_attention_above: int | None = None,
) -> Engine:  # fmt: skip
    """The engine a policy runs: eager, or with its static steps compiled."""
    cls = CompiledEngine if compile else Engine
    return cls(stack, cache, max_positions=max_positions, bf16_attention_above=bf16_attention_above)
