"""CacheConfig: every knob validated on construction, with errors that name the field."""

from __future__ import annotations

import pytest

from vla_accel_ros.core.cache import CacheConfig
from vla_accel_ros.core.config import flatten, unflatten
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.policy_config import PolicyConfig


def test_defaults_are_the_documented_ones():
    c = CacheConfig()
    assert (c.sim_threshold, c.topk_reuse, c.max_reuse_age, c.force_recompute_layers) == (0.996, 100, 8, 2)
    assert (c.relevance_mode, c.relevance_threshold, c.layer_schedule) == ("threshold", 0.5, "fixed")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("sim_threshold", 1.5, "CacheConfig.sim_threshold=1.5 is out of range"),
        ("topk_reuse", 300, "CacheConfig.topk_reuse=300 is out of range"),
        ("relevance_mode", "maybe", "CacheConfig.relevance_mode='maybe' is not one of"),
        ("layer_schedule", "cosine", "CacheConfig.layer_schedule='cosine' is not one of"),
        ("max_reuse_age", 0, "CacheConfig.max_reuse_age=0 is out of range"),
        ("scene_cut_fraction", -0.1, "CacheConfig.scene_cut_fraction=-0.1 is out of range"),
        ("reuse_layers", (6, 2), "strictly ascending"),
        ("reuse_layers", (1, 6), "starts before force_recompute_layers"),
        ("entropy_k", "big", "must be a number"),
    ],
)
def test_invalid_values_name_the_field(field, value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        CacheConfig(**{field: value})


def test_layer_checks_need_the_model_depth():
    from vla_accel_ros.core.cache import TokenCachePlanner

    CacheConfig(relevance_layer=3).check_layers(4)
    with pytest.raises(ConfigError, match=r"relevance_layer=4 is out of range \[-1, 3\]"):
        CacheConfig(relevance_layer=4).check_layers(4)
    with pytest.raises(ConfigError, match="reuse_layers"):
        CacheConfig(reuse_layers=(2, 9)).check_layers(4)
    assert CacheConfig().tap_layer(12) == 6 and CacheConfig(relevance_layer=3).tap_layer(12) == 3
    assert TokenCachePlanner(CacheConfig()).name == "cache"


def test_policy_config_nests_the_cache_with_dotted_ros_names():
    c = PolicyConfig(accel="cache", cache={"sim_threshold": 0.85, "reuse_layers": [2, 6, 9, 11]})
    assert isinstance(c.cache, CacheConfig) and c.cache.reuse_layers == (2, 6, 9, 11)
    flat = flatten(c)
    assert flat["cache.sim_threshold"] == 0.85 and flat["cache.max_reuse_age"] == 8
    assert PolicyConfig.from_dict(unflatten(flat)) == c
    with pytest.raises(ConfigError, match="CacheConfig has no field"):
        PolicyConfig(cache={"threshold": 0.9})
    # Every knob is a scalar or a tuple with a range or choices (what a ROS parameter needs).
    for spec in CacheConfig.specs():
        assert spec.range is not None or spec.choices is not None or spec.type is bool, spec.name


def test_policy_config_import_stays_light():
    import subprocess
    import sys

    code = "import sys; import vla_accel_ros.core.policy_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
