"""The per-frame token cache (VLA-Cache) on real tiny bundles of both families.

What must hold: identical frames reuse maximally and still equal full recompute; a changed
block of patches is exactly what is recomputed (plus evictions); the comparison is against
the frame whose K/V is cached (A, B, A, B and slow drift); every reset trigger forces a full
recompute; the max reuse age holds; the per-layer sets are nested and reused rows hold
valid K/V.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_accel_ros.core.cache import CacheConfig, TokenCachePlanner
from vla_accel_ros.core.cache.selection import cosine, patch_norms, patchify
from vla_accel_ros.core.parity import fixed_observation
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.types import Observation
from vla_accel_ros.models.factory import load_policy

S, P, G = 224, 14, 16  # tiny bundles: 224 px, 14 px patches, 16 x 16 tokens
MAX_REUSE = dict(topk_reuse=256, relevance_mode="off")  # every static token is reusable


def _image(seed: int) -> np.ndarray:
    """Textured mid-range pixels (so drifts never clip)."""
    rng = np.random.default_rng(seed)
    return rng.integers(90, 161, size=(S, S, 3)).astype(np.uint8)


def _obs(policy, image: np.ndarray, **kw) -> Observation:
    obs = fixed_observation(policy.spec)  # fixed state and instruction
    obs.images = {policy.spec.cameras[0]: image}
    for k, v in kw.items():
        setattr(obs, k, v)
    return obs


def _policy(tiny_bundles, family: str, **cache) -> tuple:
    policy = load_policy(tiny_bundles[family], PolicyConfig(accel="cache", cache=CacheConfig(**cache)))
    plans = []
    plan = policy.planner.plan

    def recording(ctx):
        plans.append(plan(ctx))
        return plans[-1]

    policy.planner.plan = recording
    return policy, plans


def _noise(spec, seed=0):
    return np.random.default_rng(seed).standard_normal((spec.chunk_size, spec.action_dim)).astype(np.float32)


def _block_change(image: np.ndarray, rows: range, cols: range) -> tuple[np.ndarray, set[int]]:
    """Invert a block of patches; returns the new image and the token indices changed."""
    out = image.copy()
    for r in rows:
        for c in cols:
            out[r * P : (r + 1) * P, c * P : (c + 1) * P] = 255 - out[r * P : (r + 1) * P, c * P : (c + 1) * P]
    return out, {r * G + c for r in rows for c in cols}


def _recomputed_image_tokens(plan, layout, layer: int) -> set[int]:
    img = layout.image_slots()
    rows = plan.layer_slots[layer]
    return {int(s) - int(img[0]) for s in rows if img[0] <= s <= img[-1]}


# -- identical frames ---------------------------------------------------------------------------
def test_ar_identical_frames_reuse_maximally_and_match_full_recompute(tiny_bundles, tiny_policies):
    policy, plans = _policy(tiny_bundles, "ar", **MAX_REUSE, stagger_refresh=False)
    full = tiny_policies["ar"]
    obs = _obs(policy, _image(0))
    ref_tokens = full.infer(obs).stats["action_tokens"]
    assert ref_tokens == full.reference_infer(obs).stats["action_tokens"]
    L = policy.stack.num_layers
    assert policy.parity_report.passed  # the gate's second, reusing inference matched transformers
    for i in range(4):
        out = policy.infer(obs)
        assert out.stats["action_tokens"] == ref_tokens
        assert out.timings_ms["select"] > 0.0  # selection is inside the measured latency
        if i == 0:
            assert out.stats["reset_reason"] and out.stats["reuse_fraction"] == 0.0
            continue
        # Every image token reused from layer 2 on; BOS reused everywhere (its K/V are exact).
        assert out.stats["image_recomputed_per_layer"] == [256, 256] + [0] * (L - 2)
        assert out.stats["reused_tokens"] == 256 and out.stats["fixed_reused"] == 1
        assert 0 not in plans[-1].layer_slots[0].tolist()
        assert out.stats["reuse_fraction"] == pytest.approx((L - 2) / L)


def test_ar_default_config_caps_reuse_at_topk(tiny_bundles):
    policy, _ = _policy(tiny_bundles, "ar", relevance_mode="off")
    obs = _obs(policy, _image(0))
    policy.infer(obs)
    out = policy.infer(obs)
    assert out.stats["static_tokens"] == 256
    assert out.stats["reused_tokens"] == 100 and out.stats["capped_tokens"] == 156  # 100 of 256


def test_flow_identical_frames_with_fixed_noise_match_full_recompute(tiny_bundles, tiny_policies):
    policy, _ = _policy(tiny_bundles, "flow", **MAX_REUSE)
    full = tiny_policies["flow"]
    obs = _obs(policy, _image(0))
    noise = _noise(policy.spec)
    ref = full.infer(obs, noise=noise).actions
    for i in range(4):
        out = policy.infer(obs, noise=noise)
        assert np.abs(out.actions - ref).max() <= 1e-5
        if i:
            assert out.stats["reused_tokens"] > 200  # (stagger retires a few per frame)


# -- which patches are recomputed -----------------------------------------------------------------
@pytest.mark.parametrize("family", ["ar", "flow"])
def test_a_changed_block_is_exactly_what_is_recomputed(tiny_bundles, family):
    policy, plans = _policy(tiny_bundles, family, **MAX_REUSE, stagger_refresh=False)
    a = _image(1)
    b, block = _block_change(a, range(3, 6), range(4, 8))
    policy.infer(_obs(policy, a))
    out = policy.infer(_obs(policy, b))
    layout, _ = policy.layout_for(_obs(policy, a).instruction)
    L = layout.num_layers
    for l in range(2):
        assert _recomputed_image_tokens(plans[-1], layout, l) == set(range(256))
    for l in range(2, L):
        assert _recomputed_image_tokens(plans[-1], layout, l) == block
    assert out.stats["static_tokens"] == 256 - len(block)
    # Text (and flow's state) are recomputed at every layer.
    for rows in plans[-1].layer_slots:
        assert set(layout.text_slots().tolist()) <= set(rows.tolist())
        if layout.state_slot is not None:
            assert layout.state_slot in rows.tolist()


def test_changed_block_plus_relevance_evictions_are_recomputed(tiny_bundles):
    k = 16
    policy, plans = _policy(
        tiny_bundles, "ar", topk_reuse=256, relevance_mode="topk", relevance_topk=k, stagger_refresh=False
    )
    a = _image(2)
    b, block = _block_change(a, range(8, 10), range(0, 5))
    policy.infer(_obs(policy, a))
    relevance = policy.planner._relevance.clone()  # [1, 256] from the previous step's taps
    assert relevance.shape == (1, 256) and torch.isfinite(relevance).all()
    most_attended = set(torch.topk(relevance[0], k).indices.tolist())
    out = policy.infer(_obs(policy, b))
    layout, _ = policy.layout_for(_obs(policy, a).instruction)
    assert _recomputed_image_tokens(plans[-1], layout, layout.num_layers - 1) == block | most_attended
    assert out.stats["evicted_tokens"] == len(most_attended - block)


def test_threshold_relevance_evicts_tokens_at_half_the_max_attention(tiny_bundles):
    policy, _ = _policy(tiny_bundles, "ar", topk_reuse=256, relevance_mode="threshold", relevance_threshold=0.5)
    obs = _obs(policy, _image(3))
    policy.infer(obs)
    rel = policy.planner._relevance[0]
    policy.infer(obs)
    expected = (rel / rel.max() >= 0.5)
    assert torch.equal(policy.planner.last.evicted[0], expected)


def test_abab_recomputes_the_changed_patches_every_time(tiny_bundles):
    """The comparison is against the frame whose K/V is cached, not the current one (the
    public code's bug compared a frame with itself, so everything looked static)."""
    policy, plans = _policy(tiny_bundles, "ar", **MAX_REUSE, stagger_refresh=False)
    a = _image(4)
    b, block = _block_change(a, range(10, 13), range(10, 14))
    layout, _ = policy.layout_for(_obs(policy, a).instruction)
    policy.infer(_obs(policy, a))
    for img in (b, a, b, a, b):
        policy.infer(_obs(policy, img))
        assert _recomputed_image_tokens(plans[-1], layout, layout.num_layers - 1) == block
        sim = policy.planner.last.similarity[0]
        assert bool((sim[sorted(block)] < 0.996).all())


def test_slow_drift_is_measured_against_the_cached_patch(tiny_bundles):
    """Each frame differs from the one before by less than the threshold, but a reused token
    is always within threshold of the patch it was last computed from, so the drift is caught;
    a previous-frame comparison would reuse the block forever."""
    thr = 0.996
    policy, plans = _policy(tiny_bundles, "ar", **MAX_REUSE, sim_threshold=thr, max_reuse_age=10_000, stagger_refresh=False)
    base = _image(5).astype(np.int32)
    rows, cols = range(5, 8), range(5, 9)
    direction = np.random.default_rng(6).choice([-1, 1], size=(len(rows) * P, len(cols) * P, 3))
    frames = []
    for k in range(14):
        img = base.copy()
        img[rows[0] * P : (rows[-1] + 1) * P, cols[0] * P : (cols[-1] + 1) * P] += 2 * k * direction
        frames.append(np.clip(img, 0, 255).astype(np.uint8))
    patches = [patchify(torch.from_numpy(f)[None], P)[0] for f in frames]  # [T, D] each
    norms = [patch_norms(p[None])[0] for p in patches]
    block = sorted(r * G + c for r in rows for c in cols)
    for k in range(1, len(frames)):  # consecutive frames never cross the threshold
        assert bool((cosine(patches[k], norms[k], patches[k - 1], norms[k - 1])[block] >= thr).all())
    layout, _ = policy.layout_for(_obs(policy, frames[0]).instruction)
    L = layout.num_layers
    last_computed = patches[0].clone()  # per token, the patch of the frame it was last fully computed at
    recomputed_in_block = 0
    policy.infer(_obs(policy, frames[0]))
    for k in range(1, len(frames)):
        policy.infer(_obs(policy, frames[k]))
        start = policy.planner.last.reuse_start[0]  # [T]
        reused = start < L
        sim = cosine(patches[k], norms[k], last_computed, patch_norms(last_computed[None])[0])
        assert bool((sim[reused] >= thr).all()), f"frame {k}: a reused token drifted past the threshold"
        fresh = ~reused
        recomputed_in_block += int(fresh[block].sum())
        last_computed[fresh] = patches[k][fresh]
    assert recomputed_in_block >= len(block)  # every block token was caught at least once
    assert float(cosine(patches[-1], norms[-1], patches[0], norms[0])[block].max()) < thr


# -- lifecycle ------------------------------------------------------------------------------------
def _assert_full(out, plan, layout):
    assert plan.full and all(r.numel() == layout.length for r in plan.layer_slots)
    assert out.stats["reuse_fraction"] == 0.0 and out.stats["cache_reset"]


@pytest.mark.parametrize("family", ["ar", "flow"])
def test_each_reset_trigger_forces_a_full_recompute(tiny_bundles, family):
    policy, plans = _policy(tiny_bundles, family, **MAX_REUSE)
    img = _image(7)
    obs = _obs(policy, img)
    noise = _noise(policy.spec)
    layout, _ = policy.layout_for(obs.instruction)

    def step(o, expect_reason=None):
        out = policy.infer(o, noise=noise)
        lay, _ = policy.layout_for(o.instruction)
        if expect_reason is None:
            assert out.stats["reuse_fraction"] > 0.4 and not out.stats["reset_reason"]
        else:
            assert out.stats["reset_reason"] == expect_reason
            _assert_full(out, plans[-1], lay)
        return out

    step(obs, "explicit")  # the parity gate reset the policy
    step(obs)
    step(_obs(policy, img, episode=1), "episode")
    step(_obs(policy, img, episode=1))
    step(_obs(policy, img, episode=1, instruction="pick up the red block"), "instruction")
    step(_obs(policy, img, episode=1, instruction="pick up the red block"))
    policy.reset()
    step(_obs(policy, img, episode=1, instruction="pick up the red block"), "explicit")
    step(_obs(policy, img, episode=1, instruction="pick up the red block"))
    step(_obs(policy, _image(8), episode=1, instruction="pick up the red block"), "scene_cut")
    policy.engine_prefix_hidden(obs)  # writes prefix K/V outside the planner
    step(obs, "external prefix write")
    step(obs)
    # Bundle change: the same planner object now serves another policy (another KV cache).
    other = load_policy(tiny_bundles[family], PolicyConfig(accel="none"))
    other.planner = policy.planner
    out = other.infer(obs, noise=noise)
    assert out.stats["reset_reason"] == "bundle" and out.stats["reuse_fraction"] == 0.0


def _layout(cameras=("cam",), image_size=S, text_len=3, num_layers=4):
    from vla_accel_ros.core.prefix import PrefixLayout

    grid = image_size // P
    n_img = len(cameras) * grid * grid
    return PrefixLayout(
        cameras=cameras, grid=grid, patch_size=P, image_size=image_size, image_start=1, text_start=1 + n_img,
        text_len=text_len, state_slot=None, length=1 + n_img + text_len, fixed_slots=(0,), attention="causal",
        num_layers=num_layers,
    )  # fmt: skip


def _ctx(layout, seed=0, **kw):
    from vla_accel_ros.core.prefix import PrefixContext

    n = layout.image_size
    frames = torch.stack([torch.from_numpy(_image(seed + i)[:n, :n].copy()) for i in range(len(layout.cameras))])
    return PrefixContext(
        layout=layout, images=frames, instruction=kw.get("instruction", "x"), episode=0, stamp_ns=0, source="s"
    )


def _step(planner, ctx, taps=None):
    plan = planner.plan(ctx)
    planner.update(ctx, plan, taps)
    return plan


def test_camera_set_and_resolution_changes_reset_the_planner():
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE))
    one = _layout()
    assert _step(planner, _ctx(one)).reset_reason == "initial"
    assert not _step(planner, _ctx(one)).full
    two = _layout(cameras=("cam", "wrist"))
    assert _step(planner, _ctx(two)).reset_reason == "cameras"
    assert not _step(planner, _ctx(two)).full
    small = _layout(cameras=("cam", "wrist"), image_size=112)
    assert _step(planner, _ctx(small)).reset_reason == "resolution"
    assert not _step(planner, _ctx(small)).full
    deeper = _layout(cameras=("cam", "wrist"), image_size=112, num_layers=6)
    assert _step(planner, _ctx(deeper)).reset_reason == "bundle"


