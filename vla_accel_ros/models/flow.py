"""``flow``: a SmolVLA / pi0-style flow-matching policy.

The VLM encodes ``[image tokens per camera] [prompt tokens] [state token]`` into a prefix
with bidirectional attention. A smaller action expert (same depth, K/V heads and head size,
narrower) embeds the noisy chunk x_t [H, D] with the flow time and, at every layer, attends to
the VLM's cached prefix K/V plus its own chunk tokens. Euler integration runs from t = 1
(noise) to t = 0 (actions): x <- x - (1/T) v(x, t).

Invariant: the prefix K/V is computed once per observation and only read during the T
solver steps (the expert computes the suffix rows only); ``test_flow_prefix_not_recomputed``
proves it.
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
from vla_accel_ros.core.precision import PrecisionConfig
from vla_accel_ros.core.prefix import PrefixLayout, PrefixPlanner, plan_stats
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation
from vla_accel_ros.core.precision import COMPONENTS
from vla_accel_ros.models import demo
from vla_accel_ros.models.base import PolicyBase, StageTimer, VisionPrefix
from vla_accel_ros.models.common import Normalizer, build_decoder, sincos_embedding
from vla_accel_ros.models.family import Family, check_expert_shares_cache, check_vision_patch
from vla_accel_ros.models.flops import denoise_step_flops, prefix_flops


class FlowVLA(nn.Module):
    """The modules of a ``flow`` bundle (stock transformers decoders for VLM and expert)."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        self.vlm = build_decoder(spec.lm, "lm", causal_lm=False)
        self.expert = build_decoder(spec.expert, "expert", causal_lm=False)
        hidden, width = self.vlm.config.hidden_size, self.expert.config.hidden_size
        self.vis = VisionPrefix(spec, hidden)
        self.state_proj = nn.Linear(spec.state_dim, hidden) if spec.state_dim else None
        self.action_in = nn.Linear(spec.action_dim, width)
        self.time_in = nn.Linear(2 * width, width)
        self.time_out = nn.Linear(width, width)
        self.action_out = nn.Linear(width, spec.action_dim)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        return self.vlm.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=self.vlm.embed_tokens.weight.device))  # [T, H]

    def suffix_embeddings(self, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """x_t: [B, H, D] noisy chunk at flow time t (a float, or [B] per sample) -> [B, H, W]."""
        a = self.action_in(x_t)
        t = torch.as_tensor(t, dtype=torch.float32)
        te = sincos_embedding(t.reshape(-1), a.shape[-1]).to(a.dtype)  # [1 or B, W]
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


class FlowPolicy(PolicyBase):
    family = "flow"

    def __init__(
        self, spec: BundleSpec, model: FlowVLA, config: PolicyConfig, planner: PrefixPlanner | None = None, *,
        precision: PrecisionConfig | None = None, bundle_path: str = "",
    ) -> None:  # fmt: skip
        super().__init__(spec, config, planner, precision, bundle_path)
        # Inference only; RTC differentiates w.r.t. the chunk, never the weights.
        self.model = model.eval().requires_grad_(False)
        self.vlm_stack = DecoderStack(model.vlm)
        self.max_prefix = self.prefix_capacity()
        self._build_engines()
        self.prefix_engine = self.vlm_engine
        self.action_norm = Normalizer(spec.norm_stats["action"], spec.action_dim, "norm_stats.action")
        self._layout_len = -1
        self._rng = np.random.default_rng(config.seed)

    def prefix_capacity(self) -> int:
        """The longest prefix a layout of this bundle can have (slots the cache holds for it)."""
        g = self.spec.grid
        return len(self.spec.cameras) * g * g + self.spec.max_text_tokens + (1 if self.spec.state_dim else 0)

    def kv_dtype(self) -> torch.dtype:
        """bf16 when both decoders attend in bf16 (the expert's chunk rows always do): K/V are
        then stored as attention reads them, instead of the whole prefix being cast to bf16 at
        every Euler step."""
        low = [self.precision.bf16_attention_above(c) for c in ("lm", "expert")]
        return torch.bfloat16 if None not in low and self.suffix_len > low[1] else torch.float32

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

    def _build_engines(self) -> None:
        """One cache: the VLM writes the prefix rows, the expert writes and reads the chunk rows."""
        self.expert_stack = DecoderStack(self.model.expert)
        self.max_slots = self.max_prefix + self.suffix_len
        self.cache = self.vlm_stack.make_cache(self.max_slots, dtype=self.kv_dtype())
        self.vlm_engine = self.make_engine(self.vlm_stack, self.cache, self.max_slots)
        self.expert_engine = self.make_engine(self.expert_stack, self.cache, self.max_slots, component="expert")

    def actions_out(self, x: torch.Tensor) -> np.ndarray:
        """The integrated chunk [1, H, D] (normalized) -> actions [H, action_dim] in robot units."""
        return self.action_norm.unnormalize_meanstd(x[0].detach().numpy()).astype(np.float32)

    @property
    def noise_shape(self) -> tuple[int, int]:
        return (self.spec.chunk_size, self.spec.action_dim)

    @property
    def num_steps(self) -> int:
        return self.config.flow_steps or self.spec.num_steps

    def _make_layout(self, text_len: int) -> PrefixLayout:
        s = self.spec
        n_img = len(s.cameras) * s.grid * s.grid
        state_slot = n_img + text_len if s.state_dim else None
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size,
            image_start=0, text_start=n_img, text_len=text_len, state_slot=state_slot,
            length=n_img + text_len + (1 if s.state_dim else 0), fixed_slots=(), attention="bidirectional",
            num_layers=self.vlm_stack.num_layers,
        )  # fmt: skip

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
                return self.reference_prefill(full)

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
        chunk = torch.arange(layout.length, layout.length + self.spec.chunk_size)
        return {"prefill": (self.vlm_engine, layout.all_slots()), "expert": (self.expert_engine, chunk)}

    def prepare_cache(self, layout: PrefixLayout) -> None:
        length = layout.length
        if length != self._layout_len:
            # Prefix: one bidirectional block. Chunk: sees the prefix and itself.
            self.cache.set_layout([Segment(0, (Block(length, "bidirectional"), Block(self.spec.chunk_size, "bidirectional")))])
            self.cache.invalidate()
            self._layout_len = length

    def _static_prefix(self, layout: PrefixLayout, ids: list[int]) -> torch.Tensor:
        static = torch.zeros(layout.length, self.model.vlm.config.hidden_size, device=self.model.vlm.embed_tokens.weight.device)
        static[layout.text_start : layout.text_start + layout.text_len] = self.model.embed_ids(ids)
        return static

    def _noise(self, noise: np.ndarray | None) -> torch.Tensor:
        shape = self.noise_shape
        if noise is None:
            noise = self._rng.standard_normal(shape).astype(np.float32)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape:
            raise ObservationError(f"noise has shape {list(noise.shape)}, expected {list(shape)}")
        return torch.from_numpy(noise.copy())[None]  # [1, H, D]

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

    def flow_times(self) -> list[float]:
        """The flow times of the Euler steps, from t = 1 towards 0."""
        dt = 1.0 / self.num_steps
        return [1.0 - i * dt for i in range(self.num_steps)]

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
        h, d = self.spec.chunk_size, self.spec.action_dim
        prev = np.asarray(guidance.prev_actions, dtype=np.float32)
        weights = np.asarray(guidance.weights, dtype=np.float32).reshape(-1)
        if prev.ndim != 2 or prev.shape[1] != d or weights.shape[0] != h:
            raise ObservationError(f"guidance needs prev_actions [<= {h}, {d}] and weights [{h}]")
        y = np.zeros((h, d), dtype=np.float32)
        n = min(h, prev.shape[0])
        y[:n] = self.action_norm.normalize_meanstd(prev[:n])
        w = np.zeros(h, dtype=np.float32)
        w[:n] = weights[:n]
        return torch.from_numpy(y)[None], torch.from_numpy(w)[None, :, None]

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
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, chunk_id=self.next_chunk_id(),
            joint_names=self.spec.joint_names, timings_ms=timer.finish(), stats=stats,
        )  # fmt: skip

    # -- training ---------------------------------------------------------------------------------
    def training_loss(
        self,
        pixels: torch.Tensor,
        states: torch.Tensor | None,
        instruction: str,
        actions: torch.Tensor,
        valid: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Flow matching on a batch (pi0 / SmolVLA): x_t = t * noise + (1 - t) * a, the expert
        predicts u = noise - a, with t ~ 0.999 * Beta(1.5, 1) + 0.001 (more weight on noisy t).

        The expert attends to the prefix K/V through transformers' own cache, the path the parity
        gate proves equal to the engine's inference.  pixels: [B, C, 3, S, S]; states: [B, D_s];
        actions: [B, H, D] robot units; valid: [B, H] (False: padding past the episode's end)."""
        layout, prefix = self.batch_prefix(pixels, states, instruction)  # [B, P, W]
        b, p = prefix.shape[:2]
        h = self.spec.chunk_size
        st = self.action_norm.stats
        mean = torch.as_tensor(st["mean"], device=actions.device)
        std = torch.as_tensor(np.maximum(st["std"], 1e-6), device=actions.device)
        a = (actions - mean) / std  # [B, H, D]
        dev = prefix.device
        noise = torch.randn(a.shape, generator=generator).to(dev)
        u = torch.rand(b, generator=generator).to(dev)
        t = 0.999 * u ** (1.0 / 1.5) + 0.001  # inverse CDF of Beta(1.5, 1)
        x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * a
        target = noise - a
        pkv = self.model.vlm(
            inputs_embeds=prefix, attention_mask=torch.ones(b, 1, p, p, dtype=torch.bool, device=dev), use_cache=True
        ).past_key_values
        hid = self.model.expert(
            inputs_embeds=self.model.suffix_embeddings(x_t, t),
            attention_mask=torch.ones(b, 1, h, p + h, dtype=torch.bool, device=dev),
            position_ids=torch.arange(p, p + h, device=dev)[None].expand(b, h),
            past_key_values=pkv,
            use_cache=True,
        ).last_hidden_state
        v = self.model.action_out(hid).float()  # [B, H, D]
        err = (v - target).pow(2).mean(-1)  # [B, H]
        w = valid.to(err.dtype)
        loss = (err * w).sum() / w.sum().clamp_min(1.0)
        return loss, {"loss": float(loss.detach())}

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

    def reference_prefill(self, full: torch.Tensor):
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
        """transformers' own forwards: the VLM prefix once into a DynamicCache, then per Euler
        step the expert over that cache (:meth:`reference_velocity`)."""
        timer, layout, full, x = self.reference_prefix(obs, noise)
        with timer.stage("prefill"):
            pkv = self.reference_prefill(full)
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


class FlowFamily(Family):
    """``flow`` bundles: a SmolVLA / pi0-style flow-matching policy (the package's own, trained here)."""

    name = "flow"
    # Measured on the small demo bundles (docs/runtime.md); the gate takes the expert, then
    # the LM too, back to fp32 where a bundle does not tolerate bf16.
    precision_defaults = {"vision": "bf16", "projector": "bf16", "lm": "bf16", "expert": "bf16", "heads": "fp32"}
    precision_fallbacks = ({"expert": "fp32"}, {"lm": "fp32", "expert": "fp32"}, {c: "fp32" for c in COMPONENTS})
    heads = ("state_proj", "action_in", "time_in", "time_out", "action_out")
    trainable = True
    default_chunk_size = 50

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        check_vision_patch(spec)
        check_expert_shares_cache(spec)

    def build_model(self, spec: BundleSpec) -> FlowVLA:
        return FlowVLA(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> FlowPolicy:
        return FlowPolicy(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def describe(self, spec: BundleSpec) -> list[str]:
        return [f"denoising   {spec.num_steps} Euler steps"]

    def decoder_layers(self, model: FlowVLA) -> dict[str, nn.ModuleList]:
        return {"lm": model.vlm.layers, "expert": model.expert.layers}

    def demo_spec(
        self, size: str, *, cameras: tuple[str, ...] = ("cam_high",), action_dim: int = 14, chunk_size: int | None = None,
        lm_type: str = "llama", state_dim: int | None = None, norm_stats: dict | None = None, name: str | None = None,
        default_instruction: str | None = None, reasoning_words: tuple[str, ...] = (), max_reasoning_tokens: int = 0,
    ) -> BundleSpec:  # fmt: skip
        """A random-weight ``size`` bundle; the state input is the action size unless ``state_dim``."""
        sz = demo.size_table(size)
        vocab = sz["vocab"]
        lm = {"model_type": lm_type, **sz["lm"], "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0}
        state_dim = action_dim if state_dim is None else state_dim
        expert = {
            "model_type": lm_type, **sz["expert"], "num_hidden_layers": lm["num_hidden_layers"],
            "num_key_value_heads": lm["num_key_value_heads"], "vocab_size": 1, "max_position_embeddings": 4096,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "rope_theta": 10000.0,
        }  # fmt: skip
        return BundleSpec(
            family="flow", name=name or f"demo-flow-{size}", cameras=cameras, image_size=224, patch_size=14,
            action_dim=action_dim, joint_names=demo.joint_names(action_dim), dt=0.02, state_dim=state_dim,
            norm_stats=norm_stats or demo.demo_norm_stats(action_dim, state_dim),
            vision={**sz["vision"], "image_size": 224, "patch_size": 14}, text_vocab=vocab - 3,
            chunk_size=chunk_size or 50, num_steps=10, instruction_template="{instruction}", lm=lm, expert=expert,
            reasoning_words=tuple(reasoning_words), max_reasoning_tokens=max_reasoning_tokens,
            **({"default_instruction": default_instruction} if default_instruction is not None else {}),
        )  # fmt: skip

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        out = prefix_flops(spec, work, causal=False)
        out["denoise"] = flow_steps * denoise_step_flops(spec.expert, spec.chunk_size, work.prefix_len, spec.action_dim)
        out["state"] = 2.0 * spec.state_dim * int(spec.lm["hidden_size"])  # the state token's projection
        return out


FAMILY = FlowFamily()
