"""Options and argument checks several commands share: the ``FIELD=VALUE`` overrides of a
config (``--cache``, ``--prune``, ``--precision``, ...) and the check of an output path.

The command modules import these from here and never from one another, so no command module
depends on another (``test/test_import_graph.py`` holds the package to no import cycle)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vla_accel_ros.core.errors import ConfigError

# flag -> (the config class it overrides a field of, the modes it applies to, an example)
OVERRIDES: dict[str, tuple[str, str, str]] = {
    "cache": ("CacheConfig", "every cache mode", "sim_threshold=0.99"),
    "prune": ("PruneConfig", "every pruning mode", "keep_global=48"),
    "precision": ("PrecisionConfig", "every @precision mode", "gate_ar_min_identical_tokens=0.9"),
}


def add_override_flags(parser: argparse.ArgumentParser, *names: str, applies_to: str = "") -> None:
    """``--NAME FIELD=VALUE`` (repeatable) for each of ``names`` (keys of :data:`OVERRIDES`);
    ``applies_to`` replaces the default "every ... mode" in the help (e.g. "every preset")."""
    for name in names:
        config, where, example = OVERRIDES[name]
        parser.add_argument(
            f"--{name}", action="append", default=[], metavar="FIELD=VALUE",
            help=f"override a {config} field in {applies_to or where} (repeatable), e.g. --{name} {example}",
        )  # fmt: skip


def parse_overrides(items: list[str], flag: str = "--cache") -> dict:
    """``FIELD=VALUE`` strings -> a dict; values are JSON when they parse (numbers, lists,
    booleans), plain strings otherwise. The config they go to validates them."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects FIELD=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def overrides(args: argparse.Namespace, name: str) -> dict:
    """The parsed ``--NAME FIELD=VALUE`` items of a command's arguments."""
    return parse_overrides(getattr(args, name), f"--{name}")


def check_output(path: Path | None, flag: str = "--json") -> None:
    """Fail before a long run whose result could not be written."""
    if path is not None and not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist")
