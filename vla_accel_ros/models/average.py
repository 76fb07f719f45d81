"""Weight averages of bundles of one architecture ("model soups"; WiSE-FT's interpolation between
a policy and one fine-tuned from it): ``vla-accel bundle average``.

Two runs that start from the same weights stay close enough that their weighted average is a
policy too, and it can keep what each does well: on transfer_cube the shipped SmolVLA bundle
(which hands the cube over) averaged with a run trained on from it (whose vision tower finds the
cube again) succeeds more often than either (docs/policy-experiments.md). Bundles trained apart
(different initializations) have no such path between them; the average is then not a policy,
and only the closed loop can say which case a pair is.
"""

from __future__ import annotations

import filecmp
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from vla_accel_ros.core.bundle import TOKENIZER_DIR, BundleSpec, save_bundle
from vla_accel_ros.core.errors import BundleError, ConfigError
from vla_accel_ros.models.factory import check_weights, load_bundle

# What the average takes from the first bundle instead of requiring it equal: its name and how it
# runs (the noise it samples at, the Euler steps it integrates in: a shipped bundle may run other
# settings than `vla-accel train` writes into a run trained on from it), not what it is. Everything
# else in config.json must match.
FIRST_BUNDLE_FIELDS = ("name", "noise_scale", "num_steps")


def average_bundles(paths: list[str | Path], out: str | Path, weights: list[float] | None = None) -> Path:
    """Write ``sum_i weights[i] * bundle_i`` to ``out`` (never overwritten): every tensor averaged
    in float32 and saved in the first bundle's dtype, the normalization statistics averaged with
    the same weights, config and tokenizer otherwise the first bundle's. ``weights`` default to
    uniform; they must be >= 0 and sum to 1."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {out}: exists already; bundles are never overwritten (choose another --out)")
    if len(paths) < 2:
        raise ConfigError(f"--bundle: give two bundles or more to average (got {len(paths)})")
    weights = [1.0 / len(paths)] * len(paths) if weights is None else [float(w) for w in weights]
    if len(weights) != len(paths):
        raise ConfigError(f"--weights {','.join(map(str, weights))}: {len(weights)} weights for {len(paths)} bundles")
    if any(not math.isfinite(w) or w < 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise ConfigError(f"--weights {','.join(f'{w:g}' for w in weights)}: each must be >= 0 and they must sum to 1")
    bundles = [load_bundle(p) for p in paths]
    for b in bundles:  # the loader's rule: with the configs equal below, names and shapes then match too
        check_weights(b.path, b.spec, {k: (tuple(v.shape), v.is_floating_point()) for k, v in b.state_dict.items()})
    first = bundles[0]
    reference = _comparable(first.spec)
    for b in bundles[1:]:
        other = _comparable(b.spec)
        differ = sorted(k for k in reference.keys() | other.keys() if reference.get(k) != other.get(k))
        if differ:
            k = differ[0]
            raise BundleError(f"{b.path}: config.json differs from {first.path}'s in {', '.join(differ)} "
                              f"({k}: {other.get(k)!r} against {reference.get(k)!r}); only bundles of one "
                              f"architecture and data layout average")  # fmt: skip
        _same_tokenizer(first.path, b.path)
    state = {}
    for k, v in first.state_dict.items():
        acc = torch.zeros(v.shape, dtype=torch.float32)
        for w, b in zip(weights, bundles):
            acc += w * b.state_dict[k].to(torch.float32)
        state[k] = acc.to(v.dtype)
    spec = first.spec.replace(norm_stats=_average_stats([b.spec.norm_stats for b in bundles], weights))
    if (first.path / TOKENIZER_DIR).is_dir():
        shutil.copytree(first.path / TOKENIZER_DIR, out / TOKENIZER_DIR)
    return save_bundle(out, spec, state)


def _comparable(spec: BundleSpec) -> dict:
    d = spec.to_dict()
    for k in (*FIRST_BUNDLE_FIELDS, "norm_stats"):
        d.pop(k, None)
    return d


def _average_stats(stats: list[dict], weights: list[float]) -> dict:
    """Each statistic (mean, std, quantiles) averaged with the bundles' weights: the output layer
    of an averaged model maps to averaged units. Runs fine-tuned from one bundle on similar data
    have close statistics, so this is the small part of the average."""
    out: dict = {}
    for key, first in stats[0].items():
        out[key] = {}
        for name in first:
            try:
                arrays = [np.asarray(s[key][name], dtype=np.float64) for s in stats]
            except KeyError as e:
                raise BundleError(f"norm_stats.{key}.{name}: not in every bundle ({e})") from None
            out[key][name] = sum(w * a for w, a in zip(weights, arrays)).tolist()
    return out


def _same_tokenizer(a: Path, b: Path) -> None:
    ta, tb = a / TOKENIZER_DIR, b / TOKENIZER_DIR
    if ta.is_dir() != tb.is_dir():
        raise BundleError(f"{b}: one of {a} and {b} has its own {TOKENIZER_DIR}/, the other not")
    if ta.is_dir():
        cmp = filecmp.dircmp(ta, tb)
        if cmp.left_only or cmp.right_only or filecmp.cmpfiles(ta, tb, cmp.common_files, shallow=False)[1:] != ([], []):
            raise BundleError(f"{b}: its {TOKENIZER_DIR}/ differs from {a}'s; an average keeps one tokenizer")
