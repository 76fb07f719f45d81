"""``pi05``: LeRobot's pi0.5 (openpi's pi05: PaliGemma and a Gemma action expert with adaptive
norms), computed as LeRobot 0.4.4 computes it, on the package's engine.

What pi0 and pi0.5 share is :mod:`~vla_accel_ros.models.pi0.paligemma` (the modules, the
prefix, the joint attention through one KV cache, the checks). What pi0.5 does otherwise,
written here from LeRobot 0.4.4's ``pi05`` (its fixtures, ``test/fixtures/pi05``, check every
rule):

* the state is not a token: normalized (QUANTILES by default), zero-padded to
  ``max_state_dim``, discretized into 256 bins over [-1, 1] (``np.digitize``: below -1 is bin
  -1, from 1 - 1/128 on bin 255) and written into the prompt
  ``"Task: {task}, State: {bins};\\nAction: "`` (the task stripped, ``_`` and newlines as
  spaces); so the prompt, and with it the prefix, changes with the state;
* images resized with padding *centred*, the padding filled with -1 while the frame is still in
  [0, 1], then mapped to [-1, 1]: the padding reads -3 (openpi fills it with -1 after the
  mapping; LeRobot's order is kept, the fixtures measure the difference);
* image features unscaled (openpi's PaliGemma does not divide by sqrt(hidden), pi0.5 does not
  multiply); language embeddings times sqrt(hidden) as in pi0;
* the suffix is the action tokens alone (``action_in`` of the noisy chunk: the time is not in
  them), seeing the prefix and each other;
* the flow time enters through the expert's adaptive norms (:mod:`.adarms`): its sine-cosine
  features (``min_period`` .. ``max_period``) through two linear maps with SiLU after each are
  the condition of every norm of the expert;
* Euler steps at t = 1 + i * (-1 / steps) computed in double and rounded to float32 (not
  accumulated, as pi0's 0.3.3 loop).

Everything the engine does to a prefix applies: the token cache, the vision cache, pruning,
precision per component, compiled static steps; RTC guidance through the expert.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.prefix import PrefixLayout
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models import demo
from vla_accel_ros.models.common import Frames, sincos_embedding
from vla_accel_ros.models.lerobot_compat import frame_tensor
from vla_accel_ros.models.pi0.paligemma import PaliGemmaFamily, PaliGemmaModel, PaliGemmaPolicy
from vla_accel_ros.models.pi05.adarms import AdaRMSNorm
from vla_accel_ros.models.pi05.configuration_pi05 import Pi05Options

STATE_BINS = 256  # the state's discretization over [-1, 1] (openpi's tokenizer)


def options_of(spec: BundleSpec) -> Pi05Options:
    return Pi05Options.from_dict(spec.options or {})


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Normalized state -> bins in [-1, 255], as LeRobot's pi05 pre-processor computes them."""
    return np.digitize(state, bins=np.linspace(-1, 1, STATE_BINS + 1)[:-1]) - 1


def state_prompt(task: str, bins: np.ndarray) -> str:
    """LeRobot pi05's prompt: the task cleaned as its pre-processor cleans it, the state's bins."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "


def centred_padded_frames(images, cameras: tuple[str, ...], size: int) -> Frames:
    """Frames as LeRobot 0.4.4's pi05 preprocesses them: resized with the aspect kept (bilinear,
    no antialias) and padded *centred* with -1 while still in [0, 1], then x * 2 - 1 (so the
    padding reads -3). -> pixels [C, 3, S, S]; raw uint8 [C, S, S, 3] (padding 0) for the token cache."""
    from vla_accel_ros.core.errors import ObservationError

    missing = [c for c in cameras if c not in images]
    if missing:
        raise ObservationError(f"observation lacks camera(s) {', '.join(missing)}; has {', '.join(images) or 'none'}")
    out = []
    for c in cameras:
        img = frame_tensor(images[c], c)[None]  # [1, 3, h, w] in [0, 1]
        h, w = img.shape[-2:]
        ratio = max(w / size, h / size)
        rh, rw = int(h / ratio), int(w / ratio)
        img = F.interpolate(img, size=(rh, rw), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
        ph, pw = size - rh, size - rw
        out.append(F.pad(img, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=-1.0))
    padded = torch.cat(out)  # [C, 3, S, S]
    return Frames(cameras, pixels=padded * 2.0 - 1.0, unit=padded)


class Pi05Model(PaliGemmaModel):
    """The modules of a ``pi05`` bundle: PaliGemma's, the expert with adaptive norms (conditioned
    on the flow time), the time MLP."""

    vision_rescale = False  # openpi's PaliGemma: the projected features are not rescaled

    def __init__(self, spec: BundleSpec) -> None:
        opts = options_of(spec)
        super().__init__(spec, opts)
        self.periods = (opts.min_period, opts.max_period)
        cfg = self.expert.config
        width, eps = cfg.hidden_size, cfg.rms_norm_eps
        # The expert's Gemma norms become adaptive ones (the rest of its modules stay transformers').
        for layer in self.expert.layers:
            layer.input_layernorm = AdaRMSNorm(width, width, eps)
            layer.post_attention_layernorm = AdaRMSNorm(width, width, eps)
        self.expert.norm = AdaRMSNorm(width, width, eps)
        self.time_in = nn.Linear(width, width)
        self.time_out = nn.Linear(width, width)

    def time_condition(self, t: float | torch.Tensor) -> torch.Tensor:
        """The expert's condition at flow time t: silu(time_out(silu(time_in(sincos(t))))).  -> [B, W]"""
        t = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
        te = sincos_embedding(t, self.time_in.in_features, *self.periods).to(self.time_in.weight.dtype)
        return F.silu(self.time_out(F.silu(self.time_in(te))))


