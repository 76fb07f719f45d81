"""The two VLA families on tiny random-weight bundles: interface, determinism, invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_accel_ros.core.errors import ObservationError
from vla_accel_ros.core.parity import fixed_observation
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation, Policy


def _obs(spec, seed=0, **kw) -> Observation:
    obs = fixed_observation(spec, seed)
    obs.stamp_ns = 123_000_000
    for k, v in kw.items():
        setattr(obs, k, v)
    return obs


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_infer_returns_a_stamped_chunk(tiny_policies, family):
    policy = tiny_policies[family]
    assert isinstance(policy, Policy)
    spec = policy.spec
    chunk = policy.infer(_obs(spec))
    assert isinstance(chunk, ActionChunk)
    assert chunk.actions.shape == (spec.chunk_size, spec.action_dim)
    assert chunk.actions.dtype == np.float32 and np.isfinite(chunk.actions).all()
    assert chunk.stamp_ns == 123_000_000
    assert chunk.joint_names == spec.joint_names and chunk.dt == spec.dt
    for stage in ("preprocess", "select", "vision", "prefill", "total"):
        assert chunk.timings_ms[stage] >= 0.0
    assert chunk.timings_ms["decode" if family == "ar" else "denoise"] > 0.0
    layout, ids = policy.layout_for(_obs(spec).instruction)
    assert chunk.stats["tokens_total"] == layout.length == len(ids) + 256 + (1 if family == "ar" else 1)
    assert chunk.action_time_ns(3) == 123_000_000 + 3 * 20_000_000


def test_ar_actions_are_bin_centers_inside_the_bounds(tiny_policies):
    policy = tiny_policies["ar"]
    chunk = policy.infer(_obs(policy.spec))
    stats = policy.action_norm.stats
    assert (chunk.actions >= stats["q01"] - 1e-5).all() and (chunk.actions <= stats["q99"] + 1e-5).all()
    tokens = chunk.stats["action_tokens"]
    vocab = policy.model.lm.config.vocab_size
    assert len(tokens) == 14 and all(vocab - 256 <= t < vocab for t in tokens)
    assert tokens == policy.reference_infer(_obs(policy.spec)).stats["action_tokens"]


def test_ar_image_size_is_normalized_before_the_model(tiny_policies):
    # A 480x640 camera frame and the same frame pre-resized give identical actions.
    from vla_accel_ros.models.common import resize_uint8

    policy = tiny_policies["ar"]
    rng = np.random.default_rng(3)
    big = np.kron(rng.integers(0, 255, (12, 16, 3)), np.ones((40, 40, 1))).astype(np.uint8)
    small = resize_uint8(big, 224).numpy()
    a = policy.infer(_obs(policy.spec, images={"cam_high": big}))
    b = policy.infer(_obs(policy.spec, images={"cam_high": small}))
    assert a.stats["action_tokens"] == b.stats["action_tokens"]


def test_flow_noise_makes_it_deterministic(tiny_policies):
    policy = tiny_policies["flow"]
    spec = policy.spec
    noise = np.random.default_rng(0).standard_normal((spec.chunk_size, spec.action_dim)).astype(np.float32)
    a = policy.infer(_obs(spec), noise=noise).actions
    b = policy.infer(_obs(spec), noise=noise).actions
    c = policy.infer(_obs(spec), noise=noise + 1.0).actions
    assert np.array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    ref = policy.reference_infer(_obs(spec), noise=noise).actions
    assert np.abs(a - ref).max() <= 1e-4


def test_flow_noise_scale_multiplies_the_start_and_zero_makes_chunks_deterministic(tiny_bundles):
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(tiny_bundles["flow"], PolicyConfig(parity_check=False))
    obs = _obs(policy.spec)
    noise = np.random.default_rng(0).standard_normal(policy.noise_shape).astype(np.float32)
    half = policy.infer(obs, noise=0.5 * noise).actions
    assert policy.configure(PolicyConfig(parity_check=False, flow_noise_scale=0.5)) is False  # the planner stays
    assert np.array_equal(policy.infer(obs, noise=noise).actions, half)  # scaled after the caller's draw
    policy.configure(PolicyConfig(parity_check=False, flow_noise_scale=0.0))
    a, b = policy.infer(obs, noise=noise).actions, policy.infer(obs, noise=noise + 1.0).actions
    assert np.array_equal(a, b) and np.abs(a - half).max() > 1e-4
    # The reference path starts from the same (scaled) noise: the gate compares like with like.
    assert np.abs(policy.reference_infer(obs, noise=noise).actions - a).max() <= 1e-4
    with pytest.raises(ConfigError, match=r"flow_noise_scale=-0.5 is neither -1 \(the bundle's noise_scale\) nor in \[0, 2\]"):
        PolicyConfig(flow_noise_scale=-0.5)
    with pytest.raises(ConfigError, match="flow_noise_scale"):
        PolicyConfig(flow_noise_scale=2.5)


def test_the_bundles_noise_scale_is_the_default_and_the_policys_overrides_it(tiny_bundles, tmp_path):
    """flow_noise_scale -1 (the default) samples at the bundle's noise_scale (how the policy was
    validated: the shipped SmolVLA bundle's is 0); an explicit scale overrides it, and a chunk's
    statistics say which ran. A bundle's scale outside [0, 2] is refused with the field named."""
    import json
    import shutil

    from vla_accel_ros.core.errors import BundleError
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.models.factory import load_policy

    quiet = tmp_path / "quiet"
    shutil.copytree(tiny_bundles["flow"], quiet)
    cfg = json.loads((quiet / "config.json").read_text())
    assert cfg.get("noise_scale", 1.0) == 1.0  # bundles written before the field: the trained sampler
    (quiet / "config.json").write_text(json.dumps({**cfg, "noise_scale": 0.0}))
    policy = load_policy(quiet, PolicyConfig(parity_check=False))
    obs = _obs(policy.spec)
    noise = np.random.default_rng(0).standard_normal(policy.noise_shape).astype(np.float32)
    a, b = policy.infer(obs, noise=noise), policy.infer(obs, noise=-noise)
    assert np.array_equal(a.actions, b.actions) and a.stats["flow_noise_scale"] == 0.0
    policy.configure(PolicyConfig(parity_check=False, flow_noise_scale=1.0))
    c = policy.infer(obs, noise=noise)
    assert np.abs(c.actions - a.actions).max() > 1e-4 and c.stats["flow_noise_scale"] == 1.0
    noisy = load_policy(tiny_bundles["flow"], PolicyConfig(parity_check=False))
    assert noisy.noise_scale == 1.0
    (quiet / "config.json").write_text(json.dumps({**cfg, "noise_scale": 3.0}))
    with pytest.raises(BundleError, match=r"BundleSpec.noise_scale=3.0 is out of range \[0.0, 2.0\]"):
        load_policy(quiet, PolicyConfig(parity_check=False))


