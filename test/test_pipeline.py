"""ActionFlow pipelining for ar policies: identical actions to sequential greedy decoding for the
same frames (cold start, steady state, flush), segments isolated, honest stamps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_accel_ros.core.parity import changed_observation, fixed_observation
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.models.factory import sibling_policy
from vla_accel_ros.models.pipeline import PipelinedAr


def _frames(spec, n: int, roll: int = 3):
    """Frames that differ: a changed block each time, and the view shifted by ``roll`` px."""
    obs = fixed_observation(spec)
    out = []
    for i in range(n):
        obs = changed_observation(obs, spec) if i else obs
        obs.stamp_ns = 1_000_000 + 20_000_000 * i
        shifted = {c: np.roll(img, roll * i, axis=1) for c, img in obs.images.items()}
        out.append(type(obs)(images=shifted, instruction=obs.instruction, stamp_ns=obs.stamp_ns, state=obs.state))
    return out


def _run(pipe, frames):
    chunks = []
    for obs in frames:
        chunks += pipe.push(obs)
    return chunks + pipe.flush()


@pytest.mark.parametrize("steps", [1, 3])
def test_pipelined_actions_equal_sequential_greedy(tiny_policies, steps):
    seq = sibling_policy(tiny_policies["ar"], PolicyConfig(parity_check=False))
    pipe = PipelinedAr(sibling_policy(tiny_policies["ar"], PolicyConfig(parity_check=False)), steps=steps)
    frames = _frames(seq.spec, 20)  # more than the depth: cold start, steady state, flush
    ref = [seq.infer(f) for f in frames]
    got = _run(pipe, frames)
    assert [c.stamp_ns for c in got] == [f.stamp_ns for f in frames]  # every frame once, in order
    for a, b in zip(got, ref):
        assert a.stats["action_tokens"] == b.stats["action_tokens"]
        np.testing.assert_array_equal(a.actions, b.actions)
    n = seq.num_action_tokens
    assert pipe.depth == -(-n // steps)
    assert max(c.stats["staleness_calls"] for c in got[:-pipe.depth]) == pipe.depth - 1
    assert pipe.in_flight == 0


@pytest.mark.parametrize("depth", [0, 1])  # 0: the decode's depth; 1: each frame takes back the region it frees
@pytest.mark.parametrize("reuse_vision", [False, True])
def test_pipelined_cache_equals_sequential_cache(tiny_policies, depth, reuse_vision):
    """Over the token cache: the same tokens and reuse as sequential decoding, also with the
    vision cache, which the pipeline keeps apart from its policy's (it goes with the planner and
    KV cache it serves)."""
    cfg = PolicyConfig(accel="cache", parity_check=False, cache={"relevance_mode": "off", "reuse_vision": reuse_vision})
    seq = sibling_policy(tiny_policies["ar"], cfg)
    pipe = PipelinedAr(sibling_policy(tiny_policies["ar"], cfg), **({"depth": depth} if depth else {}))
    frames = _frames(seq.spec, 8, roll=0)  # mostly static: the cache reuses
    ref = [seq.infer(f) for f in frames]
    got = _run(pipe, frames)
    assert [c.stats["action_tokens"] for c in got] == [c.stats["action_tokens"] for c in ref]
    assert [c.stats["reuse_fraction"] for c in got] == [c.stats["reuse_fraction"] for c in ref]
    assert max(c.stats["reuse_fraction"] for c in got) > 0
    assert pipe.policy._vision_cache is None and bool(pipe.vision.have.any()) == reuse_vision


def test_segments_never_see_each_others_kv(tiny_policies):
    frames = _frames(tiny_policies["ar"].spec, 6)
    clean = PipelinedAr(sibling_policy(tiny_policies["ar"], PolicyConfig(parity_check=False)))
    dirty = PipelinedAr(sibling_policy(tiny_policies["ar"], PolicyConfig(parity_check=False)))
    ref = _run(clean, frames)
    got = []
    for i, obs in enumerate(frames):
        got += dirty.push(obs)
        if i == 2:  # corrupt frame 2's region (its prefix K/V) while it and others are in flight
            region = dirty._flight[-1].region
            base = region * dirty.region_len
            torch.manual_seed(0)
            dirty.cache.k[:, :, :, base : base + 10] += 5 * torch.randn_like(dirty.cache.k[:, :, :, base : base + 10])
    got += dirty.flush()
    same = [a.stats["action_tokens"] == b.stats["action_tokens"] for a, b in zip(got, ref)]
    assert same[:2] + same[3:] == [True] * 5  # every other frame is untouched
    assert not same[2]  # the corruption reached frame 2's decode


def test_pipeline_is_for_ar_only(tiny_policies):
    from vla_accel_ros.core.errors import ConfigError

    with pytest.raises(ConfigError, match="ar policies"):
        PipelinedAr(tiny_policies["flow"])
