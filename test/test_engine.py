"""Engine parity against transformers' own forward (float32), on tiny Llama and Qwen2 decoders."""

from __future__ import annotations

import pytest
import torch

from vla_accel_ros.core.engine import DecoderStack, Engine, StepPlan, TapSpec
from vla_accel_ros.core.errors import PlanError
from vla_accel_ros.core.kv_cache import Block, Segment

TOL = 1e-4


def _decoder(kind: str, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaModel), "qwen2": (Qwen2Config, Qwen2Model)}[kind]
    cfg = cfg_cls(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(cfg).eval()


def _engine(model, slots: int = 96, segments=None) -> Engine:
    stack = DecoderStack(model)
    cache = stack.make_cache(slots)
    cache.set_layout(segments or [Segment(0, (Block(slots, "causal"),))])
    return Engine(stack, cache)


def _hf(model, x, positions=None, mask=None):
    with torch.no_grad():
        pos = None if positions is None else positions[None]
        return model(inputs_embeds=x, position_ids=pos, attention_mask=mask).last_hidden_state


def _all(n: int) -> torch.Tensor:
    return torch.arange(n)


def _full_plan(n: int) -> StepPlan:
    return StepPlan(slots=_all(n), positions=_all(n), output_slots=_all(n))


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return _decoder(request.param)


def test_full_prefill_matches_transformers(model):
    x = torch.randn(1, 48, 64)
    eng = _engine(model)
    out = eng.forward(x, _full_plan(48))
    assert (out.hidden - _hf(model, x)).abs().max() <= TOL
    assert out.computed_per_layer == [48] * 4


def test_partial_recompute_of_every_token_equals_full_prefill(model):
    x = torch.randn(1, 40, 64)
    eng = _engine(model)
    ref = eng.forward(x, _full_plan(40)).hidden
    layer_slots = [_all(40) for _ in range(4)]  # distinct objects: the nesting path runs
    plan = StepPlan(slots=_all(40), positions=_all(40), layer_slots=layer_slots, output_slots=_all(40))
    assert (eng.forward(x, plan).hidden - ref).abs().max() <= TOL
    assert (eng.forward(x, plan).hidden - _hf(model, x)).abs().max() <= TOL


def test_identical_input_with_every_image_token_reused_equals_full_prefill(model):
    # [BOS][image 0..31][text]: after one full prefill, reuse all image tokens at every layer.
    x = torch.randn(1, 45, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(45))
    text = torch.arange(33, 45)
    plan = StepPlan(slots=text, positions=text, output_slots=text)
    out = eng.forward(x[:, 33:], plan)
    assert out.computed_per_layer == [12] * 4
    assert (out.hidden - _hf(model, x)[:, 33:]).abs().max() <= TOL


def test_causal_reuse_of_unchanged_prefix_is_exact(model):
    x0 = torch.randn(1, 40, 64)
    x1 = x0.clone()
    x1[:, 25:] = torch.randn(1, 15, 64)  # only the suffix changed
    eng = _engine(model)
    eng.forward(x0, _full_plan(40))
    suffix = torch.arange(25, 40)
    out = eng.forward(x1[:, 25:], StepPlan(slots=suffix, positions=suffix, output_slots=suffix))
    assert (out.hidden - _hf(model, x1)[:, 25:]).abs().max() <= TOL


def test_reuse_after_a_changed_token_is_an_approximation_and_measured(model, record_property):
    # Tokens 10..19 change; 20..29 do not but follow them. Reusing 20..29 keeps K/V that saw
    # the old tokens 10..19: not exact. The deviation is measured, reported and bounded.
    x0 = torch.randn(1, 40, 64)
    x1 = x0.clone()
    x1[:, 10:20] = torch.randn(1, 10, 64)
    eng = _engine(model)
    eng.forward(x0, _full_plan(40))
    rows = torch.cat([torch.arange(10, 20), torch.arange(30, 40)])
    out = eng.forward(x1[:, rows], StepPlan(slots=rows, positions=rows, output_slots=torch.arange(30, 40)))
    ref = _hf(model, x1)[:, 30:]
    deviation = float((out.hidden - ref).abs().max())
    scale = float(ref.abs().max())
    record_property("approx_reuse_max_abs", deviation)
    print(f"approximate reuse: max |delta| = {deviation:.3e} (output scale {scale:.2f})")
    assert deviation > TOL  # it really is an approximation: reuse happened
    assert deviation < scale  # and a bounded one


def test_layerwise_reuse_is_nested_and_exact_when_input_is_unchanged(model):
    x = torch.randn(1, 40, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(40))
    # Recompute everything at layers 0-1, then only 20.. at layer 2 and 30.. at layer 3.
    layer_slots = [_all(40), _all(40), torch.arange(20, 40), torch.arange(30, 40)]
    plan = StepPlan(slots=_all(40), positions=_all(40), layer_slots=layer_slots, output_slots=torch.arange(30, 40))
    out = eng.forward(x, plan)
    assert out.computed_per_layer == [40, 40, 20, 10]
    assert (out.hidden - _hf(model, x)[:, 30:]).abs().max() <= TOL


def test_non_nested_layer_slots_are_rejected(model):
    eng = _engine(model)
    x = torch.randn(1, 20, 64)
    bad = [_all(20), torch.arange(5, 20), torch.arange(0, 20), torch.arange(10, 20)]
    with pytest.raises(PlanError, match="layer_slots\\[2\\]"):
        eng.forward(x, StepPlan(slots=_all(20), positions=_all(20), layer_slots=bad))
    with pytest.raises(PlanError, match="ascending"):
        eng.forward(x[:, :2], StepPlan(slots=torch.tensor([3, 1]), positions=torch.tensor([3, 1])))


def test_dropping_tokens_at_layer_0_equals_forward_without_them(model):
    # Pruned tokens vanish; the kept ones keep their original RoPE positions.
    x = torch.randn(1, 40, 64)
    keep = torch.tensor([i for i in range(40) if i % 3 != 1])
    drop = torch.tensor([i for i in range(40) if i % 3 == 1])
    eng = _engine(model)
    eng.forward(torch.randn(1, 40, 64), _full_plan(40))  # stale K/V from another frame everywhere
    out = eng.forward(x[:, keep], StepPlan(slots=keep, positions=keep, drop={0: drop}, output_slots=keep))
    ref = _hf(model, x[:, keep], positions=keep)
    assert (out.hidden - ref).abs().max() <= TOL
    assert not eng.cache.valid[:, drop].any()


def test_dropping_tokens_at_a_later_layer_matches_layerwise_reference(model):
    x = torch.randn(1, 32, 64)
    drop_layer, drop = 2, torch.arange(4, 20, 2)
    keep = torch.tensor([i for i in range(32) if i not in set(drop.tolist())])
    eng = _engine(model)
    layer_slots = [_all(32), _all(32), keep, keep]
    out = eng.forward(
        x, StepPlan(slots=_all(32), positions=_all(32), layer_slots=layer_slots, drop={drop_layer: drop}, output_slots=keep)
    )
    # Reference: transformers' own decoder layers, all tokens before the drop layer, kept after.
    with torch.no_grad():
        h = x
        pos = _all(32)[None]
        cos, sin = model.rotary_emb(h, pos)
        causal = torch.ones(32, 32, dtype=torch.bool).tril()[None, None]
        for layer in model.layers[:drop_layer]:
            h = layer(h, attention_mask=causal, position_embeddings=(cos, sin))
        h, cos, sin = h[:, keep], cos[:, keep], sin[:, keep]
        sub = causal[:, :, keep][:, :, :, keep]
        for layer in model.layers[drop_layer:]:
            h = layer(h, attention_mask=sub, position_embeddings=(cos, sin))
        ref = model.norm(h)
    assert (out.hidden - ref).abs().max() <= TOL
    assert eng.cache.valid[:drop_layer, drop].all() and not eng.cache.valid[drop_layer:, drop].any()


def test_packed_forward_keeps_segments_independent(model):
    # Segment A: a 20-token prefill. Segment B: 16 tokens cached earlier plus one decode token.
    segs = [Segment(0, (Block(24, "causal"),)), Segment(32, (Block(24, "causal"),))]
    eng = _engine(model, slots=64, segments=segs)
    xa, xb = torch.randn(1, 20, 64), torch.randn(1, 17, 64)
    b_slots = torch.arange(32, 48)
    eng.forward(xb[:, :16], StepPlan(slots=b_slots, positions=torch.arange(16)))
    rows = torch.cat([torch.arange(20), torch.tensor([48])])
    positions = torch.cat([torch.arange(20), torch.tensor([16])])
    x = torch.cat([xa, xb[:, 16:]], dim=1)
    out = eng.forward(x, StepPlan(slots=rows, positions=positions, output_slots=rows))
    assert (out.hidden[:, :20] - _hf(model, xa)).abs().max() <= TOL
    assert (out.hidden[:, 20:] - _hf(model, xb)[:, 16:]).abs().max() <= TOL


def test_decode_steps_match_transformers_dynamic_cache(model):
    from transformers import DynamicCache

    x = torch.randn(1, 30, 64)
    steps = torch.randn(1, 5, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(30))
    k_ptr = eng.cache.k.data_ptr()
    with torch.no_grad():
        pkv = DynamicCache(config=model.config)
        model(inputs_embeds=x, past_key_values=pkv, use_cache=True)
        for i in range(5):
            slot = torch.tensor([30 + i])
            got = eng.forward(steps[:, i : i + 1], StepPlan(slots=slot, positions=slot, output_slots=slot)).hidden
            ref = model(inputs_embeds=steps[:, i : i + 1], past_key_values=pkv, use_cache=True).last_hidden_state
            assert (got - ref).abs().max() <= TOL
    assert eng.cache.k.data_ptr() == k_ptr  # static cache: written in place, never reallocated


def test_bf16_attention_only_above_its_row_count(model):
    """A bf16 component's engine attends in bf16 for forwards of more than its row count (an
    approximation, close to fp32) and in fp32 for fewer (bit-identical), the cache staying fp32."""
    x = torch.randn(1, 48, 64)
    ref, low = _engine(model), _engine(model)
    low.bf16_attention_above = 8
    a, b = ref.forward(x, _full_plan(48)), low.forward(x, _full_plan(48))
    assert not torch.equal(a.hidden, b.hidden) and (a.hidden - b.hidden).abs().max() <= 0.05
    assert low.cache.k.dtype == torch.float32
    step = StepPlan(slots=torch.tensor([48]), positions=torch.tensor([48]), output_slots=torch.tensor([48]))
    y = torch.randn(1, 1, 64)
    low.cache.k.copy_(ref.cache.k)  # the same history (the bf16 prefill wrote slightly other K/V)
    low.cache.v.copy_(ref.cache.v)
    assert torch.equal(ref.forward(y, step).hidden, low.forward(y, step).hidden)


def test_keys_nobody_reads_are_left_out_so_attention_runs_unmasked(model):
    """A hole every row skips (pruned tokens, text padding): the engine gathers the readable
    keys, so the kernel gets a mask without holes; the results are transformers' with the
    hole masked out."""
    x = torch.randn(1, 40, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(40))
    eng.cache.invalidate(torch.arange(25, 30), from_layer=0)  # 36 of 41 keys readable
    seen = []
    attend, write_kv = eng.kernels.attend, eng.kernels.write_kv

    def spy(q, k, v, mask, scale):
        seen.append((k.shape[2], bool(mask.all())))
        return attend(q, k, v, mask, scale)

    eng.kernels = type("Spy", (), {"attend": staticmethod(spy), "write_kv": staticmethod(write_kv)})()
    y = torch.randn(1, 1, 64)
    step = StepPlan(slots=torch.tensor([40]), positions=torch.tensor([40]), output_slots=torch.tensor([40]))
    got = eng.forward(y, step).hidden
    assert seen == [(36, True)] * 4
    mask = torch.ones(41, 41, dtype=torch.bool).tril()
    mask[40, 25:30] = False
    ref = _hf(model, torch.cat([x, y], 1), mask=mask[None, None])
    assert (got - ref[:, 40:]).abs().max() <= TOL


def test_a_plan_run_again_reuses_its_masks_only_while_the_cache_still_matches(model):
    """One plan for several forwards (a flow policy's Euler steps): the same results as a fresh
    plan each time, also after keys were invalidated between two forwards (at some layers, as
    pruning does) and after the cache's layout changed."""
    x, y = torch.randn(1, 40, 64), torch.randn(1, 8, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(40))
    rows = torch.arange(40, 48)

    def plan() -> StepPlan:
        return StepPlan(slots=rows, positions=rows, output_slots=rows)

    kept = plan()
    first = eng.forward(y, kept).hidden
    assert torch.equal(eng.forward(y, kept).hidden, first) and torch.equal(eng.forward(y, plan()).hidden, first)
    eng.cache.invalidate(torch.arange(10, 20), from_layer=0)  # keys fewer at every layer ...
    eng.cache.invalidate(torch.arange(20, 30), from_layer=2)  # ... and more from layer 2 on
    after = eng.forward(y, plan()).hidden
    assert not torch.allclose(after, first)
    assert torch.equal(eng.forward(y, kept).hidden, after)
    eng.cache.set_layout([Segment(0, (Block(44, "causal"),)), Segment(44, (Block(52, "causal"),))])  # rows 44.. apart
    moved = eng.forward(y, plan()).hidden
    assert not torch.allclose(moved, after)
    assert torch.equal(eng.forward(y, kept).hidden, moved)


def test_a_forward_that_fails_part_way_counts_as_a_write(model):
    """A plan refused at layer 1 has written layer 0 already: a plan run again afterwards must
    not trust what its memo kept (the same results as a fresh plan)."""
    x, y = torch.randn(1, 40, 64), torch.randn(1, 8, 64)
    eng = _engine(model)
    eng.forward(x, _full_plan(40))
    head = torch.arange(0, 4)
    eng.cache.invalidate(head)  # keys 0-3 unreadable ...
    rows = torch.arange(40, 48)
    kept = StepPlan(slots=rows, positions=rows, output_slots=rows)
    eng.forward(y, kept)
    eng.forward(y, kept)  # ... in the masks the memo holds, with its "nothing changed" state
    # ... until this forward writes them at layer 0 and is refused at layer 1
    bad = StepPlan(slots=head, positions=head, layer_slots=[head] * 4, drop={1: torch.tensor([0])})
    with pytest.raises(PlanError, match="still computed"):
        eng.forward(torch.randn(1, 4, 64), bad)
    again = eng.forward(y, kept).hidden
    fresh = eng.forward(y, StepPlan(slots=rows, positions=rows, output_slots=rows)).hidden
    assert torch.equal(again, fresh)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_plan_run_again_over_a_prefix_with_holes_equals_a_fresh_plan(model, cache_dtype):
    """A chunk attending to a prefix with holes (pruned tokens) gathers the readable keys; run
    again (Euler steps), it keeps its windows' masks. Same results as an engine given a fresh
    plan every time: across another forward's rewrite of prefix keys, after keys were
    invalidated, with a bf16 cache read by fp32 attention, and for a plan whose rows changed
    between two forwards."""
    layout = [Segment(0, (Block(40, "bidirectional"), Block(8, "bidirectional")))]
    x, x2 = torch.randn(1, 40, 64), torch.randn(1, 40, 64)
    rows = torch.arange(40, 48)
    stack = DecoderStack(model)
    engines = []
    for _ in range(2):
        cache = stack.make_cache(48, dtype=cache_dtype)
        cache.set_layout(layout)
        eng = Engine(stack, cache)
        eng.forward(x, _full_plan(40))
        eng.cache.invalidate(torch.arange(10, 30), from_layer=1)  # 28 of 48 keys readable from layer 1
        engines.append(eng)
    kept_eng, ref_eng = engines

    def plan() -> StepPlan:
        return StepPlan(slots=rows, positions=rows, output_slots=rows)

    kept = plan()

    def both(y):
        got, ref = kept_eng.forward(y, kept).hidden, ref_eng.forward(y, plan()).hidden
        assert torch.equal(got, ref)
        return got

    outs = [both(torch.randn(1, 8, 64)) for _ in range(3)]
    y = torch.randn(1, 8, 64)
    before = both(y)
    assert not torch.allclose(before, outs[-1])
    for eng in engines:  # another plan rewrites prefix keys that stay valid
        head = torch.arange(0, 5)
        eng.forward(x2[:, :5], StepPlan(slots=head, positions=head))
    after = [both(y) for _ in range(3)]
    assert not torch.allclose(after[0], before)
    for eng in engines:
        eng.cache.invalidate(torch.arange(30, 35), from_layer=2)
    assert not torch.allclose(both(y), after[0])
    # The same plan object given per-layer rows, then none again: the rows it left without
    # valid K/V at the deep layers must be marked valid again.
    z = torch.randn(1, 8, 64)
    for eng in engines:
        eng.cache.invalidate(rows)
    kept.layer_slots, kept.output_slots = [rows, rows, rows[:4], rows[:4]], rows[:4]
    kept_eng.forward(z, kept)
    ref_eng.forward(z, StepPlan(slots=rows, positions=rows, output_slots=rows[:4], layer_slots=kept.layer_slots))
    kept.layer_slots, kept.output_slots = None, rows
    both(z)


def test_attention_taps_match_eager_attention_for_the_requested_rows():
    model = _decoder("llama", attn="eager")
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        eager = model(inputs_embeds=x, output_attentions=True).attentions  # per layer [1, H, S, S]
    eng = _engine(model)
    q, k = torch.arange(30, 40), torch.arange(1, 25)
    taps = TapSpec(layers=(0, 2, 3), query_slots=q, key_slots=k)
    out = eng.forward(x, StepPlan(slots=_all(40), positions=_all(40), taps=taps, output_slots=_all(40)))
    assert set(out.taps.attn) == {0, 2, 3}
    for layer in (0, 2, 3):
        ref = eager[layer][0][:, q][:, :, k].mean(0)  # [nq, nk]
        assert (out.taps.attn[layer] - ref).abs().max() <= 1e-5
        p = ref / ref.sum(-1, keepdim=True)
        # entropy per head, then averaged, as the engine reports it
        ph = eager[layer][0][:, q][:, :, k]
        ph = ph / ph.sum(-1, keepdim=True)
        ent = float(-(ph * ph.log()).sum(-1).mean())
        assert abs(out.taps.entropy[layer] - ent) <= 1e-4
        assert p.shape == (10, 24)
    # Taps observe; they do not change the computation.
    assert (out.hidden - _hf(model, x)).abs().max() <= TOL
    # Scattered key slots (a gather, not a slice), entropy not asked for.
    k2 = torch.tensor([3, 7, 8, 20, 38])
    taps = TapSpec(layers=(1,), query_slots=q, key_slots=k2, entropy=False)
    eng = _engine(model)
    out = eng.forward(x, StepPlan(slots=_all(40), positions=_all(40), taps=taps, output_slots=_all(40)))
    assert (out.taps.attn[1] - eager[1][0][:, q][:, :, k2].mean(0)).abs().max() <= 1e-5
    assert out.taps.entropy == {}


def test_rejects_unsupported_decoders():
    from transformers import Qwen2Config, Qwen2Model

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, use_sliding_window=True, sliding_window=8)  # fmt: skip
    with pytest.raises(TypeError, match="sliding"):
        DecoderStack(Qwen2Model(cfg))
    with pytest.raises(TypeError, match="layers"):
        DecoderStack(torch.nn.Linear(2, 2))


