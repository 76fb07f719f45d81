"""The inference engine: runs a stock transformers decoder layer by layer from our own loop.

We never patch transformers. :class:`DecoderStack` takes a ``LlamaModel`` / ``Qwen2Model``
(or any decoder with the same module names) and uses its modules as they are: the layer
norms, the q/k/v/o projections, the MLP, the rotary embedding and the model's own
``apply_rotary_pos_emb``. What we own is the loop, so per layer we decide which token rows
are computed:

* full prefill / decode: every row computed, K/V written to the static cache by slot;
* partial recompute: a shrinking, nested set of rows per layer; rows that stop being
  computed keep the K/V already in the cache (from the previous frame) at their original
  RoPE positions;
* pruning: rows dropped at a layer are invalidated in the cache from that layer on, so no
  later layer attends to them; the drop is either planned (``StepPlan.drop``) or decided
  during the forward by a :class:`PruneHook` from the attention taps of the layers so far
  (self-speculative and layer-level pruning);
* packed forward: rows of independent segments in one pass; the cache layout keeps each
  segment attending only to its own history;
* attention taps: softmax attention of a few query rows at chosen layers, computed next to
  the fused attention (the other rows never go through eager attention);
* adaptive norms (adaRMS, pi0.5's action expert): a decoder whose norms are conditioned on a
  vector per forward (``cond``, e.g. the flow time). Such a norm is called ``norm(x, cond)`` and
  returns ``(normed, gate)``; the gate scales the residual branch the norm feeds
  (``x + branch * gate``). The norm is the model's own module (see :func:`adaptive_norm`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch
from torch import nn

from vla_accel_ros.core.errors import PlanError
from vla_accel_ros.core.interrupt import check as check_interrupt
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.kernels import KernelSet, get_kernels


# Attention gathers the readable keys first when fewer than this share of its window are.
_COMPACT_BELOW = 0.75


class FusedProjection(Protocol):
    """Several projections of one input as one call (``members``, in order), carried by the
    members as their ``fused`` attribute (e.g. the bf16 precision's q/k/v). ``low``: the
    outputs may stay in the matmul's reduced dtype (the gate/up of an MLP feed its down
    projection, which casts them anyway)."""

    members: tuple[nn.Module, ...]

    def __call__(self, x: torch.Tensor, *, low: bool = False) -> tuple[torch.Tensor, ...]: ...


def is_adaptive(norm: nn.Module) -> bool:
    """A norm conditioned per forward: called ``norm(x, cond) -> (normed, gate)`` (its class says
    so with ``adaptive = True``)."""
    return bool(getattr(norm, "adaptive", False))


def adaptive_norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``norm`` applied to ``x``: (normed, None) for a plain norm, (normed, gate) for an adaptive
    one under ``cond`` [B, C] (the gate [B, 1, H] scales the branch the norm feeds)."""
    if cond is None:
        return norm(x), None
    return norm(x, cond)


