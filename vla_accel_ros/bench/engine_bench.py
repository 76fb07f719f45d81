"""Engine vs plain transformers, and partial recompute vs full prefill, side by side.

Every comparison runs both contenders on the same inputs in the same process, interleaved
(A, B, A, B, ...) after a warm-up, and reports medians, p95 and the ratio of medians.
Absolute CPU times drift from run to run; the ratios are the figures to quote.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.parity import fixed_observation
from vla_accel_ros.core.prefix import PrefixPlan


@dataclass
class Pair:
    name: str
    baseline: str
    contender: str
    base_ms: list[float]
    cont_ms: list[float]

    @staticmethod
    def _p(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q))

    @property
    def speedup(self) -> float:
        return statistics.median(self.base_ms) / statistics.median(self.cont_ms)

    def row(self) -> dict:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "contender": self.contender,
            "baseline_ms": {"p50": self._p(self.base_ms, 50), "p95": self._p(self.base_ms, 95)},
            "contender_ms": {"p50": self._p(self.cont_ms, 50), "p95": self._p(self.cont_ms, 95)},
            "speedup": self.speedup,
        }


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t) / 1e6


def interleave(name: str, baseline: tuple[str, Callable], contender: tuple[str, Callable], repeats: int, warmup: int = 1) -> Pair:
    for _ in range(warmup):
        baseline[1]()
        contender[1]()
    b, c = [], []
    for _ in range(repeats):
        b.append(_time(baseline[1]))
        c.append(_time(contender[1]))
    return Pair(name, baseline[0], contender[0], b, c)


def reuse_plan(layout, fraction: float, seed: int = 0) -> PrefixPlan:
    """Reuse ``fraction`` of the image tokens at every layer; recompute the rest and the text."""
    rng = np.random.default_rng(seed)
    img = layout.image_slots().numpy()
    reused = set(rng.choice(img, size=int(round(fraction * img.size)), replace=False).tolist())
    reused.update(layout.fixed_slots)
    rows = torch.tensor([s for s in range(layout.length) if s not in reused])
    return PrefixPlan(layer_slots=[rows] * layout.num_layers, full=False)


def run_engine_bench(policy, repeats: int = 5, fractions=(0.4, 0.6, 0.8), on_pair: Callable[[Pair], None] | None = None) -> list[Pair]:
    """Every comparison, interleaved; ``on_pair`` is called as each one completes (progress)."""
    pairs: list[Pair] = []

    def add(pair: Pair) -> None:
        pairs.append(pair)
        if on_pair is not None:
            on_pair(pair)

    spec = policy.spec
    obs = fixed_observation(spec)
    layout, ids = policy.layout_for(obs.instruction)
    frames = policy.frames(obs)
    cams = list(range(len(layout.cameras)))
    full = policy.prefix_embeddings(obs, layout, ids, frames.pixels, cams)
    P = layout.length
    flow = spec.family == "flow"
    decoder = policy.model.vlm if flow else policy.model.lm.model
    engine = policy.vlm_engine if flow else policy.engine
    policy.prepare_cache(layout)
    hf_mask = torch.ones(1, 1, P, P, dtype=torch.bool) if flow else None
    all_slots = layout.all_slots()
    full_step = StepPlan(slots=all_slots, positions=all_slots, output_slots=all_slots[-1:])

    def hf_prefill():
        with torch.inference_mode():
            return decoder(inputs_embeds=full[None], attention_mask=hf_mask, use_cache=True)

    def eng_prefill():
        return engine.forward(full[None], full_step)

    add(interleave("prefill", ("transformers", hf_prefill), ("engine", eng_prefill), repeats))

    if flow:
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, spec.chunk_size, spec.action_dim)).astype(np.float32))
        pkv = hf_prefill().past_key_values
        eng_prefill()
        h = spec.chunk_size
        pos = torch.arange(P, P + h)[None]
        smask = torch.ones(1, 1, h, P + h, dtype=torch.bool)

        def hf_step():
            with torch.inference_mode():
                emb = policy.model.suffix_embeddings(x, 0.5)
                out = policy.model.expert(inputs_embeds=emb, attention_mask=smask, position_ids=pos, past_key_values=pkv, use_cache=True)
                pkv.crop(-h)
                return policy.model.action_out(out.last_hidden_state)

        def eng_step():
            return policy.velocity(x, 0.5, P)

        add(interleave("denoise step", ("transformers", hf_step), ("engine", eng_step), repeats))
        add(
            interleave(
                "full infer",
                ("transformers", lambda: policy.reference_infer(obs, noise=x[0].numpy())),
                ("engine", lambda: policy.infer(obs, noise=x[0].numpy())),
                repeats,
            )
        )
    else:
        lm = policy.model.lm
        pkv_holder = {}
        tok = torch.tensor([[lm.config.vocab_size - 1]])

        def hf_decode():
            with torch.inference_mode():
                out = lm(input_ids=tok, past_key_values=pkv_holder["pkv"], use_cache=True)
                pkv_holder["pkv"].crop(-1)
                return int(out.logits[0, -1, -spec.action_bins :].argmax())

        pkv_holder["pkv"] = hf_prefill().past_key_values
        eng_prefill()
        slot = torch.tensor([P])
        dplan = StepPlan(slots=slot, positions=slot, output_slots=slot)
        embed = lm.model.embed_tokens

        def eng_decode():
            with torch.inference_mode():
                o = engine.forward(embed(tok), dplan)
                return int(policy.model.action_logits(o.hidden[0, -1]).argmax())

        add(interleave("decode step", ("transformers", hf_decode), ("engine", eng_decode), repeats * 4))
        add(
            interleave(
                "full infer",
                ("transformers", lambda: policy.reference_infer(obs)),
                ("engine", lambda: policy.infer(obs)),
                repeats,
            )
        )

    # Partial recompute: the cache holds this observation's K/V from the full prefill above.
    eng_prefill()
    for frac in fractions:
        plan = reuse_plan(layout, frac)
        rows = plan.layer_slots[0]
        step = StepPlan(slots=rows, positions=rows, layer_slots=plan.layer_slots, output_slots=all_slots[-1:])
        x_rows = full[rows][None]
        add(
            interleave(
                f"prefill, {int(frac * 100)}% image reuse",
                ("engine full", eng_prefill),
                ("engine partial", lambda s=step, xr=x_rows: engine.forward(xr, s)),
                repeats,
            )
        )
    return pairs


def format_table(pairs: list[Pair]) -> str:
    lines = [
        f"{'comparison':<28} {'baseline':<14} {'p50 ms':>9} {'p95 ms':>9}   {'contender':<15} {'p50 ms':>9} {'p95 ms':>9} {'speedup':>8}",
    ]
    for p in pairs:
        r = p.row()
        lines.append(
            f"{p.name:<28} {p.baseline:<14} {r['baseline_ms']['p50']:9.1f} {r['baseline_ms']['p95']:9.1f}   "
            f"{p.contender:<15} {r['contender_ms']['p50']:9.1f} {r['contender_ms']['p95']:9.1f} {p.speedup:7.2f}x"
        )
    return "\n".join(lines)
