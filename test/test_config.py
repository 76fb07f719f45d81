"""The config layer: validation messages name the value and the allowed range."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vla_accel_ros.core.config import Config, flatten, param, unflatten
from vla_accel_ros.core.errors import ConfigError


@dataclass(frozen=True)
class Inner(Config):
    k: float = param(0.5, doc="gain", range=(0.0, 1.0))


@dataclass(frozen=True)
class Outer(Config):
    threshold: float = param(0.996, doc="similarity", range=(0.0, 1.0))
    count: int = param(100, doc="top-k", range=(0, 4096))
    mode: str = param("topk", doc="mode", choices=("topk", "threshold"))
    layers: tuple[int, ...] = param((2, 6), doc="layers", range=(0, 128))
    enabled: bool = param(True, doc="on/off")
    inner: Inner = Inner()


def test_defaults_and_roundtrip():
    c = Outer()
    assert Outer.from_dict(c.to_dict()) == c
    flat = flatten(c)
    assert flat["inner.k"] == 0.5 and flat["layers"] == [2, 6]
    assert Outer.from_dict(unflatten(flat)) == c


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 1.5}, r"Outer.threshold=1.5 is out of range \[0.0, 1.0\]"),
        ({"count": -1}, r"Outer.count=-1 is out of range \[0, 4096\]"),
        ({"count": 2.5}, r"Outer.count must be an integer"),
        ({"mode": "fancy"}, r"Outer.mode='fancy' is not one of 'topk', 'threshold'"),
        ({"layers": (2, 200)}, r"Outer.layers=200 is out of range"),
        ({"enabled": "yes"}, r"Outer.enabled must be true or false"),
        ({"inner": {"k": 2.0}}, r"Inner.k=2.0 is out of range"),
    ],
)
def test_bad_values_are_rejected_with_the_range(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Outer(**kwargs)


def test_unknown_fields_and_replace():
    with pytest.raises(ConfigError, match="no field\\(s\\) thresh; valid fields"):
        Outer.from_dict({"thresh": 0.9})
    c = Outer().replace(count=5)
    assert c.count == 5 and Outer().count == 100
    with pytest.raises(ConfigError):
        Outer().replace(count=10_000)
    assert [s.name for s in Outer.specs()][:2] == ["threshold", "count"]
    assert Outer.specs()[0].range == (0.0, 1.0)



def test_freed_blocks_stay_in_the_process_when_asked():
    """policy.malloc_keep_mb raises glibc's mmap and trim thresholds (a freed block then stays
    in the heap: no page faults at the next inference), 0 leaves the allocator alone; the
    setting is process-wide, so a built policy cannot change it."""
    import platform

    from vla_accel_ros.core.memory import keep_freed_memory
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.base import _FIXED

    assert keep_freed_memory(0) is False
    assert keep_freed_memory(PolicyConfig().malloc_keep_mb) is (platform.libc_ver()[0] == "glibc")
    assert "malloc_keep_mb" in _FIXED
    with pytest.raises(ConfigError, match="malloc_keep_mb"):
        PolicyConfig(malloc_keep_mb=-1)
