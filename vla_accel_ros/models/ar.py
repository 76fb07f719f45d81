"""``ar``: an OpenVLA-style autoregressive policy.

Prefix: ``[BOS] [image tokens, grid x grid per camera] [prompt tokens] [state]``, causal; the
state token (a linear projection of the normalized joint state, as OpenVLA-OFT adds
proprioception) exists only when the bundle's ``state_dim`` > 0. The actions are decoded
greedily, one token per action dimension and chunk step (``chunk_size`` x ``action_dim``
tokens, step-major), from the last ``action_bins`` vocabulary ids; a token maps to the center
of its bin in [-1, 1] and is unnormalized with the bundle's q01/q99 bounds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.engine import DecoderStack, StepPlan
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.prefix import PrefixLayout, PrefixPlanner, plan_stats
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation
from vla_accel_ros.models.base import PolicyBase, StageTimer, VisionPrefix
from vla_accel_ros.models.common import HashWordTokenizer, Normalizer, build_decoder


class ArVLA(nn.Module):
    """The modules of an ``ar`` bundle: vision tower, projector, causal LM (stock transformers)."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        self.lm = build_decoder(spec.lm, "lm", causal_lm=True)
        self.vis = VisionPrefix(spec, self.lm.config.hidden_size)
        self.state_proj = nn.Linear(spec.state_dim, self.lm.config.hidden_size) if spec.state_dim else None
        self.action_bins = spec.action_bins

    @property
    def decoder(self) -> nn.Module:
        return self.lm.model

    def embed_ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.lm.model.embed_tokens.weight.device)
        return self.lm.model.embed_tokens(ids)  # [T, H]

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the action ids only: the head rows of the last ``action_bins`` ids."""
        return hidden @ self.lm.lm_head.weight[-self.action_bins :].T  # [.., bins]

    def bins_from_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary id -> bin index (the highest id is bin 0, as in OpenVLA)."""
        return self.lm.config.vocab_size - 1 - ids


