"""``pi0``: LeRobot's pi0 (PaliGemma + a Gemma action expert), computed as LeRobot 0.3.3 computes
it, on the package's engine.

The modules are stock transformers modules built from the bundle's configs: SigLIP
(``SiglipVisionModel``), PaliGemma's projector (one linear map), Gemma decoders for the VLM and
the expert (what pi0 and pi0.5 share: :mod:`~vla_accel_ros.models.pi0.paligemma`). Gemma's
differences from Llama live in those modules (the (1 + w) RMSNorm, GeGLU, MQA, head size 256);
the engine drives their layers as it drives Llama's. What pi0 adds around them is written here
from its description (``../shared/fixtures/pi0-lerobot/README.md``; the fixture checks every
rule):

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
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.engine import StepPlan
from vla_accel_ros.core.kv_cache import Block
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models.flow_core import TimeMLPHeads
from vla_accel_ros.models.pi0.configuration_pi0 import Pi0Options
from vla_accel_ros.models.pi0.paligemma import PaliGemmaFamily, PaliGemmaModel, PaliGemmaPolicy


def options_of(spec: BundleSpec) -> Pi0Options:
    return Pi0Options.from_dict(spec.options or {})


class Pi0Model(TimeMLPHeads, PaliGemmaModel):
    """The modules of a ``pi0`` bundle: PaliGemma's and the expert's, the state token's
    projection and the time MLP over [action, time] features (the action tokens: the flow
    core's :class:`~vla_accel_ros.models.flow_core.TimeMLPHeads` rule, periods 0.004 to 4)."""

    def __init__(self, spec: BundleSpec) -> None:
        opts = options_of(spec)
        super().__init__(spec, opts)
        width = self.expert.config.hidden_size
        self.state_proj = nn.Linear(opts.max_state_dim, width)  # the state is a token of the expert's suffix
        self.time_in = nn.Linear(2 * width, width)
        self.time_out = nn.Linear(width, width)


class Pi0Policy(PaliGemmaPolicy):
    family = "pi0"
    pi_aloha_on_normalized = False  # LeRobot 0.3.3 maps the ALOHA joints in robot units

    def __init__(self, spec: BundleSpec, model: Pi0Model, config, planner=None, *, precision=None, bundle_path: str = "") -> None:
        self.options = options_of(spec)
        self._state_row: torch.Tensor | None = None  # the observation's state token [1, W] (the suffix's first row)
        super().__init__(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    @property
    def suffix_len(self) -> int:
        return 1 + self.spec.chunk_size  # the state token, then the actions

    # -- the prefix and the suffix ---------------------------------------------------------------
    def cache_blocks(self, layout: PrefixLayout) -> tuple[Block, ...]:
        """Prefix | state | actions: each block sees the blocks before it and itself."""
        return (Block(layout.length, "bidirectional"), Block(1, "bidirectional"), Block(self.spec.chunk_size, "bidirectional"))

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

    # -- the plain reference: parity gate and benchmark baseline ---------------------------------
    def reference_velocity(self, x: torch.Tensor, t: float, pkv, prefix_len: int) -> torch.Tensor:
        """transformers' Gemma expert over [state, actions] with the prefix's cache (4-D mask: the
        state token does not see the actions)."""
        n = self.suffix_len
        pos = torch.arange(prefix_len, prefix_len + n)[None]
        mask = torch.ones(1, 1, n, prefix_len + n, dtype=torch.bool)
        mask[0, 0, 0, prefix_len + 1 :] = False
        hid = self.model.expert(
            inputs_embeds=self.suffix_embeddings(x, t), attention_mask=mask, position_ids=pos, past_key_values=pkv, use_cache=True
        ).last_hidden_state
        pkv.crop(-n)  # drop this step's suffix rows, keep the prefix
        return self.model.action_out(hid[:, 1:])

    @torch.inference_mode()
    def reference_intermediates(self, obs: Observation, noise: np.ndarray, fixture: dict) -> dict:
        """(ours, the reference's) of the intermediates LeRobot's pi0 fixture carries, in
        pipeline order (``vla-accel parity --reference``)."""
        ours, layout, x0 = self.prefix_intermediates(obs, noise)
        ours["state_padded"] = self.model_state(obs.state)
        ours["suffix_embs_t1"] = self.suffix_embeddings(x0, 1.0)
        ours["v_t_step0"] = self.velocity(x0, 1.0, layout.length)
        ours["x_0_padded"] = self.denoise(x0, layout.length)
        return self.paired(ours, fixture)


class Pi0Family(PaliGemmaFamily):
    """``pi0`` bundles: LeRobot pi0 checkpoints (``vla-accel bundle import --lerobot``)."""

    name = "pi0"
    model_class = Pi0Model
    policy_class = Pi0Policy
    options_class = Pi0Options
    importer = "vla_accel_ros.models.pi0.lerobot_import"

    def describe(self, spec: BundleSpec) -> list[str]:
        return [
            f"denoising   {spec.num_steps} Euler steps over [state, {spec.chunk_size} actions] (pi0's suffix)",
            self.padding_line(spec, options_of(spec)),
        ]

    def suffix_rows(self, spec: BundleSpec) -> int:
        return 1 + spec.chunk_size


FAMILY = Pi0Family()
