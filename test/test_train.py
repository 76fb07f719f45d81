"""Behaviour cloning (`vla-accel train`): data from real simulator bags, losses that learn,
deterministic and resumable runs, bundles every path can load."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import record_sim_bag
from vla_accel_ros.cli import main
from vla_accel_ros.train.data import ChunkDataset, Episode, compute_stats, read_episodes, split_episodes
from vla_accel_ros.train.trainer import TrainConfig, Trainer

EPISODES, STEPS = 2, 12


@pytest.fixture(scope="module")
def demo_bag(tmp_path_factory) -> Path:
    return record_sim_bag(tmp_path_factory.mktemp("train") / "demos", EPISODES, STEPS)


@pytest.fixture(scope="module")
def episodes(demo_bag) -> list[Episode]:
    return read_episodes([demo_bag], ("cam_high",), 224, progress=False)


def test_episodes_are_read_through_the_observation_rule(episodes):
    assert len(episodes) == EPISODES
    for e in episodes:
        assert e.frames.shape == (STEPS, 1, 224, 224, 3) and e.frames.dtype == np.uint8
        assert e.states.shape == (STEPS, 14) and e.actions.shape == (STEPS, 14)
        assert e.instruction.startswith("Pick up the red cube")
        # Grippers arrive normalized (the state assembler's finger map), not in metres.
        assert 0.0 <= e.states[0, 6] <= 1.2


def test_sparse_frames_take_their_actions_from_every_tick(tmp_path):
    """A bag rendered every 3rd tick: each frame knows its tick, and its chunk is the next
    actions of every tick (not of the next frames)."""
    from vla_accel_ros.cli import main as cli

    bag = tmp_path / "sparse"
    argv = ["sim", "record", "--task", "transfer_cube", "--episodes", "2", "--steps", "10", "--cameras", "top",
            "--height", "48", "--width", "64", "--render-every", "3", "--out", str(bag)]  # fmt: skip
    assert cli(argv) == 0
    eps = read_episodes([bag], ("cam_high",), 224, progress=False)
    assert [e.steps.tolist() for e in eps] == [[0, 3, 6, 9], [1, 4, 7]]  # the phase shifts per episode
    assert all(e.actions.shape == (10, 14) and e.states.shape == (len(e), 14) for e in eps)
    b = ChunkDataset(eps, chunk_size=4).batch(np.array([1, 5]))  # episode 0 frame 1, episode 1 frame 1
    np.testing.assert_array_equal(b.actions[0].numpy(), eps[0].actions[3:7])
    np.testing.assert_array_equal(b.actions[1].numpy(), eps[1].actions[4:8])
    assert b.valid.all()


def test_random_shift_is_the_crop_of_an_edge_padded_image():
    from vla_accel_ros.train.data import random_shift

    frames = torch.randint(0, 256, (3, 2, 16, 16, 3), dtype=torch.uint8)
    shift = 5
    out = random_shift(frames, shift, torch.Generator().manual_seed(7))
    off = torch.randint(0, 2 * shift + 1, (6, 2), generator=torch.Generator().manual_seed(7)).tolist()  # the same draws
    flat, got = frames.reshape(6, 16, 16, 3).numpy(), out.reshape(6, 16, 16, 3).numpy()
    assert any(y != shift or x != shift for y, x in off)  # something moved
    for img, res, (y, x) in zip(flat, got, off):
        padded = np.pad(img, ((shift, shift), (shift, shift), (0, 0)), mode="edge")
        np.testing.assert_array_equal(res, padded[y : y + 16, x : x + 16])


def test_a_deferred_shift_gives_the_same_batch(episodes):
    """``defer_shift`` (the GPU path): the frames stay unshifted, the offsets travel with the batch
    and :meth:`Batch.device_frames` applies them by a gather: the pixels of the CPU's slices."""
    ds = ChunkDataset(episodes, 4, 1)
    rows = np.arange(6)
    now = ds.batch(rows, shift=5, generator=torch.Generator().manual_seed(3))
    later = ds.batch(rows, shift=5, generator=torch.Generator().manual_seed(3), defer_shift=True)
    assert now.offsets is None and later.offsets is not None and not torch.equal(later.frames, now.frames)
    assert torch.equal(later.device_frames("cpu"), now.frames)


