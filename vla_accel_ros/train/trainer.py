"""Behaviour cloning of a bundle from recorded demonstrations (``vla-accel train``).

The model is an ordinary bundle model (:func:`~vla_accel_ros.models.factory.build_model`)
wrapped in its inference policy, whose ``training_loss`` builds the prefix with the same
layout ``infer`` uses; the result is saved as an ordinary bundle, so every path of the package
(engine, token cache, parity gate, ROS graph, replay, eval) runs it unchanged.

Deterministic for a seed: the initial weights come from the seed, the sample order of epoch e
from (seed, e), and the noise, flow times and augmentation of step k from (seed, k), so a run
resumed from a checkpoint continues exactly as the uninterrupted one would have. Checkpoints
are safetensors (weights and optimizer state) and JSON; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from vla_accel_ros.core.bundle import BundleSpec
from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.family import family_names, get_family
from vla_accel_ros.models.common import siglip_pixels
from vla_accel_ros.train.data import Batch, ChunkDataset, DataStats, Episode, compute_stats, prefetched, split_episodes

CHECKPOINT_DIR = "checkpoint"
STEPS_DIR = "steps"  # --keep-every: one complete bundle per kept step, steps/<step>
LOG_FILE = "train_log.jsonl"
# Settings a resumed run may change (how long and where it runs, not what it learns).
RUN_SETTINGS = ("epochs", "threads", "loader_threads", "read_workers", "device", "device_frames_gib", "checkpoint_every",
                "keep_every", "max_steps", "max_minutes", "fit_minutes")


@dataclass(frozen=True)
class TrainConfig(Config):
    family: str = param("flow", doc="policy family (one that trains from bags: ar, flow, smolvla)")
    size: str = param("mini", doc="model size preset", choices=("tiny", "mini", "small"))
    cameras: tuple[str, ...] = param(("cam_high",), doc="ROS camera names the policy sees, in token order")
    image_size: int = param(0, doc="square image size of the vision tower (0: the size preset's: ar / flow 224, smolvla 384)", range=(0, 2048))
    patch_size: int = param(
        0, doc="pixels per image-token side (0: the preset's, 14): (image_size / patch_size)^2 tokens per camera",
        range=(0, 2048),
    )  # fmt: skip
    conv_stem: tuple[int, ...] = param(
        (), doc="channels of a convolutional stem in front of the vision tower's patch embedding, one 2 x 2 stride-2 stage "
        "each (e.g. 32,64; (): none): a linear patch embedding trained from scratch is slow to find few-pixel objects",
    )  # fmt: skip
    chunk_size: int = param(0, doc="actions per inference (0: the family's default: ar 10, flow 50)", range=(0, 1024))
    state: bool = param(
        True, doc="feed the joint state to the model (false: images and instruction only; imitating a scripted "
        "expert, a policy can predict much of the next actions from where the arm is, without looking at the scene). "
        "A family whose checkpoints always read a state (smolvla: LeRobot's) keeps the input with its projection "
        "held at zero: the state token is a learned constant",
    )  # fmt: skip
    state_dropout: float = param(
        0.0, doc="fraction of training samples whose joint state is replaced by the mean state (0: none): the policy "
        "must then act from its images, against the scripted expert's shortcut without losing the state at run time",
        range=(0.0, 1.0),
    )  # fmt: skip
    freeze_vision: bool = param(
        False, doc="keep the vision tower and its connector as they start (--init-from's or the random init; LeRobot's "
        "freeze_vision_encoder): only the language model and the action expert train. Without the random shift "
        "(--shift 0) each frame's image tokens are computed once, before the first step, and a step costs no tower: "
        "on the CPU the tower is most of a SmolVLA step",
    )  # fmt: skip
    epochs: int = param(20, doc="passes over the training frames", range=(1, 100_000))
    batch_size: int = param(16, doc="samples per optimizer step", range=(1, 4096))
    lr: float = param(3e-4, doc="peak AdamW learning rate", range=(1e-7, 1.0))
    weight_decay: float = param(1e-4, doc="AdamW weight decay", range=(0.0, 1.0))
    warmup_steps: int = param(300, doc="linear warm-up steps before the cosine decay", range=(0, 10_000_000))
    min_lr_ratio: float = param(0.1, doc="the cosine decays to this fraction of lr", range=(0.0, 1.0))
    grad_clip: float = param(1.0, doc="clip the gradient norm (0: off)", range=(0.0, 1e6))
    frame_stride: int = param(1, doc="train on every N-th frame of each episode", range=(1, 10_000))
    val_episodes: int = param(2, doc="episodes held out for validation (the last ones)", range=(0, 100_000))
    shift: int = param(8, doc="random image translation in pixels for augmentation (0: off)", range=(0, 64))
    bf16: bool = param(True, doc="bfloat16 autocast for the forward pass (weights and optimizer stay fp32)")
    seed: int = param(0, doc="weights, sample order, noise and augmentation", range=(0, 2**31 - 1))
    threads: int = param(0, doc="torch CPU threads (0: all cores)", range=(0, 1024))
    loader_threads: int = param(
        -1, doc="background threads that assemble the next batches while the model trains (0: in the training loop; "
        "-1: 2 on a GPU, 0 on the CPU, where a batch is a few ms of a ~1 s step and a thread only competes)",
        range=(-1, 64),
    )  # fmt: skip
    read_workers: int = param(
        0, doc="processes reading the bags in parallel (0: in this process); decoding and resizing the frames of "
        "hundreds of multi-camera episodes is minutes on one core", range=(0, 256),
    )  # fmt: skip
    device: str = param("cpu", doc="torch device, e.g. cpu or cuda")
    device_frames_gib: float = param(
        0.0, doc="unpack the training frames once onto the training device when they take at most this many GiB "
        "(0: never; frames stay LZ4-packed on the host and every batch is unpacked and copied over): on a GPU run the "
        "host assembling 128 three-camera 512 px frames a step (300 MB) left the GPU half idle. Leave the device "
        "room for training (18 GiB at batch 128 measured on an H200); above the limit the frames stay on the host, "
        "logged", range=(0.0, 1e6),
    )  # fmt: skip
    checkpoint_every: int = param(500, doc="also checkpoint every N steps (0: only at epoch ends)", range=(0, 10_000_000))
    keep_every: int = param(
        0, doc="also keep a complete bundle of the weights every N steps in OUT/steps/<step> (0: none): the checkpoint "
        "holds only the latest step, and neither it nor the validation loss tells which step acts best in the closed "
        "loop (`vla-accel eval` each)", range=(0, 10_000_000),
    )  # fmt: skip
    lm_type: str = param("llama", doc="decoder family of the language model", choices=("llama", "qwen2"))
    save_dtype: str = param("float16", doc="dtype of the bundle's weights on disk (loaded as float32)", choices=("float16", "float32"))
    name: str = param("", doc="bundle name ('' = <task>-<family>)")
    reasoning: str = param(
        "", doc="ar: write the task's templated reasoning before the actions (a task name, e.g. transfer_cube; '': none)"
    )
    init_from: str = param("", doc="start from the weights of this bundle (same module shapes; '': random init)")
    init_norm: bool = param(
        False, doc="with init_from: normalize with that bundle's statistics, not the data's. Data unlike the start's "
        "(many tick-0 scenes: their 50 actions each are the reach) shift the data's by up to 0.8 std, which moves "
        "every output of the start's weights (default: the data's, as a LeRobot fine-tune takes its dataset's)",
    )  # fmt: skip
    max_steps: int = param(
        0, doc="stop at this optimizer step, at a checkpoint (0: run every epoch); --resume goes on", range=(0, 10**9)
    )
    max_minutes: float = param(
        0.0, doc="stop after this many minutes of training, at a checkpoint (0: run every epoch); --resume goes on",
        range=(0.0, 1e7),
    )  # fmt: skip
    fit_minutes: float = param(
        0.0, doc="size the schedule to end in this many minutes (0: --epochs decides): the first steps are timed and "
        "the run takes as many steps as fit, its cosine ending there (a time budget on a lent GPU). The steps chosen "
        "are logged and kept in the checkpoint", range=(0.0, 1e7),
    )  # fmt: skip

    def validate(self) -> None:
        try:
            family = get_family(self.family)
        except BundleError as e:
            raise ConfigError(f"TrainConfig.family={self.family!r}: not one of {', '.join(family_names())}") from e
        if not family.trainable:
            raise ConfigError(f"TrainConfig.family={self.family!r} does not train from bags here; "
                              f"use one of {', '.join(family_names(can='train'))}")  # fmt: skip
        if self.reasoning and not family.writes_reasoning:
            raise ConfigError(f"TrainConfig.reasoning={self.reasoning!r}: the {self.family} family writes no reasoning")
        if self.init_norm and not self.init_from:
            raise ConfigError("TrainConfig.init_norm=True takes the statistics of the init_from bundle, and init_from is ''")
        if self.state_dropout and not self.state:
            raise ConfigError(f"TrainConfig.state_dropout={self.state_dropout} needs the state input (state=True)")
        if self.conv_stem or self.image_size or self.patch_size:  # before hours of reading bags: a stem must divide the patch
            from vla_accel_ros.models.factory import demo_spec

            family.validate_spec(self.vision_of(demo_spec(self.family, self.size)))

    def vision_of(self, spec: BundleSpec) -> BundleSpec:
        """``spec`` (a size preset's) with this run's image size, token grid and conv stem."""
        return get_family(self.family).training_vision(spec, self.image_size, self.patch_size, self.conv_stem)

    def frame_rule(self) -> tuple[int, str]:
        """How frames are read for this run: (image size, ``square`` | ``pad``), the bundle's rule
        (--image-size, else the size preset's)."""
        from vla_accel_ros.models.factory import demo_spec

        spec = self.vision_of(demo_spec(self.family, self.size))
        return spec.image_size, spec.image_resize

    def resolved_chunk(self) -> int:
        return self.chunk_size or get_family(self.family).default_chunk_size


@dataclass
class TrainResult:
    bundle: Path
    steps: int
    epochs: int
    seconds: float
    train_samples: int
    val_loss: float | None
    history: list[dict]


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos)


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# --fit-minutes times steps FIT_SKIP..FIT_PROBE (the first ones pay for warm-up: allocator, kernels).
FIT_SKIP, FIT_PROBE = 10, 40


class Trainer:
    def __init__(
        self, cfg: TrainConfig, episodes: list[Episode], out: Path, *, task: str = "", started: float | None = None,
        progress: bool = True,
    ) -> None:  # fmt: skip
        """``started``: ``time.perf_counter()`` when the run began (reading the bags included),
        what ``fit_minutes`` counts from (default: now). ``progress``: progress bars (the frozen
        tower's tokens, then the steps)."""
        self.started = time.perf_counter() if started is None else started
        self.progress = progress
        from vla_accel_ros.core.policy_config import PolicyConfig
        from vla_accel_ros.models.factory import build_model, build_policy, demo_spec

        self.cfg, self.out = cfg, Path(out)
        if cfg.device != "cpu" and not cfg.device.startswith("cuda"):
            raise ConfigError(f"TrainConfig.device={cfg.device!r}: use cpu or cuda[:N]")
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"TrainConfig.device={cfg.device!r} but torch sees no CUDA device")
        self.device = torch.device(cfg.device)
        train_eps, val_eps = split_episodes(episodes, cfg.val_episodes)
        chunk = cfg.resolved_chunk()
        template = None
        if cfg.reasoning:
            from vla_accel_ros.core.reasoning.template import template_for

            template = template_for(cfg.reasoning)
        self.train_set = ChunkDataset(train_eps, chunk, cfg.frame_stride, reasoning=template)
        self.val_set = ChunkDataset(val_eps, chunk, cfg.frame_stride, reasoning=template) if val_eps else None
        if cfg.init_norm:  # read_spec validated them; a mismatched start fails _init_from's shape check below
            from vla_accel_ros.core.bundle import read_spec

            start = read_spec(cfg.init_from).norm_stats
            self.stats: DataStats = DataStats(action=start["action"], state=start.get("state"))
        else:
            self.stats = compute_stats(train_eps)
        # What --state-dropout puts in place of a dropped state (once, not per step).
        self._state_mean = torch.as_tensor(self.stats.state["mean"], dtype=torch.float32) if self.stats.state else None
        instruction = self.train_set.instruction
        family = get_family(cfg.family)
        state_dim = int(train_eps[0].states.shape[1]) if cfg.state or family.state_required else 0
        name = cfg.name or f"{task or 'policy'}-{cfg.family}"
        self.spec = demo_spec(
            cfg.family, cfg.size, cameras=cfg.cameras, action_dim=int(train_eps[0].actions.shape[1]),
            chunk_size=chunk, lm_type=cfg.lm_type, state_dim=state_dim, norm_stats=self.stats.to_norm_stats(),
            name=name, default_instruction=instruction or None,
            reasoning_words=template.words() if template else (),
            # headroom over the template's longest text: a policy may ramble before <act>
            max_reasoning_tokens=template.max_tokens() + 8 if template else 0,
        )  # fmt: skip
        self.spec = family.training_spec(cfg.vision_of(self.spec), self.out, sorted({e.instruction for e in episodes}))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        model = build_model(self.spec)
        family.init_for_training(model)
        if cfg.init_from:
            self._init_from(model, cfg.init_from)
        # The inference policy owns the layout; training runs its model in train mode.
        self.policy = build_policy(self.spec, model, PolicyConfig(parity_check=False), bundle_path=str(self.out))
        self.model = model.train().requires_grad_(True).to(self.device)
        if cfg.freeze_vision:
            model.vis.requires_grad_(False).eval()
        if not cfg.state and family.state_required:
            # The input stays (the family's checkpoints read it); a zero projection that never
            # trains makes the state token the same whatever the state.
            with torch.no_grad():
                model.state_proj.weight.zero_()
            model.state_proj.weight.requires_grad_(False)
        params = [(n, p) for n, p in model.named_parameters() if not (cfg.freeze_vision and n.startswith("vis."))]
        decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
        other = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), fused=self.device.type == "cuda",  # one kernel per step on a GPU
        )  # fmt: skip
        if cfg.freeze_vision and not cfg.shift:
            for data in (self.train_set, self.val_set):
                if data is not None:
                    data.image_tokens = self._image_tokens(data)
        elif cfg.device_frames_gib:
            self._store_frames()
        self.steps_per_epoch = max(1, len(self.train_set) // cfg.batch_size)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.fitted = False  # fit_minutes has chosen total_steps
        self.step = 0
        self.history: list[dict] = []

    @torch.no_grad()
    def _image_tokens(self, data: ChunkDataset) -> list[torch.Tensor]:
        """The frozen tower's tokens of every frame of ``data``, per episode [T, C, N, H], in the
        dtype a step's autocast gives them (kept where the model trains)."""
        from tqdm import tqdm

        out = []
        for e in tqdm(data.episodes, desc="image tokens", unit="episode", file=sys.stderr, leave=False,
                      disable=not self.progress):
            chunks = []
            for i in range(0, len(e), 16):
                frames = torch.from_numpy(np.stack([e.frames[t] for t in range(i, min(len(e), i + 16))])).to(self.device)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                    chunks.append(self.policy.image_tokens(siglip_pixels(frames)))
            out.append(torch.cat(chunks))
        return out

    def _store_frames(self) -> None:
        """The training frames unpacked onto the device (``device_frames_gib``), or a line saying
        why they stay on the host."""
        gib = self.train_set.frame_bytes() / 2**30
        if gib > self.cfg.device_frames_gib:
            print(f"frames: {gib:.1f} GiB unpacked, above --device-frames-gib {self.cfg.device_frames_gib:g}: "
                  "they stay packed on the host", file=sys.stderr)  # fmt: skip
            return
        t0 = time.perf_counter()
        try:
            self.train_set.store_frames(self.device, threads=self.loader_threads)
        except torch.OutOfMemoryError as e:
            raise ConfigError(f"TrainConfig.device_frames_gib={self.cfg.device_frames_gib:g}: {gib:.1f} GiB of frames do "
                              f"not fit on {self.device} ({e}); lower it below what the device has free") from e  # fmt: skip
        print(f"frames: {gib:.1f} GiB unpacked onto {self.device} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    def _init_from(self, model: torch.nn.Module, path: str) -> None:
        from vla_accel_ros.core.bundle import load_bundle
        from vla_accel_ros.models.factory import check_weights, stored_weights

        check_weights(f"TrainConfig.init_from={path}", self.spec, stored_weights(path))  # the loader's shape rule
        weights = load_bundle(path).state_dict
        model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=True)

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out / CHECKPOINT_DIR

    def save_checkpoint(self) -> None:
        from safetensors.torch import save_file

        tmp = self.out / (CHECKPOINT_DIR + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}, str(tmp / "model.safetensors"))
        opt = self.opt.state_dict()
        tensors, scalars = {}, {}
        for pid, st in opt["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
                else:
                    scalars[f"{pid}.{k}"] = v
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {"step": self.step, "total_steps": self.total_steps, "fitted": self.fitted,
                "config": self.cfg.to_dict(), "scalars": scalars, "history": self.history,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]}  # fmt: skip
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        tmp.rename(self.checkpoint_dir)  # a crash mid-save leaves the previous checkpoint intact
        self.save_bundle()  # --out is a usable bundle of the latest weights at every checkpoint

    def load_checkpoint(self) -> bool:
        from safetensors.torch import load_file

        d = self.checkpoint_dir
        if not (d / "trainer.json").is_file():
            return False
        meta = json.loads((d / "trainer.json").read_text())
        saved = TrainConfig.from_dict(meta["config"])
        same = {k: v for k, v in saved.to_dict().items() if k not in RUN_SETTINGS}
        mine = {k: v for k, v in self.cfg.to_dict().items() if k in same}
        if same != mine:
            diff = sorted(k for k in same if same[k] != mine[k])
            raise ConfigError(f"{d}: the checkpoint was trained with other settings ({', '.join(diff)}); use a new --out")
        if saved.epochs != self.cfg.epochs:  # allowed (extending a run), but the steps so far had another schedule
            print(
                f"resuming with --epochs {self.cfg.epochs} (the checkpoint's run: {saved.epochs}): the cosine learning-rate "
                "schedule changes from here on, so this is not the run an uninterrupted training with these settings "
                "gives", file=sys.stderr,
            )  # fmt: skip
        self.model.load_state_dict(load_file(str(d / "model.safetensors")))
        tensors = load_file(str(d / "optimizer.safetensors"))
        state: dict[int, dict] = {}
        for key, v in {**tensors, **meta["scalars"]}.items():
            pid, name = key.split(".", 1)
            state.setdefault(int(pid), {})[name] = torch.as_tensor(v) if name == "step" else v.to(self.device)
        groups = self.opt.state_dict()["param_groups"]
        for g, saved_g in zip(groups, meta["param_groups"]):
            g.update({k: v for k, v in saved_g.items() if k != "params"})
        self.opt.load_state_dict({"state": state, "param_groups": groups})
        self.step = int(meta["step"])
        self.history = list(meta["history"])
        if meta.get("fitted") and saved.epochs == self.cfg.epochs:  # the schedule --fit-minutes chose goes on
            self.total_steps, self.fitted = int(meta["total_steps"]), True
        return True

    # -- the loop ---------------------------------------------------------------------------------------
    def _loss(self, batch, generator: torch.Generator, *, train: bool = False):
        dev = self.device
        extra = {"reasoning": batch.reasoning} if batch.reasoning is not None else {}
        states = batch.states
        if train and self.cfg.state_dropout:
            # The mean state normalizes to zero: "no state" in the units the model sees. Drawn
            # only when set, so runs without it keep their numbers.
            drop = torch.rand(states.shape[0], generator=generator) < self.cfg.state_dropout
            states = torch.where(drop[:, None], self._state_mean, states)
        if batch.image_tokens is not None:
            extra["image_tokens"] = batch.image_tokens.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            return self.policy.training_loss(
                None if batch.image_tokens is not None else siglip_pixels(batch.device_frames(dev)), states.to(dev),
                batch.instruction, batch.actions.to(dev), batch.valid.to(dev), generator, **extra,
            )  # fmt: skip

    def train_step(self, batch, generator: torch.Generator, lr: float) -> dict[str, float]:
        """One optimizer step on ``batch`` at learning rate ``lr``."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, metrics = self._loss(batch, generator, train=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss at step {self.step}: {float(loss.detach())}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return metrics

    def validate(self) -> float | None:
        if self.val_set is None:
            return None
        self.model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i, rows in enumerate(self.val_set.batches(self.cfg.batch_size)):
                loss, _ = self._loss(self.val_set.batch(rows), _step_generator(self.cfg.seed + 1, i))
                total += float(loss) * len(rows)
                n += len(rows)
        self.model.train()
        if self.cfg.freeze_vision:
            self.model.vis.eval()
        return total / max(1, n)

    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg = self.cfg
        progress = self.progress
        t0 = time.perf_counter()
        first_epoch = self.step // self.steps_per_epoch
        self.out.mkdir(parents=True, exist_ok=True)
        log = open(self.out / LOG_FILE, "a")
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True, mininterval=2.0)  # fmt: skip
        probe = 0.0
        try:
            epoch = first_epoch
            while epoch < -(-self.total_steps // self.steps_per_epoch):
                losses: list[float] = []
                # The seconds the loop waited for its batches: near the epoch's time, the host (reading,
                # unpacking, copying frames) bounds the run, not the device.
                waited, asked = 0.0, time.perf_counter()
                for gen, batch in self._epoch_batches(epoch, self.step - epoch * self.steps_per_epoch):
                    waited += time.perf_counter() - asked
                    if self.step >= self.total_steps:  # a fitted schedule may end inside an epoch
                        break
                    metrics = self.train_step(batch, gen, lr_at(cfg, self.step, self.total_steps))
                    losses.append(metrics["loss"])
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, loss=f"{np.mean(losses[-50:]):.4f}")
                    if cfg.fit_minutes and not self.fitted:
                        if self.step == FIT_SKIP:
                            probe = time.perf_counter()
                        elif self.step >= FIT_PROBE:
                            self._fit((time.perf_counter() - probe) / (self.step - FIT_SKIP))
                            bar.total = self.total_steps
                            # The window counts from the start: say how much reading (and a frozen
                            # tower's tokens) took of it, or a short schedule looks like a bug.
                            before = (t0 - self.started) / 60.0
                            bar.write(f"--fit-minutes {cfg.fit_minutes:g}: {self.total_steps} steps "
                                      f"({self.total_steps * cfg.batch_size} samples); reading and preparing the data took "
                                      f"{before:.1f} of the {cfg.fit_minutes:g} minutes", file=sys.stderr)  # fmt: skip
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save_checkpoint()
                    if cfg.keep_every and self.step % cfg.keep_every == 0:
                        self.keep_bundle()
                    limit = self._limit_reached(t0)
                    if limit:
                        self.save_checkpoint()
                        bar.write(f"stopped {limit} at step {self.step} of {self.total_steps} (--resume goes on)",
                                  file=sys.stderr)  # fmt: skip
                        return self._result(t0)
                    asked = time.perf_counter()
                val = self.validate()
                entry = {"epoch": epoch + 1, "step": self.step, "train_loss": float(np.mean(losses)) if losses else None,
                         "val_loss": val, "seconds": round(time.perf_counter() - t0, 1), "batch_wait_s": round(waited, 1)}  # fmt: skip
                self.history.append(entry)
                log.write(json.dumps(entry) + "\n")
                log.flush()
                bar.write(f"epoch {epoch + 1}/{-(-self.total_steps // self.steps_per_epoch)}: train loss "
                          f"{entry['train_loss'] or float('nan'):.4f}" + (f", val loss {val:.4f}" if val is not None else ""),
                          file=sys.stderr)  # fmt: skip
                self.save_checkpoint()
                epoch += 1
        finally:
            bar.close()
            log.close()
        return self._result(t0)

    def _epoch_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Generator, Batch]]:
        """The batches of ``epoch`` from its step ``start`` on, each with its step's generator (the
        batch's shift draws from it first, the step's noise next), so the order and the numbers
        do not depend on ``loader_threads``. Background threads assemble the next batches while
        the model trains on this one: on a GPU run, unpacking and shifting the frames on the CPU
        was most of a step."""
        cfg = self.cfg
        order = self.train_set.epoch_order(cfg.seed, epoch)

        def make(k: int) -> tuple[torch.Generator, Batch]:
            gen = _step_generator(cfg.seed, epoch * self.steps_per_epoch + k)
            rows = order[k * cfg.batch_size : (k + 1) * cfg.batch_size]
            # The shift's gather runs on a GPU (the same pixels), on the CPU by slices.
            return gen, self.train_set.batch(rows, shift=cfg.shift, generator=gen, defer_shift=self.device.type != "cpu")

        yield from prefetched(make, range(start, self.steps_per_epoch), self.loader_threads)

    @property
    def loader_threads(self) -> int:
        return self.cfg.loader_threads if self.cfg.loader_threads >= 0 else (0 if self.device.type == "cpu" else 2)

    def _fit(self, step_seconds: float) -> None:
        """Choose ``total_steps`` so that the run ends ``fit_minutes`` after it started, at the
        measured seconds per step (a 3% margin and 15 s for the validations and the last save)."""
        left = self.cfg.fit_minutes * 60.0 * 0.97 - 15.0 - (time.perf_counter() - self.started)
        self.total_steps = max(self.step + 1, self.step + int(left / max(step_seconds, 1e-6)))
        self.fitted = True
        entry = {"fit_minutes": self.cfg.fit_minutes, "seconds_per_step": round(step_seconds, 4), "total_steps": self.total_steps}
        self.history.append(entry)
        with open(self.out / LOG_FILE, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def _limit_reached(self, t0: float) -> str:
        """Why this run stops here ('' : it goes on): --max-steps or --max-minutes."""
        cfg = self.cfg
        if cfg.max_steps and self.step >= cfg.max_steps:
            return f"at --max-steps {cfg.max_steps}"
        if cfg.max_minutes and time.perf_counter() - t0 > 60.0 * cfg.max_minutes:
            return f"after {cfg.max_minutes:g} min"
        return ""

    def _result(self, t0: float) -> TrainResult:
        return TrainResult(
            bundle=self.out, steps=self.step, epochs=self.cfg.epochs, seconds=time.perf_counter() - t0,
            train_samples=self.step * self.cfg.batch_size, val_loss=next((h["val_loss"] for h in reversed(self.history) if "val_loss" in h), None),
            history=self.history,
        )  # fmt: skip

    def save_bundle(self, path: Path | None = None) -> Path:
        """The trained weights as an ordinary bundle in ``path`` (default ``out``; config.json +
        model.safetensors)."""
        from vla_accel_ros.core.bundle import save_bundle

        dtype = torch.float16 if self.cfg.save_dtype == "float16" else torch.float32
        weights = {k: v.detach().to("cpu", dtype) for k, v in self.model.state_dict().items()}
        return save_bundle(self.out if path is None else path, self.spec, weights)

    def keep_bundle(self) -> Path:
        """This step's weights as a bundle of their own, ``out/steps/<step>``, with the run's
        tokenizer when it brings one (a bundle is self-contained)."""
        from vla_accel_ros.core.bundle import TOKENIZER_DIR

        path = self.out / STEPS_DIR / f"{self.step:07d}"
        if (self.out / TOKENIZER_DIR).is_dir():
            shutil.copytree(self.out / TOKENIZER_DIR, path / TOKENIZER_DIR, dirs_exist_ok=True)
        return self.save_bundle(path)
