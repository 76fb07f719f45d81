"""The engine's static-shape steps as one graph each: torch.compile on CPU, torch.export for
other runtimes (TensorRT, see :mod:`vla_accel_ros.core.export`).

A *static step* computes every row it is given through every layer: the full prefill of a
prefix (no reuse, no pruning), one ar decode token, one flow expert pass over the cached
prefix. Its shapes depend only on the row count, so one graph serves every call:

* K/V of the rows go into the static cache by slot (``vla_accel::write_kv``);
* attention reads the *whole* cache under ``allowed[slots] & valid[layer]``
  (``vla_accel::attend``): the eager engine cuts the keys at the last visible slot, a data
  dependent length that would give every decode step a new shape; masked keys weigh exactly
  zero, so the results agree to float rounding (measured in the tests);
* the cache tensors are arguments, not attributes, so an exported graph takes them as inputs
  and writes them in place (the cache stays owned by :class:`~vla_accel_ros.core.kv_cache.KVCache`).

:class:`CompiledEngine` is an :class:`~vla_accel_ros.core.engine.Engine` that runs plans of this
shape through the compiled graph and every other plan (partial recompute, pruning, taps,
guidance with autograd) through the eager loop; both write the same cache.
"""

from __future__ import annotations

import torch
from torch import nn

from vla_accel_ros.core.engine import DecoderStack, Engine, StepOutput, StepPlan, _rel_index, attention_dtype
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.kernels import KernelSet
from vla_accel_ros.kernels import ops  # noqa: F401  (registers torch.ops.vla_accel.*)


class StaticStep(nn.Module):
    """Every given row through every layer of a decoder, over a static KV cache.

    forward(x [B, n, H], slots [n], positions [n], k_cache / v_cache [L, B, Hkv, S, D],
    valid [L, S] bool, allowed [S, S] bool) -> [B, n, H] final normed hidden states; writes
    the rows' K/V into the cache and marks them valid.
    """

    def __init__(self, stack: DecoderStack, cos: torch.Tensor, sin: torch.Tensor, bf16_attention_above: int | None = None) -> None:
        super().__init__()
        self.bf16_attention_above = bf16_attention_above  # as Engine's
        self.layers = stack.layers
        self.norm = stack.norm
        self.apply_rope = stack.apply_rope
        self.num_heads, self.num_kv_heads, self.head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
        self.scaling = float(stack.scaling)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, slots, positions, k_cache, v_cache, valid, allowed) -> torch.Tensor:
        B, n, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # [1, n, D]
        allowed_rows = allowed[slots]  # [n, S]
        low = attention_dtype(self.bf16_attention_above, n, x.dtype)
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, n, Hq, D).transpose(1, 2)  # [B, Hq, n, D]
            k = attn.k_proj(h).view(B, n, Hkv, D).transpose(1, 2)  # [B, Hkv, n, D]
            v = attn.v_proj(h).view(B, n, Hkv, D).transpose(1, 2)
            q, k = self.apply_rope(q, k, cos, sin)
            torch.ops.vla_accel.write_kv(k_cache[l], v_cache[l], slots, k.to(k_cache.dtype), v.to(v_cache.dtype))
            valid[l].index_fill_(0, slots, True)
            mask = allowed_rows & valid[l]  # [n, S]
            dt = low or q.dtype
            o = torch.ops.vla_accel.attend(q.to(dt), k_cache[l].to(dt), v_cache[l].to(dt), mask, self.scaling).to(q.dtype)  # [B, Hq, n, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, n, Hq * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def is_static_plan(plan: StepPlan) -> bool:
    """Every row through every layer: no per-layer sets, drops, taps or prune hook."""
    if plan.taps is not None or plan.prune is not None or plan.drop:
        return False
    return plan.layer_slots is None or all(s is plan.slots or torch.equal(s, plan.slots) for s in plan.layer_slots)


class CompiledEngine(Engine):
    """An :class:`Engine` whose static plans run as a torch.compile'd :class:`StaticStep`
    (one graph per row count; the first call of a new count compiles, seconds to minutes)."""

    def __init__(
        self,
        stack: DecoderStack,
        cache: KVCache,
        *,
        max_positions: int | None = None,
        kernels: KernelSet | None = None,
        bf16_attention_above: int | None = None,
        backend: str = "inductor",
    ) -> None:
        super().__init__(stack, cache, max_positions=max_positions, kernels=kernels, bf16_attention_above=bf16_attention_above)
        self.step = StaticStep(stack, self.cos, self.sin, bf16_attention_above)
        self.compiled = torch.compile(self.step, backend=backend, dynamic=False, fullgraph=True)
        self.static_calls = 0  # how many forwards took the compiled graph

    def forward(self, x: torch.Tensor, plan: StepPlan, *, differentiable: bool = False) -> StepOutput:
        if differentiable or not is_static_plan(plan):
            return super().forward(x, plan, differentiable=differentiable)
        c, n = self.cache, plan.slots.numel()
        if x.shape[1] != n or plan.positions.numel() != n:
            return super().forward(x, plan)  # the eager loop reports the malformed plan
        with torch.inference_mode():
            hidden = self.compiled(x, plan.slots, plan.positions, c.k, c.v, c.valid, c.allowed)
            c.writes += 1  # what an eager plan run again kept of the cache is stale now
            if plan.output_slots is not None:
                hidden = hidden[:, _rel_index(plan.slots, plan.output_slots, "output_slots")]
        self.static_calls += 1
        return StepOutput(
            hidden=hidden if plan.output_slots is not None else None, taps=None,
            computed_per_layer=[n] * self.stack.num_layers,
        )  # fmt: skip


def build_engine(
    stack: DecoderStack, cache: KVCache, *, max_positions: int | None = None, compile: bool = False,
    bf16_attention_above: int | None = None,
) -> Engine:  # fmt: skip
    """The engine a policy runs: eager, or with its static steps compiled."""
    cls = CompiledEngine if compile else Engine
    return cls(stack, cache, max_positions=max_positions, bf16_attention_above=bf16_attention_above)