def test_bidirectional_prefix_matches_transformers_with_a_full_mask(model):
    # pi0/SmolVLA prefix: every prefix token sees every other; then a chunk block sees all.
    P, H = 36, 8
    eng = _engine(model, slots=64, segments=[Segment(0, (Block(P, "bidirectional"), Block(H, "bidirectional")))])
    x = torch.randn(1, P, 64)
    full = torch.ones(1, 1, P, P, dtype=torch.bool)
    out = eng.forward(x, StepPlan(slots=_all(P), positions=_all(P), output_slots=_all(P)))
    ref = _hf(model, x, mask=full)
    assert (out.hidden - ref).abs().max() <= TOL
    # Identical input, image tokens 0..29 reused at every layer, 30..35 recomputed: exact.
    rest = torch.arange(30, P)
    again = eng.forward(x[:, 30:], StepPlan(slots=rest, positions=rest, output_slots=rest))
    assert (again.hidden - ref[:, 30:]).abs().max() <= TOL
    # The chunk block attends to the whole prefix and itself.
    xs = torch.randn(1, H, 64)
    chunk = torch.arange(P, P + H)
    got = eng.forward(xs, StepPlan(slots=chunk, positions=chunk, output_slots=chunk)).hidden
    block = torch.ones(1, 1, P + H, P + H, dtype=torch.bool)
    block[..., :P, P:] = False  # the prefix does not see the chunk
    ref_all = _hf(model, torch.cat([x, xs], 1), mask=block)
    assert (got - ref_all[:, P:]).abs().max() <= TOL