def test_a_plan_without_its_update_forces_a_full_recompute():
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE))
    lay = _layout()
    _step(planner, _ctx(lay))
    planner.plan(_ctx(lay))  # the forward "failed": no update
    assert planner.plan(_ctx(lay)).reset_reason == "incomplete step"


def test_update_rejects_a_plan_it_did_not_make():
    from vla_accel_ros.core.errors import PlanError
    from vla_accel_ros.core.prefix import FullRecompute

    planner = TokenCachePlanner()
    ctx = _ctx(_layout())
    planner.plan(ctx)
    with pytest.raises(PlanError):
        planner.update(ctx, FullRecompute().plan(ctx), None)


def test_max_reuse_age_is_enforced():
    lay = _layout()
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE, max_reuse_age=3, stagger_refresh=False))
    ctx = _ctx(lay)
    reused = []
    for _ in range(10):
        _step(planner, ctx)
        reused.append(int(planner.last.reused.sum()))
    # frame 0 full, 3 frames of reuse, then every token is at its age limit and recomputed.
    assert reused == [0, 256, 256, 256, 0, 256, 256, 256, 0, 256]


def test_staggered_refresh_spreads_the_age_limit_over_frames():
    lay = _layout()
    n = 4
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE, max_reuse_age=n))
    ctx = _ctx(lay)
    run = torch.zeros(1, 256, dtype=torch.long)  # consecutive frames each token was reused
    for i in range(16):
        _step(planner, ctx)
        r = planner.last.reused.long()
        run = (run + r) * r
        assert int(run.max()) <= n
        if i:
            assert int(planner.last.aged.sum()) <= 256 // n  # never a wholesale refresh
            assert int(planner.last.reused.sum()) >= 256 - 256 // n


