"""ROS 2 parameter files without ROS: read the way rcl reads them.

``config/aloha.yaml`` is the graph's source of truth; the launch file and ``vla-accel bringup``
(``ros/graph.py``) hand each node its section, and the closed-loop evaluation builds the same
controller, camera and policy-node configs from the same file.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

PACKAGE = "vla_accel_ros"
C = TypeVar("C")


def find_shared(relative: str) -> Path:
    """A file or directory the package ships beside its code (``config/aloha.yaml``,
    ``models/<bundle>``): from the source tree, an ament share directory (colcon install
    space) or the Python environment's ``share/vla_accel_ros``."""
    here = Path(__file__).resolve()
    candidates = [here.parents[2] / relative]  # the source tree
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory  # noqa: PLC0415

        try:
            candidates.append(Path(get_package_share_directory(PACKAGE)) / relative)
        except (PackageNotFoundError, OSError, ValueError):  # OSError: no AMENT_PREFIX_PATH (a plain venv)
            pass
    except ImportError:
        pass
    prefix = Path(os.environ.get("VIRTUAL_ENV") or sys.prefix)
    candidates.append(prefix / "share" / PACKAGE / relative)
    for c in candidates:
        if c.exists():
            return c
    raise FileNotFoundError(f"{relative} not found (looked in {', '.join(map(str, candidates))})")


def default_params_file() -> Path:
    """``config/aloha.yaml``: from the install's share directory, else the source tree."""
    return find_shared("config/aloha.yaml")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def node_parameters(params: Mapping[str, Any], node: str, namespace: str = "") -> dict[str, Any]:
    """Dotted parameters a node named ``node`` in ``namespace`` gets from a ROS 2 parameter
    file (``/**``, ``/**/node``, ``node``, ``/ns/node`` sections; later, more specific ones win)."""
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    full = f"{ns}/{node}"
    keys = ["/**", f"/**/{node}", node, f"/{node}" if ns else None, full.lstrip("/"), full]
    out: dict[str, Any] = {}
    for key in keys:
        if key is None or key not in params:
            continue
        section = params[key] or {}
        out.update(_flatten(section.get("ros__parameters", {}) or {}))
    return out


def load_params(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a ROS 2 parameter file is a mapping of node names")
    return data




def node_config(params: Mapping[str, Any], node: str, cls: type[C], namespace: str = "") -> C:
    """The node's section as a validated config of type ``cls``; keys the config does not have
    (the ``/**`` section holds every node's shared keys) are left out."""
    from vla_accel_ros.core.config import unflatten

    values = unflatten(node_parameters(params, node, namespace))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls.from_dict({k: v for k, v in values.items() if k in names})