def gated(branch: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return branch if gate is None else branch * gate


def _fused(parent: nn.Module, names: tuple[str, ...]) -> FusedProjection | None:
    members = tuple(getattr(parent, n, None) for n in names)
    group = getattr(members[0], "fused", None)
    if group is None or len(group.members) != len(members) or any(a is not b for a, b in zip(group.members, members)):
        return None
    return group


class DecoderStack:
    """Handles on the modules of a transformers decoder, validated once."""

    def __init__(self, model: nn.Module) -> None:
        for attr in ("layers", "norm", "rotary_emb"):
            if not hasattr(model, attr):
                raise TypeError(f"{type(model).__name__} has no .{attr}; expected a LlamaModel-like decoder")
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False):
            raise TypeError("sliding-window attention is not supported by the engine")
        layer0 = model.layers[0]
        attn = layer0.self_attn
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, attr):
                raise TypeError(f"{type(attn).__name__} has no .{attr}")
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise TypeError("per-head q/k norms (Qwen3-style) are not supported by the engine yet")
        self.model = model
        self.layers: Sequence[nn.Module] = model.layers
        self.norm: nn.Module = model.norm
        self.rotary: nn.Module = model.rotary_emb
        self.embed: nn.Module | None = getattr(model, "embed_tokens", None)
        self.num_layers = len(model.layers)
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        # Adaptive norms (all of them or none): every forward then takes the condition.
        norms = [model.norm, *(n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
        self.adaptive = is_adaptive(model.norm)
        self.cond_dim = int(getattr(model.norm, "cond_dim", 0)) if self.adaptive else 0  # the condition's width
        if any(is_adaptive(n) != self.adaptive for n in norms):
            raise TypeError("a decoder's norms must be all adaptive or all plain")
        # The rotary application of the model's own modeling module (identical for Llama and
        # Qwen2 today, but taken from the module so a model family that differs stays right).
        self.apply_rope: Callable = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        # Per layer, the fused q/k/v and gate/up projections a reduced-precision model carries
        # (None: the projections run one by one).
        self.qkv = [_fused(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
        self.gate_up = [
            _fused(layer.mlp, ("gate_proj", "up_proj")) if hasattr(layer.mlp, "act_fn") and hasattr(layer.mlp, "down_proj") else None
            for layer in self.layers
        ]

    def rope_table(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for every position once, so a step only gathers rows.  # [P, D] each"""
        pos = torch.arange(max_positions, device=device)[None]
        probe = torch.empty(1, dtype=dtype, device=device)
        cos, sin = self.rotary(probe, pos)
        return cos[0].to(dtype), sin[0].to(dtype)

    def make_cache(self, max_slots: int, *, batch: int = 1, dtype=torch.float32, device="cpu") -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, max_slots, batch=batch, dtype=dtype, device=device)


@dataclass
class TapSpec:
    """Record attention of ``query_slots`` over ``key_slots`` at ``layers``."""

    layers: tuple[int, ...]
    query_slots: torch.Tensor  # [nq] int64, ascending
    key_slots: torch.Tensor  # [nk] int64
    entropy: bool = True  # also each layer's mean entropy (TapResult.entropy)


@dataclass
class TapResult:
    # layer -> [nq, nk]: softmax attention probabilities (over all visible keys), head-averaged.
    attn: dict[int, torch.Tensor] = field(default_factory=dict)
    # layer -> mean entropy (nats) of each query row's attention renormalized over key_slots
    # (empty when the TapSpec did not ask for it).
    entropy: dict[int, float] = field(default_factory=dict)


class PruneHook(Protocol):
    """Decides drops during a forward. After each layer in ``layers`` the engine calls it with
    that layer's tapped attention (``TapResult.attn[layer]``, [nq, nk] over the tap's key
    slots); the slots it returns are dropped from the next layer on (their K/V stays valid up
    to this layer, original RoPE positions are untouched)."""

    layers: frozenset[int]

    def __call__(self, layer: int, attn: torch.Tensor) -> torch.Tensor | None: ...


@dataclass
class StepPlan:
    """What one forward computes.

    slots / positions: the rows entering layer 0 (ascending slots) and their RoPE positions.
    layer_slots: optional, per layer, the slots computed at that layer; must be nested
        (layer l's set is a subset of layer l-1's). Rows that leave keep the cached K/V of
        their slot at the later layers (reuse) unless they are listed in ``drop``.
    drop: layer -> slots dropped from that layer on (pruning); they must leave the computed
        set at that layer.
    output_slots: slots whose final, normed hidden states are returned (computed at the last
        layer); None returns nothing.
    taps: optional attention taps.
    prune: optional hook that drops rows during the forward (its layers must be tapped).
    key_window: every key the rows may read lies in slots [0, key_window), the same window
        at every call of the plan (a flow policy's Euler steps); a compiled step then reads
        only that window. None: the whole cache (a compiled decode step, whose keys grow).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    layer_slots: Sequence[torch.Tensor] | None = None
    drop: dict[int, torch.Tensor] = field(default_factory=dict)
    output_slots: torch.Tensor | None = None
    taps: TapSpec | None = None
    prune: PruneHook | None = None
    key_window: int | None = None
    # What the engine and the compiled steps keep for this plan (rotary rows, the attention rows
    # of the cache layout, each layer's key window and mask), kept when the same plan runs again,
    # e.g. a flow policy's Euler steps; every entry is checked against the cache before it is used.
    memo: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class StepOutput:
    hidden: torch.Tensor | None  # [B, n_out, H]
    taps: TapResult | None
    computed_per_layer: list[int]
    # layer -> slots dropped from that layer on, planned and decided by the hook alike
    dropped: dict[int, torch.Tensor] = field(default_factory=dict)


def attention_dtype(bf16_above: int | None, rows: int, dtype: torch.dtype) -> torch.dtype | None:
    """bf16 when a forward of ``rows`` rows attends in bf16 (and ``dtype`` is not bf16), else None."""
    if bf16_above is None or rows <= bf16_above or dtype == torch.bfloat16:
        return None
    return torch.bfloat16


def check_cond(stack: DecoderStack, cond: torch.Tensor | None) -> None:
    """A condition exactly when the decoder's norms are adaptive (the norms check its width)."""
    if stack.adaptive and cond is None:
        raise PlanError("this decoder's norms are adaptive: its forward needs the condition (cond)")
    if cond is not None and not stack.adaptive:
        raise PlanError("cond given, but this decoder's norms are plain")


def _rel_index(superset: torch.Tensor, subset: torch.Tensor, what: str) -> torch.Tensor:
    """Positions of ``subset`` inside ascending ``superset``; PlanError if one is missing."""
    idx = torch.searchsorted(superset, subset)
    if subset.numel() and (idx.max() >= superset.numel() or not torch.equal(superset[idx], subset)):
        raise PlanError(f"{what}: some slots are not in the rows computed at the previous layer")
    return idx


class _Window(NamedTuple):
    """One segment group's key window at one layer, as attention last read it."""

    valid: torch.Tensor  # [S'] a copy of the window's valid flags
    mask: torch.Tensor  # [n_g, S'] which keys each row may read
    keep: torch.Tensor | None  # the key columns gathered (None: the window as it is)
    kept_mask: torch.Tensor | None  # mask[:, keep]


@dataclass
class _Scratch:
    """What the engine keeps in a plan between its forwards (``StepPlan.memo["engine"]``):
    valid for one engine, cache layout and set of rows, else built again.

    Measured (small flow bundle, ``cache+prune@auto`` with the max-reuse cache settings, 38
    frames of a 40-step scripted bag, one thread, policies interleaved per frame; five runs):
    keeping each layer's windows across the Euler steps (``windows``) makes the denoise 2.8%
    faster on average (2.9%, 4.3%, 3.1%, 2.1%, 1.8%), so it stays. Two things the engine kept
    before were measured and dropped as not worth their code (about 60 lines of flags, and the
    first version of the kept keys had three bugs a review found): the readable keys a plan
    gathered, updated in place with its own rows while nothing else wrote the cache (the denoise
    1.8%, -0.3%, 0.5%, 1.3%, 1.0% faster with them: 0.9% on average), and a bf16 attention output
    handed to a bf16 ``o_proj`` as it is (``takes_bf16``: 0.2%, 1.3%, 1.8%, 1.6%, 1.2%: 1.2%);
    actions were identical in every run. How: docs/results.md, "Engine plan memo"."""

    engine: "Engine"
    layout: int  # the cache's layout_version
    parts: tuple  # the plan's slots, positions and layer_slots (by identity)
    cos: torch.Tensor  # [1, N, D]
    sin: torch.Tensor
    allowed_rows: torch.Tensor  # [N, S]
    rows: torch.Tensor | None = None  # the rows the windows below were made for
    groups: list = field(default_factory=list)  # their segment groups (_segment_groups)
    windows: dict[tuple[int, int], _Window] = field(default_factory=dict)  # (group, layer) -> window
    previous: dict[int, _Window] = field(default_factory=dict)  # group -> the previous layer's window


@dataclass
class _Rows:
    """The rows a forward computes from the current layer on, and what it gathered per row."""

    slots: torch.Tensor  # [n] ascending
    x: torch.Tensor  # [B, n, H] hidden states
    cos: torch.Tensor  # [1, n, D] rotary rows
    sin: torch.Tensor
    allowed: torch.Tensor  # [n, S] which slots each row may read (before the cache's valid flags)

    def narrow_to(self, slots: torch.Tensor, what: str) -> None:
        """Keep the rows of ``slots`` (a subset of the current ones; PlanError otherwise)."""
        sel = _rel_index(self.slots, slots, what)
        self.x, self.cos, self.sin, self.allowed = self.x[:, sel], self.cos[:, sel], self.sin[:, sel], self.allowed[sel]
        self.slots = slots


class Engine:
    """Drives a :class:`DecoderStack` over a :class:`KVCache` (one per sequence context)."""

    def __init__(
        self,
        stack: DecoderStack,
        cache: KVCache,
        *,
        max_positions: int | None = None,
        kernels: KernelSet | None = None,
        bf16_attention_above: int | None = None,
    ) -> None:
        """``bf16_attention_above``: forwards of more rows attend in bf16 (q, k, v cast for the
        kernel, the output back; the cache stays in its dtype); None: never."""
        if cache.num_layers != stack.num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the decoder {stack.num_layers}")
        self.stack = stack
        self.cache = cache
        self.device = cache.k.device
        # The compute dtype: a bf16 cache (components that attend in bf16 anyway) stores K/V
        # rounded as attention would read them; RoPE and the residual stream stay fp32.
        self.dtype = cache.k.dtype if cache.k.dtype in (torch.float32, torch.float64) else torch.float32
        self.kernels = kernels or get_kernels(self.device)
        max_positions = max_positions or stack.model.config.max_position_embeddings
        self.cos, self.sin = stack.rope_table(max_positions, self.dtype, self.device)
        self.bf16_attention_above = bf16_attention_above

    def forward(
        self, x: torch.Tensor, plan: StepPlan, *, differentiable: bool = False, cond: torch.Tensor | None = None
    ) -> StepOutput:
        """x: [B, N, H] input embeddings of ``plan.slots`` (in that order).

        ``differentiable=True`` runs with autograd on (for guidance that needs d out / d x, e.g.
        Real-Time Chunking): the rows' K/V are then merged out of place and the cache is left
        untouched, so a guided step can be differentiated without disturbing cached state.
        ``cond`` [B, C]: the condition of a decoder with adaptive norms (required there, refused
        elsewhere).
        """
        check_cond(self.stack, cond)
        if differentiable:
            with torch.enable_grad():
                return self._forward(x, plan, differentiable=True, cond=cond)
        with torch.inference_mode():
            return self._forward(x, plan, differentiable=False, cond=cond)

    def _forward(self, x: torch.Tensor, plan: StepPlan, differentiable: bool, cond: torch.Tensor | None = None) -> StepOutput:
        """``plan`` layer by layer: the rows each layer computes, the plan's drops at that layer,
        the layer itself, then what the prune hook drops from the next layer on."""
        memo = self._plan_memo(x, plan)
        if not differentiable:  # counted before the first write too: a forward that raises part-way
            self.cache.writes += 1  # has written some layers (KVCache.writes: what others kept is stale)
        taps = TapResult() if plan.taps is not None else None
        tap_layers = set(plan.taps.layers) if plan.taps is not None else set()
        if plan.prune is not None and not plan.prune.layers <= tap_layers:
            raise PlanError(f"prune hook layers {sorted(plan.prune.layers)} are not all tapped ({sorted(tap_layers)})")
        r = _Rows(plan.slots, x, memo.cos, memo.sin, memo.allowed_rows)
        computed: list[int] = []
        dropped_at: dict[int, torch.Tensor] = dict(plan.drop)
        gone: torch.Tensor | None = None  # [S] bool: slots the hook dropped so far

        for l, layer in enumerate(self.stack.layers):
            check_interrupt()  # a node that is ending stops its inference here
            self._select_rows(l, plan, r, gone)
            self._drop_planned(l, plan, r.slots)
            computed.append(r.slots.numel())
            if r.slots.numel() == 0:
                continue
            r.x = self._layer(l, layer, r, plan.taps if l in tap_layers else None, taps, memo, differentiable, cond)
            drop = self._hook_drop(l, plan.prune, taps)
            if drop is not None:
                gone = self._drop_from(l + 1, drop, gone)
                dropped_at[l + 1] = drop

        hidden = None
        if plan.output_slots is not None:
            sel = _rel_index(r.slots, plan.output_slots, "output_slots")
            hidden = adaptive_norm(self.stack.norm, r.x[:, sel], cond)[0]
        return StepOutput(hidden=hidden, taps=taps, computed_per_layer=computed, dropped=dropped_at)

    def _plan_memo(self, x: torch.Tensor, plan: StepPlan) -> _Scratch:
        """The plan checked against ``x``, and what this engine keeps in it between forwards,
        built again for another engine (its rotary tables, its cache), a layout change or new rows."""
        _, N, _ = x.shape
        rows = plan.slots
        if rows.numel() != N or plan.positions.numel() != N:
            raise PlanError(f"x has {N} rows but plan has {rows.numel()} slots / {plan.positions.numel()} positions")
        parts = (plan.slots, plan.positions, plan.layer_slots)
        memo: _Scratch | None = plan.memo.get("engine")
        cache = self.cache
        if (
            memo is None or memo.engine is not self or memo.layout != cache.layout_version
            or any(a is not b for a, b in zip(memo.parts, parts))
        ):  # fmt: skip
            if N > 1 and not bool((rows[1:] > rows[:-1]).all()):
                raise PlanError("plan.slots must be strictly ascending")
            memo = _Scratch(self, cache.layout_version, parts, self.cos[plan.positions][None],
                            self.sin[plan.positions][None], cache.allowed[rows])  # fmt: skip
            plan.memo["engine"] = memo
        return memo

    @staticmethod
    def _select_rows(l: int, plan: StepPlan, r: _Rows, gone: torch.Tensor | None) -> None:
        """Narrow ``r`` to the rows layer ``l`` computes: the plan's ``layer_slots[l]`` (without
        them, the rows so far) less the slots the prune hook dropped (``gone``). ``r.slots`` stays
        the same tensor while the rows do not change (attention keeps its windows by it)."""
        rows = r.slots if plan.layer_slots is None else plan.layer_slots[l]
        if gone is not None:
            keep = ~gone[rows]
            if not bool(keep.all()):
                rows = rows[keep]
        if rows is not r.slots and not (l == 0 and torch.equal(rows, r.slots)):
            r.narrow_to(rows, f"layer_slots[{l}]")

    def _drop_planned(self, l: int, plan: StepPlan, rows: torch.Tensor) -> None:
        """The plan's drops at layer ``l``: their K/V is invalid from this layer on."""
        if l not in plan.drop:
            return
        planned = plan.drop[l]
        if torch.isin(planned, rows).any():
            raise PlanError(f"drop[{l}]: a dropped slot is still computed at layer {l}")
        self.cache.invalidate(planned, from_layer=l)

    def _layer(
        self, l: int, layer: nn.Module, r: _Rows, tap: TapSpec | None, taps: TapResult | None, memo: _Scratch,
        differentiable: bool, cond: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Decoder layer ``l`` on the rows of ``r``: attention (the rows' K/V written first), then
        the MLP, each branch gated by its adaptive norm under ``cond``; the rows' new hidden
        states [B, n, H]."""
        st = self.stack
        B, n = r.x.shape[0], r.slots.numel()
        Hq, Hkv, D = st.num_heads, st.num_kv_heads, st.head_dim
        attn = layer.self_attn
        h, gate = adaptive_norm(layer.input_layernorm, r.x, cond)
        fused = st.qkv[l]
        q, k, v = fused(h) if fused is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q = q.view(B, n, Hq, D).transpose(1, 2)  # [B, Hq, n, D]
        k = k.view(B, n, Hkv, D).transpose(1, 2)  # [B, Hkv, n, D]
        v = v.view(B, n, Hkv, D).transpose(1, 2)
        q, k = st.apply_rope(q, k, r.cos, r.sin)
        k_cache, v_cache, valid = self._write_kv(l, r.slots, k, v, differentiable)
        o = self._attend(l, q, k_cache, v_cache, valid, r.allowed, r.slots, tap, taps, memo)
        x = r.x + gated(attn.o_proj(o.transpose(1, 2).reshape(B, n, Hq * D)), gate)
        h, gate = adaptive_norm(layer.post_attention_layernorm, x, cond)
        return x + gated(self._mlp(l, layer, h), gate)

    def _write_kv(
        self, l: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, differentiable: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' K/V at layer ``l``: written into the cache in place and marked valid, or, for
        a ``differentiable`` forward, merged into copies that leave the cache as it is. Returns the
        keys, values [B, Hkv, S, D] and valid flags [S] attention reads."""
        cache = self.cache
        k_cache, v_cache = cache.k[l], cache.v[l]  # [B, Hkv, S, D]
        if differentiable:
            k_cache = k_cache.index_copy(2, rows, k.to(k_cache.dtype))
            v_cache = v_cache.index_copy(2, rows, v.to(v_cache.dtype))
            valid = cache.valid[l].clone()
            valid[rows] = True
            return k_cache, v_cache, valid
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # as the cache holds them
        self.kernels.write_kv(k_cache, v_cache, rows, k, v)
        cache.valid[l, rows] = True
        return k_cache, v_cache, cache.valid[l]

    def _mlp(self, l: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        fused = self.stack.gate_up[l]
        if fused is None:
            return layer.mlp(h)
        # The MLP's own modules, its gate and up projections in one call. bf16 layers: the
        # activation and product run in bf16, the down projection's input dtype anyway (one
        # rounding more than the unfused path; measured mean error 0.00266 vs 0.00253 on an
        # output RMS of 0.61)
        gate, up = fused(h, low=True)
        return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _hook_drop(self, l: int, hook: PruneHook | None, taps: TapResult | None) -> torch.Tensor | None:
        """The slots the prune hook drops after layer ``l`` (None: no hook there, or no slot)."""
        if hook is None or l not in hook.layers or l + 1 >= self.stack.num_layers:
            return None
        drop = hook(l, taps.attn[l])
        return drop if drop is not None and drop.numel() else None

    def _drop_from(self, layer: int, drop: torch.Tensor, gone: torch.Tensor | None) -> torch.Tensor:
        """``drop`` gone from ``layer`` on: its K/V there invalid, no later layer computes it.
        Returns the slots gone so far ([S] bool)."""
        if gone is None:
            gone = torch.zeros(self.cache.max_slots, dtype=torch.bool, device=self.device)
        gone[drop] = True
        self.cache.invalidate(drop, from_layer=layer)
        return gone

    def _attend(
        self, l, q, k_cache, v_cache, valid, allowed_rows, rows, tap: TapSpec | None, taps: TapResult | None,
        memo: _Scratch,
    ):  # fmt: skip
        """Attention of the computed rows over the keys their segments hold.  q: [B, Hq, n, D]

        Rows of one segment read only that segment's key window [start, visible end): a packed
        forward over several segments (pipelined frames) costs what its segments cost apart,
        not rows x every slot of the cache. ``memo`` (the plan's) keeps each window's mask and
        gather (:class:`_Window`) for the next layer with the same rows and the same valid keys
        (most of them: ar `baseline@hybrid` decode 279 -> 265 ms, flow `baseline@bf16` 526 ->
        512 ms), and for the same layer when the plan runs again (a flow policy's Euler steps
        over a pruned prefix build its masks once per chunk: denoise 5% faster); each is checked
        against the cache's valid flags before it is used."""
        kern, scale = self.kernels, self.stack.scaling
        low = attention_dtype(self.bf16_attention_above, rows.numel(), q.dtype)
        if memo.rows is not rows:  # layer 0, or the rows shrank: windows of other rows
            memo.rows, memo.groups = rows, self._segment_groups(rows)
            memo.windows.clear()
            memo.previous.clear()
        groups = memo.groups
        out = torch.empty_like(q) if len(groups) > 1 else None
        for g, (idx, s0, s1) in enumerate(groups):
            valid_now = valid[s0:s1]  # this layer's row of the cache's valid flags
            w = memo.windows.get((g, l))  # this layer, an earlier forward of the plan
            if w is None or not torch.equal(w.valid, valid_now):
                w = memo.previous.get(g)  # the previous layer of this forward
                if w is None or not torch.equal(w.valid, valid_now):
                    mask = (allowed_rows if idx is None else allowed_rows[idx])[:, s0:s1] & valid_now  # [n_g, S']
                    keep = self._readable(mask)
                    w = _Window(valid_now.clone(), mask, keep, None if keep is None else mask[:, keep])
                memo.windows[(g, l)] = w
            memo.previous[g] = w
            mask = w.mask
            qg = q if idx is None else q[:, :, idx]
            keys, values = k_cache[:, :, s0:s1], v_cache[:, :, s0:s1]
            if tap is not None and self._taps_group(tap, rows if idx is None else rows[idx]):
                self._tap(l, qg, keys, mask, rows if idx is None else rows[idx], tap, taps, s0)
            dt = low or q.dtype
            if w.keep is not None:  # the readable keys only
                keys, values, mask = keys.index_select(2, w.keep), values.index_select(2, w.keep), w.kept_mask
            o = kern.attend(qg.to(dt), keys.to(dt), values.to(dt), mask, scale).to(q.dtype)  # [B, Hq, n_g, D]
            if out is None:
                return o
            out[:, :, idx] = o
        return out

    def _segment_groups(self, rows: torch.Tensor) -> list[tuple[torch.Tensor | None, int, int]]:
        """(row indices or None for all, first key slot, one past the last visible key) per
        segment among ``rows``."""
        cache = self.cache
        starts = cache.seg_start[rows]  # [n]
        if bool((starts == starts[0]).all()):
            return [(None, int(starts[0]), int(cache.visible_end[rows].max()))]
        groups = []
        for s0 in torch.unique(starts).tolist():
            idx = torch.nonzero(starts == s0).flatten()
            groups.append((idx, s0, int(cache.visible_end[rows[idx]].max())))
        return groups

    @staticmethod
    def _readable(mask: torch.Tensor) -> torch.Tensor | None:
        """The key columns to gather (None: attend over the window as it is).  mask [n, S']

        Keys nobody may read (pruned tokens, the unused tail of a prefix) are left out when
        they are many (what every flow step and decode row attends to shrinks too), or when
        what is left is a mask without holes: the kernel's unmasked path is faster than the
        gather."""
        cols = mask.any(0)
        n_cols = int(cols.sum())
        if n_cols < cols.numel() and (
            (mask.shape[1] >= 64 and n_cols < _COMPACT_BELOW * cols.numel()) or bool((mask == cols).all())
        ):
            return torch.nonzero(cols).flatten()
        return None

    @staticmethod
    def _taps_group(tap: TapSpec, group_rows: torch.Tensor) -> bool:
        return bool(torch.isin(tap.query_slots, group_rows).all())

    def _tap(self, l, q, keys, mask, rows, spec: TapSpec, out: TapResult, key0: int = 0) -> None:
        """Eager softmax for the tapped query rows only.  q: [B, Hq, n, D], keys: [B, Hkv, S', D]
        holding slots [key0, key0 + S')."""
        qi = _rel_index(rows, spec.query_slots, f"taps.query_slots at layer {l}")
        B, Hq, _, D = q.shape
        Hkv, nq = keys.shape[1], qi.numel()
        # One matmul per kv head with its query heads stacked as rows (no einsum permutes)
        qt = q[:, :, qi].reshape(B, Hkv, (Hq // Hkv) * nq, D)
        scores = torch.matmul(qt, keys.to(q.dtype).transpose(-1, -2)).mul_(self.stack.scaling)  # [B, Hkv, g*nq, S']
        m = mask[qi]  # [nq, S']
        if not bool(m.all()):
            scores = scores.view(B, Hkv, -1, nq, m.shape[1]).masked_fill_(~m, float("-inf"))
        probs = scores.softmax(dim=-1).view(B, Hq, nq, m.shape[1])  # [B, Hq, nq, S']
        key_slots = spec.key_slots - key0
        nk = key_slots.numel()
        k0 = int(key_slots[0]) if nk else 0
        contiguous = nk and 0 <= k0 and k0 + nk <= probs.shape[-1]
        if contiguous and torch.equal(key_slots, torch.arange(k0, k0 + nk, device=key_slots.device)):
            pk = probs[..., k0 : k0 + nk]  # one camera block or several adjacent: a view, no gather
        else:
            pk = probs[..., key_slots]  # [B, Hq, nq, nk]
        out.attn[l] = pk.mean(dim=(0, 1))
        if not spec.entropy:
            return
        p = pk / pk.sum(-1, keepdim=True).clamp_min(1e-12)
        ent = -(p * p.clamp_min(1e-12).log()).sum(-1)  # [B, Hq, nq]
        out.entropy[l] = float(ent.mean())
