"""What every policy shares, whatever its family (``ar`` and ``flow`` subclass
:class:`PolicyBase`; ``flow`` and LeRobot's ``smolvla``, ``pi0`` and ``pi05`` through the
flow-matching core, :class:`~vla_accel_ros.models.flow_core.FlowCore`): prefix
assembly, planning, timing, reset, and the run-time interface (:meth:`PolicyBase.configure`,
:meth:`PolicyBase.set_motion_mode`) that callers use instead of touching ``config`` or ``planner``."""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.config import changed_fields
from vla_accel_ros.core.errors import ConfigError, ObservationError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.compiled import build_engine
from vla_accel_ros.core.engine import DecoderStack, Engine, StepPlan
from vla_accel_ros.core.kv_cache import KVCache
from vla_accel_ros.core.precision import COMPONENTS, PrecisionConfig
from vla_accel_ros.core.prefix import FullRecompute, PrefixContext, PrefixLayout, PrefixPlan, PrefixPlanner
from vla_accel_ros.core.robot.motion import MODE_NAMES
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models.common import (
    CONV_STEM,
    ConvStem,
    Frames,
    Normalizer,
    Projector,
    build_vision,
    format_instruction,
    interrupt_between_layers,
    make_tokenizer,
    preprocess_frames,
)
from vla_accel_ros.models.family import get_family
from vla_accel_ros.models.vision import VisionCache


def make_planner(config: PolicyConfig) -> PrefixPlanner:
    """The prefix planner ``config.accel`` names, fresh (its caches empty): one planner decides
    per image token and layer recompute / reuse (token cache) / drop (pruning)."""
    if config.accel == "none":
        return FullRecompute()
    reuse = None
    if config.uses_cache:
        from vla_accel_ros.core.cache import TokenCachePlanner

        reuse = TokenCachePlanner(config.cache)
    if not config.uses_prune:
        return reuse
    from vla_accel_ros.core.prune import PrunePlanner

    return PrunePlanner(config.prune, reuse)


