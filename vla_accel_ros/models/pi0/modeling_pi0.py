"""``pi0``: LeRobot's pi0 (PaliGemma + a Gemma action expert), computed as LeRobot 0.3.3 computes
it, on the package's engine.

The modules are stock transformers modules built from the bundle's configs: SigLIP
(``SiglipVisionModel``), PaliGemma's projector (one linear map), Gemma decoders for the VLM and
the expert. Gemma's differences from Llama live in those modules (the (1 + w) RMSNorm, GeGLU,
MQA, head size 256); the engine drives their layers as it drives Llama's. What pi0 adds around
them is written here from its description (``../shared/fixtures/pi0-lerobot/README.md``; the
fixture checks every rule):

* images resized with padding to 224 px (LeRobot's rule), mapped to [-1, 1]; SigLIP patch tokens
  through the projector, divided by sqrt(hidden) as transformers' PaliGemma does and multiplied
  by it again as pi0 does; language embeddings (the table, unscaled: transformers 5 scales
  Gemma's embedding inside its module) times sqrt(hidden);
* the prefix ``[images][language]`` attends to itself both ways; the suffix ``[state][actions]``
  runs in the expert: the state token sees the prefix and itself, every action token the
  prefix, the state and all action tokens;
* each layer one joint attention of both streams: the expert's rows attend to the VLM's cached
  prefix K/V of that layer and their own (one cache, the flow family's layout);
* the suffix MLP over the noisy actions and the flow time (periods 0.004 to 4); Euler steps with
  the flow time accumulated in float32 as LeRobot does; state and actions padded to
  ``max_state_dim`` / ``max_action_dim``; normalization with LeRobot's eps; the pi-ALOHA maps
  (0.3.3 applies them in robot units).

Everything the engine does to a prefix applies: the token cache, the vision cache, pruning,
precision per component, compiled static steps.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.kv_cache import Block, Segment
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.core.types import ActionChunk, Observation
from vla_accel_ros.models.base import VisionPrefix
from vla_accel_ros.models.common import build_decoder, sincos_embedding
from vla_accel_ros.models.family import check_expert_shares_cache, check_vision_patch
from vla_accel_ros.models.flops import denoise_step_flops, prefix_flops
from vla_accel_ros.models.lerobot_compat import LeRobotFamily, LeRobotPolicy, check_lerobot_io
from vla_accel_ros.models.pi0.configuration_pi0 import Pi0Options

PERIODS = (4e-3, 4.0)  # the flow time's sine-cosine periods (pi0 fixes them)


def options_of(spec: BundleSpec) -> Pi0Options:
    return Pi0Options.from_dict(spec.options or {})


class Pi0Vision(VisionPrefix):
    """SigLIP + PaliGemma's projector (one linear map): frames -> image-token embeddings,
    scaled as pi0 scales them."""

    def __init__(self, spec: BundleSpec, lm_hidden: int) -> None:
        super().__init__(spec, lm_hidden)
        self.projector = nn.Linear(self.vision.config.hidden_size, lm_hidden)

    def _scaled(self, projected: torch.Tensor) -> torch.Tensor:
        # transformers' PaliGemma divides by sqrt(hidden), pi0 multiplies by it again (a 0-dim
        # tensor of the embeddings' dtype): both roundings kept.
        x = projected / (self.out_dim**0.5)
        return x * torch.tensor(self.out_dim**0.5, dtype=x.dtype, device=x.device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [C, 3, S, S] in [-1, 1] -> [C, T, H]"""
        return self._scaled(super().forward(pixels))

    def project_tokens(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self._scaled(super().project_tokens(feats, tokens))


class Pi0Model(nn.Module):
    """The modules of a ``pi0`` bundle (names as the flow family's)."""

    def __init__(self, spec: BundleSpec) -> None:
        super().__init__()
        opts = options_of(spec)
        self.vlm = build_decoder(spec.lm, "lm", causal_lm=False)
        self.expert = build_decoder(spec.expert, "expert", causal_lm=False)
        self.expert.embed_tokens = None  # the expert reads embeddings, never ids
        hidden, width = self.vlm.config.hidden_size, self.expert.config.hidden_size
        self.vis = Pi0Vision(spec, hidden)
        self.state_proj = nn.Linear(opts.max_state_dim, width)  # the state is a token of the expert's suffix
        self.action_in = nn.Linear(opts.max_action_dim, width)
        self.time_in = nn.Linear(2 * width, width)
        self.time_out = nn.Linear(width, width)
        self.action_out = nn.Linear(width, opts.max_action_dim)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        """The embedding table's rows (unscaled: pi0 scales them itself)."""
        table = self.vlm.embed_tokens.weight
        return F.embedding(torch.as_tensor(ids, dtype=torch.long, device=table.device), table)

    def suffix_embeddings(self, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """x_t: [B, H, A] noisy chunk at flow time t -> [B, H, W] (the action tokens)."""
        a = self.action_in(x_t)
        t = torch.as_tensor(t, dtype=torch.float32)
        te = sincos_embedding(t.reshape(-1), a.shape[-1], *PERIODS).to(a.dtype)[:, None, :].expand_as(a)
        return self.time_out(F.silu(self.time_in(torch.cat([a, te], dim=-1))))


class Pi0Policy(LeRobotPolicy):
    family = "pi0"
    pi_aloha_on_normalized = False  # LeRobot 0.3.3 maps the ALOHA joints in robot units

    def __init__(self, spec: BundleSpec, model: Pi0Model, config, planner=None, *, precision=None, bundle_path: str = "") -> None:
        self.options = options_of(spec)
        self._state_row: torch.Tensor | None = None  # the observation's state token [1, W] (the suffix's first row)
        super().__init__(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def prefix_capacity(self) -> int:
        return len(self.spec.cameras) * self.spec.grid**2 + self.spec.max_text_tokens

    @property
    def suffix_len(self) -> int:
        return 1 + self.spec.chunk_size  # the state token, then the actions

    # -- the prefix and the suffix ---------------------------------------------------------------
    def _make_layout(self, text_len: int) -> PrefixLayout:
        s = self.spec
        n_img = len(s.cameras) * s.grid * s.grid
        return PrefixLayout(
            cameras=s.cameras, grid=s.grid, patch_size=s.patch_size, image_size=s.image_size, image_start=0,
            text_start=n_img, text_len=text_len, state_slot=None, length=n_img + text_len, fixed_slots=(),
            attention="bidirectional", num_layers=self.vlm_stack.num_layers,
        )  # fmt: skip

    def prepare_cache(self, layout: PrefixLayout) -> None:
        if layout.length != self._layout_len:
            # Prefix | state | actions: each block sees the blocks before it and itself.
            blocks = (Block(layout.length, "bidirectional"), Block(1, "bidirectional"), Block(self.spec.chunk_size, "bidirectional"))
            self.cache.set_layout([Segment(0, blocks)])
            self.cache.invalidate()
            self._layout_len = layout.length

    def _dynamic_rows(self, full: torch.Tensor, obs: Observation, layout: PrefixLayout) -> None:
        """pi0's state is the suffix's first token: embedded here, run by the expert."""
        self._state_row = self.model.state_proj(self.model_state(obs.state))  # [1, W]

    def expert_plan(self, length: int) -> StepPlan:
        slots = torch.arange(length, length + self.suffix_len)
        return StepPlan(slots=slots, positions=slots, output_slots=slots[1:], key_window=length + self.suffix_len)

    def suffix_embeddings(self, x_t: torch.Tensor, t: float) -> torch.Tensor:
        actions = self.model.suffix_embeddings(x_t, t)
        state = self._state_row[:, None, :].expand(actions.shape[0], 1, -1).to(actions.dtype)
        return torch.cat([state, actions], dim=1)

    def flow_times(self) -> list[float]:
        """t accumulated in float32 from 1 by -1/steps, as LeRobot's loop does (0.0999999 for
        the last of 10, not 0.1)."""
        dt, t, out = np.float32(-1.0 / self.num_steps), np.float32(1.0), []
        for _ in range(self.num_steps):
            out.append(float(t))
            t = np.float32(t + dt)
        return out

    def static_steps(self, layout: PrefixLayout) -> dict:
        suffix = torch.arange(layout.length, layout.length + self.suffix_len)
        return {"prefill": (self.vlm_engine, layout.all_slots()), "expert": (self.expert_engine, suffix)}

    def training_loss(self, *args, **kwargs):
        raise ConfigError("pi0 bundles are imported from LeRobot checkpoints; train them with LeRobot or openpi")

    # -- the plain reference: parity gate and benchmark baseline ---------------------------------
    @torch.inference_mode()
    def reference_prefix_hidden(self, obs: Observation) -> torch.Tensor:
        layout, full = self.full_prefix(obs)
        mask = torch.ones(1, 1, layout.length, layout.length, dtype=torch.bool)
        return self.model.vlm(inputs_embeds=full[None], attention_mask=mask).last_hidden_state[0]

    @torch.inference_mode()
    def reference_infer(self, obs: Observation, *, noise: np.ndarray | None = None) -> ActionChunk:
        """transformers' own Gemma forwards: the prefix once into a DynamicCache (4-D mask), then
        per Euler step the expert over [state, actions] with that cache (cropped back after)."""
        timer, layout, full, x = self.reference_prefix(obs, noise)
        p, n = layout.length, self.suffix_len
        with timer.stage("prefill"):
            mask = torch.ones(1, 1, p, p, dtype=torch.bool)
            pkv = self.model.vlm(inputs_embeds=full[None], attention_mask=mask, use_cache=True).past_key_values
        with timer.stage("denoise"):
            dt = 1.0 / self.num_steps
            pos = torch.arange(p, p + n)[None]
            smask = torch.ones(1, 1, n, p + n, dtype=torch.bool)
            smask[0, 0, 0, p + 1 :] = False  # the state token does not see the actions
            for t in self.flow_times():
                hid = self.model.expert(
                    inputs_embeds=self.suffix_embeddings(x, t), attention_mask=smask, position_ids=pos, past_key_values=pkv,
                    use_cache=True,
                ).last_hidden_state
                pkv.crop(-n)  # drop this step's suffix rows, keep the prefix
                x = x - dt * self.model.action_out(hid[:, 1:])
        with timer.stage("postprocess"):
            actions = self.actions_out(x)
        return ActionChunk(
            actions=actions, stamp_ns=obs.stamp_ns, dt=self.spec.dt, joint_names=self.spec.joint_names,
            timings_ms=timer.finish(), stats={"mode": "transformers"},
        )  # fmt: skip

    @torch.inference_mode()
    def reference_intermediates(self, obs: Observation, noise: np.ndarray, fixture: dict) -> dict:
        """(ours, the reference's) of the intermediates LeRobot's pi0 fixture carries, in
        pipeline order (``vla-accel parity --reference``)."""
        layout, ids = self.layout_for(obs.instruction)
        self.prepare_cache(layout)
        frames = self.frames(obs)
        full = self.prefix_embeddings(obs, layout, ids, frames.pixels, self.all_cameras(layout))
        rows = layout.all_slots()
        self.vlm_engine.forward(full[None], StepPlan(slots=rows, positions=rows))
        self.planner.reset("external prefix write")
        x0 = self._noise(noise)
        vis = self.model.vis
        ours = {f"image{i}_resized_padded_2x_minus_1": frames.pixels[i : i + 1] for i in range(len(layout.cameras))}
        ours["image0_features"] = vis.projector(vis.vision(pixel_values=frames.pixels[:1]).last_hidden_state) / (vis.out_dim**0.5)
        ours["prefix_embs"] = full[None]
        c = self.cache  # [L, B, Hkv, S, D] -> the fixture's [B, P, Hkv, D]
        ours["prefix_kv_layer0_keys"] = c.k[0, :, :, : layout.length].transpose(1, 2).float()
        ours["prefix_kv_layer0_values"] = c.v[0, :, :, : layout.length].transpose(1, 2).float()
        ours["state_padded"] = self.model_state(obs.state)
        ours["suffix_embs_t1"] = self.suffix_embeddings(x0, 1.0)
        ours["v_t_step0"] = self.velocity(x0, 1.0, layout.length)
        ours["x_0_padded"] = self.denoise(x0, layout.length)
        valid = fixture["prefix_pad_masks"][0].bool() if "prefix_pad_masks" in fixture else None
        pairs = {}
        for name, value in ours.items():
            ref = fixture.get(name)
            if ref is not None and valid is not None and name.startswith("prefix_"):
                ref = ref[:, valid]  # the language padding: nobody attends to it, we do not compute it
            pairs[name] = (value, ref)
        return pairs


class Pi0Family(LeRobotFamily):
    """``pi0`` bundles: LeRobot pi0 checkpoints (``vla-accel bundle import --lerobot``)."""

    name = "pi0"

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        opts = options_of(spec)
        check_vision_patch(spec)
        check_expert_shares_cache(spec, "pi0's expert attends jointly with the VLM, layer by layer")
        for section in ("lm", "expert"):
            if getattr(spec, section).get("model_type") != "gemma":
                raise ConfigError(f"{section}.model_type must be gemma (pi0's PaliGemma and its expert)")
        check_lerobot_io(spec, opts)

    def build_model(self, spec: BundleSpec) -> Pi0Model:
        return Pi0Model(spec)

    def make_policy(self, spec, model, config, planner, *, bundle_path: str = "", precision=None) -> Pi0Policy:
        return Pi0Policy(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    def describe(self, spec: BundleSpec) -> list[str]:
        return [
            f"denoising   {spec.num_steps} Euler steps over [state, {spec.chunk_size} actions] (pi0's suffix)",
            self.padding_line(spec, options_of(spec)),
        ]

    def flops(self, spec: BundleSpec, work, *, flow_steps: int) -> dict[str, float]:
        out = prefix_flops(spec, work, causal=False)
        dv, d = int(spec.vision["hidden_size"]), int(spec.lm["hidden_size"])
        out["projector"] = work.cameras_encoded * 2.0 * spec.grid * spec.grid * dv * d  # one linear map
        a = options_of(spec).max_action_dim
        h = 1 + spec.chunk_size
        out["denoise"] = flow_steps * denoise_step_flops(spec.expert, h, work.prefix_len, a)
        return out

    def import_lerobot(self, policy_dir, out, **kwargs):
        from vla_accel_ros.models.pi0.lerobot_import import import_lerobot

        return import_lerobot(policy_dir, out, **kwargs)


FAMILY = Pi0Family()