class Pi05Policy(PaliGemmaPolicy):
    family = "pi05"

    def __init__(self, spec: BundleSpec, model: Pi05Model, config, planner=None, *, precision=None, bundle_path: str = "") -> None:
        self.options = options_of(spec)
        super().__init__(spec, model, config, planner, precision=precision, bundle_path=bundle_path)

    # -- inputs: frames and the prompt with the state --------------------------------------------
    def frames(self, obs: Observation) -> Frames:
        return centred_padded_frames(obs.images, self.spec.cameras, self.spec.image_size)

    def state_bins(self, state: np.ndarray | None) -> np.ndarray:
        """The observation's state as the prompt writes it: normalized, zero-padded to
        ``max_state_dim``, discretized (the state is required, as LeRobot's step requires it)."""
        return discretize_state(self.model_state(state)[0].numpy())

    def prompt(self, instruction: str, state: np.ndarray | None = None) -> str:
        """The text the tokenizer reads: the task and the state's bins. Without a state (an
        instruction checked alone, an export's layout) every value is bin 128, the normalized 0."""
        task = self.spec.instruction_template.replace("{instruction}", instruction or self.spec.default_instruction)
        bins = self.state_bins(state) if state is not None else np.full(self.options.max_state_dim, STATE_BINS // 2)
        return state_prompt(task, bins)

    def layout_of(self, obs: Observation) -> tuple[PrefixLayout, list[int]]:
        """The prompt carries the state: a state whose bins tokenize to another length gives
        another layout (the KV cache and the token cache start again on it)."""
        return self.layout_for_prompt(self.prompt(obs.instruction, obs.state))

    # -- the suffix: the actions, the time through the adaptive norms ----------------------------
    def suffix_embeddings(self, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """x_t: [B, H, A] -> [B, H, W]: the action tokens (the time is not in them)."""
        return self.model.action_in(x_t)

    def expert_condition(self, t: float) -> torch.Tensor:
        return self.model.time_condition(t)

    def flow_times(self) -> list[float]:
        """t = 1 + i * (-1 / steps) in double, rounded to float32 (LeRobot's ``time_tensor``)."""
        dt = -1.0 / self.num_steps
        return [float(np.float32(1.0 + i * dt)) for i in range(self.num_steps)]

    # -- the plain reference: parity gate and benchmark baseline ---------------------------------
    def reference_velocity(self, x: torch.Tensor, t: float, pkv, prefix_len: int) -> torch.Tensor:
        """The expert over the action rows with the prefix's DynamicCache, layer by layer through
        transformers' own Gemma attention (its cache and attention function), MLP and rotary
        embedding; the adaptive norms between them are ours (transformers has none, so its decoder
        layer cannot run them). The cache is cropped back to the prefix after."""
        ex, cond = self.model.expert, self.expert_condition(t)
        x = self.suffix_embeddings(x, t)
        n = x.shape[1]
        pos = torch.arange(prefix_len, prefix_len + n)[None]
        mask = torch.ones(1, 1, n, prefix_len + n, dtype=torch.bool)
        rope = ex.rotary_emb(x, pos)
        for layer in ex.layers:
            h, gate = layer.input_layernorm(x, cond)
            a, _ = layer.self_attn(hidden_states=h, position_embeddings=rope, attention_mask=mask, past_key_values=pkv)
            x = x + a * gate
            h, gate = layer.post_attention_layernorm(x, cond)
            x = x + layer.mlp(h) * gate
        pkv.crop(-n)  # drop these rows, keep the prefix
        return self.model.action_out(ex.norm(x, cond)[0])

    @torch.inference_mode()
    def reference_intermediates(self, obs: Observation, noise: np.ndarray, fixture: dict) -> dict:
        """(ours, the reference's) of the intermediates LeRobot's pi05 fixtures carry, in
        pipeline order (``vla-accel parity --reference``)."""
        ours, layout, x0 = self.prefix_intermediates(obs, noise)
        ours["state_padded"] = self.model_state(obs.state)
        ours["adarms_cond_t1"] = self.expert_condition(1.0)
        ours["suffix_embs_t1"] = self.suffix_embeddings(x0, 1.0)
        ours["v_t_step0"] = self.velocity(x0, 1.0, layout.length)
        ours["x_0_padded"] = self.denoise(x0, layout.length)
        return self.paired(ours, fixture)


# Demo sizes: the package's tiny / small modules (demo.size_table) as Gemma with one K/V head.
_DEMO_IMAGE = {"tiny": 112, "mini": 224, "small": 224}


class Pi05Family(PaliGemmaFamily):
    """``pi05`` bundles: LeRobot pi0.5 checkpoints (``vla-accel bundle import --lerobot``) and
    random-weight ones of the same architecture (``vla-accel bundle create-demo --family pi05``)."""

    name = "pi05"
    model_class = Pi05Model
    policy_class = Pi05Policy
    options_class = Pi05Options
    importer = "vla_accel_ros.models.pi05.lerobot_import"
    # pi0.5 has no state token; ``time_in`` / ``time_out`` make the expert's condition.
    heads = ("action_in", "time_in", "time_out", "action_out")

    def validate_spec(self, spec: BundleSpec) -> None:
        super().validate_spec(spec)
        if spec.max_text_tokens < 16:
            raise ConfigError(f"max_text_tokens={spec.max_text_tokens}: pi05's prompt holds the task and the state (>= 16)")

    def describe(self, spec: BundleSpec) -> list[str]:
        o = options_of(spec)
        return [
            f"denoising   {spec.num_steps} Euler steps over {spec.chunk_size} actions; the flow time through adaRMS",
            f"state       in the prompt: {o.max_state_dim} values in {STATE_BINS} bins",
            self.padding_line(spec, o),
        ]

    def demo_spec(
        self, size: str, *, cameras: tuple[str, ...] = ("cam_high",), action_dim: int = 14, chunk_size: int | None = None,
        lm_type: str = "gemma", state_dim: int | None = None, norm_stats: dict | None = None, name: str | None = None,
        default_instruction: str | None = None, **_unused,
    ) -> BundleSpec:  # fmt: skip
        """A random-weight pi0.5-architecture bundle (the hash tokenizer: no vocabulary files)."""
        if lm_type not in ("gemma", "llama"):  # llama: the CLI's default, meaning "the family's own"
            raise ConfigError(f"lm_type={lm_type!r}: pi05's decoders are Gemma")
        sz = demo.size_table(size)
        vocab, lm_sz, ex_sz = sz["vocab"], sz["lm"], sz["expert"]
        head_dim = int(ex_sz["head_dim"])
        gemma = {"model_type": "gemma", "num_key_value_heads": 1, "head_dim": head_dim, "rms_norm_eps": 1e-6,
                 "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                 "max_position_embeddings": 8192}  # fmt: skip
        lm = {**gemma, "hidden_size": lm_sz["hidden_size"], "intermediate_size": lm_sz["intermediate_size"],
              "num_hidden_layers": lm_sz["num_hidden_layers"], "num_attention_heads": lm_sz["hidden_size"] // head_dim,
              "vocab_size": vocab, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
        expert = {**gemma, "hidden_size": ex_sz["hidden_size"], "intermediate_size": ex_sz["intermediate_size"],
                  "num_hidden_layers": lm["num_hidden_layers"], "num_attention_heads": lm["num_attention_heads"],
                  "vocab_size": 1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # fmt: skip
        state_dim = action_dim if state_dim is None else state_dim
        stats = norm_stats or demo.demo_norm_stats(action_dim, state_dim)
        st = stats["state"]
        if "q01" not in st:  # QUANTILES (pi0.5's default) reads q01 / q99: the mean -/+ 2.5 std
            m, s = np.asarray(st["mean"], np.float32), np.asarray(st["std"], np.float32)
            stats = {**stats, "state": {**st, "q01": (m - 2.5 * s).tolist(), "q99": (m + 2.5 * s).tolist()}}
        image = _DEMO_IMAGE[size]
        return BundleSpec(
            family="pi05", name=name or f"demo-pi05-{size}", cameras=cameras, image_size=image, patch_size=14,
            image_resize="pad", action_dim=action_dim, joint_names=demo.joint_names(action_dim), dt=0.02, state_dim=state_dim,
            norm_stats=stats, text_vocab=vocab - 3, chunk_size=chunk_size or 50, num_steps=10,
            instruction_template="{instruction}", max_text_tokens=200,
            vision={**sz["vision"], "image_size": image, "patch_size": 14, "layer_norm_eps": 1e-6,
                    "hidden_act": "gelu_pytorch_tanh"},
            lm=lm, expert=expert, options=Pi05Options().to_dict(),
            **({"default_instruction": default_instruction} if default_instruction is not None else {}),
        )  # fmt: skip


FAMILY = Pi05Family()