@pytest.mark.parametrize("family", ["ar", "flow"])
@pytest.mark.parametrize(
    "cache",
    [
        dict(),
        dict(**MAX_REUSE),
        dict(topk_reuse=200, relevance_mode="topk", relevance_topk=40, reuse_layers=(2, 3)),
        dict(topk_reuse=256, relevance_mode="off", force_recompute_layers=1, reuse_layers=(1, 3)),
    ],
)
def test_layer_sets_are_nested_and_reused_rows_hold_valid_kv(tiny_bundles, family, cache):
    from vla_accel_ros.sim.synthetic import synthetic_observations

    policy, plans = _policy(tiny_bundles, family, **cache)
    force = policy.planner.config.force_recompute_layers
    for obs in synthetic_observations(policy.spec, 8, speed=2.0):
        out = policy.infer(obs, noise=_noise(policy.spec))
        plan = plans[-1]
        layout, _ = policy.layout_for(obs.instruction)
        image = set(layout.image_slots().tolist())
        prev = None
        for l, rows in enumerate(plan.layer_slots):
            r = rows.tolist()
            assert r == sorted(set(r))
            if prev is not None:
                assert set(r) <= prev, f"layer {l} computes a row that layer {l - 1} did not"
            if l < force:
                assert image <= set(r)
            assert set(layout.text_slots().tolist()) <= set(r)
            # Every row not computed at this layer must hold K/V of this frame's context.
            missing = sorted(set(range(layout.length)) - set(r))
            if missing:
                assert bool(policy.cache.valid[l, missing].all())
            prev = set(r)
        alpha = out.stats["alpha_per_layer"]
        assert all(b >= a for a, b in zip(alpha, alpha[1:]))


