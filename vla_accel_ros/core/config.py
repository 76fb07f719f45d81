"""One source of truth for configuration: frozen dataclasses validated on construction.

Every knob is declared with :func:`param`, which records its documentation, its allowed
range or choices and whether it may change at run time. The YAML files and the ROS
parameters mirror these declarations (the ROS layer declares one parameter per field, with
the same range, and validates a change by building a new config), so a value is checked in
exactly one place.

Example::

    @dataclass(frozen=True)
    class CacheConfig(Config):
        sim_threshold: float = param(0.996, doc="patch cosine similarity to reuse", range=(0.0, 1.0))

    CacheConfig(sim_threshold=1.5)
    # ConfigError: CacheConfig.sim_threshold=1.5 is out of range [0.0, 1.0] (patch cosine ...)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

from vla_accel_ros.core.errors import ConfigError

C = TypeVar("C", bound="Config")

_META_KEY = "vla_accel_ros"


@dataclass(frozen=True)
class ParamSpec:
    """What the config layer knows about one field; the ROS layer builds descriptors from it."""

    name: str
    type: Any
    default: Any
    doc: str
    range: tuple[float, float] | None
    choices: tuple[Any, ...] | None
    read_only: bool


def param(
    default: Any,
    *,
    doc: str,
    range: tuple[float, float] | None = None,  # noqa: A002 - the natural name for users
    choices: tuple[Any, ...] | None = None,
    read_only: bool = False,
) -> Any:
    """Declare a config field. ``range`` is inclusive; ``read_only`` marks shape-changing values."""
    meta = {_META_KEY: {"doc": doc, "range": range, "choices": choices, "read_only": read_only}}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults so configs stay immutable")
    return dataclasses.field(default=default, metadata=meta)


def _is_config_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Config)


def _tuple_item_type(tp: Any) -> Any | None:
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
    return None


def _optional_inner(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _coerce(owner: str, name: str, tp: Any, value: Any) -> Any:
    """Convert YAML/ROS-friendly values to the declared type, or raise a ConfigError."""
    where = f"{owner}.{name}"
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _coerce(owner, name, inner, value)
    if _is_config_type(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return tp.from_dict(value)
        raise ConfigError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
    item = _tuple_item_type(tp)
    if item is not None:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ConfigError(f"{where} must be a list of {item.__name__}, got {value!r}")
        return tuple(_coerce(owner, name, item, v) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value


@dataclass(frozen=True)
class Config:
    """Base class: validates every field against its :func:`param` declaration."""

    _hints_cache: ClassVar[dict[type, dict[str, Any]]] = {}

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = Config._hints_cache.get(cls)
        if hints is None:
            hints = typing.get_type_hints(cls)
            Config._hints_cache[cls] = hints
        return hints

    def __post_init__(self) -> None:
        hints = self._hints()
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            value = _coerce(owner, f.name, hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            meta = f.metadata.get(_META_KEY)
            if meta is None or value is None:
                continue
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                _check_one(owner, f.name, v, meta)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; subclasses raise ConfigError naming the fields involved."""

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any] | None) -> C:
        """Build from a plain mapping (YAML, JSON, ROS parameters); unknown keys are errors."""
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"{cls.__name__} has no field(s) {', '.join(unknown)}; "
                f"valid fields: {', '.join(sorted(names))}"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Config):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def replace(self: C, **changes: Any) -> C:
        """A new validated config with ``changes`` applied (the old one is untouched)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"{type(self).__name__} has no field(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    # -- introspection for the ROS / YAML mirrors --------------------------------------------
    @classmethod
    def specs(cls) -> list[ParamSpec]:
        hints = cls._hints()
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get(_META_KEY, {})
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(
                ParamSpec(
                    name=f.name,
                    type=hints[f.name],
                    default=default,
                    doc=meta.get("doc", ""),
                    range=meta.get("range"),
                    choices=meta.get("choices"),
                    read_only=meta.get("read_only", False),
                )
            )
        return out


def _check_one(owner: str, name: str, value: Any, meta: Mapping[str, Any]) -> None:
    doc = meta.get("doc") or ""
    rng = meta.get("range")
    if rng is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = rng
        if not (lo <= value <= hi):
            raise ConfigError(
                f"{owner}.{name}={value!r} is out of range [{lo}, {hi}]" + (f" ({doc})" if doc else "")
            )
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{owner}.{name}={value!r} is not one of {', '.join(map(repr, choices))}"
            + (f" ({doc})" if doc else "")
        )


def flatten(config: Config, prefix: str = "") -> dict[str, Any]:
    """``{"cache.sim_threshold": 0.996, ...}``: the dotted names ROS parameters use."""
    out: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        sub = getattr(config, key)
        if isinstance(sub, Config):
            out.update(flatten(sub, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(old: Config, new: Config) -> list[str]:
    """Dotted names of the leaf fields that differ between two configs of one class, sorted."""
    a, b = flatten(old), flatten(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def unflatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten` on plain values."""
    out: dict[str, Any] = {}
    for dotted, value in values.items():
        node = out
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out