class ArPolicy(PolicyBase):
    family = "ar"

    def __init__(self, spec: BundleSpec, model: ArVLA, config: PolicyConfig, planner: PrefixPlanner | None = None) -> None:
        super().__init__(spec, config, planner)
        self.model = model.eval().requires_grad_(False)
        self.num_action_tokens = spec.action_dim * spec.chunk_size
        self.stack = DecoderStack(model.decoder)
        g = spec.grid
        n_state = 1 if spec.state_dim else 0
        self.max_slots = 1 + len(spec.cameras) * g * g + spec.max_text_tokens + n_state + self.num_action_tokens
        self.cache = self.stack.make_cache(self.max_slots)
        self.cache.set_layout([Segment(0, (Block(self.max_slots, "causal"),))])
        self.engine = self.make_engine(self.stack, self.cache, self.max_slots)
        self.prefix_engine = self.engine
        self.action_norm = Normalizer(spec.norm_stats["action"], spec.action_dim, "norm_stats.action")
        bins = spec.action_bins
        self.bin_centers = (-1.0 + (2.0 * np.arange(bins) + 1.0) / bins).astype(np.float32)

    def _make_layout(self, text_len: int) -> PrefixLayout:
        s = self.spec
        n_img = len(s.cameras) * s.grid * s.grid
        state_slot = 1 + n_img + text_len if s.state_dim else None
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size,
            image_start=1, text_start=1 + n_img, text_len=text_len, state_slot=state_slot,
            length=1 + n_img + text_len + (1 if s.state_dim else 0), fixed_slots=(0,), attention="causal",
            num_layers=self.stack.num_layers,
        )  # fmt: skip

    def _static_prefix(self, layout: PrefixLayout, ids: list[int]) -> torch.Tensor:
        static = torch.zeros(layout.length, self.model.lm.config.hidden_size, device=self.model.lm.lm_head.weight.device)
        static[0] = self.model.embed_ids([HashWordTokenizer.BOS])[0]
        static[layout.text_start : layout.text_start + layout.text_len] = self.model.embed_ids(ids)
        return static

    def _decode_actions(self, token_ids: list[int]) -> np.ndarray:
        ids = torch.tensor(token_ids)
        bins = self.model.bins_from_ids(ids).clamp(0, self.spec.action_bins - 1).numpy()
        normalized = self.bin_centers[bins].reshape(self.spec.chunk_size, self.spec.action_dim)
        return self.action_norm.unnormalize_bounds(normalized).astype(np.float32)

    @torch.inference_mode()
    def infer(self, obs: Observation, *, noise: np.ndarray | None = None, guidance: ChunkGuidance | None = None) -> ActionChunk:
        timer = StageTimer()
        with timer.stage("preprocess"):
            layout, ids = self.layout_for(obs.instruction)
            frames = self.frames(obs)
            ctx = self.context(obs, layout, frames)
        with timer.stage("select"):
            plan = self.planner.plan(ctx)
        rows = plan.layer_slots[0]
        with timer.stage("vision"):
            cams = self.image_rows(layout, rows)
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, cams)
        with timer.stage("prefill"):
            last = torch.tensor([layout.length - 1])
            step = StepPlan(
                slots=rows, positions=rows, layer_slots=plan.layer_slots, drop=plan.drop, output_slots=last, taps=plan.taps,
                prune=plan.prune,
            )
            out = self.engine.forward(full[rows][None], step)
            token = int(self.model.action_logits(out.hidden[0, -1]).argmax()) + self._first_action_id
        with timer.stage("select"):
            self.planner.update(ctx, plan, out.taps)
        with timer.stage("decode"):
            tokens = [token]
            embed = self.model.lm.model.embed_tokens
            for i in range(1, self.num_action_tokens):
                slot = torch.tensor([layout.length + i - 1])
                x = embed(torch.tensor([[token]]))  # [1, 1, H]
                o = self.engine.forward(x, StepPlan(slots=slot, positions=slot, output_slots=slot))
                token = int(self.model.action_logits(o.hidden[0, -1]).argmax()) + self._first_action_id
                tokens.append(token)
        with timer.stage("postprocess"):
            actions = self._decode_actions(tokens)
        stats = plan_stats(plan, layout, out.computed_per_layer, self.planner.name, out.dropped)
        stats["action_tokens"] = tokens
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, chunk_id=self.next_chunk_id(),
            joint_names=self.spec.joint_names, timings_ms=timer.finish(), stats=stats,
        )  # fmt: skip

    def pipeline(self, *, depth: int = 0, steps: int = 0):
        """ActionFlow's pipelined decode over this policy's model (:class:`PipelinedAr`: its own
        KV cache and a planner from this policy's options)."""
        from vla_accel_ros.models.pipeline import PipelinedAr

        return PipelinedAr(self, depth=depth, steps=steps)

    # -- training ---------------------------------------------------------------------------------
    def action_bins_of(self, actions: torch.Tensor) -> torch.Tensor:
        """Robot-unit actions [..., D] -> bin indices [..., D] (the inverse of the decoding)."""
        st = self.action_norm.stats
        lo = torch.as_tensor(st["q01"], device=actions.device)
        hi = torch.as_tensor(st["q99"], device=actions.device)
        x = (2.0 * (actions - lo) / (hi - lo).clamp_min(1e-6) - 1.0).clamp(-1.0, 1.0)
        bins = self.spec.action_bins
        return ((x + 1.0) * 0.5 * bins).floor().long().clamp(0, bins - 1)

    def training_loss(
        self,
        pixels: torch.Tensor,
        states: torch.Tensor | None,
        instruction: str,
        actions: torch.Tensor,
        valid: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy on the action tokens with teacher forcing (the prefix, then the chunk's
        tokens step-major), over the action ids only, as :meth:`infer` takes its argmax.
        actions: [B, H, D] robot units; valid: [B, H]. ``generator`` is unused (no noise)."""
        layout, prefix = self.batch_prefix(pixels, states, instruction)  # [B, P, W]
        b, p = prefix.shape[:2]
        bins = self.spec.action_bins
        target = (bins - 1 - self.action_bins_of(actions)).reshape(b, -1)  # [B, n] rows of the head
        ids = target + self._first_action_id
        emb = self.model.lm.model.embed_tokens(ids[:, :-1]).to(prefix.dtype)
        hidden = self.model.lm.model(inputs_embeds=torch.cat([prefix, emb], dim=1)).last_hidden_state
        logits = self.model.action_logits(hidden[:, p - 1 :]).float()  # [B, n, bins]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [B, n]
        w = valid.repeat_interleave(self.spec.action_dim, dim=1).to(ce.dtype)
        loss = (ce * w).sum() / w.sum().clamp_min(1.0)
        acc = float(((logits.argmax(-1) == target).float() * w).sum() / w.sum().clamp_min(1.0))
        return loss, {"loss": float(loss.detach()), "token_acc": acc}

    @property
    def _first_action_id(self) -> int:
        return self.model.lm.config.vocab_size - self.spec.action_bins

    # -- the plain transformers path: parity gate and benchmark baseline -------------------------
    @torch.inference_mode()
    def reference_infer(self, obs: Observation) -> ActionChunk:
        """The same policy through transformers' own forward and DynamicCache (full vocab head)."""
        timer = StageTimer()
        with timer.stage("preprocess"):
            layout, ids = self.layout_for(obs.instruction)
            frames = self.frames(obs)
        with timer.stage("vision"):
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))
        bins, lm = self.spec.action_bins, self.model.lm
        with timer.stage("prefill"):
            out = lm(inputs_embeds=full[None], use_cache=True)
            token = int(out.logits[0, -1, -bins:].argmax()) + self._first_action_id
        with timer.stage("decode"):
            tokens, pkv = [token], out.past_key_values
            for _ in range(1, self.num_action_tokens):
                out = lm(input_ids=torch.tensor([[token]]), past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                token = int(out.logits[0, -1, -bins:].argmax()) + self._first_action_id
                tokens.append(token)
        with timer.stage("postprocess"):
            actions = self._decode_actions(tokens)
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, joint_names=self.spec.joint_names,
            timings_ms=timer.finish(), stats={"mode": "transformers", "action_tokens": tokens},
        )  # fmt: skip

    @torch.inference_mode()
    def reference_prefix_hidden(self, obs: Observation) -> torch.Tensor:
        """transformers' final hidden state of the whole prefix.  # [P, H]"""
        _, full = self.full_prefix(obs)
        return self.model.lm.model(inputs_embeds=full[None]).last_hidden_state[0]