# -- layer schedules ------------------------------------------------------------------------------
def test_fixed_schedule_steps_over_reuse_layers():
    from vla_accel_ros.core.cache.schedule import layer_alpha

    assert layer_alpha(CacheConfig(), None, 6) == [0, 0, 1, 1, 1, 1]
    steps = layer_alpha(CacheConfig(reuse_layers=(2, 6, 9, 11)), None, 12)
    assert steps == [0, 0, 0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 0.5, 0.75, 0.75, 1.0]


def test_entropy_schedule_follows_the_paper_and_never_shrinks():
    from vla_accel_ros.core.cache.schedule import entropy_alpha

    cfg = CacheConfig(layer_schedule="entropy", entropy_k=1.0, force_recompute_layers=1)
    # H = 4, 3, 2, 3, 1: R = 0, .25, .333, -.5, .667; cumulative .25, .583, .083, .75
    alpha = entropy_alpha(cfg, [4.0, 3.0, 2.0, 3.0, 1.0], 5)
    assert alpha == pytest.approx([0.0, 0.25, 7 / 12, 7 / 12, 0.75])
    cfg2 = CacheConfig(layer_schedule="entropy", entropy_k=2.0, force_recompute_layers=2, reuse_layers=(3,))
    assert entropy_alpha(cfg2, [4.0, 3.0, 2.0, 3.0, 1.0], 5) == pytest.approx([0, 0, 0, 1 / 6, 1 / 6])
    assert entropy_alpha(cfg, None, 5) == [0.0] * 5