def test_packed_frames_take_frames_one_at_a_time_and_refuse_a_different_shape():
    """The reader packs each frame as it comes (a bag's episodes never sit unpacked in memory)."""
    from vla_accel_ros.core.errors import BagError
    from vla_accel_ros.train.data import PackedFrames

    frames = np.random.default_rng(0).integers(0, 256, (3, 2, 8, 8, 3), dtype=np.uint8)
    packed = PackedFrames()
    with pytest.raises(BagError, match="at least one frame"):
        packed.shape
    for f in frames:
        packed.append(f)
    assert packed.shape == frames.shape and all(np.array_equal(packed[i], frames[i]) for i in range(3))
    with pytest.raises(BagError, match=r"frame of shape \[2, 8, 9, 3\] among frames of shape \[2, 8, 8, 3\]"):
        packed.append(np.zeros((2, 8, 9, 3), np.uint8))


def test_stored_frames_give_the_packed_batch(episodes):
    """Frames unpacked once (``store_frames``, the GPU run's store) give every batch the packed
    frames gave: the same pixels, shifted or not, with a stride that skips frames."""
    packed, stored = ChunkDataset(episodes, 4, stride=3), ChunkDataset(episodes, 4, stride=3)
    stored.store_frames("cpu", block=5, threads=2)  # blocks that cross an episode's end, unpacked ahead
    assert stored.frame_store.shape[0] == len(stored) < sum(len(e) for e in episodes)
    assert stored.frame_bytes() == stored.frame_store.numel()
    rows = np.array([len(stored) - 1, 0, 3, 2])
    for shift in (0, 5):
        a = packed.batch(rows, shift=shift, generator=torch.Generator().manual_seed(1))
        b = stored.batch(rows, shift=shift, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a.frames, b.frames) and torch.equal(a.actions, b.actions)


def test_frames_on_the_device_train_the_same_weights_and_a_low_limit_keeps_them_packed(episodes, tmp_path, capsys):
    cfg = TrainConfig(family="flow", size="tiny", chunk_size=4, epochs=1, batch_size=4, val_episodes=1, shift=4,
                      threads=1, checkpoint_every=0)  # fmt: skip
    plain = Trainer(cfg, episodes, tmp_path / "plain", progress=False)
    stored = Trainer(cfg.replace(device_frames_gib=1.0), episodes, tmp_path / "stored", progress=False)
    assert plain.train_set.frame_store is None and stored.train_set.frame_store is not None
    for t in (plain, stored):
        t.run()
    assert all(torch.equal(v, stored.model.state_dict()[k]) for k, v in plain.model.state_dict().items())
    capsys.readouterr()
    low = Trainer(cfg.replace(device_frames_gib=1e-6), episodes, tmp_path / "low")
    assert low.train_set.frame_store is None
    assert "above --device-frames-gib 1e-06: they stay packed on the host" in capsys.readouterr().err


def test_chunks_pad_past_the_episode_end(episodes):
    ds = ChunkDataset(episodes, chunk_size=5, stride=4)
    assert len(ds) == EPISODES * 3  # frames 0, 4, 8 of each episode
    last = int(np.nonzero((ds.index[:, 0] == 0) & (ds.index[:, 1] == 8))[0][0])
    b = ds.batch(np.array([last]))
    assert b.actions.shape == (1, 5, 14)
    assert b.valid[0].tolist() == [True, True, True, True, False]  # frames 8..11 exist, 12 does not
    assert torch.equal(b.actions[0, 4], b.actions[0, 3])  # padded with the last action
    assert torch.equal(b.actions[0, 0], torch.from_numpy(episodes[0].actions[8]))


def test_stats_come_from_training_episodes_only(episodes):
    train, val = split_episodes(episodes, 1)
    assert len(train) == 1 and val[0] is episodes[-1]
    stats = compute_stats(train)
    np.testing.assert_allclose(stats.action["mean"], episodes[0].actions.mean(0), rtol=1e-5, atol=1e-6)
    assert min(stats.action["std"]) >= 1e-2  # floored: joints that never move stay finite
    with pytest.raises(ValueError, match="val_episodes"):
        split_episodes(episodes, EPISODES)


