"""The vision tower's token cache (models/vision.py) and the token cache's reuse_vision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_accel_ros.core.parity import changed_observation, fixed_observation, gate_noise, run_parity
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.models.factory import sibling_policy
from vla_accel_ros.models.vision import VisionCache


def test_every_patch_fresh_is_the_stock_tower(tiny_policies):
    vis = tiny_policies["flow"].model.vis
    cache = VisionCache(vis, cameras=2)
    pixels = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        ref = vis(pixels)
        got = cache.embed(pixels, [0, 1], None)
    assert torch.equal(got, ref)
    assert cache.computed == 2 * cache.tokens and bool(cache.have.all())


def test_only_fresh_patches_go_through_the_tower(tiny_policies):
    """Reused patches keep the embeddings of the frame that computed them (whatever their
    pixels now); fresh ones are computed over every patch's K/V, so with the same pixels a
    partial pass gives the full pass's embeddings."""
    vis = tiny_policies["flow"].model.vis
    cache = VisionCache(vis, cameras=1)
    a, b = torch.randn(1, 3, 224, 224), torch.randn(1, 3, 224, 224)
    fresh = torch.zeros(1, cache.tokens, dtype=torch.bool)
    fresh[0, 10:30] = True
    with torch.inference_mode():
        first = cache.embed(a, [0], None).clone()
        same = cache.embed(a, [0], fresh)
        assert cache.computed == 20
        assert torch.allclose(same, first, atol=1e-5)
        mixed = cache.embed(b, [0], fresh)
    assert torch.equal(mixed[0, ~fresh[0]], first[0, ~fresh[0]])
    assert not torch.allclose(mixed[0, fresh[0]], first[0, fresh[0]])
    cache.reset()
    with torch.inference_mode():
        cache.embed(b, [0], fresh)
    assert cache.computed == cache.tokens  # no state after a reset: every patch computed


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_reuse_vision_runs_the_changed_patches(family, tiny_policies):
    """With reuse_vision the tower runs over the tokens the plan computes at every layer; a
    reset frame runs every patch; the gate's checks pass (the exact ones on a reset frame and
    on the same frame again, the approximate one on a changed frame)."""
    cache = {"relevance_mode": "off", "topk_reuse": 256, "reuse_vision": True}
    policy = sibling_policy(tiny_policies[family], PolicyConfig(accel="cache", parity_check=False, cache=cache))
    plain = sibling_policy(tiny_policies[family], PolicyConfig(accel="cache", parity_check=False, cache={**cache, "reuse_vision": False}))
    obs = fixed_observation(policy.spec)
    second = changed_observation(obs, policy.spec)
    noise = gate_noise(policy)
    first = policy.infer(obs, noise=noise)
    assert first.stats["vision_reused"] == 0 and policy._vision_cache.computed == 256
    np.testing.assert_allclose(first.actions, plain.infer(obs, noise=noise).actions, atol=1e-5)
    chunk = policy.infer(second, noise=noise)
    sel = policy.planner.last
    fresh = int((~sel.reused).sum())
    assert 0 < fresh < 256 and policy._vision_cache.computed == fresh
    assert chunk.stats["vision_reused"] == 256 - fresh
    policy.reset()
    policy.infer(second, noise=noise)
    assert policy._vision_cache.computed == 256
    report = run_parity(policy)
    assert report.passed, report.table()
    assert report.metrics["accel_tokens_reused"] > 0


def test_vision_only_reuse_recomputes_the_decoder_and_ages_the_kept_features(tiny_policies):
    """force_recompute_layers past the decoder's depth: the decoder recomputes every token at
    every layer (no K/V reused, the plan is full), while the static tokens keep their vision
    features; those keep their reference patch and age, so max_reuse_age still refreshes them."""
    cache = {"relevance_mode": "off", "topk_reuse": 256, "reuse_vision": True, "force_recompute_layers": 1024,
             "max_reuse_age": 2, "stagger_refresh": False}  # fmt: skip
    policy = sibling_policy(tiny_policies["flow"], PolicyConfig(accel="cache", parity_check=False, cache=cache))
    obs = fixed_observation(policy.spec)
    second = changed_observation(obs, policy.spec)
    noise = gate_noise(policy)
    policy.infer(obs, noise=noise)
    chunk = policy.infer(second, noise=noise)
    sel = policy.planner.last
    kept = int(sel.kept.sum())
    assert not bool(sel.reused.any()) and chunk.stats["reused_tokens"] == 0  # no decoder K/V reused
    assert 0 < kept < 256 and chunk.stats["vision_reused"] == kept
    assert policy._vision_cache.computed == 256 - kept
    again = policy.infer(second, noise=noise)  # kept tokens at age 1, then 2: refreshed
    assert again.stats["vision_reused"] > 0
    policy.infer(second, noise=noise)
    assert bool(policy.planner.last.aged.any()) and policy._vision_cache.computed > 0
    report = run_parity(policy)
    assert report.passed, report.table()
    assert report.metrics["accel_tokens_reused"] > 0  # the gate counts the vision reuse


def _stem_spec(stem, patch: int = 14):
    from vla_accel_ros.models.factory import demo_spec

    spec = demo_spec("flow", "tiny")
    return spec.replace(patch_size=patch, vision={**spec.vision, "patch_size": patch, "conv_stem": stem})


def test_a_conv_stem_bundle_loads_and_keeps_each_token_to_its_own_patch(tmp_path):
    """A tower with a convolutional stem (vision.conv_stem) saves and loads like any bundle
    (parity gate passed), and a token's embedding still depends on its own patch only, which the
    token cache's per-patch freshness assumes: changing one patch's pixels moves one token."""
    from vla_accel_ros.core.bundle import save_bundle
    from vla_accel_ros.models.factory import build_model, load_policy

    spec = _stem_spec([4])
    torch.manual_seed(0)
    path = save_bundle(tmp_path / "stem", spec, build_model(spec).state_dict())
    policy = load_policy(path)
    assert policy.parity_report.passed
    vis = policy.model.vis
    assert vis.stem[0].weight.shape == (4, 3, 2, 2) and vis.vision.config.num_channels == 4
    a = torch.randn(1, 3, 224, 224)
    b = a.clone()
    b[0, :, 3 * 14 : 4 * 14, 5 * 14 : 6 * 14] += 1.0  # the patch of token 3 * 16 + 5
    with torch.inference_mode():
        moved = (vis.patch_embeddings(a) - vis.patch_embeddings(b)).abs().amax(-1)[0]
        assert torch.nonzero(moved).flatten().tolist() == [3 * 16 + 5]
        cache = VisionCache(vis, cameras=1)
        assert torch.equal(cache.embed(a, [0], None), vis(a))


@pytest.mark.parametrize(
    "stem, patch, match",
    [([4, 4], 14, "shrinks the image 4x, which must divide patch_size=14"), ([0], 14, "integers in"),
     (["8"], 14, "integers in"), ([2] * 5, 32, "1 to 4 channel counts")],
)  # fmt: skip
def test_a_conv_stem_that_does_not_fit_the_patch_is_refused(stem, patch, match):
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.models.family import get_family

    with pytest.raises(ConfigError, match=match):
        get_family("flow").validate_spec(_stem_spec(stem, patch))