def test_entropy_schedule_reuses_alpha_of_the_reusable_set_per_layer():
    from vla_accel_ros.core.engine import TapResult

    lay = _layout(num_layers=4)
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE, layer_schedule="entropy", entropy_k=2.0))
    ctx = _ctx(lay)
    plan = planner.plan(ctx)
    assert plan.taps is not None and plan.taps.layers == (0, 1, 2, 3)
    # Attention uniform over 256, 128, 64, 64 keys: H = ln 256, ln 128, ln 64, ln 64.
    taps = TapResult()
    for l, m in enumerate((256, 128, 64, 64)):
        a = torch.zeros(lay.text_len, 256)
        a[:, :m] = 1.0 / m
        taps.attn[l] = a
    planner.update(ctx, plan, taps)
    plan = planner.plan(ctx)
    r = [0.0, 1 / 8, 1 / 7, 0.0]
    alpha = min(2.0 * (r[1] + r[2]), 1.0)
    n = int(np.floor(alpha * 256 + 1e-9))
    counts = [int(((s >= 1) & (s <= 256)).sum()) for s in plan.layer_slots]
    assert counts == [256, 256, 256 - n, 256 - n]


def test_scene_cut_recomputes_the_camera():
    lay = _layout(cameras=("cam", "wrist"))
    planner = TokenCachePlanner(CacheConfig(**MAX_REUSE, scene_cut_fraction=0.5))
    _step(planner, _ctx(lay, seed=0))
    ctx = _ctx(lay, seed=0)
    ctx.frames[1] = torch.from_numpy(_image(99))  # the wrist camera sees a new scene
    plan = _step(planner, ctx)
    assert plan.stats["scene_cut"] and plan.stats["scene_cut_cameras"] == 1 and not plan.full
    reused = planner.last.reused
    assert int(reused[1].sum()) == 0 and int(reused[0].sum()) == 256


