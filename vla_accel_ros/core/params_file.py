"""ROS 2 parameter files without ROS: read the way rcl reads them.

``config/aloha.yaml`` is the graph's source of truth; the launch file and ``vla-accel bringup``
(``ros/graph.py``) hand each node its section, and the closed-loop evaluation builds the same
controller, camera and policy-node configs from the same file.
"""

from __future__ import annotations

import dataclasses
import os
import re
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


def flatten_parameters(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as dotted names (``{'a': {'b': 1}}`` -> ``{'a.b': 1}``), as ROS names them."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten_parameters(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def node_parameters(params: Mapping[str, Any], node: str, namespace: str = "") -> dict[str, Any]:
    """Dotted parameters the node ``node`` in ``namespace`` gets from a ROS 2 parameter file, by
    rcl's rule: every section whose node name matches the node's fully qualified name applies,
    in file order (a later one wins). A name without a leading ``/`` is absolute all the same
    (``camera_node`` is ``/camera_node``: not a node in ``/r1``); ``/*`` matches one namespace
    token and ``/**`` any number, so ``/**/camera_node`` applies in every namespace and ``/**``
    to every node. Nested namespace keys (``r1: {camera_node: {ros__parameters: ...}}``) count."""
    fqn = fully_qualified_name(node, namespace)
    out: dict[str, Any] = {}
    for name, section in sections(params):
        if name_matches(name, fqn):
            out.update(flatten_parameters(section))
    return out


def fully_qualified_name(node: str, namespace: str = "") -> str:
    ns = namespace.strip("/")
    return f"/{ns}/{node}" if ns else f"/{node}"


def sections(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Mapping[str, Any]]]:
    """(node name, its ``ros__parameters``) of every section, in file order, names as rcl
    reads them (with a leading ``/``)."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in params.items():
        name = f"{prefix}/{str(key).strip('/')}"
        if not isinstance(value, Mapping):
            continue
        if "ros__parameters" in value:
            out.append((name, value["ros__parameters"] or {}))
        else:
            out += sections(value, name)
    return out


def name_matches(pattern: str, fqn: str) -> bool:
    """Whether a parameter file's node name (``/**``, ``/**/node``, ``/*/node``, ``/ns/node``)
    applies to the node ``fqn`` (``/ns/node``), as rcl decides."""
    rx = "".join(
        "(/[^/]+)*" if token == "**" else "/[^/]+" if token == "*" else "/" + re.escape(token)
        for token in pattern.strip("/").split("/")
    )
    return re.fullmatch(rx, fqn) is not None


def unmatched_sections(params: Mapping[str, Any], node: str, namespace: str = "") -> list[str]:
    """Sections that name ``node`` but do not apply to it in ``namespace`` (``camera_node:`` for
    ``/r1/camera_node``): rcl ignores them without a word."""
    fqn = fully_qualified_name(node, namespace)
    return [name for name, _ in sections(params) if name.rsplit("/", 1)[-1] == node and not name_matches(name, fqn)]


def node_section(params: dict[str, Any], node: str) -> dict[str, Any]:
    """The ``ros__parameters`` of ``node``'s own section of a parameter file (``/**/node``, as
    ``config/aloha.yaml`` names it, or a plain ``node`` / ``/node``), added as ``/**/node`` when
    there is none: for programs and tests that change a node's values in a copy of a file."""
    for key in (f"/**/{node}", node, f"/{node}"):
        if isinstance(params.get(key), dict):
            return params[key].setdefault("ros__parameters", {})
    return params.setdefault(f"/**/{node}", {}).setdefault("ros__parameters", {})


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