def test_flow_prefix_not_recomputed_during_denoising(tiny_policies):
    """The prefix K/V is computed once per observation: no VLM projection runs in the Euler
    loop, the prefix rows of the cache are bit-identical before and after it, and the expert
    runs exactly once per step."""
    policy = tiny_policies["flow"]
    spec = policy.spec
    calls = {"vlm": 0, "expert": 0}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda *a: calls.__setitem__("vlm", calls["vlm"] + 1))
             for layer in policy.model.vlm.layers]  # fmt: skip
    hooks += [
        policy.model.expert.layers[0].self_attn.q_proj.register_forward_hook(
            lambda *a: calls.__setitem__("expert", calls["expert"] + 1)
        )
    ]
    try:
        obs = _obs(spec)
        policy.infer(obs)  # prefix of this observation now cached
        layout, _ = policy.layout_for(obs.instruction)
        P = layout.length
        before_k = policy.cache.k[:, :, :, :P].clone()
        before_v = policy.cache.v[:, :, :, :P].clone()
        calls.update(vlm=0, expert=0)
        noise = torch.randn(1, spec.chunk_size, spec.action_dim)
        policy.denoise(noise, P)
        assert calls["vlm"] == 0
        assert calls["expert"] == policy.num_steps
        assert torch.equal(policy.cache.k[:, :, :, :P], before_k)
        assert torch.equal(policy.cache.v[:, :, :, :P], before_v)
        # And a whole infer runs the VLM layers exactly once each.
        calls.update(vlm=0, expert=0)
        policy.infer(obs)
        assert calls["vlm"] == len(policy.model.vlm.layers)
    finally:
        for h in hooks:
            h.remove()