@pytest.mark.parametrize("change", ["exposure", "view"])
def test_photometric_and_view_changes_are_not_static(change):
    """Halving every pixel keeps the raw-pixel cosine at 1: the relative-change test catches it,
    and a frame where most patches changed is a scene cut (nothing reused). The paper's rule
    (cosine only, the `paper-rule` preset) is kept available and still reuses there."""
    from vla_accel_ros.bench.cache_bench import PRESETS

    lay = _layout()
    image = _image(0)
    if change == "exposure":
        changed = (image // 2).astype(np.uint8)
    else:  # the camera moved: the same texture, shifted by 5 pixels
        changed = np.roll(image, 5, axis=1)
    reused = {}
    for name, cfg in (("default", {}), ("paper-rule", PRESETS["paper-rule"])):
        planner = TokenCachePlanner(CacheConfig(**MAX_REUSE, **cfg))
        for frame in (image, changed):
            ctx = _ctx(lay)
            ctx.frames[0] = torch.from_numpy(frame)
            plan = _step(planner, ctx)
        reused[name] = int(planner.last.reused.sum())
        if name == "default":
            assert plan.reset_reason == "scene_cut" and plan.full
    assert reused["default"] == 0
    if change == "exposure":
        assert reused["paper-rule"] == 256  # the cosine alone calls every halved patch static


def test_a_token_of_several_patches_is_static_only_when_each_of_them_is():
    """A SmolVLA-style token merges 4 x 4 vision patches (``static_patch``): one patch changed
    inside it makes it non-static, although the token's whole block barely changes (its block
    cosine stays above the threshold, which alone would have reused it)."""
    import dataclasses

    from vla_accel_ros.core.prefix import PrefixContext

    lay = dataclasses.replace(_layout(image_size=112), grid=2, patch_size=56)  # 2 x 2 tokens of 56 px
    frame = torch.from_numpy(_image(0)[:112, :112].copy())[None]
    changed = frame.clone()
    changed[0, 0:14, 0:14] = 255 - changed[0, 0:14, 0:14]  # one 14 px patch of token 0
    ctx = lambda f: PrefixContext(layout=lay, images=f, instruction="x", episode=0, stamp_ns=0, source="s")  # noqa: E731
    cfg = CacheConfig(**MAX_REUSE, sim_threshold=0.97, max_relative_change=0.5)
    whole = patchify(changed, 56), patchify(frame, 56)
    assert float(cosine(whole[0], patch_norms(whole[0]), whole[1], patch_norms(whole[1]))[0, 0]) > 0.97
    for static_patch, token0_static in ((0, True), (14, False)):
        planner = TokenCachePlanner(cfg)
        sub = dataclasses.replace(lay, static_patch=static_patch)
        ctx = lambda f, sub=sub: PrefixContext(layout=sub, images=f, instruction="x", episode=0, stamp_ns=0, source="s")  # noqa: E731
        _step(planner, ctx(frame))
        _step(planner, ctx(changed))
        assert bool(planner.last.static[0, 0]) is token0_static and bool(planner.last.static[0, 1:].all())


def test_patchify_by_sub_patch_lays_each_vision_patch_out_contiguously():
    """``patchify(..., sub)`` orders a token's row by its vision patches, so ``sub_patches`` is a
    view: block k of token t is exactly the pixels of that patch, and norms over a whole row do
    not depend on the order."""
    from vla_accel_ros.core.cache.selection import sub_patches

    frame = torch.from_numpy(_image(3)[:112, :112].copy())[None]  # [1, 112, 112, 3]: 2 x 2 tokens of 56 px
    rows = patchify(frame, 56, 14)
    blocks = sub_patches(rows, 56, 14)  # [1, 4, 16, 14 * 14 * 3]
    assert blocks.data_ptr() == rows.data_ptr()
    for t, k in ((0, 0), (1, 5), (3, 15)):
        y, x = (t // 2) * 56 + (k // 4) * 14, (t % 2) * 56 + (k % 4) * 14
        assert torch.equal(blocks[0, t, k], frame[0, y : y + 14, x : x + 14].reshape(-1).float())
    torch.testing.assert_close(patch_norms(rows), patch_norms(patchify(frame, 56)))
