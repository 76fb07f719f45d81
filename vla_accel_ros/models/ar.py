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
longer holds is regenerated (:mod:`vla_accel_ros.core.reasoning.memo`).
"""

from __future__ import annotations

from pathlib import Path

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
from vla_accel_ros.core.reasoning.memo import ACT, CALIBRATION_FILE, Calibration, MemoState, Thresholds, decide
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation
from vla_accel_ros.core.precision import COMPONENTS
from vla_accel_ros.models import demo
from vla_accel_ros.models.base import PolicyBase, StageTimer, VisionPrefix
from vla_accel_ros.models.common import HashWordTokenizer, Normalizer, build_decoder
from vla_accel_ros.models.family import Family, check_vision_patch
from vla_accel_ros.models.flops import decoder_layer_flops, prefix_flops


# Rows of each decode forward after a draft's first rejection: the last token and the next
# guesses of the draft. A forward of a few rows costs about one decode step (the weights stream
# once), so a wrong guess costs little and a right one saves a step. Measured on the trained
# ar bundle (40 frames, mean ms per frame): 1 row 184, 4 rows 172, 8 rows 178, 16 rows 201.
DRAFT_WINDOW = 4


def _confirm(tokens: list[int], guesses, predicted: list[int], n: int) -> int:
    """Append to ``tokens`` the predictions whose inputs were right: ``predicted[i]`` followed
    the input ``guesses[i]``, which must equal the last token so far. Returns how many."""
    got = 0
    for guess, token in zip(guesses, predicted):
        if guess != tokens[-1] or len(tokens) >= n:
            break
        tokens.append(token)
        got += 1
    return got


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
        self.memo_state = MemoState()
        self.thresholds: Thresholds | None = None
        self._setup_memo(config)
        self._draft: list[int] | None = None  # the last chunk's action tokens (action_draft)
        self._draft_key: tuple | None = None  # (episode, instruction) the draft was made in

    # -- reasoning reuse (MEMO-VLM) -----------------------------------------------------------------
    def check_config(self, config: PolicyConfig) -> None:
        super().check_config(config)
        self._memo_thresholds(config)  # ConfigError before anything changes

    def configure(self, config: PolicyConfig) -> bool:
        replan = super().configure(config)
        self._setup_memo(config)
        self._draft = None
        return replan

    def _memo_thresholds(self, config: PolicyConfig) -> Thresholds | None:
        memo = config.memo
        if not memo.enabled:
            return None
        if not self.reasoning_words:
            raise ConfigError(f"memo.mode={memo.mode}: bundle {self.spec.name} writes no reasoning (no reasoning_words)")
        calibration = None
        if memo.mode == "calibrated":
            path = memo.calibration or str(Path(self.bundle_path or ".") / CALIBRATION_FILE)
            calibration = Calibration.load(path, self.reasoning_words)
        return Thresholds(self.reasoning_words, memo, calibration)

    def _setup_memo(self, config: PolicyConfig) -> None:
        self.thresholds = self._memo_thresholds(config)
        self.memo_state.reset()

    def reset(self) -> None:
        super().reset()
        self.memo_state.reset()
        self._draft = None
        if self.thresholds is not None:
            self.thresholds.reset()

    def _hypothesis(self, obs: Observation) -> list[int] | None:
        """The previous frame's reasoning to validate in this frame's prefill (None: regenerate)."""
        if self.thresholds is None:
            return None
        key = (obs.episode, obs.instruction)
        if key != self.memo_state.key:
            self.memo_state.reset()
            self.memo_state.key = key
            return None
        return list(self.memo_state.classes) or None

    def _step(self, token_ids: list[int], slot: int, taps: TapSpec | None = None):
        """Tokens at consecutive slots from ``slot`` (a decode step: one), every row output."""
        s = torch.arange(slot, slot + len(token_ids))
        return self.engine.forward(self.model.embed_ids(token_ids)[None], StepPlan(slots=s, positions=s, output_slots=s, taps=taps))

    def _reason(self, p0: int, rows_out: torch.Tensor, prev: list[int] | None) -> tuple[list[int], torch.Tensor, dict]:
        """The reasoning of this frame. ``p0``: its first slot (the prefix length);
        ``rows_out`` [1 + n, H]: the prefill's output at the last prefix row and, with a
        hypothesis ``prev`` (n = its words + <act>), at each of its rows. Returns the word
        classes, the hidden state that predicts the first action token, and stats."""
        ids = self.model.reasoning_token_ids
        n_prev = len(prev) if prev else 0
        logits = self.model.reasoning_logits(rows_out[: n_prev + 1]).float()  # row i predicts word i
        stats: dict = {"reasoning_validated": prev is not None, "reasoning_refresh": False}
        keep, decision = 0, None
        if prev is not None:
            target = torch.tensor([*prev, self.act_class])
            probs = logits.softmax(-1)
            p = probs[torch.arange(n_prev + 1), target]
            if self.config.memo.mode == "exact":
                ok = (probs.argmax(-1) == target).numpy()
            else:
                ok = p.numpy() >= self.thresholds.of(target.numpy())
            every = self.config.memo.refresh_every
            decision = decide(ok, force_refresh=bool(every) and self.memo_state.frames_since_refresh + 1 >= every)
            keep = decision.keep
            stats["reasoning_refresh"] = decision.refresh
            stats["reasoning_min_prob"] = float(p.min())
        stats["reasoning_kept_whole"] = prev is not None and keep == n_prev + 1
        if stats["reasoning_kept_whole"]:  # every word and <act> held: the actions follow the <act> row
            classes, act_hidden = list(prev), rows_out[n_prev + 1]
        else:
            classes = list(prev[:keep]) if prev else []
            nxt = int(logits[keep].argmax())
            while nxt != self.act_class and len(classes) < self.spec.max_reasoning_tokens:
                classes.append(nxt)
                o = self._step([ids[nxt]], p0 + len(classes) - 1)
                nxt = int(self.model.reasoning_logits(o.hidden[0, -1]).argmax())
            act_hidden = self._step([ids[self.act_class]], p0 + len(classes)).hidden[0, -1]
            if decision is not None and self.config.memo.mode == "calibrated":
                # False rejections: a failed word the regeneration wrote again at its place.
                same = [i for i in decision.failed.tolist() if i < min(len(classes), n_prev) and classes[i] == prev[i]]
                if same:
                    self.thresholds.adapt(target.numpy()[same], p.numpy()[same])
        reused = min(keep, len(classes))
        m = self.memo_state
        m.classes = classes
        m.frames_since_refresh = 0 if (prev is None or stats["reasoning_refresh"]) else m.frames_since_refresh + 1
        stats.update(
            reasoning_tokens=[ids[c] for c in classes], reasoning_text=" ".join(self.reasoning_words[c] for c in classes),
            reasoning_len=len(classes), reasoning_reused=reused, reasoning_regenerated=len(classes) - reused,
            reasoning_reused_fraction=reused / max(1, len(classes)),
            memo_adaptations=self.thresholds.adaptations if self.thresholds is not None else 0,
        )  # fmt: skip
        return classes, act_hidden, stats

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
        with timer.stage("prefill"):
            p0 = layout.length
            prev = self._hypothesis(obs) if self.reasoning_words else None
            # MEMO: the previous reasoning and <act> ride along in the prefill (one pass).
            extra = [] if prev is None else [self.model.reasoning_token_ids[c] for c in (*prev, self.act_class)]
            n_hyp = len(extra)
            # The draft follows where the actions will start if the hypothesis holds.
            draft = self._draft if not self.reasoning_words or prev is not None else None  # set by action_draft only
            if self._draft_key != (obs.episode, obs.instruction):
                # Another episode or task: the old chunk says nothing about this one, and with a
                # reduced-precision LM the tokens it confirms could differ from a fresh decode.
                draft = None
            if draft is not None:
                extra = extra + draft[:-1]
            ext = torch.arange(p0, p0 + len(extra))
            x = full[rows]
            layer_slots = plan.layer_slots
            if extra:
                x = torch.cat([x, self.model.embed_ids(extra).to(x.dtype)])
                layer_slots = [torch.cat([ls, ext]) for ls in plan.layer_slots]
            slots = torch.cat([rows, ext])
            step = StepPlan(
                slots=slots, positions=slots, layer_slots=layer_slots, drop=plan.drop,
                output_slots=torch.cat([torch.tensor([p0 - 1]), ext]), taps=plan.taps, prune=plan.prune,
            )  # fmt: skip
            out = self.engine.forward(x[None], step)
        with timer.stage("select"):
            self.planner.update(ctx, plan, out.taps)
        reasoning_stats: dict = {}
        a0 = p0  # slot of the first action token's input row
        act_hidden = out.hidden[0, 0]
        if self.reasoning_words:
            with timer.stage("reason"):
                classes, act_hidden, reasoning_stats = self._reason(p0, out.hidden[0, : 1 + n_hyp], prev)
            a0 = p0 + len(classes) + 1
        # The draft rows saw the right context only if the prefill's hypothesis rows hold this
        # frame's reasoning: the same words (then <act> too, validated or forced by the length
        # cap); a regenerated reasoning of the same length with other words does not.
        same = not self.reasoning_words or (prev is not None and classes == list(prev))
        draft_out = out.hidden[0, 1 + n_hyp :] if draft is not None and same else None
        with timer.stage("decode"):
            tokens, accepted, steps, rows_run = self._decode_tokens(a0, act_hidden, draft, draft_out)
        with timer.stage("postprocess"):
            actions = self._decode_actions(tokens)
        if self.config.action_draft == "previous":
            self._draft, self._draft_key = tokens, (obs.episode, obs.instruction)
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

    def _decode_tokens(
        self, a0: int, act_hidden: torch.Tensor, draft: list[int] | None, draft_out: torch.Tensor | None
    ) -> tuple[list[int], int, int, int]:
        """The action tokens, greedy: the first from ``act_hidden``, then as many as the draft
        rows of the prefill confirm (``draft_out`` [n - 1, H]: the outputs of the rows whose
        inputs were ``draft[:-1]`` at slots a0..), then decode forwards from slot ``a0 + len - 1``
        on: each takes the last token and, with a draft, its next ``DRAFT_WINDOW - 1`` guesses.
        Row i of a forward predicts the token after its input, which is greedy
        decoding's token as long as every input before it equals the tokens so far (in fp32;
        a reduced-precision LM computes the prefill's draft rows and the windows on other paths
        than single decode rows, see the README). Returns the tokens, how many of them draft
        rows confirmed (the prefill's and the windows'), the decode forwards and their rows."""
        n, first = self.num_action_tokens, self._first_action_id
        tokens = [int(self.model.action_logits(act_hidden).argmax()) + first]
        accepted = 0 if draft_out is None else _confirm(tokens, draft, self._argmax_tokens(draft_out), n)
        steps, rows_run = 0, 0
        # A rejected row's K/V (slots from a0 + len(tokens) - 1 on) is overwritten by the next
        # forward before any row may read it: the causal mask hides later slots.
        while len(tokens) < n:
            # guesses for tokens len .. at most n - 2: the last token is never an input
            guesses = [] if draft is None else draft[len(tokens) : min(len(tokens) + DRAFT_WINDOW, n) - 1]
            o = self._step([tokens[-1], *guesses], a0 + len(tokens) - 1)
            predicted = self._argmax_tokens(o.hidden[0])
            tokens.append(predicted[0])
            accepted += _confirm(tokens, guesses, predicted[1:], n)
            steps, rows_run = steps + 1, rows_run + 1 + len(guesses)
        return tokens, accepted, steps, rows_run

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
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy with teacher forcing on ``[reasoning] <act> [actions]`` after the prefix
        (a reasoning bundle) or on the actions alone, each over its own ids (the reasoning words
        and <act>; the action bins), as :meth:`infer` takes its argmaxes. actions: [B, H, D]
        robot units; valid: [B, H]; reasoning: per sample, its words. ``generator`` is unused."""
        layout, prefix = self.batch_prefix(pixels, states, instruction)  # [B, P, W]
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
    # obs-to-action within the gate's default limits (README, "Runtime"). The shipped ar bundle
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