def test_flow_rtc_guidance_freezes_the_prefix_and_follows_the_old_chunk(tiny_policies):
    policy = tiny_policies["flow"]
    spec = policy.spec
    H, D = spec.chunk_size, spec.action_dim
    obs = _obs(spec)
    rng = np.random.default_rng(1)
    prev = policy.infer(obs, noise=rng.standard_normal((H, D)).astype(np.float32)).actions
    noise = rng.standard_normal((H, D)).astype(np.float32)
    free = policy.infer(obs, noise=noise).actions
    d, horizon = 5, 25
    w = np.zeros(H, dtype=np.float32)
    w[:d] = 1.0
    c = (horizon - np.arange(d, horizon)) / (horizon - d + 1)
    w[d:horizon] = c * np.expm1(c) / np.expm1(1.0)
    guided = policy.infer(obs, noise=noise, guidance=ChunkGuidance(prev_actions=prev, frozen=d, weights=w)).actions
    assert np.array_equal(guided[:d], prev[:d])
    band = slice(d, d + 5)
    assert np.abs(guided[band] - prev[band]).mean() < np.abs(free[band] - prev[band]).mean()
    assert np.isfinite(guided).all()


def test_reset_restarts_chunk_ids(tiny_policies):
    policy = tiny_policies["ar"]
    policy.reset()
    first = policy.infer(_obs(policy.spec)).chunk_id
    second = policy.infer(_obs(policy.spec)).chunk_id
    policy.reset()
    assert second == first + 1 and policy.infer(_obs(policy.spec)).chunk_id == first


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_bad_observations_are_rejected_with_clear_errors(tiny_policies, family):
    policy = tiny_policies[family]
    spec = policy.spec
    with pytest.raises(ObservationError, match="lacks camera"):
        policy.infer(_obs(spec, images={"other": np.zeros((224, 224, 3), np.uint8)}))
    with pytest.raises(ObservationError, match="uint8"):
        policy.infer(_obs(spec, images={"cam_high": np.zeros((224, 224, 3), np.float32)}))
    with pytest.raises(ObservationError, match="max_text_tokens"):
        policy.infer(_obs(spec, instruction="pick " * 500))
    if family == "flow":
        with pytest.raises(ObservationError, match="state"):
            policy.infer(_obs(spec, state=None))
        with pytest.raises(ObservationError, match="noise"):
            policy.infer(_obs(spec), noise=np.zeros((3, 3), np.float32))


def test_qwen2_backbone_bundle_passes_parity(tmp_path):
    from vla_accel_ros.models.factory import create_demo_bundle, load_policy

    path = create_demo_bundle("ar", "tiny", tmp_path / "q", lm_type="qwen2")
    policy = load_policy(path)  # runs the parity gate
    assert policy.parity_report.passed
    assert type(policy.model.lm).__name__ == "Qwen2ForCausalLM"


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_configure_applies_atomically_or_refuses(tiny_bundles, family):
    from vla_accel_ros.core.cache.config import CacheConfig
    from vla_accel_ros.core.errors import ConfigError
    from vla_accel_ros.core.policy_config import PolicyConfig
    from vla_accel_ros.core.prefix import FullRecompute
    from vla_accel_ros.core.types import ConfigurablePolicy
    from vla_accel_ros.models.factory import load_policy

    policy = load_policy(tiny_bundles[family], PolicyConfig(parity_check=False))
    assert isinstance(policy, ConfigurablePolicy)
    before, planner = policy.config, policy.planner
    # Refused: a layer the model does not have, a field fixed at build time. Nothing changes.
    deep = PolicyConfig(accel="cache", parity_check=False, cache=CacheConfig(relevance_layer=policy.num_layers))
    with pytest.raises(ConfigError, match="relevance_layer"):
        policy.configure(deep)
    with pytest.raises(ConfigError, match="seed"):
        policy.configure(PolicyConfig(parity_check=False, seed=7))
    assert policy.config is before and policy.planner is planner
    # A planning change builds a fresh planner; a solver change keeps it.
    assert policy.configure(PolicyConfig(accel="cache", parity_check=False)) is True
    assert policy.planner is not planner and policy.planner.name != FullRecompute.name
    cached = policy.planner
    assert policy.configure(PolicyConfig(accel="cache", parity_check=False, flow_steps=3)) is False
    assert policy.planner is cached and policy.config.flow_steps == 3
    policy.set_motion_mode("fine")
    assert policy.infer(_obs(policy.spec)).actions.shape[0] == policy.spec.chunk_size
    with pytest.raises(ConfigError, match="motion mode"):
        policy.set_motion_mode("slow")
