"""The one LeRobot checkpoint reader (models/lerobot/): the normalization modes as LeRobot reads
them, the typed import options of each family (an option a family does not take is refused by
name, in the library and in ``vla-accel bundle import``), and importers that share the reader
instead of each other's helpers."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.models.lerobot.reader import Checkpoint
from vla_accel_ros.models.pi05.configuration_pi05 import Pi05Options
from vla_accel_ros.models.pi0.configuration_pi0 import Pi0Options
from vla_accel_ros.models.smolvla.configuration_smolvla import SmolVLAOptions

ROOT = Path(__file__).resolve().parents[1]
SMOLVLA_POLICY = ROOT / "test" / "fixtures" / "smolvla" / "self_attn_one_camera" / "policy"


def _checkpoint(tmp_path: Path, family: str, options_class, **cfg) -> Checkpoint:
    policy = tmp_path / "policy"
    policy.mkdir(parents=True)
    (policy / "config.json").write_text(json.dumps({"type": family, **cfg}))
    return Checkpoint(policy, tmp_path / "out", family, options_class)


@pytest.mark.parametrize(
    "family, options_class, default", [("smolvla", SmolVLAOptions, "MEAN_STD"), ("pi0", Pi0Options, "MEAN_STD"), ("pi05", Pi05Options, "QUANTILES")]
)  # fmt: skip
def test_normalization_modes_are_read_as_lerobot_reads_them(tmp_path, family, options_class, default):
    """No mapping: the family's LeRobot config default; a mapping without the feature type: IDENTITY
    (LeRobot's normalizer's rule); a mode LeRobot does not have: refused by name."""
    ckpt = _checkpoint(tmp_path / "a", family, options_class)
    assert (ckpt.norm_mode("VISUAL"), ckpt.norm_mode("STATE"), ckpt.norm_mode("ACTION")) == ("IDENTITY", default, default)
    ckpt = _checkpoint(tmp_path / "b", family, options_class, normalization_mapping={"STATE": "MIN_MAX"})
    assert (ckpt.norm_mode("STATE"), ckpt.norm_mode("ACTION")) == ("MIN_MAX", "IDENTITY")
    ckpt = _checkpoint(tmp_path / "c", family, options_class, normalization_mapping={"ACTION": "LOG"})
    with pytest.raises(ConfigError, match="normalization_mapping.ACTION='LOG' is not a LeRobot normalization mode"):
        ckpt.norm_mode("ACTION")


@pytest.mark.parametrize(
    "options_class, family, option, value, takes",
    [
        (SmolVLAOptions, "smolvla", "vision_heads", 4, "vlm (--vlm)"),
        (SmolVLAOptions, "smolvla", "tokenizer", "/tmp/tok", "vlm (--vlm)"),
        (Pi0Options, "pi0", "vlm", "/tmp/vlm", "vision_heads (--vision-heads)"),
        (Pi05Options, "pi05", "vlm", "/tmp/vlm", "tokenizer (--tokenizer)"),
    ],
)
def test_an_import_option_the_family_does_not_take_is_refused_by_name(options_class, family, option, value, takes):
    with pytest.raises(ConfigError, match=rf"import option {option} \(--{option.replace('_', '-')}\) does not apply to "
                       rf"{family} checkpoints; {family} imports take: .*{re.escape(takes)}"):  # fmt: skip
        options_class.import_options.parse(family, {option: value})
    # Not given (None, as the CLI passes an unset flag) is no option at all; paths become strings.
    opts = options_class.import_options.parse(family, {option: None, "name": Path("n"), "fps": 25})
    assert (opts.name, opts.fps, opts.dt()) == ("n", 25.0, 0.04)


def test_the_cli_refuses_vision_heads_for_a_smolvla_checkpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vla_accel_ros.cli", "bundle", "import", "--lerobot", str(SMOLVLA_POLICY),
         "--out", str(tmp_path / "b"), "--vision-heads", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "import option vision_heads (--vision-heads) does not apply to smolvla checkpoints" in proc.stderr
    assert "vlm (--vlm)" in proc.stderr and not (tmp_path / "b").exists()


def test_no_family_importer_imports_another_family():
    """The importers share models/lerobot/ and never another family's module (private or not)."""
    families = ("smolvla", "pi0", "pi05")
    bad = []
    for fam in families:
        path = ROOT / "vla_accel_ros" / "models" / fam / "lerobot_import.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["vla_accel_ros", "models"] and len(parts) > 2 and parts[2] in families and parts[2] != fam:
                    bad.append(f"{fam}: {node.module}")
    assert not bad, bad

