"""Mirror a :class:`~vla_accel_ros.core.config.Config` as ROS 2 parameters, generically.

One parameter per leaf field, nested configs as dotted names (``safety.max_step``,
``policy.cache.sim_threshold``), read from ``Config.specs()`` recursively, so a field added to
any config shows up as a parameter with no change here. Each parameter gets a descriptor with
the field's documentation, its range (``IntegerRange`` / ``FloatingPointRange``), its choices
(in ``additional_constraints``) and ``read_only``.

Changes: the on-set callback validates by building the whole config from the current values
plus the proposed ones and rejects with the parameters and values asked for and the
:class:`ConfigError` text (which says the allowed values) as the reason; the
post-set callback (Iron and newer; on Humble the on-set callback itself) stages the new config,
and the node swaps it in at a point of its choosing (:meth:`ConfigParameters.take_pending`),
e.g. between two inferences, so a change never lands half-way through one.
"""

from __future__ import annotations

import array
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.node import Node
from rclpy.parameter import Parameter

from vla_accel_ros.core.config import Config, flatten, unflatten
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.ros.drops import capped

_SCALARS = {
    bool: Parameter.Type.BOOL,
    int: Parameter.Type.INTEGER,
    float: Parameter.Type.DOUBLE,
    str: Parameter.Type.STRING,
}
_ARRAYS = {
    bool: Parameter.Type.BOOL_ARRAY,
    int: Parameter.Type.INTEGER_ARRAY,
    float: Parameter.Type.DOUBLE_ARRAY,
    str: Parameter.Type.STRING_ARRAY,
}


@dataclass(frozen=True)
class LeafSpec:
    name: str  # dotted
    ros_type: Parameter.Type
    default: Any
    descriptor: ParameterDescriptor


def _optional_inner(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _ros_type(name: str, tp: Any) -> Parameter.Type:
    tp = _optional_inner(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in _ARRAYS:
            return _ARRAYS[args[0]]
    raise TypeError(f"config field {name!r} of type {tp!r} cannot be mirrored as a ROS parameter")


def leaf_specs(cls: type[Config], *, read_only: Iterable[str] = ()) -> list[LeafSpec]:
    """Every leaf field of ``cls`` (recursively), with the defaults of ``cls()``."""
    defaults = flatten(cls())
    extra_ro = set(read_only)
    out: list[LeafSpec] = []

    def walk(c: type[Config], prefix: str) -> None:
        hints = typing.get_type_hints(c)
        for spec in c.specs():
            name = f"{prefix}{spec.name}"
            tp = _optional_inner(hints[spec.name])
            if isinstance(tp, type) and issubclass(tp, Config):
                walk(tp, f"{name}.")
                continue
            ros_type = _ros_type(name, tp)
            d = ParameterDescriptor(
                name=name,
                type=ros_type.value,
                description=spec.doc,
                read_only=bool(spec.read_only or name in extra_ro),
            )
            if spec.choices is not None:
                d.additional_constraints = "one of: " + ", ".join(map(str, spec.choices))
            if spec.range is not None:
                lo, hi = spec.range
                if ros_type == Parameter.Type.INTEGER:
                    d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=0)]
                elif ros_type == Parameter.Type.DOUBLE:
                    d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=0.0)]
                else:  # arrays: ROS checks no ranges on arrays; the config does
                    d.additional_constraints = (d.additional_constraints + "; " if d.additional_constraints else "") + (
                        f"each in [{lo}, {hi}]"
                    )
            default = defaults.get(name)
            if isinstance(default, list):
                default = tuple(default)
            out.append(LeafSpec(name, ros_type, default, d))

    walk(cls, "")
    return out


def from_ros(value: Any) -> Any:
    """A parameter value as plain Python (arrays become tuples)."""
    if isinstance(value, (array.array, list, tuple)):
        return tuple(value)
    return value


def _fix_override_types(node: Node, specs: list[LeafSpec]) -> None:
    """YAML writes 100 for a float parameter and rcl keeps it as an integer; ROS would refuse
    to declare it. Turn integer overrides of DOUBLE / DOUBLE_ARRAY parameters into floats."""
    overrides = getattr(node, "_parameter_overrides", None)
    if not isinstance(overrides, dict):
        return
    for s in specs:
        p = overrides.get(s.name)
        if p is None:
            continue
        if s.ros_type == Parameter.Type.DOUBLE and p.type_ == Parameter.Type.INTEGER:
            overrides[s.name] = Parameter(s.name, Parameter.Type.DOUBLE, float(p.value))
        elif s.ros_type == Parameter.Type.DOUBLE_ARRAY and p.type_ == Parameter.Type.INTEGER_ARRAY:
            overrides[s.name] = Parameter(s.name, Parameter.Type.DOUBLE_ARRAY, [float(v) for v in p.value])