@pytest.mark.parametrize("family", ["flow", pytest.param("ar", marks=pytest.mark.slow)])  # ar: 23 s, make test-slow
def test_loss_decreases(family, episodes, tmp_path):
    cfg = TrainConfig(family=family, size="tiny", chunk_size=4, epochs=1, batch_size=8, val_episodes=0, shift=0)
    trainer = Trainer(cfg, episodes, tmp_path)
    batch = trainer.train_set.batch(np.arange(8))
    # The same batch and noise every step: the loss must go down.
    losses = [trainer.train_step(batch, torch.Generator().manual_seed(0), lr=1e-3)["loss"] for _ in range(16)]
    assert np.mean(losses[-3:]) < 0.85 * np.mean(losses[:3]), losses


def test_a_policy_without_state_input_trains_and_loads(episodes, tmp_path):
    from vla_accel_ros.models.factory import load_policy

    cfg = TrainConfig(family="flow", size="tiny", chunk_size=4, epochs=1, batch_size=4, val_episodes=1, state=False,
                      threads=1, save_dtype="float32")  # fmt: skip
    trainer = Trainer(cfg, episodes, tmp_path, progress=False)
    assert trainer.spec.state_dim == 0 and trainer.model.state_proj is None
    trainer.run()
    trainer.save_bundle()
    policy = load_policy(tmp_path)  # the parity gate runs on the stateless layout
    assert policy.spec.state_dim == 0 and policy.parity_report.passed


def test_state_dropout_hides_the_state_of_the_dropped_samples_only_in_training(episodes, tmp_path):
    """With --state-dropout 1 every training sample sees the mean state: the loss no longer
    depends on the recorded states; validation still sees them; 0 changes nothing."""
    cfg = TrainConfig(family="flow", size="tiny", chunk_size=4, epochs=1, batch_size=4, val_episodes=1, threads=1)
    trainer = Trainer(cfg.replace(state_dropout=1.0), episodes, tmp_path)
    batch = trainer.train_set.batch(np.arange(4))
    moved = trainer.train_set.batch(np.arange(4))
    moved.states = moved.states + 0.5

    def loss(b, **kw):
        with torch.no_grad():
            return float(trainer._loss(b, torch.Generator().manual_seed(0), **kw)[0])

    assert loss(batch, train=True) == loss(moved, train=True)
    assert loss(batch) != loss(moved)  # validation: the recorded state
    trainer.cfg = cfg
    assert loss(batch, train=True) != loss(moved, train=True)
    with pytest.raises(Exception, match="state_dropout=0.5 needs the state input"):
        cfg.replace(state=False, state_dropout=0.5)


def test_background_batches_train_the_same_weights_as_the_loop(episodes, tmp_path):
    """Batches assembled ahead on threads (and a run stopped mid-epoch, which leaves some
    unused) give the numbers of the plain loop: each batch draws from its own step's generator."""
    cfg = TrainConfig(family="flow", size="tiny", chunk_size=4, epochs=2, batch_size=4, val_episodes=1, shift=4,
                      threads=1, checkpoint_every=0)  # fmt: skip
    weights = {}
    for threads in (0, 2):
        trainer = Trainer(cfg.replace(loader_threads=threads), episodes, tmp_path / f"t{threads}", progress=False)
        trainer.run()
        weights[threads] = trainer.model.state_dict()
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])
    stopped = Trainer(cfg.replace(loader_threads=2, max_steps=1), episodes, tmp_path / "stopped", progress=False)
    assert stopped.run().steps == 1


