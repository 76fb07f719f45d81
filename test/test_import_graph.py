"""No import cycle among the package's modules, proved on the import graph read with ``ast``.

Every import counts, the lazy ones inside functions too: a cycle of lazy imports still makes two
modules one unit that neither can be read, tested or moved without the other. Names a registry
imports by string (``importlib.import_module`` over ``cli.COMMANDS``, ``models.family``) are looked
up when called, after every module involved is loaded, and are not edges here.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "vla_accel_ros"
PKG = SRC.name


def _modules() -> dict[str, Path]:
    """Module name -> source file (a package by its ``__init__.py``)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports: ``from a import b`` is module ``a.b`` when that is
    a module, else ``a``; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert len(graph) > 100
    # a lazy import inside a function (cli commands import their work only when run)
    assert "vla_accel_ros.bench.replay" in graph["vla_accel_ros.cli.replay_cmd"]
    # a relative import (the kernels' package registers its reference set)
    assert "vla_accel_ros.kernels.reference" in graph["vla_accel_ros.kernels"]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "modules that import one another (move what they share into a module of its own):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
