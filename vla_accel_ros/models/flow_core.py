"""The flow-matching policy core every flow family fills in: ``flow`` (the package's own,
trained here), LeRobot's ``smolvla``, ``pi0`` and ``pi05``.

One copy of what they share: a VLM writes the prefix K/V into one cache once per observation;
an action expert reads it while Euler integration runs from t = 1 (noise) to t = 0 (actions),
x <- x - (1/T) v(x, t), optionally guided towards the previous chunk (Real-Time Chunking); the
plain transformers forward of the same computation (the parity gate's reference and the
benchmarks' baseline); the time-MLP suffix and its head Linears; the precision defaults.

What differs is a small set of hooks a family's policy fills in:

* the action codec (:meth:`FlowCore.make_codec`): how actions and the noise look inside the
  model and come back out in robot units: :class:`MeanStdCodec` (the package's mean/std) or
  LeRobot's normalize + pad + pi-ALOHA maps (:class:`~vla_accel_ros.models.lerobot_compat.LeRobotCodec`);
* the suffix rows: :attr:`FlowCore.suffix_len`, :meth:`FlowCore.suffix_embeddings`,
  :meth:`FlowCore.expert_plan`, :meth:`FlowCore.expert_condition` (adaptive norms);
* the cache layout: :meth:`FlowCore.cache_blocks` (and :meth:`FlowCore._build_engines` for an
  expert that does not write the cache);
* the flow times (:meth:`FlowCore.flow_times`: LeRobot's versions round them differently) and
  the reference's :meth:`FlowCore.reference_prefill` / :meth:`FlowCore.reference_velocity`;
* the prefix (``_make_layout``, ``_static_prefix``, ``prefix_capacity``: :class:`PolicyBase`'s hooks).

Training lives where training exists (the ``flow`` and ``smolvla`` policies), not here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.engine import DecoderStack, StepPlan
from vla_accel_ros.core.errors import ConfigError, ObservationError
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import COMPONENTS, PrecisionConfig
from vla_accel_ros.core.prefix import PrefixLayout, PrefixPlanner, plan_stats
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation
from vla_accel_ros.models.base import PolicyBase, StageTimer
from vla_accel_ros.models.common import Normalizer, sincos_embedding
from vla_accel_ros.models.family import Family

# The flow-time features' periods (pi0's scheme; SmolVLA's and pi0.5's checkpoints may say others).
PERIODS = (4e-3, 4.0)


class TimeMLPHeads:
    """The heads of an expert whose input rows carry the flow time (flow, SmolVLA, pi0), mixed into
    their ``nn.Module``: ``action_in`` over the noisy chunk, ``time_in`` / ``time_out`` over
    [action, time] features, ``action_out`` (the velocity). ``periods``: the time features'."""

    periods: tuple[float, float] = PERIODS

    def add_action_heads(self, action_width: int, width: int) -> None:
        """action_in, time_in, time_out, action_out, created in that order (a demo bundle's random
        weights follow the order)."""
        self.action_in = nn.Linear(action_width, width)
        self.time_in = nn.Linear(2 * width, width)
        self.time_out = nn.Linear(width, width)
        self.action_out = nn.Linear(width, action_width)

    def suffix_embeddings(self, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """x_t: [B, H, A] noisy chunk at flow time t (a float, or [B] per sample) -> [B, H, W]:
        time_out(silu(time_in([action_in(x_t), sincos(t)])))."""
        a = self.action_in(x_t)
        t = torch.as_tensor(t, dtype=torch.float32)
        te = sincos_embedding(t.reshape(-1), a.shape[-1], *self.periods).to(a.dtype)  # [1 or B, W]
        te = te[:, None, :].expand_as(a)
        return self.time_out(F.silu(self.time_in(torch.cat([a, te], dim=-1))))


def rtc_guidance_gain(t: float, max_guidance: float) -> float:
    """RTC's clipped gain min(beta, (1 - tau) / (tau * r^2)) with tau = 1 - t (data at tau = 1)."""
    tau = 1.0 - t
    if tau <= 0.0:
        return max_guidance
    r2 = (1.0 - tau) ** 2 / (tau**2 + (1.0 - tau) ** 2)
    if r2 <= 0.0:
        return max_guidance
    return min(max_guidance, (1.0 - tau) / (tau * r2))


class MeanStdCodec:
    """The package's action codec: actions normalized by the bundle's mean and std, the model
    as wide as the actions."""

    def __init__(self, spec: BundleSpec) -> None:
        self.spec = spec
        self.norm = Normalizer(spec.norm_stats["action"], spec.action_dim, "norm_stats.action")
        self.width = spec.action_dim  # the noise's and the model's action width

    def actions_out(self, x: torch.Tensor) -> np.ndarray:
        """The integrated chunk [1, H, D] (normalized) -> actions [H, action_dim] in robot units."""
        return self.norm.unnormalize_meanstd(x[0].detach().numpy()).astype(np.float32)

    def guidance_targets(self, prev: np.ndarray, weights: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """RTC targets [1, H, D] and weights [1, H, 1] in the model's space from the previous
        chunk's first n actions [n, D] and their weights [n] (the rest unweighted)."""
        h, n = self.spec.chunk_size, prev.shape[0]
        y = np.zeros((h, self.spec.action_dim), dtype=np.float32)
        y[:n] = self.norm.normalize_meanstd(prev)
        w = np.zeros(h, dtype=np.float32)
        w[:n] = weights
        return torch.from_numpy(y)[None], torch.from_numpy(w)[None, :, None]

    def scale(self) -> tuple[np.ndarray, np.ndarray]:
        st = self.norm.stats
        return st["mean"], np.maximum(st["std"], 1e-6)


class FlowCore(PolicyBase):
    """A flow-matching policy on the engine: the VLM's prefix in the cache, the expert's Euler
    steps over it, RTC guidance, and the plain transformers path of the same (see the module
    docstring for the hooks a family fills in)."""

    def __init__(
        self, spec: BundleSpec, model: nn.Module, config: PolicyConfig, planner: PrefixPlanner | None = None, *,
        precision: PrecisionConfig | None = None, bundle_path: str = "",
    ) -> None:  # fmt: skip
        super().__init__(spec, config, planner, precision, bundle_path)
        # Inference only; RTC differentiates w.r.t. the chunk, never the weights.
        self.model = model.eval().requires_grad_(False)
        self.vlm_stack = DecoderStack(model.vlm)
        self.max_prefix = self.prefix_capacity()
        self._build_engines()
        self.prefix_engine = self.vlm_engine
        self.codec = self.make_codec()
        self._layout_len = -1
        self._rng = np.random.default_rng(config.seed)

    # -- hooks ------------------------------------------------------------------------------------
    def make_codec(self):
        """The action codec: ``width``, ``actions_out(x)``, ``guidance_targets(prev, weights)``,
        ``scale()`` (:class:`MeanStdCodec` is the package's)."""
        return MeanStdCodec(self.spec)

    @property
    def suffix_len(self) -> int:
        """Rows the expert computes per Euler step (after the prefix)."""
        return self.spec.chunk_size

    def suffix_embeddings(self, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """The expert's input rows for the noisy chunk at flow time t.  x_t: [B, H, D] -> [B, n, W]"""
        return self.model.suffix_embeddings(x_t, t)

    def expert_condition(self, t: float) -> torch.Tensor | None:
        """The condition of an expert with adaptive norms at flow time t ([1, C]; pi0.5's time
        features); None for a plain expert (the time is in its input rows)."""
        return None

    def cache_blocks(self, layout: PrefixLayout) -> tuple[Block, ...]:
        """The cache's attention blocks for ``layout``: the prefix one bidirectional block, the
        chunk after it seeing the prefix and itself."""
        return (Block(layout.length, "bidirectional"), Block(self.spec.chunk_size, "bidirectional"))

    def flow_times(self) -> list[float]:
        """The flow times of the Euler steps, from t = 1 towards 0."""
        dt = 1.0 / self.num_steps
        return [1.0 - i * dt for i in range(self.num_steps)]

    # -- what follows from them -----------------------------------------------------------------
    def kv_dtype(self) -> torch.dtype:
        """bf16 when both decoders attend in bf16 (the expert's chunk rows always do): K/V are
        then stored as attention reads them, instead of the whole prefix being cast to bf16 at
        every Euler step."""
        low = [self.precision.bf16_attention_above(c) for c in ("lm", "expert")]
        return torch.bfloat16 if None not in low and self.suffix_len > low[1] else torch.float32

    def _build_engines(self) -> None:
        """One cache: the VLM writes the prefix rows, the expert writes and reads the chunk rows."""
        self.expert_stack = DecoderStack(self.model.expert)
        self.max_slots = self.max_prefix + self.suffix_len
        self.cache = self.vlm_stack.make_cache(self.max_slots, dtype=self.kv_dtype())
        self.vlm_engine = self.make_engine(self.vlm_stack, self.cache, self.max_slots)
        self.expert_engine = self.make_engine(self.expert_stack, self.cache, self.max_slots, component="expert")

    def actions_out(self, x: torch.Tensor) -> np.ndarray:
        """The integrated chunk [1, H, A] in the model's space -> actions [H, action_dim] in robot units."""
        return self.codec.actions_out(x)

    def action_scale(self) -> tuple[np.ndarray, np.ndarray]:
        return self.codec.scale()

    @property
    def noise_shape(self) -> tuple[int, int]:
        return (self.spec.chunk_size, self.codec.width)

    @property
    def num_steps(self) -> int:
        return self.config.flow_steps or self.spec.num_steps

    @property
    def noise_scale(self) -> float:
        """The multiple of the noise chunks start from (the policy's, else the bundle's)."""
        return self.config.noise_scale(self.spec.noise_scale)

    def bench_pairs(self, obs: Observation, layout: PrefixLayout, full: torch.Tensor) -> list:
        """``vla-accel bench engine``'s comparisons, transformers against the engine: (name,
        (label, fn), (label, fn), repeat factor) for the prefill, one denoise step over the
        cached prefix and a whole inference. ``full``: the prefix embeddings [P, H]."""
        P = layout.length
        all_slots = layout.all_slots()
        full_step = StepPlan(slots=all_slots, positions=all_slots, output_slots=all_slots[-1:])
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, *self.noise_shape)).astype(np.float32))

        def hf_prefill():
            with torch.inference_mode():
                return self.reference_prefill(full, layout)

        def eng_prefill():
            return self.vlm_engine.forward(full[None], full_step)

        pkv = hf_prefill()
        eng_prefill()

        def hf_step():
            with torch.inference_mode():
                return self.reference_velocity(x, 0.5, pkv, P)

        noise = x[0].numpy()
        return [
            ("prefill", ("transformers", hf_prefill), ("engine", eng_prefill), 1),
            ("denoise step", ("transformers", hf_step), ("engine", lambda: self.velocity(x, 0.5, P)), 1),
            ("full infer", ("transformers", lambda: self.reference_infer(obs, noise=noise)),
             ("engine", lambda: self.infer(obs, noise=noise)), 1),
        ]  # fmt: skip

    def static_steps(self, layout: PrefixLayout) -> dict:
        """The engine's static-shape steps (export): the full prefill and one expert pass."""
        suffix = torch.arange(layout.length, layout.length + self.suffix_len)
        return {"prefill": (self.vlm_engine, layout.all_slots()), "expert": (self.expert_engine, suffix)}

    def prepare_cache(self, layout: PrefixLayout) -> None:
        if layout.length != self._layout_len:
            self.cache.set_layout([Segment(0, self.cache_blocks(layout))])
            self.cache.invalidate()
            self._layout_len = layout.length

    def _noise(self, noise: np.ndarray | None) -> torch.Tensor:
        shape = self.noise_shape
        if noise is None:
            noise = self._rng.standard_normal(shape).astype(np.float32)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape:
            raise ObservationError(f"noise has shape {list(noise.shape)}, expected {list(shape)}")
        # Scaled here, after the caller's draw, so a given noise (the eval's per-chunk stream, the
        # gate's) means the same with any scale and the reference and engine paths see one start.
        return torch.from_numpy(noise * np.float32(self.noise_scale))[None]  # [1, H, D]

    def expert_plan(self, length: int) -> StepPlan:
        """The expert pass's plan over a prefix of ``length`` slots: the chunk's rows after it.
        One plan serves every Euler step of a chunk (the engine keeps its masks between them)."""
        slots = torch.arange(length, length + self.spec.chunk_size)
        return StepPlan(slots=slots, positions=slots, output_slots=slots, key_window=length + self.spec.chunk_size)

    def velocity(
        self, x_t: torch.Tensor, t: float, length: int, *, differentiable: bool = False, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """One expert pass over the cached prefix.  x_t: [1, H, D] -> v: [1, H, D]"""
        plan = plan or self.expert_plan(length)
        cond = self.expert_condition(t)
        extra = {} if cond is None else {"cond": cond}  # a plain expert's engine (SmolVLA's own) takes none
        if differentiable:
            with torch.enable_grad():
                out = self.expert_engine.forward(self.suffix_embeddings(x_t, t), plan, differentiable=True, **extra)
                return self.model.action_out(out.hidden)
        with torch.inference_mode():
            out = self.expert_engine.forward(self.suffix_embeddings(x_t, t), plan, **extra)
            return self.model.action_out(out.hidden)

    def denoise(self, noise: torch.Tensor, length: int, guidance: ChunkGuidance | None = None) -> torch.Tensor:
        """Euler from t=1 to t=0, optionally with Real-Time Chunking guidance.  -> [1, H, D]"""
        dt = 1.0 / self.num_steps
        x = noise
        plan = self.expert_plan(length)
        if guidance is None:
            for t in self.flow_times():
                x = x - dt * self.velocity(x, t, length, plan=plan)
            return x
        if self.precision.expert == "int8":
            raise ConfigError("Real-Time Chunking guidance differentiates the expert; precision.expert=int8 has no backward (use bf16)")
        y, w = self._guidance_targets(guidance)
        for t in self.flow_times():
            x_in = x.detach().requires_grad_(True)
            v = self.velocity(x_in, t, length, differentiable=True, plan=plan)
            with torch.enable_grad():
                x1_hat = x_in - t * v  # the data the current velocity points at
                (g,) = torch.autograd.grad(x1_hat, x_in, grad_outputs=(y - x1_hat.detach()) * w)
            # Move toward data (tau direction) and pull the predicted chunk toward the old one.
            x = (x_in + dt * (-v + rtc_guidance_gain(t, guidance.max_guidance) * g)).detach()
        return x

    def _guidance_targets(self, guidance: ChunkGuidance) -> tuple[torch.Tensor, torch.Tensor]:
        """RTC targets and weights in the model's action space (the codec's), from the previous
        chunk's actions in robot units."""
        h, d = self.spec.chunk_size, self.spec.action_dim
        prev = np.asarray(guidance.prev_actions, dtype=np.float32)
        weights = np.asarray(guidance.weights, dtype=np.float32).reshape(-1)
        if prev.ndim != 2 or prev.shape[1] != d or weights.shape[0] != h:
            raise ObservationError(f"guidance needs prev_actions [<= {h}, {d}] and weights [{h}]")
        n = min(h, prev.shape[0])
        return self.codec.guidance_targets(prev[:n], weights[:n])

    def infer(self, obs: Observation, *, noise: np.ndarray | None = None, guidance: ChunkGuidance | None = None) -> ActionChunk:
        timer = StageTimer()
        with timer.stage("preprocess"):
            layout, ids = self.layout_of(obs)
            self.prepare_cache(layout)
            frames = self.frames(obs)
            ctx = self.context(obs, layout, frames)
            x0 = self._noise(noise)
        with timer.stage("select"):
            plan = self.planner.plan(ctx)
        rows = plan.layer_slots[0]
        with timer.stage("vision"):
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.image_rows(layout, rows), plan.vision_fresh)
        with timer.stage("prefill"):
            step = StepPlan(
                slots=rows, positions=rows, layer_slots=plan.layer_slots, drop=plan.drop, taps=plan.taps, prune=plan.prune
            )
            out = self.vlm_engine.forward(full[rows][None], step)
        with timer.stage("select"):
            self.planner.update(ctx, plan, out.taps)
        with timer.stage("denoise"):
            x = self.denoise(x0, layout.length, guidance)
        with timer.stage("postprocess"):
            actions = self.actions_out(x)
            if guidance is not None and guidance.frozen > 0:
                # The frozen prefix executes from the old chunk anyway; return it exactly.
                d = min(guidance.frozen, actions.shape[0], len(guidance.prev_actions))
                actions[:d] = np.asarray(guidance.prev_actions, dtype=np.float32)[:d]
        stats = plan_stats(plan, layout, out.computed_per_layer, self.planner.name, out.dropped)
        stats["flow_steps"] = self.num_steps
        stats["flow_noise_scale"] = self.noise_scale
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, chunk_id=self.next_chunk_id(),
            joint_names=self.spec.joint_names, timings_ms=timer.finish(), stats=stats,
        )  # fmt: skip

    # -- the plain transformers path: parity gate and benchmark baseline -------------------------
    def reference_prefix(self, obs: Observation, noise: np.ndarray | None) -> tuple[StageTimer, PrefixLayout, torch.Tensor, torch.Tensor]:
        """The reference path's start: its timer (preprocess and vision timed), the layout, the
        whole prefix's embeddings [P, H] and the noise [1, H, D]."""
        timer = StageTimer()
        with timer.stage("preprocess"):
            layout, ids = self.layout_of(obs)
            frames = self.frames(obs)
            x = self._noise(noise)
        with timer.stage("vision"):
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))
        return timer, layout, full, x

    def reference_prefill(self, full: torch.Tensor, layout: PrefixLayout):
        """transformers' VLM over the whole prefix [P, H] (bidirectional 4-D mask) -> its DynamicCache."""
        p = full.shape[0]
        mask = torch.ones(1, 1, p, p, dtype=torch.bool)
        return self.model.vlm(inputs_embeds=full[None], attention_mask=mask, use_cache=True).past_key_values

    def reference_velocity(self, x: torch.Tensor, t: float, pkv, prefix_len: int) -> torch.Tensor:
        """transformers' expert over the chunk at flow time t with the prefix's DynamicCache,
        cropped back to the prefix after.  x: [1, H, D] -> v: [1, H, D]"""
        h = x.shape[1]
        pos = torch.arange(prefix_len, prefix_len + h)[None]
        mask = torch.ones(1, 1, h, prefix_len + h, dtype=torch.bool)
        hid = self.model.expert(
            inputs_embeds=self.suffix_embeddings(x, t), attention_mask=mask, position_ids=pos, past_key_values=pkv, use_cache=True
        ).last_hidden_state
        pkv.crop(-h)  # drop this step's chunk rows, keep the prefix
        return self.model.action_out(hid)

    @torch.inference_mode()
    def reference_infer(self, obs: Observation, *, noise: np.ndarray | None = None) -> ActionChunk:
        """transformers' own forwards: the VLM prefix once (:meth:`reference_prefill`), then per
        Euler step the expert over it (:meth:`reference_velocity`)."""
        timer, layout, full, x = self.reference_prefix(obs, noise)
        with timer.stage("prefill"):
            pkv = self.reference_prefill(full, layout)
        with timer.stage("denoise"):
            dt = 1.0 / self.num_steps
            for t in self.flow_times():
                x = x - dt * self.reference_velocity(x, t, pkv, layout.length)
        return self.reference_chunk(obs, timer, x)

    def reference_chunk(self, obs: Observation, timer: StageTimer, x: torch.Tensor) -> ActionChunk:
        """The reference path's end: the integrated chunk [1, H, A] as actions (timed)."""
        with timer.stage("postprocess"):
            actions = self.actions_out(x)
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, joint_names=self.spec.joint_names,
            timings_ms=timer.finish(), stats={"mode": "transformers"},
        )  # fmt: skip

    @torch.inference_mode()
    def reference_prefix_hidden(self, obs: Observation) -> torch.Tensor:
        layout, full = self.full_prefix(obs)
        mask = torch.ones(1, 1, layout.length, layout.length, dtype=torch.bool)
        return self.model.vlm(inputs_embeds=full[None], attention_mask=mask).last_hidden_state[0]

    @torch.inference_mode()
    def intermediate_prefix(self, obs: Observation, noise: np.ndarray):
        """The start of ``reference_intermediates`` (a reference fixture's comparison): the
        observation's prefix computed by the engine into the cache, for the suffix's intermediates
        after. -> (layout, frames, the prefix embeddings [P, H], the noise [1, H, A])"""
        layout, ids = self.layout_of(obs)
        self.prepare_cache(layout)
        frames = self.frames(obs)
        full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))
        rows = layout.all_slots()
        self.vlm_engine.forward(full[rows][None], StepPlan(slots=rows, positions=rows))
        self.planner.reset("external prefix write")
        return layout, frames, full, self._noise(noise)


class FlowFamilyBase(Family):
    """What the flow families' plug-ins share: the defaults of ``precision: auto`` (measured on
    the flow family's small demo bundles, docs/runtime.md; the gate takes the expert, then the LM
    too, back to fp32 where a bundle does not tolerate bf16), the head Linears, the decoders."""

    precision_defaults = {"vision": "bf16", "projector": "bf16", "lm": "bf16", "expert": "bf16", "heads": "fp32"}
    precision_fallbacks = ({"expert": "fp32"}, {"lm": "fp32", "expert": "fp32"}, {c: "fp32" for c in COMPONENTS})
    heads = ("state_proj", "action_in", "time_in", "time_out", "action_out")

    def decoder_layers(self, model) -> dict[str, nn.ModuleList]:
        return {"lm": model.vlm.layers, "expert": model.expert.layers}