def test_train_cli_bundle_loads_passes_parity_and_resumes_exactly(demo_bag, tmp_path, capsys):
    from safetensors.torch import load_file

    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_policy

    common = ["train", "--family", "flow", "--size", "tiny", "--data", str(demo_bag), "--batch", "4",
              "--val-episodes", "1", "--chunk-size", "4", "--threads", "1", "--no-progress", "--save-dtype", "float32"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(common + ["--out", str(straight), "--epochs", "2"]) == 0
    assert main(common + ["--out", str(resumed), "--epochs", "1"]) == 0
    capsys.readouterr()
    assert main(common + ["--out", str(resumed), "--epochs", "2", "--resume"]) == 0
    # Extending the run changes the cosine schedule from the resume on, and says so; here the
    # default warm-up (300 steps) spans the whole tiny run, so the weights still match.
    assert "resuming with --epochs 2 (the checkpoint's run: 1)" in capsys.readouterr().err
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = (straight / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 2 and '"val_loss"' in log[0]
    first = json.loads(log[0])  # how long the loop waited for its batches, within the epoch's time
    assert 0.0 <= first["batch_wait_s"] <= first["seconds"]
    # An existing output is never overwritten without --resume.
    assert main(common + ["--out", str(straight), "--epochs", "1"]) == 2

    policy = load_policy(straight)  # parity gate on: the trained bundle passes it
    assert policy.parity_report.passed
    with BagReader(demo_bag) as bag:
        sample = next(iter(bag.samples()))
    chunk = policy.infer(sample.observation)
    assert chunk.actions.shape == (4, 14) and np.isfinite(chunk.actions).all()


def test_train_cli_image_grid_and_time_budget(demo_bag, tmp_path, capsys):
    """--image-size / --patch-size set the token grid and --conv-stem adds a stem to the tower (a
    bundle every path loads, parity gate passed); --max-minutes and --max-steps stop at a
    checkpoint that --resume continues."""
    from vla_accel_ros.models.factory import load_policy

    out = tmp_path / "grid"
    common = ["train", "--family", "flow", "--size", "tiny", "--data", str(demo_bag), "--batch", "4",
              "--val-episodes", "1", "--chunk-size", "4", "--threads", "1", "--no-progress", "--out", str(out),
              "--image-size", "112", "--patch-size", "28", "--conv-stem", "4,4", "--epochs", "2"]  # fmt: skip
    assert main(common + ["--max-minutes", "1e-6"]) == 0
    assert "stopped after 1e-06 min at step 1 of 6" in capsys.readouterr().err
    policy = load_policy(out)
    assert policy.spec.grid == 4 and policy.spec.image_size == 112 and policy.parity_report.passed
    assert policy.spec.vision["conv_stem"] == [4, 4] and policy.model.vis.vision.config.patch_size == 7
    assert main(common + ["--resume", "--max-steps", "3"]) == 0
    err = capsys.readouterr().err
    assert "resumed at step 1 of 6" in err and "stopped at --max-steps 3 at step 3 of 6" in err
    assert main(common + ["--resume"]) == 0
    assert "resumed at step 3 of 6" in capsys.readouterr().err


@pytest.mark.parametrize("shift", [0, 4])
def test_a_frozen_tower_keeps_its_weights_and_its_tokens_computed_once_give_the_loss_of_the_pixels(episodes, tmp_path, shift, capsys):
    """--freeze-vision: the tower and connector never change while the rest trains; without the
    shift each frame's tokens are computed once (no progress bar when progress is off, as
    --no-progress asks) and a batch carries them instead of frames, for the loss the frames would
    give; with the shift the frozen tower runs in every step."""
    cfg = TrainConfig(family="flow", size="tiny", chunk_size=4, epochs=2, batch_size=4, val_episodes=1, shift=shift,
                      threads=1, checkpoint_every=0, bf16=False)  # fmt: skip
    trainer = Trainer(cfg.replace(freeze_vision=True), episodes, tmp_path, progress=False)
    assert "image tokens" not in capsys.readouterr().err
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batch = trainer.train_set.batch(np.arange(4))
    assert (batch.image_tokens is not None and batch.frames is None) == (shift == 0)
    if shift == 0:
        pixels = Trainer(cfg, episodes, tmp_path / "pixels")  # the same init (the seed's): tokens from the frames
        gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
        with torch.no_grad():
            via_tokens = float(trainer._loss(batch, gen())[0])
            via_frames = float(pixels._loss(pixels.train_set.batch(np.arange(4)), gen())[0])
        assert via_tokens == pytest.approx(via_frames, rel=1e-5)
        with pytest.raises(Exception, match="cannot be shifted"):
            trainer.train_set.batch(np.arange(4), shift=2)
    trainer.run()
    end = trainer.model.state_dict()
    vision = [k for k in end if k.startswith("vis.")]
    assert vision and all(torch.equal(start[k], end[k]) for k in vision)
    assert not all(torch.equal(start[k], end[k]) for k in end if not k.startswith("vis."))
    assert trainer.validate() is not None


def test_a_smolvla_trains_here_without_the_state_and_loads_as_lerobots_architecture(tmp_path, capsys):
    """``--family smolvla``: two cameras read at their own size and padded as LeRobot pads them
    (read by two processes), its own tokenizer written into the bundle, a schedule sized by
    --fit-minutes; without the state the projection stays zero, so the chunk is the same
    whatever the state; the bundle passes the parity gate. With the state it learns from it, also
    from a stateless bundle (--init-from) with --state-dropout.
    --keep-every keeps each step's weights as a bundle of their own, the tokenizer included."""
    from safetensors.torch import load_file

    from vla_accel_ros.core.bundle import read_spec
    from vla_accel_ros.io.bag_reader import BagReader
    from vla_accel_ros.models.factory import load_policy

    bags = [tmp_path / "a", tmp_path / "b"]
    for i, bag in enumerate(bags):
        assert main(["sim", "record", "--task", "transfer_cube", "--episodes", "1", "--steps", "8", "--seed", str(i),
                     "--cameras", "top,left_wrist", "--height", "96", "--width", "128", "--out", str(bag)]) == 0  # fmt: skip
    common = ["train", "--family", "smolvla", "--size", "tiny", "--data", *map(str, bags), "--cameras",
              "cam_high,cam_left_wrist", "--batch", "4", "--val-episodes", "1", "--chunk-size", "4", "--threads", "1",
              "--read-workers", "2", "--no-progress", "--save-dtype", "float32", "--epochs", "50"]  # fmt: skip
    blind, seeing = tmp_path / "blind", tmp_path / "seeing"
    assert main(common + ["--out", str(blind), "--no-state", "--fit-minutes", "1e-3"]) == 0
    err = capsys.readouterr().err
    assert "--fit-minutes 0.001: " in err  # the probe's steps, then the fitted end
    assert "of the 0.001 minutes" in err  # and how much of the window reading took
    assert (blind / "tokenizer" / "tokenizer.json").is_file()
    assert main(common + ["--out", str(seeing), "--max-steps", "2", "--keep-every", "1"]) == 0
    # A bundle trained without the state takes it on: its zero projection trains from the start.
    taught = tmp_path / "taught"
    assert main(common + ["--out", str(taught), "--max-steps", "2", "--init-from", str(blind), "--state-dropout", "0.5"]) == 0
    # --init-norm: the start's statistics, not the data's (here made unlike the data's on purpose).
    start = tmp_path / "start"
    shutil.copytree(blind, start)
    raw = json.loads((start / "config.json").read_text())
    raw["norm_stats"]["action"]["mean"] = [m + 0.5 for m in raw["norm_stats"]["action"]["mean"]]
    (start / "config.json").write_text(json.dumps(raw))
    kept_norm = tmp_path / "kept_norm"
    assert main(common + ["--out", str(kept_norm), "--max-steps", "1", "--no-state", "--init-from", str(start), "--init-norm"]) == 0
    assert read_spec(kept_norm).norm_stats == raw["norm_stats"] != read_spec(blind).norm_stats
    with pytest.raises(Exception, match="init_norm=True takes the statistics of the init_from bundle, and init_from is ''"):
        TrainConfig(family="smolvla", init_norm=True)
    # A start the loader's shape rule refuses (a coarser token grid reshapes the connector) leaves
    # --out as it found it, so the corrected command reruns there.
    coarse = tmp_path / "coarse"
    capsys.readouterr()
    assert main(common + ["--out", str(coarse), "--no-state", "--init-from", str(blind), "--patch-size", "64"]) == 2
    assert re.search(r"vis\.connector\.\S+ has shape", capsys.readouterr().err)
    assert coarse.is_dir() and not any(coarse.iterdir())
    assert main(common + ["--out", str(coarse), "--no-state", "--patch-size", "64", "--max-steps", "1"]) == 0
    kept = sorted(p.name for p in (seeing / "steps").iterdir())
    assert kept == ["0000001", "0000002"]
    assert (seeing / "steps" / "0000001" / "tokenizer" / "tokenizer.json").is_file()
    last, one = (load_file(str(seeing / d / "model.safetensors")) for d in ("steps/0000002", "steps/0000001"))
    final = load_file(str(seeing / "model.safetensors"))
    assert all(torch.equal(final[k], last[k]) for k in final) and not all(torch.equal(final[k], one[k]) for k in final)
    with BagReader(bags[0]) as bag:
        obs = next(iter(bag.samples())).observation
    moved = type(obs)(**{**obs.__dict__, "state": np.asarray(obs.state) + 0.3})
    for out, state_matters in ((blind, False), (seeing, True), (seeing / "steps" / "0000001", True), (taught, True)):
        policy = load_policy(out)  # the start-up gate on the trained bundle
        assert policy.spec.image_resize == "pad" and policy.spec.tokenizer == "bundle" and policy.parity_report.passed
        nonzero = torch.count_nonzero(policy.model.state_proj.weight).item()
        assert nonzero > 0 if state_matters else nonzero == 0
        noise = np.zeros(policy.noise_shape, np.float32)
        same = np.array_equal(policy.infer(obs, noise=noise).actions, policy.infer(moved, noise=noise).actions)
        assert same != state_matters
    with pytest.raises(Exception, match="conv_stem: a smolvla policy keeps"):
        TrainConfig(family="smolvla", conv_stem=(4,))
    with pytest.raises(Exception, match="patch_size=40 must be a multiple of SmolVLM's 16 px patches"):
        TrainConfig(family="smolvla", image_size=400, patch_size=40)
    big = TrainConfig(family="smolvla", size="mini", image_size=512, patch_size=64).frame_rule()
    assert big == (512, "pad")


def _marker_bag(path, markers: dict[int, int], ticks: int = 6):
    """A small bag: a frame, both joint states and an action per 20 ms tick; ``markers``: tick
    -> episode index announced there (with an instruction)."""
    from vla_accel_ros.core.robot.topics import TopicLayout
    from vla_accel_ros.io.bag_file import ACTION_NAMES, ARM_JOINTS
    from vla_accel_ros.io.bag_writer import BagWriter

    lay = TopicLayout()
    with BagWriter(path) as w:
        for k in range(ticks):
            s = 1_000_000_000 + k * 20_000_000
            if k in markers:
                w.write_int32(lay.episode_topic, s, markers[k])
                w.write_string(lay.instruction_topic, s, "do it")
            w.write_image(lay.image_topic("cam_high"), s, np.full((8, 8, 3), k, np.uint8))
            for t in lay.joint_state_topics:
                w.write_joint_state(t, s, ARM_JOINTS + ("left_finger",), np.full(8, k * 0.01))
            w.write_joint_state(lay.action_topic, s, ACTION_NAMES, np.full(14, float(k)))
    return path


@pytest.mark.parametrize("markers", [{0: 0, 3: 0}, {0: 0, 3: 1}], ids=["repeated index", "two"])
def test_every_episode_marker_starts_an_episode_and_targets_stay_inside_it(tmp_path, markers):
    """A marker that repeats the previous index (a restarted simulator) still splits: the last
    frame's chunk target never reaches into the next episode's actions (padded and masked)."""
    from vla_accel_ros.train.data import ChunkDataset, read_episodes

    bag = _marker_bag(tmp_path / "bag", markers)
    eps = read_episodes([bag], ("cam_high",), 8, progress=False)
    assert [len(e.actions) for e in eps] == [3, 3]
    batch = ChunkDataset(eps, chunk_size=3).batch(np.array([2]))  # the first episode's last frame
    assert batch.actions[0, 0, 0] == 2.0 and batch.valid[0].tolist() == [True, False, False]
