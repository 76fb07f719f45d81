"""``smolvla``: LeRobot's SmolVLA, computed as LeRobot computes it, on the package's engine.

The modules are stock transformers modules built from the bundle's configs: SmolVLM's vision
tower (``SmolVLMVisionTransformer``) and connector (pixel shuffle, then a bias-free linear map),
the first ``num_vlm_layers`` Llama layers of its text model, and a narrower Llama expert whose
cross-attention layers' K/V maps read the VLM's keys and values. What SmolVLA adds around them
is written here from its description (``../shared/fixtures/smolvla-lerobot/README.md`` names
every rule; the fixture checks them):

* images: resized keeping their aspect, bilinear on [0, 1] floats, zero-padded on top and left
  to ``image_size``, mapped to [-1, 1]; image and language embeddings times sqrt(hidden);
  optional special tokens around each camera's image (not scaled);
* the prefix ``[images][language][state]``: images and language attend to each other both
  ways, the state token sees them and they do not see it; the action tokens see the whole
  prefix and each other causally;
* RoPE of base 10,000 at every layer (the bundle's decoder configs carry it), positions
  counting the prefix's tokens;
* the expert per layer: self-attention, cross-attention or nothing
  (:mod:`~vla_accel_ros.models.smolvla.expert`); the suffix MLP over the noisy actions and the
  flow time; Euler from t = 1 to 0; state and actions padded to ``max_state_dim`` /
  ``max_action_dim``, actions cut back to ``action_dim``;
* LeRobot's normalization modes and eps, and its optional pi-ALOHA joint maps.

Everything the engine does to a prefix applies: the token cache, pruning, precision per
component. A SmolVLA token covers a ``scale_factor`` x ``scale_factor`` block of vision
patches; the token cache and pruning decide per token (``patch_size`` is the block's size in
pixels), so a token is static when its whole block of pixels is.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec, head_dim
from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.core.kv_cache import Block
from vla_accel_ros.core.precision import COMPONENTS
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models import demo
from vla_accel_ros.models.common import interrupt_between_layers, lm_config
from vla_accel_ros.models.flops import decoder_layer_flops, vision_flops
from vla_accel_ros.models.flow_core import TimeMLPHeads
from vla_accel_ros.models.lerobot_compat import LeRobotFamily, LeRobotPolicy, check_lerobot_io
from vla_accel_ros.models.smolvla.configuration_smolvla import SmolVLAOptions
from vla_accel_ros.models.smolvla.expert import ExpertEngine


def options_of(spec: BundleSpec) -> SmolVLAOptions:
    return SmolVLAOptions.from_dict(spec.options or {})


def vision_config(spec: BundleSpec):
    """SmolVLM's vision config from the bundle's ``vision`` section (sdpa attention)."""
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

    kw = {k: v for k, v in spec.vision.items() if k not in ("model_type", "scale_factor")}
    try:
        cfg = SmolVLMVisionConfig(**kw)
    except (TypeError, ValueError) as e:
        raise BundleError(f"vision: invalid SmolVLM vision config: {e}") from e
    cfg._attn_implementation = "sdpa"
    return cfg


class SmolVLAVision(nn.Module):
    """SmolVLM's vision tower and connector: frames -> image-token embeddings times sqrt(hidden)."""

    def __init__(self, spec: BundleSpec, lm_hidden: int) -> None:
        super().__init__()
        from transformers import SmolVLMConfig
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

        vcfg = vision_config(spec)
        scale = int(spec.vision["scale_factor"])
        self.vision = interrupt_between_layers(SmolVLMVisionTransformer(vcfg))
        self.connector = SmolVLMConnector(
            SmolVLMConfig(vision_config=vcfg.to_dict(), text_config={"hidden_size": lm_hidden}, scale_factor=scale)
        )
        self.embed_scale = math.sqrt(lm_hidden)
        self.scale = scale
        self.side = vcfg.image_size // vcfg.patch_size  # patches per side
        self.num_patches, self.num_tokens, self.out_dim = self.side**2, (self.side // scale) ** 2, lm_hidden

    @property
    def projector(self) -> nn.Module:  # the ``projector`` precision component
        return self.connector

    def position_ids(self, side: int) -> torch.Tensor:
        """The position-embedding row of each of ``side`` x ``side`` patches, as transformers 4.x
        computes it, which LeRobot runs and SmolVLA was trained with: patch i lands in the bucket
        of i / side * (1 - 1e-6), i.e. i - 1 for i >= 1 (transformers 5 changed the rule to i;
        the stock embeddings' forward would give other features).  -> [side * side]"""
        per_side = self.vision.embeddings.num_patches_per_side
        frac = torch.arange(side, dtype=torch.float32) / side * (1 - 1e-6)
        bucket = torch.bucketize(frac, torch.arange(1 / per_side, 1.0, 1 / per_side), right=True)
        return (bucket[:, None] * per_side + bucket[None, :]).flatten()

    def patch_embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        """[C, 3, S, S] -> [C, N, W]: the stock patch convolution plus the position embeddings."""
        emb = self.vision.embeddings
        x = emb.patch_embedding(pixels.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        side = pixels.shape[-1] // emb.patch_size
        return x + emb.position_embedding(self.position_ids(side).to(pixels.device))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [C, 3, S, S] in [-1, 1] -> [C, T, H]: every patch attends to every other."""
        feats = self.vision.encoder(inputs_embeds=self.patch_embeddings(pixels)).last_hidden_state
        return self.connector(self.vision.post_layernorm(feats)) * self.embed_scale

    # -- the vision cache's view (models/vision.py: VisionTower) --------------------------------------
    @property
    def encoder_layers(self) -> nn.ModuleList:
        return self.vision.encoder.layers

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.vision.post_layernorm(x)

    def token_patches(self, tokens: torch.Tensor) -> torch.Tensor:
        """The s x s block of patches each token merges (the pixel shuffle's: token (i, j) of the
        token grid holds patches (i s + m, j s + k), in row-major order)."""
        s, g = self.scale, self.side // self.scale
        i, j = tokens // g, tokens % g
        m = torch.arange(s)
        rows = (i[:, None, None] * s + m[None, :, None]) * self.side + (j[:, None, None] * s + m[None, None, :])
        return rows.flatten().sort().values

    def project_tokens(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[N, W] every patch's features -> [n, H] the embeddings of ``tokens``."""
        shuffled = self.connector.pixel_shuffle(feats[None], self.scale)[0]  # [T, W s^2]
        return self.connector.modality_projection(shuffled[tokens]) * self.embed_scale


@torch.no_grad()
def siglip_init_(vis: SmolVLAVision) -> None:
    """SigLIP's own initialization of SmolVLM's vision tower (lecun normal for the patch
    embedding and the connector, xavier uniform for attention and MLP, position embeddings of
    std 1 / sqrt(width), layer norms at identity), for a tower trained from scratch. transformers
    initializes SmolVLM's tower with N(0, 0.02) everywhere, meant for loading pretrained weights:
    its attention and MLP maps start ~3x smaller than SigLIP's and a tower trained from it did not
    find a few-pixel cube (docs/policy-experiments.md, "A trained SmolVLA")."""
    from torch.nn import init

    def lecun_(w: torch.Tensor) -> None:
        init.trunc_normal_(w, std=(1.0 / w[0].numel()) ** 0.5)

    emb = vis.vision.embeddings
    lecun_(emb.patch_embedding.weight)
    init.zeros_(emb.patch_embedding.bias)
    init.normal_(emb.position_embedding.weight, std=emb.position_embedding.weight.shape[1] ** -0.5)
    for layer in vis.vision.encoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
            init.xavier_uniform_(lin.weight)
            init.zeros_(lin.bias)
        for lin in (mlp.fc1, mlp.fc2):
            init.xavier_uniform_(lin.weight)
            init.normal_(lin.bias, std=1e-6)
    for norm in [m for m in vis.vision.modules() if isinstance(m, nn.LayerNorm)]:
        init.ones_(norm.weight)
        init.zeros_(norm.bias)
    lecun_(vis.connector.modality_projection.proj.weight)


def get_intermediate_size(hidden: int, ffn_multiplier: int = 4, multiple_of: int = 256) -> int:
    """LeRobot's expert MLP width for a given expert width (SwiGLU's 2/3, rounded up to 256)."""
    h = int(ffn_multiplier * int(2 * hidden / 3))
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


class SmolVLAModel(TimeMLPHeads, nn.Module):
    """The modules of a ``smolvla`` bundle."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        from transformers import LlamaModel

        opts = options_of(spec)
        self.vlm = LlamaModel(lm_config(spec.lm, "lm"))
        self.expert = LlamaModel(lm_config(spec.expert, "expert"))
        self.expert.embed_tokens = None  # the expert reads embeddings, never ids (LeRobot drops it too)
        hidden, width = self.vlm.config.hidden_size, self.expert.config.hidden_size
        kv_width = self.vlm.config.num_key_value_heads * self.vlm.layers[0].self_attn.head_dim
        e_kv = self.expert.config.num_key_value_heads * self.expert.layers[0].self_attn.head_dim
        bias = bool(getattr(self.expert.config, "attention_bias", False))
        for j, wide in enumerate(opts.vlm_width_kv(len(self.vlm.layers))):
            if wide:  # these layers' K/V maps read the VLM's keys and values
                attn = self.expert.layers[j].self_attn
                attn.k_proj = nn.Linear(kv_width, e_kv, bias=bias)
                attn.v_proj = nn.Linear(kv_width, e_kv, bias=bias)
        self.vis = SmolVLAVision(spec, hidden)
        self.state_proj = nn.Linear(opts.max_state_dim, hidden)
        self.add_action_heads(opts.max_action_dim, width)
        self.periods = (opts.min_period, opts.max_period)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        return self.vlm.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=self.vlm.embed_tokens.weight.device))


class SmolVLAPolicy(LeRobotPolicy):
    family = "smolvla"

    def __init__(self, spec: BundleSpec, model: SmolVLAModel, config, planner=None, *, precision=None, bundle_path: str = "") -> None:
        self.options = options_of(spec)
        super().__init__(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    # -- construction hooks ---------------------------------------------------------------------
    def prefix_capacity(self) -> int:
        per_cam = self.spec.grid**2 + (3 if self.options.add_image_special_tokens else 0)
        return len(self.spec.cameras) * per_cam + self.spec.max_text_tokens + 1

    def _build_engines(self) -> None:
        """The VLM engine writes the prefix into the cache; the expert reads it in place (its own
        rows are never cached), so the cache holds the prefix only."""
        self.max_slots = self.max_prefix
        self.cache = self.vlm_stack.make_cache(self.max_slots, dtype=self.kv_dtype())
        self.vlm_engine = self.make_engine(self.vlm_stack, self.cache, self.max_slots)
        plan = self.options.layer_plan(self.vlm_stack.num_layers)
        self.expert_engine = ExpertEngine(
            self.model.expert, plan, self.cache, max_positions=self.max_prefix + self.spec.chunk_size,
            bf16_attention_above=self.precision.bf16_attention_above("expert"), compile=self.config.precision.compile,
        )  # fmt: skip

    # -- the prefix -------------------------------------------------------------------------------
    def _make_layout(self, text_len: int) -> PrefixLayout:
        s, special = self.spec, self.options.add_image_special_tokens
        t = s.grid * s.grid
        stride = t + 3 if special else t
        n_img = len(s.cameras) * stride
        fixed = tuple(c * stride + k for c in range(len(s.cameras)) for k in (0, 1, t + 2)) if special else ()
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size,
            image_start=2 if special else 0, text_start=n_img, text_len=text_len, state_slot=n_img + text_len,
            length=n_img + text_len + 1, fixed_slots=fixed, attention="bidirectional",
            num_layers=self.vlm_stack.num_layers, camera_stride=stride if special else 0,
            static_patch=int(s.vision["patch_size"]),
        )  # fmt: skip

    def cache_blocks(self, layout: PrefixLayout) -> tuple[Block, ...]:
        """Images and language one bidirectional block; the state token after it sees it, it does
        not see the state (the expert's rows are never cached)."""
        return (Block(layout.length - 1, "bidirectional"), Block(1, "bidirectional"))

    def _static_prefix(self, layout: PrefixLayout, ids: list[int]) -> torch.Tensor:
        m = self.model
        static = super()._static_prefix(layout, ids)
        if layout.fixed_slots:  # per camera: <fake><global> before, <fake> after (not scaled, as LeRobot)
            o = self.options
            special = m.embed_ids([o.fake_image_token_id, o.global_image_token_id, o.fake_image_token_id])
            for c in range(len(layout.cameras)):
                static[list(layout.fixed_slots[3 * c : 3 * c + 3])] = special
        return static

    def _state_embedding(self, state: np.ndarray | None) -> torch.Tensor:
        return self.model.state_proj(self.model_state(state)[0])

    def static_steps(self, layout: PrefixLayout) -> dict:
        return {"prefill": (self.vlm_engine, layout.all_slots())}

    def use_step_graphs(self, fp32_model: nn.Module, converted: dict) -> list[str]:
        """The expert's pass on the backend at the expert's precision (OpenVINO fp32 / bf16, ONNX
        Runtime fp32: :class:`~vla_accel_ros.models.smolvla.expert.ExpertGraph`), exported now for
        the default instruction's prefix; torch where the backend does not run that precision or
        the export fails (the note says why)."""
        from vla_accel_ros.core.backends import BackendUnavailable
        from vla_accel_ros.core.engine import attention_dtype
        from vla_accel_ros.models.smolvla.expert import ExpertGraph

        p, eng = self.precision, self.expert_engine
        if p.expert == "bf16" and attention_dtype(p.bf16_attention_above("expert"), self.suffix_len, torch.float32) is None:
            # The runtime's bf16 runs every matmul in bf16, the attention's too: where the
            # precision attends in fp32 (auto's fallback that keeps the task) torch runs it.
            return [f"the expert's pass runs on torch: its {self.suffix_len}-row attention is fp32 here "
                    f"(policy.precision.attention={p.attention}, few_rows={p.few_rows}), which {p.backend}'s bf16 "
                    "graph would run in bf16"]  # fmt: skip
        key = f"graph:expert:{p.backend}:{p.expert}"
        graph = converted.get(key)
        try:
            if graph is None:
                graph = converted[key] = ExpertGraph(fp32_model.expert, eng.steps, eng.step.cos, eng.step.sin, p.backend,
                                                     p.expert, threads=torch.get_num_threads())  # fmt: skip
        except BackendUnavailable as e:
            return [f"the expert's pass runs on torch: {e}"]
        layout, _ = self.layout_for(self.spec.default_instruction)
        self.prepare_cache(layout)
        x = torch.zeros(1, self.suffix_len, fp32_model.expert.config.hidden_size)
        if not graph.prepare(layout.length, (x, *eng.prefix_inputs(layout.length))):
            return [f"the expert's pass runs on torch: {graph.failed[layout.length]}"]
        eng.graph = graph
        return []

    def onnx_steps(self, layout: PrefixLayout) -> dict:
        """The prefix pass and one pass of the expert over the prefix K/V (a denoising step
        without its small heads), the expert being no engine step (it reads the cache's K/V and
        its cross-attention maps of them)."""
        from vla_accel_ros.models.smolvla.expert import expert_onnx_graph

        return {**super().onnx_steps(layout), "expert": expert_onnx_graph(self.expert_engine, layout.length, self.suffix_len)}

    # -- training -----------------------------------------------------------------------------------
    def training_loss(
        self, pixels: torch.Tensor, states: torch.Tensor, instruction: str, actions: torch.Tensor, valid: torch.Tensor,
        generator: torch.Generator | None, *, noise: torch.Tensor | None = None, time: torch.Tensor | None = None,
        image_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        """LeRobot's flow-matching loss (0.4.4's ``SmolVLAPolicy.forward``), term for term:
        actions normalized (and mapped with ``adapt_to_pi_aloha``), zero-padded to
        ``max_action_dim``; x_t = t noise + (1 - t) a, target u = noise - a, with t ~ 0.999
        Beta(1.5, 1) + 0.001 and noise ~ N(0, 1) over the padded width; the mean squared error
        over every sample, step and padded dimension. LeRobot reads the padding flags from a key
        its datasets never write (``actions_id_pad``), so steps past an episode's end (the last
        action repeated, as here) count too: ``valid`` is not applied, and the loss is LeRobot's.

        ``noise`` [B, H, max_action_dim] and ``time`` [B] may be given (a check against LeRobot's
        own loss); else drawn from ``generator``. ``image_tokens``: a frozen tower's tokens instead of
        pixels (:meth:`batch_prefix`).  pixels: [B, C, 3, S, S] in [-1, 1] (resized
        with padding); states: [B, state_dim] and actions: [B, H, action_dim] in robot units."""
        del valid  # see above: LeRobot's loss ignores it
        o = self.options
        layout, prefix = self.batch_prefix(pixels, states, instruction, image_tokens=image_tokens)  # [B, P, W]
        dev = prefix.device
        a = self.codec.to_model(actions.float(), "action", o.action_norm)
        a = F.pad(a, (0, o.max_action_dim - self.spec.action_dim))  # [B, H, A]
        b = a.shape[0]
        if noise is None:
            noise = torch.randn(a.shape, generator=generator)
        if time is None:
            time = 0.999 * torch.rand(b, generator=generator) ** (1.0 / 1.5) + 0.001  # inverse CDF of Beta(1.5, 1)
        noise, time = noise.to(dev, torch.float32), time.to(dev, torch.float32)
        x_t = time[:, None, None] * noise + (1.0 - time[:, None, None]) * a
        v = self.training_velocity(layout, prefix, x_t, time).float()
        loss = (v - (noise - a)).pow(2).mean()
        return loss, {"loss": float(loss.detach())}

    def training_velocity(self, layout: PrefixLayout, prefix: torch.Tensor, x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """The expert's velocity for a batch, differentiable: prefix [B, P, W] embeddings, x_t
        [B, H, A] at flow times ``time`` [B] -> [B, H, A]. LeRobot trains prefix and suffix in one
        pass whose masks keep the prefix from seeing the actions: the same numbers as the VLM's
        prefix K/V first, then the expert over them, which is the path :meth:`reference_infer`
        takes (one copy of the expert's rule)."""
        return self.model.action_out(self._reference_expert(self.model.suffix_embeddings(x_t, time), self._prefix_kv(layout, prefix), layout.length))

    # -- the plain reference: parity gate and benchmark baseline ---------------------------------
    def _prefix_mask(self, layout: PrefixLayout) -> torch.Tensor:
        p = layout.length
        mask = torch.ones(p, p, dtype=torch.bool)
        mask[:-1, -1] = False  # nothing before the state token sees it
        return mask

    @torch.inference_mode()
    def reference_prefix_hidden(self, obs: Observation) -> torch.Tensor:
        layout, full = self.full_prefix(obs)
        return self.model.vlm(inputs_embeds=full[None], attention_mask=self._prefix_mask(layout)[None, None]).last_hidden_state[0]

    def reference_prefill(self, full: torch.Tensor, layout: PrefixLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """transformers' own VLM forward over the whole prefix (a 4-D mask, its DynamicCache) ->
        per layer (keys, values): the reference expert, written out with dense masks over explicit
        K/V (no slots, no valid flags, no plan), reads them (:meth:`reference_velocity`)."""
        return self._prefix_kv(layout, full[None])

    def reference_velocity(self, x: torch.Tensor, t: float, prefix_kv, prefix_len: int) -> torch.Tensor:
        return self.model.action_out(self._reference_expert(self.model.suffix_embeddings(x, t), prefix_kv, prefix_len))

    def _prefix_kv(self, layout: PrefixLayout, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """transformers' own VLM forward over prefixes [B, P, W] (a 4-D mask, its DynamicCache)
        -> per layer (keys, values) [B, Hkv, P, D], the keys rotated."""
        mask = self._prefix_mask(layout).to(full.device)[None, None].expand(full.shape[0], 1, -1, -1)
        pkv = self.model.vlm(inputs_embeds=full, attention_mask=mask, use_cache=True).past_key_values
        return [(pkv.layers[i].keys, pkv.layers[i].values) for i in range(self.vlm_stack.num_layers)]

    def _reference_expert(self, x: torch.Tensor, prefix_kv: list, p: int) -> torch.Tensor:
        """The expert written out with dense masks over explicit K/V: x [B, H, W] -> [B, H, W]."""
        expert = self.model.expert
        b, h, _ = x.shape
        dev = x.device
        eng = self.expert_engine
        Hq, Hkv, D = eng.num_heads, eng.num_kv_heads, eng.head_dim
        pos_self = torch.arange(p, p + h, device=dev)[None].expand(b, h)
        pos_cross = torch.arange(h, device=dev)[None].expand(b, h)
        causal = torch.ones(h, h, dtype=torch.bool, device=dev).tril()
        for step in self.options.layer_plan(self.vlm_stack.num_layers):
            if step.kind == "skip":
                continue
            layer = expert.layers[step.expert_layer]
            attn = layer.self_attn
            pk, pv = prefix_kv[step.vlm_layer]  # [B, Hkv, P, D], rotated keys
            hs = layer.input_layernorm(x)
            q = attn.q_proj(hs).view(b, h, Hq, D).transpose(1, 2)
            if step.kind == "self":
                cos, sin = expert.rotary_emb(hs, pos_self)
                k = attn.k_proj(hs).view(b, h, Hkv, D).transpose(1, 2)
                v = attn.v_proj(hs).view(b, h, Hkv, D).transpose(1, 2)
                q, k = eng.apply_rope(q, k, cos, sin)
                keys, values = torch.cat([pk.to(k.dtype), k], 2), torch.cat([pv.to(v.dtype), v], 2)
                mask = torch.cat([torch.ones(h, p, dtype=torch.bool, device=dev), causal], 1)
            else:
                cos, sin = expert.rotary_emb(hs, pos_cross)
                q, _ = eng.apply_rope(q, q, cos, sin)
                flat = lambda t: t.transpose(1, 2).reshape(b, p, -1)  # noqa: E731 - [B, P, Hkv*D], head-major
                keys = attn.k_proj(flat(pk)).view(b, p, Hkv, D).transpose(1, 2)
                values = attn.v_proj(flat(pv)).view(b, p, Hkv, D).transpose(1, 2)
                mask = torch.ones(h, p, dtype=torch.bool, device=dev)
            keys, values = keys.repeat_interleave(Hq // Hkv, 1), values.repeat_interleave(Hq // Hkv, 1)
            scores = (q @ keys.transpose(-1, -2).to(q.dtype)) * eng.scaling
            probs = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)
            o = (probs @ values.to(probs.dtype)).transpose(1, 2).reshape(b, h, Hq * D)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return expert.norm(x)

    @torch.inference_mode()
    def reference_intermediates(self, obs: Observation, noise: np.ndarray, fixture: dict) -> dict:
        """(ours, the reference's) of the intermediates a LeRobot SmolVLA fixture carries, in
        pipeline order (``vla-accel parity --reference``): the first camera's pixels and
        connector output, the prefix embeddings (the fixture's padding rows left out), the
        padded state, the velocity at t = 1 and the final padded sample."""
        layout, frames, full, x0 = self.intermediate_prefix(obs, noise)
        out = {
            "image0_after_resize_with_pad_and_2x_minus_1": frames.pixels[:1],
            "image0_connector_out": self.model.vis(frames.pixels[:1]) / self.model.vis.embed_scale,
            "prefix_embs": full[None],
            "state_padded": self.model_state(obs.state),
            "v_t_step0": self.velocity(x0, 1.0, layout.length),
            "x_0_padded": self.denoise(x0, layout.length),
        }
        pairs = {}
        for name, ours in out.items():
            theirs = fixture.get(name)
            if theirs is not None and name == "prefix_embs" and "prefix_pad_masks" in fixture:
                theirs = theirs[:, fixture["prefix_pad_masks"][0].bool()]  # padding rows: nobody attends to them
            pairs[name] = (ours, theirs)
        return pairs

    def bench_pairs(self, obs: Observation, layout: PrefixLayout, full: torch.Tensor) -> list:
        noise = np.random.default_rng(0).standard_normal(self.noise_shape).astype(np.float32)
        all_slots = layout.all_slots()
        step = StepPlan(slots=all_slots, positions=all_slots, output_slots=all_slots[-1:])
        mask = self._prefix_mask(layout)[None, None]

        def hf_prefill():
            with torch.inference_mode():
                return self.model.vlm(inputs_embeds=full[None], attention_mask=mask, use_cache=True)

        return [
            ("prefill", ("transformers", hf_prefill), ("engine", lambda: self.vlm_engine.forward(full[None], step)), 1),
            ("full infer", ("reference", lambda: self.reference_infer(obs, noise=noise)),
             ("engine", lambda: self.infer(obs, noise=noise)), 1),
        ]  # fmt: skip


# -- the plug-in -----------------------------------------------------------------------------------
# Sizes of random-weight demo bundles and of policies trained here. ``tiny`` shrinks the image
# (128 px, 2 x 2 patches per token: 16 tokens per camera) to keep tests fast; ``mini`` is the
# trained transfer_cube policy's: 384 px, where the cube of the top view is ~6 px wide (at 256 px,
# ~4 px, a tower trained from scratch did not find it: docs/policy-experiments.md), 16 px patches,
# 3 x 3 shuffle (64 tokens per camera), 8.3 M parameters, vision and the VLM prefix most of a
# chunk on a CPU as at full size; ``small`` keeps SmolVLA's 512 px, 16 px patches and 4 x 4 pixel
# shuffle (64 tokens per camera).
_DEMO = {
    "tiny": dict(image=128, patch=16, scale=2, vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
                 lm=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                 vocab=1024),
    "mini": dict(image=384, patch=16, scale=3, vision=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3),
                 lm=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
                 vocab=1024),
    "small": dict(image=512, patch=16, scale=4, vision=dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6),
                  lm=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9, num_key_value_heads=3, head_dim=64),
                  vocab=32000),
}  # fmt: skip


class SmolVLAFamily(LeRobotFamily):
    """``smolvla`` bundles: LeRobot SmolVLA checkpoints (``vla-accel bundle import --lerobot``),
    and SmolVLA-architecture policies trained here (``vla-accel train --family smolvla``)."""

    name = "smolvla"
    importer = "vla_accel_ros.models.smolvla.lerobot_import"
    trainable = True
    default_chunk_size = 50
    # Vision is most of a SmolVLA chunk (SigLIP at 512 px, 1,024 patches per camera): its linear
    # layers in int8 (VNNI) are the largest saving measured on the full-size model (docs/models.md,
    # "SmolVLA against LeRobot, side by side"); the gate takes the vision tower back to bf16 where a bundle does
    # not tolerate int8 within precision.gate_flow_max_over_std, then the decoders to fp32.
    # With the tower in bf16 (PyTorch's int8 tower is refused on the shipped bundle) the decoders
    # attend in fp32: bf16 attention over that bf16 prefix passed the gate and lost the trained
    # bundle's task (107/300 against 121/300, p = 0.009; with fp32 attention 114/300, p = 0.21, at
    # no measurable cost: 1.25-1.26x against 1.22-1.25x; no bf16 stage alone lost it:
    # docs/results.md). The int8 tower keeps bf16 attention: fp32 attention did not help it on
    # OpenVINO (77/200 against 81/200), and on torch it kept the task with bf16 (110/300, p = 0.07).
    precision_defaults = {"vision": "int8", "projector": "bf16", "lm": "bf16", "expert": "bf16", "heads": "fp32",
                          "attention": "bf16"}  # fmt: skip
    precision_fallbacks = (
        {"vision": "bf16", "attention": "fp32"}, {"vision": "bf16", "attention": "fp32", "expert": "fp32"},
        {"vision": "bf16", "lm": "fp32", "expert": "fp32"}, {c: "fp32" for c in COMPONENTS},
    )  # fmt: skip

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        opts = options_of(spec)
        if not isinstance(spec.expert, dict):
            raise ConfigError("smolvla bundles need an 'expert' decoder config")
        check_lerobot_io(spec, opts)
        scale = spec.vision.get("scale_factor")
        if not isinstance(scale, int) or scale < 1:
            raise ConfigError(f"vision.scale_factor={scale!r} must be a positive integer (SmolVLM's pixel shuffle)")
        v_image, v_patch = spec.vision.get("image_size"), spec.vision.get("patch_size")
        if (v_image, (v_patch or 0) * scale) != (spec.image_size, spec.patch_size):
            raise ConfigError(
                f"image_size={spec.image_size} / patch_size={spec.patch_size} must be vision.image_size={v_image} and "
                f"vision.patch_size x scale_factor = {v_patch} x {scale} (one token per pixel-shuffled block)"
            )
        lm, ex = spec.lm, spec.expert
        for key in ("num_attention_heads", "num_key_value_heads"):
            if ex.get(key) != lm.get(key):
                raise ConfigError(f"expert.{key} must equal lm.{key} (SmolVLA's expert attends with the VLM's heads)")
        if head_dim(ex) != head_dim(lm):
            raise ConfigError("expert and lm must have the same head_dim")
        layers = int(lm["num_hidden_layers"])
        opts.layer_plan(layers)  # LeRobot's own limits first
        if int(ex["num_hidden_layers"]) != opts.expert_depth(layers):
            raise ConfigError(
                f"expert.num_hidden_layers={ex['num_hidden_layers']} but options.num_expert_layers={opts.num_expert_layers} "
                f"with {layers} VLM layers means {opts.expert_depth(layers)}"
            )
        opts.check_kv_widths(layers, int(ex["hidden_size"]), int(lm["num_key_value_heads"]) * head_dim(lm))
        if opts.add_image_special_tokens and spec.tokenizer != "bundle":
            raise ConfigError("options.add_image_special_tokens needs the checkpoint's tokenizer (tokenizer: bundle)")

    def build_model(self, spec: BundleSpec) -> SmolVLAModel:
        return SmolVLAModel(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> SmolVLAPolicy:
        return SmolVLAPolicy(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def describe(self, spec: BundleSpec) -> list[str]:
        o = options_of(spec)
        plan = o.layer_plan(int(spec.lm["num_hidden_layers"]))
        kinds = "".join({"self": "S", "cross": "X", "skip": "-"}[s.kind] for s in plan)
        return [
            f"denoising   {spec.num_steps} Euler steps; expert layers per VLM layer {kinds} (S self, X cross, - none)",
            self.padding_line(spec, o),
        ]

    def component_roots(self, model: SmolVLAModel) -> dict[str, list[nn.Module]]:
        return {"vision": [model.vis.vision], "projector": [model.vis.connector]}

    def demo_spec(
        self, size: str, *, cameras: tuple[str, ...] = ("cam_high",), action_dim: int = 14, chunk_size: int | None = None,
        lm_type: str = "llama", state_dim: int | None = None, norm_stats: dict | None = None, name: str | None = None,
        default_instruction: str | None = None, **_unused,
    ) -> BundleSpec:  # fmt: skip
        """A random-weight SmolVLA-architecture bundle (the hash tokenizer: no vocabulary files)."""
        if size not in _DEMO:
            raise ConfigError(f"size={size!r}: smolvla demo bundles come in {', '.join(_DEMO)}")
        if lm_type != "llama":
            raise ConfigError("smolvla's text model is a Llama decoder (lm_type llama)")
        d = _DEMO[size]
        state_dim = action_dim if state_dim is None else state_dim
        lm = {"model_type": "llama", **d["lm"], "vocab_size": d["vocab"], "max_position_embeddings": 8192, "rope_theta": 10000.0}
        width = int(lm["hidden_size"] * 0.75)
        expert = {**lm, "hidden_size": width, "intermediate_size": get_intermediate_size(width), "vocab_size": 1,
                  "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # fmt: skip
        return BundleSpec(
            family="smolvla", name=name or f"demo-smolvla-{size}", cameras=cameras, image_size=d["image"],
            patch_size=d["patch"] * d["scale"], image_resize="pad", action_dim=action_dim,
            joint_names=demo.joint_names(action_dim), dt=0.02, state_dim=state_dim,
            norm_stats=norm_stats or demo.demo_norm_stats(action_dim, state_dim), text_vocab=d["vocab"] - 3,
            vision={"model_type": "smolvlm_vision", **d["vision"], "image_size": d["image"], "patch_size": d["patch"],
                    "scale_factor": d["scale"]},
            chunk_size=chunk_size or 50, num_steps=10, instruction_template="{instruction}", max_text_tokens=48, lm=lm,
            expert=expert, options=SmolVLAOptions(truncate_text=False).to_dict(),
            **({"default_instruction": default_instruction} if default_instruction is not None else {}),
        )  # fmt: skip

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        o = options_of(spec)
        lm, ex = spec.lm, spec.expert
        d, p, h = int(lm["hidden_size"]), work.prefix_len, spec.chunk_size
        dv, s = int(spec.vision["hidden_size"]), int(spec.vision["scale_factor"])
        tokens = spec.grid * spec.grid
        out = {
            "vision": work.cameras_encoded * vision_flops(spec.vision),
            "projector": work.cameras_encoded * 2.0 * tokens * dv * s * s * d,  # the connector's one map
            "prefill": sum(decoder_layer_flops(lm, n, n * float(p)) for n in work.rows_per_layer),
        }
        plan = o.layer_plan(int(lm["num_hidden_layers"]))
        kv, hd = int(ex["num_key_value_heads"]), head_dim(ex)
        step = 0.0
        one = {**ex, "num_hidden_layers": 1}
        for st in plan:
            if st.kind == "self":
                step += decoder_layer_flops(one, h, h * (p + (h + 1) / 2.0))
            elif st.kind == "cross":  # q/o and the MLP over the chunk; K/V maps once per prefix (below)
                step += decoder_layer_flops(one, h, h * p) - 2.0 * h * int(ex["hidden_size"]) * hd * 2 * kv
        suffix = 2.0 * h * (o.max_action_dim * int(ex["hidden_size"]) * 2 + 3 * int(ex["hidden_size"]) ** 2)
        cross_kv = sum(2.0 * p * (kv * hd) ** 2 * 2 for st in plan if st.kind == "cross")
        out["denoise"] = flow_steps * (step + suffix) + cross_kv
        out["state"] = 2.0 * o.max_state_dim * d
        return out


    def training_vision(self, spec: BundleSpec, image_size: int, patch_size: int, conv_stem: tuple[int, ...]) -> BundleSpec:
        """SmolVLM's tower as LeRobot builds it: its vision patches stay (16 px); ``image_size``
        sets LeRobot's resize_imgs_with_padding and ``patch_size`` an image token's side, a
        block of scale_factor x scale_factor patches merged by the pixel shuffle."""
        if conv_stem:
            raise ConfigError("TrainConfig.conv_stem: a smolvla policy keeps SmolVLM's vision tower so that LeRobot "
                              "runs it (no stem)")  # fmt: skip
        if not (image_size or patch_size):
            return spec
        size, block, vp = image_size or spec.image_size, patch_size or spec.patch_size, int(spec.vision["patch_size"])
        if block % vp or size % block:
            raise ConfigError(
                f"TrainConfig.patch_size={block} must be a multiple of SmolVLM's {vp} px patches and image_size={size} a "
                f"multiple of it (whole tokens of scale_factor x scale_factor patches)"
            )
        vision = {**spec.vision, "image_size": size, "scale_factor": block // vp}
        return spec.replace(image_size=size, patch_size=block, vision=vision)

    def init_for_training(self, model: SmolVLAModel) -> None:
        siglip_init_(model.vis)

    def training_spec(self, spec: BundleSpec, out, instructions: list[str]) -> BundleSpec:
        """A policy trained here brings its own tokenizer (SmolVLM's cannot be downloaded, and
        LeRobot loads this one from the exported SmolVLM directory): written into ``out``."""
        from pathlib import Path

        from vla_accel_ros.core.bundle import TOKENIZER_DIR
        from vla_accel_ros.models.smolvla.tokenizer import write_tokenizer

        write_tokenizer(Path(out) / TOKENIZER_DIR, instructions, int(spec.lm["vocab_size"]))
        return spec.replace(tokenizer="bundle", text_vocab=int(spec.lm["vocab_size"]))


FAMILY = SmolVLAFamily()
