"""``ar``: an OpenVLA-style autoregressive policy.

Prefix: ``[BOS] [image tokens, grid x grid per camera] [prompt tokens] [state]``, causal; the
state token (a linear projection of the normalized joint state, as OpenVLA-OFT adds
proprioception) exists only when the bundle's ``state_dim`` > 0. The actions are decoded
greedily, one token per action dimension and chunk step (``chunk_size`` x ``action_dim``
tokens, step-major), from the last ``action_bins`` vocabulary ids; a token maps to the center
of its bin in [-1, 1] and is unnormalized with the bundle's q01/q99 bounds.

A reasoning bundle (``reasoning_words``) first writes its reasoning greedily over those words
(their ids lie just below the action bins) until ``<act>`` (the EOS id), at most
``max_reasoning_tokens``, then the actions: ``[prefix] [reasoning] <act> [actions]``. With
``memo.mode`` on, the previous frame's reasoning is validated in the prefill and only what no
longer holds is regenerated (:mod:`vla_accel_ros.models.reasoning_reuse`).

With ``action_draft: previous`` the previous chunk's action tokens ride along in the prefill as
the draft of speculative decoding (:mod:`vla_accel_ros.models.action_draft`). The prefill's rows
are then ``[prefix] [hypothesis words, <act>] [draft tokens]``, each part present or not.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.engine import DecoderStack, StepPlan, TapSpec
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.precision import PrecisionConfig
from vla_accel_ros.core.prefix import PrefixLayout, PrefixPlanner, plan_stats
from vla_accel_ros.core.reasoning.memo import ACT
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation
from vla_accel_ros.core.precision import COMPONENTS
from vla_accel_ros.models import demo
from vla_accel_ros.models.action_draft import ActionDraft, greedy_tokens
from vla_accel_ros.models.base import PolicyBase, StageTimer, VisionPrefix
from vla_accel_ros.models.common import HashWordTokenizer, Normalizer, build_decoder
from vla_accel_ros.models.family import Family, check_vision_patch
from vla_accel_ros.models.flops import decoder_layer_flops, prefix_flops
from vla_accel_ros.models.reasoning_reuse import ReasoningReuse


class ArVLA(nn.Module):
    """The modules of an ``ar`` bundle: vision tower, projector, causal LM (stock transformers)."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        self.lm = build_decoder(spec.lm, "lm", causal_lm=True)
        self.vis = VisionPrefix(spec, self.lm.config.hidden_size)
        self.state_proj = nn.Linear(spec.state_dim, self.lm.config.hidden_size) if spec.state_dim else None
        self.action_bins = spec.action_bins
        # Reasoning word class c -> vocabulary id; the last class is <act> (EOS).
        first = self.lm.config.vocab_size - spec.action_bins - len(spec.reasoning_words)
        self.reasoning_token_ids = [*range(first, first + len(spec.reasoning_words)), HashWordTokenizer.EOS]
        # the head rows of those ids (a buffer: it follows the model's device, not in the weights)
        self.register_buffer("reasoning_index", torch.tensor(self.reasoning_token_ids), persistent=False)

    @property
    def decoder(self) -> nn.Module:
        return self.lm.model

    def embed_ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.lm.model.embed_tokens.weight.device)
        return self.lm.model.embed_tokens(ids)  # [T, H]

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the action ids only: the head rows of the last ``action_bins`` ids."""
        return hidden @ self.lm.lm_head.weight[-self.action_bins :].T  # [.., bins]

    def reasoning_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the reasoning words and <act> only (the class order of ``reasoning_token_ids``)."""
        return hidden @ self.lm.lm_head.weight[self.reasoning_index].T  # [.., words + 1]

    def bins_from_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary id -> bin index (the highest id is bin 0, as in OpenVLA)."""
        return self.lm.config.vocab_size - 1 - ids


class ArPolicy(PolicyBase):
    family = "ar"

    def __init__(
        self, spec: BundleSpec, model: ArVLA, config: PolicyConfig, planner: PrefixPlanner | None = None, *,
        bundle_path: str = "", precision: PrecisionConfig | None = None,
    ) -> None:  # fmt: skip
        super().__init__(spec, config, planner, precision, bundle_path)
        self.model = model.eval().requires_grad_(False)
        self.num_action_tokens = spec.action_dim * spec.chunk_size
        self.stack = DecoderStack(model.decoder)
        g = spec.grid
        n_state = 1 if spec.state_dim else 0
        self.reasoning_words = tuple(spec.reasoning_words)
        self.act_class = len(self.reasoning_words)  # <act>
        reason_slots = spec.max_reasoning_tokens + 1 if self.reasoning_words else 0  # the words, then <act>
        self.max_slots = 1 + len(spec.cameras) * g * g + spec.max_text_tokens + n_state + reason_slots + self.num_action_tokens
        self.cache = self.stack.make_cache(self.max_slots)
        self.cache.set_layout([Segment(0, (Block(self.max_slots, "causal"),))])
        self.engine = self.make_engine(self.stack, self.cache, self.max_slots)
        self.prefix_engine = self.engine
        self.action_norm = Normalizer(spec.norm_stats["action"], spec.action_dim, "norm_stats.action")
        bins = spec.action_bins
        self.bin_centers = (-1.0 + (2.0 * np.arange(bins) + 1.0) / bins).astype(np.float32)
        self.reasoning = (
            ReasoningReuse(self.reasoning_words, model.reasoning_token_ids, spec.max_reasoning_tokens, bundle_path)
            if self.reasoning_words else None
        )  # fmt: skip
        self.draft = ActionDraft()
        if self.reasoning is not None:
            self.reasoning.configure(config.memo)
        else:
            self._check_memo(config)

    # -- run-time options: reasoning reuse (MEMO-VLM) and the action draft ---------------------------
    def check_config(self, config: PolicyConfig) -> None:
        super().check_config(config)
        self._check_memo(config)  # ConfigError before anything changes

    def _check_memo(self, config: PolicyConfig) -> None:
        if self.reasoning is not None:
            self.reasoning.thresholds_for(config.memo)  # reads a calibrated mode's calibration
        elif config.memo.enabled:
            raise ConfigError(f"memo.mode={config.memo.mode}: bundle {self.spec.name} writes no reasoning (no reasoning_words)")

    def configure(self, config: PolicyConfig) -> bool:
        replan = super().configure(config)
        if self.reasoning is not None:
            self.reasoning.configure(config.memo)
        self.draft.reset()
        return replan

    def reset(self) -> None:
        super().reset()
        if self.reasoning is not None:
            self.reasoning.reset()
        self.draft.reset()

    def _step(self, token_ids: list[int], slot: int, taps: TapSpec | None = None):
        """Tokens at consecutive slots from ``slot`` (a decode step: one), every row output."""
        s = torch.arange(slot, slot + len(token_ids))
        return self.engine.forward(self.model.embed_ids(token_ids)[None], StepPlan(slots=s, positions=s, output_slots=s, taps=taps))

    @torch.inference_mode()
    def reasoning_trace(self, obs: Observation) -> tuple[list[str], list[float], list[float]]:
        """Full greedy reasoning of ``obs`` (no reuse, every prefix row computed): the words
        (``<act>`` last), the probability of each, and the attention mass on the image tokens
        of the row that chose it, averaged over layers and heads (engine taps). What
        ``vla-accel calibrate-reasoning`` collects."""
        if not self.reasoning_words:
            raise ConfigError(f"bundle {self.spec.name} writes no reasoning")
        layout, ids = self.layout_for(obs.instruction)
        self.prepare_cache(layout)
        self.planner.reset("external prefix write")
        full = self.prefix_embeddings(obs, layout, ids, self.frames(obs).pixels, self.all_cameras(layout))
        p0 = layout.length
        layers = tuple(range(self.stack.num_layers))
        img = layout.image_slots()

        def taps(slot: int) -> TapSpec:
            return TapSpec(layers=layers, query_slots=torch.tensor([slot]), key_slots=img, entropy=False)

        rows = torch.arange(p0)
        out = self.engine.forward(full[None], StepPlan(slots=rows, positions=rows, output_slots=rows[-1:], taps=taps(p0 - 1)))
        words, probs, mass = [], [], []
        hidden, tap = out.hidden[0, -1], out.taps
        classes: list[int] = []
        while True:
            pr = self.model.reasoning_logits(hidden).float().softmax(-1)
            c = int(pr.argmax())
            words.append(ACT if c == self.act_class else self.reasoning_words[c])
            probs.append(float(pr[c]))
            mass.append(float(np.mean([float(tap.attn[l].sum()) for l in layers])))
            if c == self.act_class or len(classes) >= self.spec.max_reasoning_tokens:
                break
            classes.append(c)
            slot = p0 + len(classes) - 1
            o = self._step([self.model.reasoning_token_ids[c]], slot, taps(slot))
            hidden, tap = o.hidden[0, -1], o.taps
        self.planner.reset("external prefix write")
        return words, probs, mass

    def bench_pairs(self, obs: Observation, layout: PrefixLayout, full: torch.Tensor) -> list:
        """``vla-accel bench engine``'s comparisons, transformers against the engine: (name,
        (label, fn), (label, fn), repeat factor) for the prefill, one decode token after it and
        a whole inference. ``full``: the prefix embeddings [P, H]."""
        P, lm = layout.length, self.model.lm
        all_slots = layout.all_slots()
        full_step = StepPlan(slots=all_slots, positions=all_slots, output_slots=all_slots[-1:])

        def hf_prefill():
            with torch.inference_mode():
                return lm.model(inputs_embeds=full[None], use_cache=True)

        def eng_prefill():
            return self.engine.forward(full[None], full_step)

        pkv = hf_prefill().past_key_values
        eng_prefill()
        tok = torch.tensor([[lm.config.vocab_size - 1]])
        bins = self.spec.action_bins

        def hf_decode():
            with torch.inference_mode():
                out = lm(input_ids=tok, past_key_values=pkv, use_cache=True)
                pkv.crop(-1)
                return int(out.logits[0, -1, -bins:].argmax())

        slot = torch.tensor([P])
        dplan = StepPlan(slots=slot, positions=slot, output_slots=slot)

        def eng_decode():
            with torch.inference_mode():
                o = self.engine.forward(lm.model.embed_tokens(tok), dplan)
                return int(self.model.action_logits(o.hidden[0, -1]).argmax())

        return [
            ("prefill", ("transformers", hf_prefill), ("engine", eng_prefill), 1),
            ("decode step", ("transformers", hf_decode), ("engine", eng_decode), 4),
            ("full infer", ("transformers", lambda: self.reference_infer(obs)), ("engine", lambda: self.infer(obs)), 1),
        ]

    def static_steps(self, layout: PrefixLayout) -> dict:
        """The engine's static-shape steps (export): the full prefill and one decode row."""
        return {"prefill": (self.engine, layout.all_slots()), "decode": (self.engine, torch.tensor([layout.length]))}

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
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, cams, plan.vision_fresh)
        key = (obs.episode, obs.instruction)
        with timer.stage("prefill"):
            p0 = layout.length
            # The prefill's rows after the prefix: the previous reasoning and <act> (MEMO-VLM's
            # hypothesis), then the previous chunk's tokens (the action draft), which follow where
            # the actions will start if the hypothesis holds.
            hypothesis = self.reasoning.hypothesis(key) if self.reasoning is not None else None
            hyp_ids = self.reasoning.prefill_ids(hypothesis) if self.reasoning is not None else []
            draft = self.draft.for_frame(key) if self.reasoning is None or hypothesis is not None else None
            extra = hyp_ids + (ActionDraft.prefill_ids(draft) if draft is not None else [])
            out = self.engine.forward(*self._prefill_step(full, plan, p0, extra))
        with timer.stage("select"):
            self.planner.update(ctx, plan, out.taps)
        reasoning_stats: dict = {}
        a0 = p0  # slot of the first action token's input row
        act_hidden, draft_seen = out.hidden[0, 0], True
        if self.reasoning is not None:
            with timer.stage("reason"):
                r = self.reasoning.resolve(
                    self.config.memo, out.hidden[0, : 1 + len(hyp_ids)], hypothesis, self.model.reasoning_logits,
                    lambda c, i: self._step([self.model.reasoning_token_ids[c]], p0 + i).hidden[0, -1],
                )  # fmt: skip
            a0, act_hidden, reasoning_stats = p0 + len(r.classes) + 1, r.act_hidden, r.stats
            # The draft rows saw the right context only if the hypothesis rows hold this frame's reasoning.
            draft_seen = r.held
        draft_rows = out.hidden[0, 1 + len(hyp_ids) :] if draft is not None and draft_seen else None
        with timer.stage("decode"):
            # A rejected row's K/V (a later slot) is overwritten by the next forward before any
            # row may read it: the causal mask hides later slots.
            tokens, accepted, steps, rows_run = greedy_tokens(
                self.num_action_tokens, int(self.model.action_logits(act_hidden).argmax()) + self._first_action_id, draft,
                None if draft_rows is None else self._argmax_tokens(draft_rows),
                lambda inputs, i: self._argmax_tokens(self._step(inputs, a0 + i).hidden[0]),
            )  # fmt: skip
        with timer.stage("postprocess"):
            actions = self._decode_actions(tokens)
        if self.config.action_draft == "previous":
            self.draft.remember(tokens, key)
        stats = plan_stats(plan, layout, out.computed_per_layer, self.planner.name, out.dropped)
        stats["action_tokens"] = tokens
        stats["draft_rows"] = 0 if draft is None else len(draft) - 1
        stats["draft_accepted"] = accepted
        stats["decode_steps"] = steps
        stats["decode_rows"] = rows_run
        stats.update(reasoning_stats)
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, chunk_id=self.next_chunk_id(),
            joint_names=self.spec.joint_names, timings_ms=timer.finish(), stats=stats,
        )  # fmt: skip

    def _prefill_step(self, full: torch.Tensor, plan, p0: int, extra: list[int]) -> tuple[torch.Tensor, StepPlan]:
        """The prefill's input rows [1, N, H] and its StepPlan: the prefix rows the prefix plan
        computes, then the tokens ``extra`` at slots ``p0..`` (computed at every layer). Its
        outputs: the last prefix row, then every extra row."""
        rows = plan.layer_slots[0]
        ext = torch.arange(p0, p0 + len(extra))
        x, layer_slots = full[rows], plan.layer_slots
        if extra:
            x = torch.cat([x, self.model.embed_ids(extra).to(x.dtype)])
            layer_slots = [torch.cat([ls, ext]) for ls in plan.layer_slots]
        slots = torch.cat([rows, ext])
        step = StepPlan(
            slots=slots, positions=slots, layer_slots=layer_slots, drop=plan.drop,
            output_slots=torch.cat([torch.tensor([p0 - 1]), ext]), taps=plan.taps, prune=plan.prune,
        )  # fmt: skip
        return x[None], step

    def _argmax_tokens(self, hidden: torch.Tensor) -> list[int]:
        return (self.model.action_logits(hidden).argmax(-1) + self._first_action_id).tolist()

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
        reasoning: list[list[str]] | None = None,
        *,
        image_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy with teacher forcing on ``[reasoning] <act> [actions]`` after the prefix
        (a reasoning bundle) or on the actions alone, each over its own ids (the reasoning words
        and <act>; the action bins), as :meth:`infer` takes its argmaxes. actions: [B, H, D]
        robot units; valid: [B, H]; reasoning: per sample, its words. ``generator`` is unused."""
        layout, prefix = self.batch_prefix(pixels, states, instruction, image_tokens=image_tokens)  # [B, P, W]
        b, p = prefix.shape[:2]
        bins = self.spec.action_bins
        target = (bins - 1 - self.action_bins_of(actions)).reshape(b, -1)  # [B, n] rows of the head
        n_act = target.shape[1]
        w_act = valid.repeat_interleave(self.spec.action_dim, dim=1)  # [B, n]
        classes = self._reasoning_classes(reasoning, b)  # per sample: word classes and <act> (none: [])
        dev = target.device
        length = max(len(c) for c in classes) + n_act  # predicted tokens per sample (padded); inputs are one fewer
        ids = torch.zeros(b, length, dtype=torch.long, device=dev)  # PAD after each sample's end
        cls_t = torch.zeros(b, length, dtype=torch.long, device=dev)
        act_t = torch.zeros(b, length, dtype=torch.long, device=dev)
        m_r = torch.zeros(b, length, dtype=torch.bool, device=dev)
        m_a = torch.zeros(b, length, dtype=torch.float32, device=dev)
        rid = self.model.reasoning_index.to(dev)
        for i, c in enumerate(classes):
            r = len(c)
            if r:
                ct = torch.as_tensor(c, device=dev)
                ids[i, :r] = rid[ct]
                cls_t[i, :r] = ct
                m_r[i, :r] = True
            ids[i, r : r + n_act] = target[i] + self._first_action_id
            act_t[i, r : r + n_act] = target[i]
            m_a[i, r : r + n_act] = w_act[i].float()
        emb = self.model.lm.model.embed_tokens(ids[:, :-1]).to(prefix.dtype)
        hidden = self.model.lm.model(inputs_embeds=torch.cat([prefix, emb], dim=1)).last_hidden_state[:, p - 1 :]
        a_logits = self.model.action_logits(hidden).float()  # [B, L, bins]
        ce_a = torch.nn.functional.cross_entropy(a_logits.transpose(1, 2), act_t, reduction="none")  # [B, L]
        loss = (ce_a * m_a).sum() / m_a.sum().clamp_min(1.0)
        acc = float(((a_logits.argmax(-1) == act_t).float() * m_a).sum() / m_a.sum().clamp_min(1.0))
        if not self.reasoning_words:
            return loss, {"loss": float(loss.detach()), "token_acc": acc}
        r_logits = self.model.reasoning_logits(hidden[m_r]).float()  # [rows, words + 1]
        ce_r = torch.nn.functional.cross_entropy(r_logits, cls_t[m_r])
        loss = loss + ce_r
        r_acc = float((r_logits.argmax(-1) == cls_t[m_r]).float().mean())
        return loss, {"loss": float(loss.detach()), "token_acc": acc, "reasoning_ce": float(ce_r.detach()), "reasoning_acc": r_acc}

    def _reasoning_classes(self, reasoning: list[list[str]] | None, b: int) -> list[list[int]]:
        """Training targets before the actions: each sample's word classes then <act> (no
        reasoning bundle: nothing)."""
        if not self.reasoning_words:
            return [[] for _ in range(b)]
        if reasoning is None or len(reasoning) != b:
            raise ConfigError(f"bundle {self.spec.name} writes reasoning: training needs the reasoning of every sample")
        index = {w: i for i, w in enumerate(self.reasoning_words)}
        out = []
        for words in reasoning:
            unknown = [w for w in words if w not in index]
            if unknown or len(words) > self.spec.max_reasoning_tokens:
                raise ConfigError(
                    f"reasoning {' '.join(words)!r}: words outside the bundle's reasoning_words ({unknown[:5]}) or longer "
                    f"than max_reasoning_tokens={self.spec.max_reasoning_tokens}"
                )
            out.append([index[w] for w in words] + [self.act_class])
        return out

    @property
    def _first_action_id(self) -> int:
        return self.model.lm.config.vocab_size - self.spec.action_bins

    # -- the plain transformers path: parity gate and benchmark baseline -------------------------
    @torch.inference_mode()
    def reference_infer(self, obs: Observation, *, noise: np.ndarray | None = None) -> ActionChunk:
        """The same policy through transformers' own forward and DynamicCache (full vocab head);
        greedy decoding: ``noise`` is ignored."""
        timer = StageTimer()
        with timer.stage("preprocess"):
            layout, ids = self.layout_for(obs.instruction)
            frames = self.frames(obs)
        with timer.stage("vision"):
            full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))
        bins, lm = self.spec.action_bins, self.model.lm
        with timer.stage("prefill"):
            out = lm(inputs_embeds=full[None], use_cache=True)
        pkv, reasoning = out.past_key_values, []
        if self.reasoning_words:
            with timer.stage("reason"):
                rid = self.model.reasoning_token_ids
                while True:
                    c = int(out.logits[0, -1, rid].argmax())
                    if c == self.act_class or len(reasoning) >= self.spec.max_reasoning_tokens:
                        break
                    reasoning.append(rid[c])
                    out = lm(input_ids=torch.tensor([[rid[c]]]), past_key_values=pkv, use_cache=True)
                    pkv = out.past_key_values
                out = lm(input_ids=torch.tensor([[rid[self.act_class]]]), past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
        with timer.stage("decode"):
            token = int(out.logits[0, -1, -bins:].argmax()) + self._first_action_id
            tokens = [token]
            for _ in range(1, self.num_action_tokens):
                out = lm(input_ids=torch.tensor([[token]]), past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                token = int(out.logits[0, -1, -bins:].argmax()) + self._first_action_id
                tokens.append(token)
        with timer.stage("postprocess"):
            actions = self._decode_actions(tokens)
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, joint_names=self.spec.joint_names,
            timings_ms=timer.finish(),
            stats={"mode": "transformers", "action_tokens": tokens, **({"reasoning_tokens": reasoning} if self.reasoning_words else {})},
        )  # fmt: skip

    @torch.inference_mode()
    def reference_prefix_hidden(self, obs: Observation) -> torch.Tensor:
        """transformers' final hidden state of the whole prefix.  # [P, H]"""
        _, full = self.full_prefix(obs)
        return self.model.lm.model(inputs_embeds=full[None]).last_hidden_state[0]


