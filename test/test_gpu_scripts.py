"""scripts/gpu_record_train.sh, the one command a borrowed GPU machine runs, dry on this CPU:
the same script with the recipe's own training flags (against the shipped SmolVLA bundle it
starts from), only smaller, through recording, training, keeping steps and packing; and
scripts/gpu_eval.sh, the closed loop of several bundles on that machine's cores."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PART_LIMIT = 16 * 2**20  # what one returned file may hold
FILE_LIMIT = 8  # how many files may come back


@pytest.mark.slow  # two minutes: run it (pytest -m slow test/test_gpu_scripts.py) before a device call
def test_the_gpu_script_records_trains_from_the_shipped_bundle_and_packs_what_comes_back(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(out), "WORKDIR": str(work),
        "PROCS": "1", "RECORD_S": "1", "EPISODES_PER_BAG": "1", "STEPS": "16", "VAL_EPISODES": "1", "DEVICE": "cpu",
        "SCENES": "3", "SCENE_STEPS": "20", "DEVICE_FRAMES_GIB": "1", "DEADLINE_S": "400", "TRAIN_EXTRA": "--batch 2 --max-steps 2 --keep-every 1 --checkpoint-every 1 --threads 2 "
        "--loader-threads 0",
    }  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_record_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    log = (out / "run.log").read_text() if (out / "run.log").is_file() else ""
    assert run.returncode == 0, run.stdout + run.stderr + log[-3000:]
    assert "recorded: 1 training bags of 1 episodes (command noise 0.02 rad held 25 ticks), 0 of them detours (10,45), validation bag: yes" in run.stdout
    assert "tick-0 scenes: 3 (of SCENES=3), 20 actions each" in run.stdout
    # Trained on beside the whole episode: 4 episodes, of which the scenes add one frame each.
    assert re.search(r"\b7 training samples \(4 episodes\)", log), log[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= FILE_LIMIT, files
    assert all(p.stat().st_size <= PART_LIMIT for p in out.iterdir())
    assert {"run.log", "summary.txt"} <= set(files)
    for name in ("final", "step_a", "step_b"):
        parts = sorted(out.glob(f"{name}.tar.*"))
        assert len(parts) == 2, files  # a SmolVLA bundle is ~18 MB: cut in two
        dest = tmp_path / "back" / name
        dest.mkdir(parents=True)
        subprocess.run(f"cat {' '.join(map(str, parts))} | tar -xf - -C {dest}", shell=True, check=True)
        assert not (dest / "checkpoint").exists() and not (dest / "steps").exists()

    from vla_accel_ros.core.bundle import load_bundle

    final, shipped = load_bundle(tmp_path / "back" / "final"), load_bundle(ROOT / "bundles" / "transfer_cube-smolvla")
    assert final.spec.family == "smolvla" and final.spec.cameras == shipped.spec.cameras
    assert final.state_dict.keys() == shipped.state_dict.keys()
    assert final.spec.norm_stats == shipped.spec.norm_stats  # INIT_NORM=1: the start's, not the new data's
    # It trained from the shipped weights: two steps move them a little, not to a new init.
    name = next(k for k, v in shipped.state_dict.items() if v.ndim == 2 and "vision" in k)
    diff = (final.state_dict[name].float() - shipped.state_dict[name].float()).abs().max().item()
    assert 0 < diff < 0.05, diff
    kept = sorted(p.name for p in (work / "run" / "steps").iterdir())
    assert kept == ["0000001", "0000002"], kept
    summary = (out / "summary.txt").read_text()
    assert "train status 0" in summary and '"steps": 2' in summary, summary
    assert re.search(r"^frames: [0-9.]+ GiB unpacked onto cpu", summary, re.M), summary  # the GPU run's frame store


def test_a_failing_probe_recording_stops_the_script_before_the_recorders_start(tmp_path):
    env = {**os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(tmp_path / "out"),
           "WORKDIR": str(tmp_path / "work"), "TASK": "no_such_task"}  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_record_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 1
    assert "FAILED: a one-episode probe recording failed" in run.stdout
    assert not (tmp_path / "work" / "data").exists() or not any((tmp_path / "work" / "data").iterdir())


def test_a_trainer_that_cannot_start_stops_the_recorders_and_the_script(tmp_path):
    """The training smoke on the probe bag (here: an initial bundle that is not there) ends the
    call in about a minute, the recorders stopped, before any training on their bags."""
    env = {
        **os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(tmp_path / "out"),
        "WORKDIR": str(tmp_path / "work"), "PROCS": "1", "RECORD_S": "300", "EPISODES_PER_BAG": "1", "STEPS": "16",
        "VAL_EPISODES": "1", "DEVICE": "cpu", "INIT_FROM": str(tmp_path / "no_bundle"),
    }  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_record_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=200)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED: one training step on the probe recording failed" in run.stdout
    assert "no_bundle" in run.stdout  # the trainer's own error reaches the output that comes back
    assert "training for" not in run.stdout
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == "failed: training smoke"


def test_no_bag_kind_to_record_is_refused_before_anything_starts(tmp_path):
    env = {**os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(tmp_path / "out"),
           "WORKDIR": str(tmp_path / "work"), "WHOLE": "0", "DETOURS": "0"}  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_record_train.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert "WHOLE=0 DETOURS=0" in run.stderr and "at least one must be above 0" in run.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("name", ["gym-aloha", "dm-control", "mujoco", "gymnasium", "rosbags", "lz4", "transformers"])
def test_what_the_carry_script_pins_is_pinned_in_the_requirements(name):
    script = (ROOT / "scripts" / "gpu_carry.sh").read_text()
    assert re.search(rf"PINNED=\([^)]*\b{re.escape(name)}\b", script)
    reqs = "\n".join(p.read_text() for p in ROOT.glob("requirements*.txt"))
    assert re.search(rf"(?im)^{re.escape(name)}==\S+", reqs), name


def test_the_gpu_eval_script_judges_bundles_on_the_same_seeds_and_packs_the_reports(tmp_path):
    """Two bundles x two noise scales x two one-episode slices on two processes: every slice's
    report comes back in one archive, and the paired table (the first bundle at the first noise
    scale the reference) is in the summary."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "bundles" / "transfer_cube-smolvla", other)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(out), "WORKDIR": str(work),
        "BUNDLES": f"bundles/transfer_cube-smolvla {other}", "EPISODES": "2", "SLICE": "1", "STEPS": "10", "PROCS": "2",
        "DEADLINE_S": "300", "SLICE_S": "60", "FIRST_DEMOS": "3",
    }  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_eval.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["evals.tar.gz", "run_eval.log", "summary.txt"]
    with tarfile.open(out / "evals.tar.gz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith("report.json"))
    other_name = re.sub(r"[^A-Za-z0-9._-]", "_", str(other))
    evaluations = [f"{b}_n{n}" for b in ("bundles_transfer_cube-smolvla", other_name) for n in (0, 1)]
    firsts = sorted(f"./first/first_{b}/report.json" for b in ("bundles_transfer_cube-smolvla", other_name))
    assert names == sorted([*firsts, *(f"./{e}/{s}/report.json" for e in evaluations for s in (95000, 95001))])
    with tarfile.open(out / "evals.tar.gz") as tar:  # each evaluation ran at its own noise scale
        for e in evaluations:
            report = json.load(tar.extractfile(f"./{e}/95000/report.json"))
            assert report["modes"]["baseline"]["policy_config"]["flow_noise_scale"] == float(e[-1]), e
    summary = (out / "summary.txt").read_text()
    assert all(f"{e}: 2 slices" in summary for e in evaluations)
    assert "against bundles_transfer_cube-smolvla_n0:baseline, seed by seed" in summary  # the paired table
    assert "by where the object started (y)" in summary
    for b in ("bundles_transfer_cube-smolvla", other_name):  # each bundle's first chunks at tick 0, once
        assert re.search(rf"^{re.escape(b)}: first chunks at tick 0 of 3 demonstrations \(noise 0\): slope ", summary, re.M), summary


def test_the_gpu_eval_script_names_a_missing_bundle_and_starts_no_slice_past_its_deadline(tmp_path):
    env = {**os.environ, "PY": sys.executable, "CARRY": str(tmp_path / "none"), "OUTDIR": str(tmp_path / "out"),
           "WORKDIR": str(tmp_path / "work"), "BUNDLES": f"bundles/transfer_cube-smolvla {tmp_path / 'gone'}"}  # fmt: skip
    run = subprocess.run(["bash", "scripts/gpu_eval.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"BUNDLES names {tmp_path / 'gone'}, which is not a bundle" in run.stdout
    env.update(BUNDLES="bundles/transfer_cube-smolvla", DEADLINE_S="30", SLICE_S="60")
    run = subprocess.run(["bash", "scripts/gpu_eval.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "FAILED: no slice wrote a report" in run.stdout
    assert "not started (deadline)" in (tmp_path / "out" / "run_eval.log").read_text()
