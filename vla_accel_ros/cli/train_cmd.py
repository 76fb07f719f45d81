"""``vla-accel train``: behaviour cloning of a bundle from rosbag2 demonstrations."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from vla_accel_ros.models.family import family_names
from vla_accel_ros.cli import command


def register(sub: argparse._SubParsersAction) -> None:
    from vla_accel_ros.train.trainer import TrainConfig

    d = TrainConfig()
    p = command(
        sub, "train", "train a bundle by behaviour cloning on recorded demonstrations (e.g. `vla-accel sim record`)",
        "vla-accel train --family flow --data data/tc0 data/tc30 --out models/transfer_cube-flow --size mini --epochs 12",
        details="Reads every episode of the bags through the policy node's observation rule, holds out the "
        "last --val-episodes episodes, computes the bundle's normalization statistics from the rest, trains, "
        "and writes an ordinary bundle (config.json + model.safetensors) to --out, with train_log.jsonl and a "
        "resumable checkpoint/ beside it.",
    )
    p.add_argument("--family", choices=family_names(can="train"), required=True)
    p.add_argument("--data", type=Path, nargs="+", required=True, metavar="BAG", help="rosbag2 bags with demonstrations")
    p.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    p.add_argument("--size", choices=("tiny", "mini", "small"), default=d.size, help=f"model size (default {d.size})")
    p.add_argument("--cameras", default=",".join(d.cameras), help="comma-separated ROS camera names (default %(default)s)")
    p.add_argument("--image-size", type=int, default=d.image_size, help="square image size (0: the preset's, 224)")
    p.add_argument(
        "--patch-size", type=int, default=d.patch_size,
        help="pixels per image-token side (0: the preset's); e.g. 28 at 224 px: 8 x 8 tokens per camera (smolvla: a "
        "multiple of its 16 px patches, merged by the pixel shuffle; 64 at 512 px: 8 x 8 tokens)",
    )  # fmt: skip
    p.add_argument(
        "--conv-stem", default="", metavar="C1,C2",
        help="channels of a convolutional stem before the patch embedding, one 2 x 2 stride-2 stage each "
        "(e.g. 32,64; default: none); helps a tower trained from scratch find few-pixel objects",
    )  # fmt: skip
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="actions per inference (0: ar 10, flow 50)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--frame-stride", type=int, default=d.frame_stride, help="train on every N-th frame")
    p.add_argument("--val-episodes", type=int, default=d.val_episodes, help="episodes held out (the last ones)")
    p.add_argument(
        "--train-episodes", type=int, default=0, metavar="N",
        help="train on the first N episodes only (0: all but the held-out ones; those stay the last --val-episodes)",
    )  # fmt: skip
    p.add_argument("--shift", type=int, default=d.shift, help="augmentation: random image shift in pixels (0: off)")
    p.add_argument("--no-state", action="store_true",
                   help="no joint-state input: the policy acts from its cameras and instruction alone")
    p.add_argument("--state-dropout", type=float, default=d.state_dropout, metavar="P",
                   help="replace the joint state of this fraction of training samples by the mean state (default 0)")
    p.add_argument("--freeze-vision", action="store_true",
                   help="keep the vision tower and connector as they start (--init-from's or the random init): only the "
                   "language model and the expert train; with --shift 0 each frame's image tokens are computed once")
    p.add_argument("--fp32", action="store_true", help="no bfloat16 autocast in the forward pass")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0: all cores)")
    p.add_argument("--loader-threads", type=int, default=d.loader_threads,
                   help="background threads assembling the next batches (0: in the loop; -1: 2 on a GPU, 0 on the CPU)")
    p.add_argument("--read-workers", type=int, default=d.read_workers, metavar="N",
                   help="processes reading the bags in parallel (default 0: in this process)")
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--device-frames-gib", type=float, default=d.device_frames_gib, metavar="GIB",
                   help="unpack the training frames onto --device once when they take at most GIB (0: never): no batch "
                   "crosses the host")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--keep-every", type=int, default=d.keep_every,
                   help="also keep a bundle of every N-th step in OUT/steps/<step> (0: none), to evaluate each")
    p.add_argument("--save-dtype", choices=("float16", "float32"), default=d.save_dtype)
    p.add_argument("--name", default="", help="bundle name (default <task>-<family>)")
    p.add_argument("--reasoning", default="", metavar="TASK",
                   help="ar: train a reasoning policy on TASK's templated reasoning (e.g. transfer_cube)")
    p.add_argument("--init-from", default="", metavar="BUNDLE", help="start from this bundle's weights (same module shapes)")
    p.add_argument("--init-norm", action="store_true",
                   help="with --init-from: normalize with that bundle's statistics, not the data's (for data unlike "
                   "the start's, e.g. many tick-0 scenes; default: the data's, as a LeRobot fine-tune does)")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="stop at a checkpoint at this optimizer step (0: no limit); --resume continues")
    p.add_argument("--max-minutes", type=float, default=d.max_minutes,
                   help="stop at a checkpoint after this many minutes (0: no limit); --resume continues")
    p.add_argument("--fit-minutes", type=float, default=d.fit_minutes, metavar="M",
                   help="size the schedule to end in M minutes from the speed of the first steps (0: --epochs decides)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)


def _channels(text: str) -> tuple[int, ...]:
    from vla_accel_ros.core.errors import ConfigError

    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--conv-stem {text!r}: give comma-separated channel counts, e.g. 32,64") from None


def _train(args: argparse.Namespace) -> int:
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.train.data import read_episodes
    from vla_accel_ros.train.trainer import CHECKPOINT_DIR, TrainConfig, Trainer

    cfg = TrainConfig(
        family=args.family, size=args.size, cameras=tuple(c.strip() for c in args.cameras.split(",") if c.strip()),
        image_size=args.image_size, patch_size=args.patch_size, conv_stem=_channels(args.conv_stem),
        max_steps=args.max_steps, max_minutes=args.max_minutes,
        chunk_size=args.chunk_size, state=not args.no_state, state_dropout=args.state_dropout, epochs=args.epochs,
        batch_size=args.batch, lr=args.lr,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, frame_stride=args.frame_stride,
        val_episodes=args.val_episodes, shift=args.shift, freeze_vision=args.freeze_vision, bf16=not args.fp32, seed=args.seed, threads=args.threads,
        loader_threads=args.loader_threads, read_workers=args.read_workers, fit_minutes=args.fit_minutes,
        device=args.device, device_frames_gib=args.device_frames_gib, checkpoint_every=args.checkpoint_every, keep_every=args.keep_every,
        save_dtype=args.save_dtype, name=args.name, reasoning=args.reasoning, init_from=args.init_from,
        init_norm=args.init_norm,
    )  # fmt: skip
    if args.train_episodes < 0:
        raise ConfigError(f"--train-episodes must be >= 0, got {args.train_episodes}")
    missing = [str(b) for b in args.data if not b.exists()]
    if missing:
        raise ConfigError(f"--data: no such bag(s): {', '.join(missing)}")
    out: Path = args.out
    if out.exists() and not args.resume and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; pass --resume to continue its checkpoint or choose a new directory")
    if args.resume and not (out / CHECKPOINT_DIR / "trainer.json").is_file():
        raise ConfigError(f"--resume: {out / CHECKPOINT_DIR} holds no checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    t0 = time.perf_counter()
    size, resize = cfg.frame_rule()
    episodes = read_episodes(args.data, cfg.cameras, size, resize=resize, workers=cfg.read_workers, progress=progress)
    if args.train_episodes:
        if not 0 < args.train_episodes <= len(episodes) - cfg.val_episodes:
            raise ConfigError(f"--train-episodes {args.train_episodes}: the bags have {len(episodes) - cfg.val_episodes} "
                              f"training episodes besides the {cfg.val_episodes} held out")  # fmt: skip
        episodes = episodes[: args.train_episodes] + episodes[len(episodes) - cfg.val_episodes :]
    frames = sum(len(e) for e in episodes)
    print(f"read {len(episodes)} episodes, {frames} frames in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    task = _task_name(episodes[0].instruction)
    try:
        trainer = Trainer(cfg, episodes, out, task=task, started=t0, progress=progress)
    except Exception:
        if not args.resume:  # --out was new or empty (checked above): a refused start leaves it so, for the rerun
            for p in out.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        raise
    if args.resume:
        trainer.load_checkpoint()
        print(f"resumed at step {trainer.step} of {trainer.total_steps}", file=sys.stderr)
    params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"training {trainer.spec.name}: {cfg.family}/{cfg.size}, {params / 1e6:.2f} M parameters, "
        f"{len(trainer.train_set)} training samples ({len(trainer.train_set.episodes)} episodes), "
        f"{len(trainer.val_set) if trainer.val_set else 0} validation samples, {trainer.total_steps} steps",
        file=sys.stderr,
    )
    result = trainer.run()
    path = trainer.save_bundle()
    summary = {
        "bundle": str(path), "steps": result.steps, "epochs": result.epochs, "seconds": round(result.seconds, 1),
        "samples_seen": result.train_samples, "val_loss": result.val_loss,
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


def _task_name(instruction: str) -> str:
    from vla_accel_ros.sim.aloha import task_of_instruction

    return task_of_instruction(instruction) or "policy"
