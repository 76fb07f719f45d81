"""ActionFlow for ``ar`` policies: the prefill of the newest frame packed with the next decode
steps of the frames still in flight, in one engine forward.

A sequential ``ar`` inference is one prefill (P rows) and then ``n - 1`` decode forwards of a
single row each; on a CPU (and on an edge GPU) a one-row forward costs nearly what a forward of
a few hundred rows does, because each reads every weight once. Here every call packs the new
frame's prefill with one decode row of each frame in flight (``steps`` decode forwards per call
in all: the first packed with the prefill, the others decode rows only), so a frame's tokens
come out ``ceil((n - 1) / steps)`` calls after it went in, at about the cost of one prefill per
frame.

Layout: the pipeline's own preallocated KV cache holds ``depth`` regions, one per frame in
flight, each an independent causal segment (the engine attends each row only within its
segment, so frames never see each other's K/V); a new frame takes a free region (a ring), and
nothing is ever copied between pipeline stages. With the token cache (``pipelined+cache``) the
prefix K/V of the previous frame are copied into the new frame's region first: that is what the
sequential policy's cache holds when it plans, so the plan and the actions are the same.

Honesty: every chunk carries the stamp of the observation it came from and its staleness
(calls and milliseconds between that observation entering and its chunk coming out); cold
start and flush compute nothing that is not a real frame, and a frame's actions come out only
when its greedy decode is complete. Actions equal sequential greedy decoding of the same frames.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.core.prefix import PrefixLayout, PrefixPlan, plan_stats
from vla_accel_ros.core.types import ActionChunk, Observation
from vla_accel_ros.models.base import StageTimer, make_planner
from vla_accel_ros.models.family import get_family
from vla_accel_ros.models.vision import VisionCache


@dataclass
class _Frame:
    obs: Observation
    region: int
    layout_len: int  # P
    tokens: list[int]
    entered_ns: int  # perf counter when the frame entered
    entered_call: int
    entered_busy_ns: int  # the pipeline's own compute time when the frame entered
    stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


class _OffsetHook:
    """A planner's prune hook in prefix coordinates, moved to a region's slots."""

    def __init__(self, hook, base: int) -> None:
        self.hook, self.base, self.layers = hook, base, hook.layers

    def __call__(self, layer: int, attn: torch.Tensor) -> torch.Tensor | None:
        drop = self.hook(layer, attn)
        return None if drop is None else drop + self.base


class PipelinedAr:
    """Pipelined inference over an :class:`~vla_accel_ros.models.ar.ArPolicy`'s model (its
    weights, tokenizer and layouts; its own KV cache and planner from ``policy.config``).

    ``push(obs)`` -> the chunks completed by this call (oldest first); ``flush()`` completes
    every frame in flight; ``reset()`` forgets them. ``depth`` (K) frames may be in flight;
    ``steps`` decode steps advance per call (more steps: less staleness, more work per call).
    Give either: the depth ``steps`` needs is ``ceil(n / steps)``, the steps a depth needs
    ``ceil(n / depth)`` (neither: one step per call).
    """

    def __init__(self, policy, *, depth: int = 0, steps: int = 0) -> None:
        if not get_family(policy.spec.family).pipelines:
            raise ConfigError(f"pipelined decoding is for ar policies, not {policy.spec.family}")
        if getattr(policy, "reasoning_words", ()):
            raise ConfigError(
                f"pipelined decoding does not run reasoning bundles ({policy.spec.name} writes reasoning before its "
                "actions); use memo modes for them"
            )
        n = policy.num_action_tokens
        if steps < 0 or depth < 0:
            raise ConfigError(f"pipeline depth={depth} and steps={steps} must be >= 0 (0: derived)")
        if not steps:  # the fewest steps that fit n tokens through depth stages (1 without a depth)
            steps = math.ceil(n / depth) if depth else 1
        depth = depth or math.ceil(n / steps)
        self.policy, self.depth, self.steps, self.n = policy, depth, steps, n
        self.region_len = policy.max_slots  # longest prefix + every action token
        self.cache = policy.stack.make_cache(depth * self.region_len)
        self.cache.set_layout([Segment(r * self.region_len, (Block(self.region_len, "causal"),)) for r in range(depth)])
        from vla_accel_ros.core.engine import Engine

        self.engine = Engine(
            policy.stack, self.cache, max_positions=self.region_len, bf16_attention_above=policy.engine.bf16_attention_above
        )
        self.planner = make_planner(policy.config)
        self.vision = VisionCache(policy.model.vis, len(policy.spec.cameras))  # its planner's, as its KV cache
        self.source = f"{policy.source}/pipeline"
        self.reset()

    @property
    def name(self) -> str:
        return f"pipelined+{self.planner.name}" if self.planner.name != "baseline" else "pipelined"

    def reset(self) -> None:
        self.planner.reset("explicit")
        self.vision.reset()
        self.cache.invalidate()
        self._flight: list[_Frame] = []
        self._free = list(range(self.depth))
        self._last_region: int | None = None
        self._last_layout: PrefixLayout | None = None
        self._calls = 0
        self._busy_ns = 0  # time spent inside push / flush (the pipeline's own compute)
        self._call_t0 = 0

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    # -- the calls ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def push(self, obs: Observation) -> list[ActionChunk]:
        """Put a new frame in; advance every frame in flight; the chunks that completed."""
        pol = self.policy
        t0 = self._call_t0 = time.perf_counter_ns()
        timer = StageTimer()
        self._calls += 1  # this call's index is _calls - 1 from here on
        done: list[ActionChunk] = []
        with timer.stage("preprocess"):
            layout, ids = pol.layout_for(obs.instruction)
            if self._last_layout is not None and layout != self._last_layout:
                done += self.flush()  # another prompt length: regions restart
            while not self._free:  # shallower than the decode needs: make room
                done += self._advance()
            frames = pol.frames(obs)
            ctx = pol.context(obs, layout, frames)
            ctx.source = self.source
            region = self._free.pop(0)
            base = region * self.region_len
            # The token cache reuses the previous frame's prefix K/V: copied into this region,
            # or kept where this region is that frame's own (depth 1 hands the region back).
            same = region == self._last_region and self._uses_cache()
            keep = layout.length if same else 0
            self.cache.invalidate(torch.arange(base + keep, base + self.region_len))
            if self._last_region is not None and self._uses_cache() and not same:
                old = self._last_region * self.region_len
                self.cache.copy_slots(old, base, layout.length)
        with timer.stage("select"):
            plan = self.planner.plan(ctx)
        with timer.stage("vision"):
            rows = plan.layer_slots[0]
            full = pol.prefix_embeddings(obs, layout, ids, frames.pixels, pol.image_rows(layout, rows), plan.vision_fresh, self.vision)
        frame = _Frame(obs, region, layout.length, [], t0, self._calls - 1, self._busy_ns)
        with timer.stage("prefill"):
            out, extra = self._packed(plan, full[rows], base, layout)
        with timer.stage("select"):
            self.planner.update(ctx, plan, out.taps)
        frame.stats = plan_stats(plan, layout, out.computed_per_layer, self.name, _unshift(out.dropped, base))
        frame.tokens.append(extra.pop(0))
        self._apply_decode(extra)
        self._flight.append(frame)
        self._last_region, self._last_layout = region, layout
        with timer.stage("decode"):
            for _ in range(self.steps - 1):
                done += self._advance()
        frame.timings = timer.finish()
        done += self._collect()
        self._busy_ns += time.perf_counter_ns() - t0
        return done

    def flush(self) -> list[ActionChunk]:
        """Decode-only forwards until every frame in flight is complete; their chunks."""
        done: list[ActionChunk] = []
        t0 = self._call_t0 = time.perf_counter_ns()
        with torch.inference_mode():
            while self._flight:
                done += self._advance()
        self._busy_ns += time.perf_counter_ns() - t0
        return done

    # -- internals ---------------------------------------------------------------------------------
    def _uses_cache(self) -> bool:
        return bool(getattr(self.policy.config, "uses_cache", False))

    def _decode_rows(self) -> tuple[list[_Frame], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next decode row of every unfinished frame in flight: frames, slots, positions, x."""
        frames = [f for f in self._flight if 0 < len(f.tokens) < self.n]
        pos = [f.layout_len + len(f.tokens) - 1 for f in frames]
        slots = torch.tensor([f.region * self.region_len + p for f, p in zip(frames, pos)], dtype=torch.long)
        toks = torch.tensor([f.tokens[-1] for f in frames], dtype=torch.long)
        x = self.policy.model.lm.model.embed_tokens(toks)  # [m, H]
        return frames, slots, torch.tensor(pos, dtype=torch.long), x

    def _packed(self, plan: PrefixPlan, prefix_x: torch.Tensor, base: int, layout: PrefixLayout):
        """One forward: the new frame's prefix rows (its planner's plan, moved to its region)
        and the decode rows of the frames in flight. Returns the output and, in order, the new
        frame's first token followed by each decode row's next token."""
        frames, dslots, dpos, dx = self._decode_rows()
        pslots = plan.layer_slots[0] + base
        slots = torch.cat([pslots, dslots])
        order = torch.argsort(slots)
        positions = torch.cat([plan.layer_slots[0], dpos])[order]
        x = torch.cat([prefix_x, dx])[order][None]
        layer_slots = [torch.sort(torch.cat([s + base, dslots])).values for s in plan.layer_slots]
        last = torch.tensor([base + layout.length - 1])
        outputs = torch.sort(torch.cat([last, dslots])).values
        taps = None
        if plan.taps is not None:
            t = plan.taps
            taps = dataclasses.replace(t, query_slots=t.query_slots + base, key_slots=t.key_slots + base)
        step = StepPlan(
            slots=slots[order], positions=positions, layer_slots=layer_slots,
            drop={l: d + base for l, d in plan.drop.items()}, output_slots=outputs, taps=taps,
            prune=_OffsetHook(plan.prune, base) if plan.prune is not None else None,
        )  # fmt: skip
        out = self.engine.forward(x, step)
        tokens = self._next_tokens(out.hidden[0])  # in output-slot order
        by_slot = dict(zip(outputs.tolist(), tokens))
        first = by_slot[int(last)]
        return out, [first] + [by_slot[int(s)] for s in dslots]

    def _next_tokens(self, hidden: torch.Tensor) -> list[int]:
        pol = self.policy
        return (pol.model.action_logits(hidden).argmax(-1) + pol._first_action_id).tolist()

    def _apply_decode(self, tokens: list[int]) -> None:
        frames = [f for f in self._flight if 0 < len(f.tokens) < self.n]
        for f, tok in zip(frames, tokens):
            f.tokens.append(tok)

    def _advance(self) -> list[ActionChunk]:
        """One decode-only forward over every frame in flight."""
        frames, slots, pos, x = self._decode_rows()
        if frames:
            order = torch.argsort(slots)
            out = self.engine.forward(x[order][None], StepPlan(slots=slots[order], positions=pos[order], output_slots=slots[order]))
            by_slot = dict(zip(slots[order].tolist(), self._next_tokens(out.hidden[0])))
            self._apply_decode([by_slot[int(s)] for s in slots])
        return self._collect()

    def _collect(self) -> list[ActionChunk]:
        """Chunks of the frames whose decode is complete, oldest first; their regions are freed."""
        now = time.perf_counter_ns()
        busy = self._busy_ns + (now - self._call_t0)
        done, keep = [], []
        for f in self._flight:
            if len(f.tokens) < self.n:
                keep.append(f)
                continue
            stats = dict(f.stats)
            stats.update(
                action_tokens=list(f.tokens), pipeline_depth=self.depth, pipeline_steps=self.steps,
                staleness_calls=self._calls - 1 - f.entered_call,  # calls after the one it entered in
                staleness_busy_ms=(busy - f.entered_busy_ns) / 1e6,  # the pipeline's own compute since then
                staleness_ms=(now - f.entered_ns) / 1e6,  # wall time since it entered (waits for frames too)
            )  # fmt: skip
            timings = dict(f.timings)
            timings["obs_to_action"] = (now - f.entered_ns) / 1e6
            done.append(
                ActionChunk(
                    actions=self.policy._decode_actions(f.tokens), stamp_ns=f.obs.stamp_ns, dt=self.policy.spec.dt,
                    chunk_id=self.policy.next_chunk_id(), joint_names=self.policy.spec.joint_names, timings_ms=timings,
                    stats=stats,
                )  # fmt: skip
            )
            self._free.append(f.region)
        self._flight = keep
        return done


def _unshift(dropped: dict[int, torch.Tensor], base: int) -> dict[int, torch.Tensor]:
    return {l: d - base for l, d in dropped.items()}