class ArFamily(Family):
    """``ar`` bundles: OpenVLA-style token decoding (the package's own, trained here)."""

    name = "ar"
    # Measured on the small demo bundles on a 2-core Xeon (AMX, AVX512-BF16, VNNI), fastest
    # obs-to-action within the gate's default limits (docs/runtime.md). The shipped ar bundle
    # flips 25% of its tokens with its LM in int8 or hybrid: the gate then takes the LM to fp32.
    precision_defaults = {"vision": "bf16", "projector": "bf16", "lm": "hybrid", "heads": "fp32"}
    precision_fallbacks = ({"lm": "fp32"}, {c: "fp32" for c in COMPONENTS})
    heads = ("state_proj",)
    token_actions = True
    writes_reasoning = True
    pipelines = True
    trainable = True
    default_chunk_size = 10

    def validate_spec(self, spec: BundleSpec) -> None:
        check_vision_patch(spec)
        vocab = int(spec.lm.get("vocab_size", 0))
        n_words = len(spec.reasoning_words)
        if 3 + spec.text_vocab + n_words > vocab - spec.action_bins:
            raise ConfigError(
                f"lm.vocab_size={vocab} leaves no room for 3 special + text_vocab={spec.text_vocab} "
                f"+ {n_words} reasoning_words + action_bins={spec.action_bins} ids"
            )
        if len(set(spec.reasoning_words)) != n_words:
            raise ConfigError("reasoning_words must be unique")
        if bool(n_words) != bool(spec.max_reasoning_tokens):
            raise ConfigError(
                f"reasoning_words ({n_words} words) and max_reasoning_tokens={spec.max_reasoning_tokens} "
                "must be both set (a reasoning policy) or both empty"
            )

    def build_model(self, spec: BundleSpec) -> ArVLA:
        return ArVLA(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> ArPolicy:
        return ArPolicy(spec, model, config, planner, bundle_path=bundle_path, precision=precision)

    def describe(self, spec: BundleSpec) -> list[str]:
        return [f"decoding    {spec.action_dim * spec.chunk_size} tokens from {spec.action_bins} bins"]

    def decoder_layers(self, model: ArVLA) -> dict[str, nn.ModuleList]:
        return {"lm": model.lm.model.layers}

    def demo_spec(
        self, size: str, *, cameras: tuple[str, ...] = ("cam_high",), action_dim: int = 14, chunk_size: int | None = None,
        lm_type: str = "llama", state_dim: int | None = None, norm_stats: dict | None = None, name: str | None = None,
        default_instruction: str | None = None, reasoning_words: tuple[str, ...] = (), max_reasoning_tokens: int = 0,
    ) -> BundleSpec:  # fmt: skip
        """A random-weight ``size`` bundle (no state input unless ``state_dim``); a reasoning
        policy's words take the ids just below the action bins."""
        sz = demo.size_table(size)
        vocab = sz["vocab"]
        state_dim = state_dim or 0
        return BundleSpec(
            family="ar", name=name or f"demo-ar-{size}", cameras=cameras, image_size=224, patch_size=14,
            action_dim=action_dim, joint_names=demo.joint_names(action_dim), dt=0.02, state_dim=state_dim,
            norm_stats=norm_stats or demo.demo_norm_stats(action_dim, state_dim),
            vision={**sz["vision"], "image_size": 224, "patch_size": 14},
            lm={"model_type": lm_type, **sz["lm"], "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0},
            text_vocab=vocab - 256 - 3 - len(reasoning_words), action_bins=256, chunk_size=chunk_size or 1,
            reasoning_words=tuple(reasoning_words), max_reasoning_tokens=max_reasoning_tokens,
            **({"default_instruction": default_instruction} if default_instruction is not None else {}),
        )  # fmt: skip

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        lm = spec.lm
        d, p = int(lm["hidden_size"]), work.prefix_len
        out = prefix_flops(spec, work, causal=True)
        a = spec.action_dim * spec.chunk_size
        layers = int(lm["num_hidden_layers"])
        r = work.reason_rows
        if r or work.reason_steps:  # approximate: the rows at the end of the prefix, then steps
            out["reason"] = layers * (
                decoder_layer_flops(lm, r, r * (p + r / 2.0)) + work.reason_steps * decoder_layer_flops(lm, 1, p + r)
            )
        rows = a - 1 if work.decode_rows is None else work.decode_rows
        # a decode row sees P + i keys, i = 1..A-1: P + A/2 on average (exact for plain decoding)
        out["decode"] = layers * decoder_layer_flops(lm, rows, rows * (p + a / 2.0))
        vocab = int(lm["vocab_size"])
        # The engine scores the action bins of the last row only; transformers' causal LM
        # head scores the whole vocabulary on every prefix row and every decoded token.
        scored = 1 + work.draft_rows + rows  # the prefill's last row, draft rows, decode rows
        out["head"] = 2.0 * d * vocab * (p + a - 1) if work.reference else 2.0 * d * spec.action_bins * scored
        return out


FAMILY = ArFamily()
