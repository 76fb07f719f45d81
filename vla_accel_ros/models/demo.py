"""What random-weight demo bundles of every family share: the model sizes, the ALOHA joints and
statistics around its start pose. Each family builds its own spec from these
(``Family.demo_spec``); ``vla-accel bundle create-demo`` and ``vla-accel train`` call it."""

from __future__ import annotations

import numpy as np

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.robot.config import ALOHA_JOINT_NAMES, ALOHA_START_ARM

ALOHA_START = np.array([*ALOHA_START_ARM, 0.5] * 2, dtype=np.float32)  # grippers half open

# Model sizes. ``tiny`` keeps tests fast; ``mini`` (~7M parameters) is what ``vla-accel train``
# trains on a CPU in about an hour (the shipped models/ bundles); ``small`` (~130M parameters)
# is for CPU benchmarks. The vision grid is OpenVLA's 16 x 16 (224 px, 14 px patches) in all.
SIZES = ("tiny", "mini", "small")
_SIZES = {
    "tiny": {
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        "lm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "expert": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16),
        "vocab": 1024,
    },
    "mini": {
        "vision": dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3),
        "lm": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "expert": dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, head_dim=64),
        "vocab": 1024,
    },
    "small": {
        "vision": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6),
        "lm": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
        "expert": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=12, head_dim=64),
        "vocab": 32000,
    },
}


def size_table(size: str) -> dict:
    """The module sizes of ``size`` (ConfigError naming the sizes otherwise)."""
    if size not in _SIZES:
        raise ConfigError(f"size={size!r} is not one of {', '.join(_SIZES)}")
    return _SIZES[size]


def joint_names(action_dim: int) -> tuple[str, ...]:
    return ALOHA_JOINT_NAMES if action_dim == 14 else tuple(f"joint_{i}" for i in range(action_dim))


def demo_norm_stats(action_dim: int, state_dim: int) -> dict:
    """Statistics around the ALOHA start pose (random-weight bundles; ``vla-accel train`` passes
    the statistics of its data instead)."""
    start = ALOHA_START if action_dim == 14 else np.zeros(action_dim, dtype=np.float32)
    std = np.full(action_dim, 0.25, dtype=np.float32)
    stats = {"mean": start, "std": std, "q01": start - 2.5 * std, "q99": start + 2.5 * std}
    norm_stats = {"action": {k: v.tolist() for k, v in stats.items()}}
    if state_dim:
        s_mean = start if state_dim == action_dim else np.zeros(state_dim, dtype=np.float32)
        norm_stats["state"] = {"mean": s_mean.tolist(), "std": [0.25] * state_dim}
    return norm_stats