class ConfigParameters:
    """Declares ``cls``'s fields on ``node`` and keeps a validated ``config`` in sync.

    ``validate`` (optional) runs after the config builds, for node-level checks; raise
    :class:`ConfigError` to reject. ``on_staged`` (optional) is called with the new config from
    the post-set callback; nodes usually just let their worker call :meth:`take_pending`.
    """

    def __init__(
        self,
        node: Node,
        cls: type[Config],
        *,
        read_only: Iterable[str] = (),
        validate: Callable[[Config], None] | None = None,
        on_staged: Callable[[Config], None] | None = None,
    ) -> None:
        self.node, self.cls = node, cls
        self._validate_extra = validate
        self._on_staged = on_staged
        self.specs = leaf_specs(cls, read_only=read_only)
        self._by_name = {s.name: s for s in self.specs}
        _fix_override_types(node, self.specs)
        values: dict[str, Any] = {}
        for s in self.specs:
            empty = isinstance(s.default, tuple) and not s.default
            if s.default is None or empty:
                # ROS cannot infer an array type from [] (it reads it as a byte array): declare
                # by type; an unset parameter means the config default.
                p = node.declare_parameter(s.name, s.ros_type, s.descriptor)
                if empty and p.type_ == Parameter.Type.NOT_SET and not s.descriptor.read_only:
                    # rclpy's get_parameters service answers nothing at all when one name is
                    # unset (`ros2 param dump` shows no parameter): hold a typed [] instead.
                    p = Parameter(s.name, s.ros_type, [])
                    node.set_parameters([p])
            else:
                p = node.declare_parameter(s.name, list(s.default) if isinstance(s.default, tuple) else s.default, s.descriptor)
            values[s.name] = s.default if p.type_ == Parameter.Type.NOT_SET else from_ros(p.value)
        self._lock = threading.Lock()
        self._values = values
        self.config = self._build(values)  # raises ConfigError: a bad parameter file stops the node
        self._candidate: tuple[dict[str, Any], Config] | None = None
        self._pending: Config | None = None
        node.add_on_set_parameters_callback(self._on_set)
        self._has_post_set = hasattr(node, "add_post_set_parameters_callback")
        if self._has_post_set:
            node.add_post_set_parameters_callback(self._post_set)

    def _build(self, values: dict[str, Any]) -> Config:
        cfg = self.cls.from_dict(unflatten(values))
        if self._validate_extra is not None:
            self._validate_extra(cfg)
        return cfg

    def _on_set(self, params: list[Parameter]) -> SetParametersResult:
        mine = [p for p in params if p.name in self._by_name]
        if not mine:
            return SetParametersResult(successful=True)
        with self._lock:
            values = dict(self._values)
        for p in mine:
            values[p.name] = self._by_name[p.name].default if p.type_ == Parameter.Type.NOT_SET else from_ros(p.value)
        try:
            cfg = self._build(values)
        except ConfigError as e:  # the reason names what was set and its value, then why not
            asked = ", ".join(f"{p.name}={capped(repr(values[p.name]))}" for p in mine)
            return SetParametersResult(successful=False, reason=f"{asked} rejected: {e}")
        with self._lock:
            self._candidate = (values, cfg)
        if not self._has_post_set:  # Humble: no post-set callback; nothing else can veto ours
            self._commit()
        return SetParametersResult(successful=True)

    def _post_set(self, params: list[Parameter]) -> None:
        if any(p.name in self._by_name for p in params):
            self._commit()

    def _commit(self) -> None:
        with self._lock:
            if self._candidate is None:
                return
            self._values, cfg = self._candidate
            self._candidate = None
            self.config = cfg
            self._pending = cfg
        if self._on_staged is not None:
            self._on_staged(cfg)

    def take_pending(self) -> Config | None:
        """The newest accepted config not yet taken (None if nothing changed): swap it in."""
        with self._lock:
            cfg, self._pending = self._pending, None
            return cfg

    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def parameter(self, name: str, value: Any) -> Parameter:
        """``name`` set to ``value`` as its declared type: rclpy would type an empty list as a
        byte array, which the declared array parameter refuses."""
        spec = self._by_name[name]
        return Parameter(name, spec.ros_type, list(value) if isinstance(value, tuple) else value)