class StageTimer:
    """Wall time per stage, in ms, for one inference."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._t0 = time.perf_counter_ns()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter_ns()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter_ns() - t) / 1e6

    def finish(self) -> dict[str, float]:
        self.ms["total"] = (time.perf_counter_ns() - self._t0) / 1e6
        return self.ms


class VisionPrefix(nn.Module):
    """Vision tower + projector: camera frames -> LM embeddings of the image tokens (one per
    patch; the :class:`~vla_accel_ros.models.vision.VisionTower` protocol for the vision cache)."""

    def __init__(self, spec: BundleSpec, lm_hidden: int) -> None:
        super().__init__()
        stem = spec.vision.get(CONV_STEM)
        # No stem: an empty Sequential is the identity and adds no weights (older bundles load as before).
        self.stem = ConvStem(stem or ())
        self.vision = interrupt_between_layers(build_vision(spec.vision))
        self.projector = Projector(self.vision.config.hidden_size, lm_hidden)
        self.num_patches = self.num_tokens = spec.grid * spec.grid
        self.out_dim = lm_hidden

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [C, 3, S, S] -> [C, G*G, H]"""
        feats = self.vision(pixel_values=self.stem(pixels)).last_hidden_state
        return self.projector(feats)

    @property
    def encoder_layers(self) -> nn.ModuleList:
        return self.vision.encoder.layers

    def patch_embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vision.embeddings(self.stem(pixels))

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.vision.post_layernorm(x)

    @staticmethod
    def token_patches(tokens: torch.Tensor) -> torch.Tensor:
        return tokens  # one patch per token

    def project_tokens(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.projector(feats[tokens])


_INSTANCES = itertools.count()
# PolicyConfig fields fixed when the policy is built: the parity gate ran, torch's thread count
# is process-wide, the noise generator was seeded, the weights were converted and the engines
# built for a precision and compile switch.
_FIXED = ("parity_check", "num_threads", "malloc_keep_mb", "seed", *(f"precision.{c}" for c in (*COMPONENTS, "compile", "backend")))
# Fields that do not change how the prefix is planned: changing them keeps the planner's caches.
_NOT_PLANNER = {"flow_steps", "flow_noise_scale", "parity_tolerance", "precision", "memo", "action_draft", *_FIXED}
MOTION_MODES = tuple(MODE_NAMES.values())


class PolicyBase:
    """Prefix bookkeeping of every policy (:class:`ArPolicy`, and :class:`FlowCore` under
    :class:`FlowPolicy` and the LeRobot families)."""

    family = ""

    def __init__(
        self, spec: BundleSpec, config: PolicyConfig, planner: PrefixPlanner | None, precision: PrecisionConfig | None = None,
        bundle_path: str = "",
    ) -> None:  # fmt: skip
        self.spec = spec
        self.config = config
        self.planner: PrefixPlanner = planner or FullRecompute()
        self.bundle_path = bundle_path  # where files beside the weights are looked for (tokenizer, calibration)
        self.tokenizer = self.make_tokenizer()
        self._layouts: dict[str, tuple[PrefixLayout, list[int]]] = {}
        self._static: dict[tuple[int, ...], torch.Tensor] = {}
        self._chunk_id = 0
        self._vision_cache: VisionCache | None = None  # built by the first plan that reuses vision features
        # The vision tower + connector as an exported graph on a backend (models/graphs.py; set
        # by the policy builder when ``precision.backend`` is not torch): the uncached path.
        self.vision_graph = None
        # What the builder says about this policy's precision (a backend it could not use, ...).
        self.precision_notes: list[str] = []
        # The parity gate's frames (None: its synthetic pair): the task's own when the builder
        # was given them, so a later change of acceleration is checked on the same frames.
        self.gate_observations = None
        self.motion_mode = MOTION_MODES[0]
        # Names this policy's KV cache in every PrefixContext (a counter, never reused like id()).
        self.source = f"{spec.name}#{next(_INSTANCES)}"
        # What the weights run at (``auto`` resolved, or the fallback the gate accepted);
        # models.factory converted them to it.
        if precision is None:
            from vla_accel_ros.models.precision import native_bf16, native_vnni

            precision = config.precision.resolve(get_family(spec.family), native_bf16=native_bf16(), native_vnni=native_vnni())
        self.precision = precision
        self.state_norm = (
            Normalizer(spec.norm_stats["state"], spec.state_dim, "norm_stats.state") if spec.state_dim else None
        )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    # -- subclass hooks ---------------------------------------------------------------------
    noise_shape: tuple[int, ...] | None = None  # of the noise ``infer`` takes (None: it samples none)

    def action_scale(self) -> tuple[np.ndarray, np.ndarray]:
        """(center, scale) of each action dimension: deviations are reported in these units."""
        st = self.action_norm.stats
        return st["mean"], np.maximum(st["std"], 1e-6)

    def make_tokenizer(self):
        """The bundle's tokenizer (a family whose checkpoints truncate long prompts says so here)."""
        return make_tokenizer(self.spec, self.bundle_path)

    model: nn.Module  # has .vis (VisionPrefix)

    def _make_layout(self, text_len: int) -> PrefixLayout:
        raise NotImplementedError

    def _static_prefix(self, layout: PrefixLayout, ids: list[int]) -> torch.Tensor:
        """[P, H] embeddings of the rows fixed by the instruction (BOS, prompt)."""
        raise NotImplementedError

    def _dynamic_rows(self, full: torch.Tensor, obs: Observation, layout: PrefixLayout) -> None:
        """Fill per-observation rows other than images: the state token, when the bundle has one."""
        if layout.state_slot is not None:
            full[layout.state_slot] = self._state_embedding(obs.state)

    def checked_state(self, state: np.ndarray | None) -> np.ndarray:
        """The observation's state as a float32 vector of the bundle's size (ObservationError otherwise)."""
        s = self.spec
        if state is None:
            raise ObservationError(f"this {self.family} bundle needs a {s.state_dim}-D state in the observation")
        state = np.asarray(state, dtype=np.float32).reshape(-1)
        if state.shape != (s.state_dim,):
            raise ObservationError(f"observation state has {state.shape[0]} values, the bundle expects {s.state_dim}")
        if not np.isfinite(state).all():
            raise ObservationError("observation state has non-finite values")
        return state

    def _state_embedding(self, state: np.ndarray | None) -> torch.Tensor:
        z = torch.from_numpy(self.state_norm.normalize_meanstd(self.checked_state(state)).astype(np.float32))
        return self.model.state_proj(z)

    prefix_engine: Engine

    def make_engine(self, stack: DecoderStack, cache: KVCache, max_positions: int, component: str = "lm") -> Engine:
        """An engine over ``cache`` for the decoder of ``component`` (its precision sets the
        attention's): eager, or with its static steps compiled (``precision.compile``)."""
        return build_engine(
            stack, cache, max_positions=max_positions, compile=self.config.precision.compile,
            bf16_attention_above=self.precision.bf16_attention_above(component),
        )  # fmt: skip

    def prepare_cache(self, layout: PrefixLayout) -> None:
        """Make the KV cache ready for a prefix of this layout. :meth:`infer` does it itself;
        callers that drive the engines directly (the engine benchmark) call it first."""

    def static_steps(self, layout: PrefixLayout) -> dict:
        """The engines' static-shape steps (export): name -> (engine, slots)."""
        raise NotImplementedError

    def use_step_graphs(self, fp32_model: nn.Module, converted: dict) -> list[str]:
        """Run the steps this family has as exported graphs on ``precision.backend`` (the policy
        builder calls it when the backend is not torch; ``converted`` holds graphs shared by the
        policies of one bundle) -> notes on what stays on torch. The engines' steps stay on
        torch (or ``compile``); SmolVLA runs its expert's pass there."""
        return []

    def onnx_steps(self, layout: PrefixLayout) -> dict:
        """The steps as ONNX graphs (``vla-accel export --onnx --steps``): name ->
        :class:`~vla_accel_ros.core.export.OnnxGraph`; a family with a step outside its engines
        adds it (SmolVLA's expert)."""
        from vla_accel_ros.core.export import engine_onnx_graph

        return {name: engine_onnx_graph(engine, slots) for name, (engine, slots) in self.static_steps(layout).items()}

    @property
    def num_layers(self) -> int:
        """Decoder layers of the prefix (what layer indices in a config are checked against)."""
        return self.prefix_engine.stack.num_layers

    # -- run-time interface -------------------------------------------------------------------
    def check_config(self, config: PolicyConfig) -> None:
        """Raise :class:`ConfigError` when :meth:`configure` would refuse ``config``."""
        if not isinstance(config, PolicyConfig):
            raise ConfigError(f"configure() takes a PolicyConfig, got {type(config).__name__}")
        fixed = [k for k in changed_fields(self.config, config) if k in _FIXED]
        if fixed:
            raise ConfigError(f"policy.{', policy.'.join(fixed)} cannot change once the policy is built")
        if config.uses_cache:
            config.cache.check_layers(self.num_layers)
        if config.uses_prune:
            config.prune.check_layers(self.num_layers)
        if config.memo.enabled and not getattr(self.spec, "reasoning_words", ()):
            raise ConfigError(f"memo.mode={config.memo.mode}: bundle {self.spec.name} writes no reasoning (no reasoning_words)")

    def configure(self, config: PolicyConfig) -> bool:
        """Apply new run-time options (acceleration, cache thresholds, flow steps, ...) all at
        once, or refuse them with :class:`ConfigError` and change nothing. A change to how the
        prefix is planned builds a new planner (its caches start empty); returns whether it did.
        Call it between two inferences (never concurrently with :meth:`infer`)."""
        self.check_config(config)
        changed = changed_fields(self.config, config)
        replan = any(k.split(".")[0] not in _NOT_PLANNER for k in changed) or any(k.startswith("parity_tolerance_") for k in changed)
        planner = make_planner(config) if replan else self.planner  # may raise: nothing changed yet
        old = (self.config, self.planner)
        self.config, self.planner = config, planner
        if replan and config.accel != "none" and old[0].parity_check:
            # The gate covers what runs: a new plan is verified before its first real inference.
            from vla_accel_ros.core.parity import run_parity

            report = run_parity(self, tolerance=config.parity_tolerance, observations=self.gate_observations)
            if not report.passed:
                self.config, self.planner = old
                self.planner.reset("external prefix write")  # the gate overwrote the cached K/V
                raise ConfigError(f"policy.accel={config.accel}: the parity gate failed, the change is refused:\n{report.table()}")
            self.parity_report = report
        return replan

    def set_motion_mode(self, mode: str) -> None:
        """The arm's motion mode from the controller (``coarse`` | ``fine``); planners that prune
        by it see it in their PrefixContext, the others (all of today's) ignore it."""
        if mode not in MOTION_MODES:
            raise ConfigError(f"motion mode {mode!r} is not one of {', '.join(MOTION_MODES)}")
        self.motion_mode = mode

    # -- shared steps -------------------------------------------------------------------------
    def prompt(self, instruction: str) -> str:
        """The text the tokenizer reads for ``instruction`` (the bundle's template around it)."""
        return format_instruction(self.spec.instruction_template, instruction or self.spec.default_instruction)

    def text_ids(self, instruction: str) -> list[int]:
        return self.prompt_ids(self.prompt(instruction))

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids of a prompt as the tokenizer reads it (ObservationError beyond max_text_tokens)."""
        ids = self.tokenizer.encode(text)
        if len(ids) > self.spec.max_text_tokens:
            raise ObservationError(
                f"instruction is {len(ids)} tokens long with its template; the bundle accepts "
                f"max_text_tokens={self.spec.max_text_tokens}"
            )
        return ids

    def layout_for(self, instruction: str) -> tuple[PrefixLayout, list[int]]:
        return self.layout_for_prompt(self.prompt(instruction))

    def layout_for_prompt(self, text: str) -> tuple[PrefixLayout, list[int]]:
        """The layout and token ids of the prefix of prompt ``text`` (kept: prompts rarely change)."""
        hit = self._layouts.get(text)
        if hit is None:
            ids = self.prompt_ids(text)
            hit = (self._make_layout(len(ids)), ids)
            if len(self._layouts) > 16:  # instructions rarely change; keep the map small
                self._layouts.clear()
            self._layouts[text] = hit
        return hit

    def layout_of(self, obs: Observation) -> tuple[PrefixLayout, list[int]]:
        """The layout and token ids of this observation's prefix: its instruction's (a family whose
        prompt carries more of the observation, pi0.5's discretized state, says so here)."""
        return self.layout_for(obs.instruction)

    @torch.inference_mode()
    def prefix_embeddings(
        self, obs: Observation, layout: PrefixLayout, ids: list[int], pixels: torch.Tensor, cams: list[int],
        fresh: torch.Tensor | None = None, vision: VisionCache | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[P, H] prefix embeddings. Only cameras in ``cams`` go through the vision tower: the
        image rows of the others are not computed this step, so their values are never read.
        ``fresh`` (a plan's ``vision_fresh``, [C, T] bool): only those patches go through the
        tower, the others take the embeddings ``vision`` holds (default: the policy's own vision
        cache; another KV cache with its own planner, a pipeline's, brings its own); None: every
        patch of ``cams``, the stock tower's forward (or its exported graph on a backend,
        ``vision_graph``)."""
        key = tuple(ids)  # the rows depend on the token ids alone (a prompt may carry the state)
        static = self._static.get(key)
        if static is None:
            static = self._static_prefix(layout, ids)
            if len(self._static) > 16:
                self._static.clear()
            self._static[key] = static
        full = static.clone()
        if cams:
            if fresh is None:
                img = (self.vision_graph or self.model.vis)(pixels[cams])  # [c, G*G, H]
            else:
                if vision is None:
                    if self._vision_cache is None:
                        self._vision_cache = VisionCache(self.model.vis, len(layout.cameras))
                    vision = self._vision_cache
                img = vision.embed(pixels[cams], cams, fresh)
            for j, cam in enumerate(cams):
                full[layout.image_slots(cam)] = img[j]
        self._dynamic_rows(full, obs, layout)
        return full

    @staticmethod
    def all_cameras(layout: PrefixLayout) -> list[int]:
        return list(range(len(layout.cameras)))

    def full_prefix(self, obs: Observation) -> tuple[PrefixLayout, torch.Tensor]:
        """Layout and [P, H] embeddings of the whole prefix (every camera through the tower)."""
        layout, ids = self.layout_of(obs)
        frames = self.frames(obs)
        return layout, self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))

    @torch.inference_mode()
    def engine_prefix_hidden(self, obs: Observation, plan: PrefixPlan | None = None) -> torch.Tensor:
        """The engine's final hidden states of the prefix rows computed at the last layer."""
        layout, ids = self.layout_of(obs)
        self.prepare_cache(layout)
        frames = self.frames(obs)
        if plan is None:
            plan = PrefixPlan(layer_slots=[layout.all_slots()] * layout.num_layers)
        rows = plan.layer_slots[0]
        full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.image_rows(layout, rows))
        # This writes prefix K/V behind the planner's back: a caching planner must not trust
        # what it cached before.
        self.planner.reset("external prefix write")
        step = StepPlan(slots=rows, positions=rows, layer_slots=plan.layer_slots, drop=plan.drop, output_slots=plan.layer_slots[-1])
        return self.prefix_engine.forward(full[rows][None], step).hidden[0]

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """The vision tower's tokens of a batch: pixels [B, C, 3, S, S] normalized -> [B, C, N, H]."""
        b, c = pixels.shape[:2]
        img = self.model.vis(pixels.flatten(0, 1))  # [B*C, N, H]
        return img.reshape(b, c, *img.shape[1:])

    def batch_prefix(
        self, pixels: torch.Tensor | None, states: torch.Tensor | None, instruction: str, *,
        image_tokens: torch.Tensor | None = None,
    ) -> tuple[PrefixLayout, torch.Tensor]:  # fmt: skip
        """Differentiable prefix embeddings of a batch (training), with the rows and layout
        :meth:`infer` uses.  pixels: [B, C, 3, S, S] normalized, or ``image_tokens`` [B, C, N, H]
        already computed (a frozen tower's, :meth:`image_tokens`); states: [B, state_dim] in robot
        units (None without state) -> [B, P, H]"""
        layout, ids = self.layout_for(instruction)
        img = self.image_tokens(pixels) if image_tokens is None else image_tokens
        b, c = img.shape[:2]
        static = self._static_prefix(layout, ids).to(img.device)  # [P, H]
        full = static[None].expand(b, *static.shape).clone()
        full[:, layout.image_slots()] = img.reshape(b, c * img.shape[2], img.shape[3]).to(full.dtype)
        if layout.state_slot is not None:
            if states is None:
                raise ObservationError(f"this {self.family} bundle needs states to train on")
            full[:, layout.state_slot] = self.model.state_proj(self.model_states(states)).to(full.dtype)
        return layout, full

    def model_states(self, states: torch.Tensor) -> torch.Tensor:
        """A batch of states [B, state_dim] in robot units -> what ``state_proj`` reads (training;
        :meth:`_state_embedding` is the same rule for one observation)."""
        st = self.state_norm.stats
        mean = torch.as_tensor(st["mean"], device=states.device)
        std = torch.as_tensor(np.maximum(st["std"], 1e-6), device=states.device)
        return (states - mean) / std

    def frames(self, obs: Observation) -> Frames:
        return preprocess_frames(obs.images, self.spec.cameras, self.spec.image_size)

    def context(self, obs: Observation, layout: PrefixLayout, frames: Frames) -> PrefixContext:
        return PrefixContext(
            layout=layout, images=frames, instruction=obs.instruction, episode=obs.episode, stamp_ns=obs.stamp_ns,
            source=self.source, motion_mode=self.motion_mode,
        )

    def next_chunk_id(self) -> int:
        self._chunk_id += 1
        return self._chunk_id

    def reset(self) -> None:
        self.planner.reset("explicit")
        if self._vision_cache is not None:
            self._vision_cache.reset()
        self._chunk_id = 0

    @staticmethod
    def image_rows(layout: PrefixLayout, rows: torch.Tensor) -> list[int]:
        """Cameras that have at least one image token among ``rows`` (others skip the vision tower)."""
        cams = []
        for i in range(len(layout.cameras)):
            s = layout.camera_start(i)
            if bool(((rows >= s) & (rows < s + layout.tokens_per_camera)).any()):
                cams.append(i)
        return cams
