"""MEMO-VLM reasoning reuse on a reasoning bundle trained (briefly) on real simulator bags:
exact mode equals greedy decoding, truncation keeps exactly the accepted prefix and its K/V,
two failing words refresh, calibration is written by the command and used at load, and the
replay reports reuse and agreement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import record_sim_bag
from vla_accel_ros.cli import main
from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.reasoning.memo import ACT, CALIBRATION_FILE, Calibration, decide
from vla_accel_ros.core.reasoning.template import TRANSFER_CUBE_PHASES, template_for, words_of
from vla_accel_ros.models.factory import load_policy

EPISODES, STEPS = 2, 12


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    return record_sim_bag(tmp_path_factory.mktemp("memo") / "demos", EPISODES, STEPS)


@pytest.fixture(scope="module")
def bundle(bag, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("memo") / "reasoning"
    argv = ["train", "--family", "ar", "--size", "tiny", "--data", str(bag), "--out", str(out), "--batch", "8",
            "--val-episodes", "0", "--chunk-size", "2", "--epochs", "6", "--lr", "3e-3", "--warmup-steps", "2",
            "--threads", "1", "--no-progress", "--save-dtype", "float32", "--reasoning", "transfer_cube"]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def frames(bag):
    from vla_accel_ros.io.bag_reader import BagReader

    with BagReader(bag) as b:
        return [s.observation for s in b.samples()]


def _policy(bundle, **memo):
    return load_policy(bundle, PolicyConfig.from_dict({"parity_check": False, "memo": memo} if memo else {"parity_check": False}))


def test_the_bundle_writes_reasoning_and_passes_the_parity_gate(bundle, frames):
    cfg = json.loads((bundle / "config.json").read_text())
    template = template_for("transfer_cube")
    assert tuple(cfg["reasoning_words"]) == template.words() and cfg["max_reasoning_tokens"] >= template.max_tokens()
    policy = load_policy(bundle)  # gate on: engine and transformers write the same reasoning and actions
    assert policy.parity_report.passed
    chunk = policy.infer(frames[0])
    ref = policy.reference_infer(frames[0])
    assert chunk.stats["reasoning_tokens"] == ref.stats["reasoning_tokens"]
    assert chunk.stats["action_tokens"] == ref.stats["action_tokens"]
    assert set(chunk.stats["reasoning_text"].split()) <= set(template.words())


def test_exact_mode_equals_greedy_decoding(bundle, frames):
    greedy, exact = _policy(bundle), _policy(bundle, mode="exact")
    order = frames[:6] + frames[6:8][::-1] + [frames[3]] * 2  # changes, reversals, repeats
    reused = 0
    for obs in order:
        a, b = greedy.infer(obs), exact.infer(obs)
        assert b.stats["reasoning_tokens"] == a.stats["reasoning_tokens"]
        assert b.stats["action_tokens"] == a.stats["action_tokens"]
        reused += b.stats["reasoning_reused"]
    assert reused > 0  # it did reuse (a repeated frame keeps everything)
    assert exact.infer(frames[3]).stats["reasoning_reused_fraction"] == 1.0


def test_the_action_draft_follows_a_kept_reasoning_and_equals_greedy_decoding(bundle, frames):
    greedy = _policy(bundle)
    drafted = load_policy(bundle, PolicyConfig.from_dict({"parity_check": False, "memo": {"mode": "exact"}, "action_draft": "previous"}))
    n = drafted.num_action_tokens
    accepted = 0
    for obs in frames[:4] + [frames[3]] * 2:
        a, b = greedy.infer(obs), drafted.infer(obs)
        assert b.stats["reasoning_tokens"] == a.stats["reasoning_tokens"]
        assert b.stats["action_tokens"] == a.stats["action_tokens"]
        accepted += b.stats["draft_accepted"]
    assert b.stats["reasoning_reused_fraction"] == 1.0 and b.stats["draft_accepted"] == n - 1  # the repeat: no step
    assert b.stats["decode_steps"] == 0 and accepted >= n - 1
    # A hypothesis with one wrong word: the reasoning is regenerated (to the same length when the
    # word is replaced), so the draft rows saw other words and must not be used.
    truth, nw = list(drafted.reasoning.state.classes), len(drafted.reasoning_words)
    reference = greedy.infer(frames[3]).stats
    for j in range(len(truth)):
        drafted.reasoning.state.classes = truth[:j] + [(truth[j] + 1) % nw] + truth[j + 1 :]
        drafted.draft.tokens = list(reference["action_tokens"])
        got = drafted.infer(frames[3]).stats
        assert got["reasoning_tokens"] == reference["reasoning_tokens"], j
        assert got["action_tokens"] == reference["action_tokens"], j
        assert not got["reasoning_kept_whole"] and got["draft_accepted"] < n - 1, j
    # memo off: no hypothesis, so the draft rows would not sit where the actions start
    plain = load_policy(bundle, PolicyConfig(parity_check=False, action_draft="previous"))
    plain.infer(frames[0])
    assert plain.infer(frames[0]).stats["draft_rows"] == 0


def _thresholded(bundle):
    """A calibrated-mode policy whose thresholds the test sets itself (built in exact mode, which
    needs no calibration file, then switched without rebuilding them)."""
    policy = _policy(bundle, mode="exact")
    policy.config = policy.config.replace(memo=policy.config.memo.replace(mode="calibrated"))
    return policy


def _failing_position(classes: list[int]) -> int:
    """The last position j >= 1 whose word occurs nowhere before it nor right after it."""
    for j in range(len(classes) - 1, 0, -1):
        nxt = classes[j + 1] if j + 1 < len(classes) else None
        if classes[j] not in classes[:j] and classes[j] != nxt:
            return j
    return 0


def test_truncation_keeps_exactly_the_accepted_prefix_and_its_kv(bundle, frames):
    policy = _thresholded(bundle)
    a_obs, b_obs = frames[0], frames[STEPS - 1]
    first = policy.infer(a_obs)
    classes = list(policy.reasoning.state.classes)
    j = _failing_position(classes)
    th = policy.reasoning.thresholds
    th.current[:] = 0.0  # every word passes ...
    th.current[classes[j]] = 2.0  # ... but this one, which occurs once, at j
    th.config = th.config.replace(adapt=False)
    second = policy.infer(b_obs)
    assert not second.stats["reasoning_refresh"] and second.stats["reasoning_reused"] == j
    got = second.stats["reasoning_tokens"]
    assert got[:j] == first.stats["reasoning_tokens"][:j]

    # transformers over [prefix of B, the kept words]: the same K/V, and greedy continues the same way.
    lm = policy.model.lm
    _, full = policy.full_prefix(b_obs)
    kept = torch.tensor(got[:j], dtype=torch.long)
    emb = torch.cat([full, lm.model.embed_tokens(kept)]) if j else full
    out = lm(inputs_embeds=emb[None], use_cache=True)
    p0 = full.shape[0]
    for layer in range(policy.stack.num_layers):
        ref_k = out.past_key_values.layers[layer].keys[0, :, p0 : p0 + j]
        ref_v = out.past_key_values.layers[layer].values[0, :, p0 : p0 + j]
        torch.testing.assert_close(policy.cache.k[layer][0, :, p0 : p0 + j], ref_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(policy.cache.v[layer][0, :, p0 : p0 + j], ref_v, atol=1e-4, rtol=1e-4)
    rid = policy.model.reasoning_token_ids
    pkv, words = out.past_key_values, list(got[:j])
    logits = out.logits[0, -1]
    while True:
        c = int(logits[rid].argmax())
        if c == policy.act_class or len(words) >= policy.spec.max_reasoning_tokens:
            break
        words.append(rid[c])
        o = lm(input_ids=torch.tensor([[rid[c]]]), past_key_values=pkv, use_cache=True)
        pkv, logits = o.past_key_values, o.logits[0, -1]
    assert got == words


def test_two_consecutive_failing_words_refresh(bundle, frames):
    greedy = _policy(bundle)
    policy = _thresholded(bundle)
    policy.infer(frames[0])
    classes = list(policy.reasoning.state.classes)
    th = policy.reasoning.thresholds
    th.current[:] = 0.0
    th.current[classes[1]] = th.current[classes[2]] = 2.0  # positions 1 and 2 (at least) fail
    out = policy.infer(frames[STEPS - 1])
    assert out.stats["reasoning_refresh"] and out.stats["reasoning_reused"] == 0
    assert out.stats["reasoning_tokens"] == greedy.infer(frames[STEPS - 1]).stats["reasoning_tokens"]
    # the rule itself
    assert decide(np.array([True, False, True])).keep == 1
    assert decide(np.array([True, False, False, True])).refresh
    assert decide(np.array([True, True, False])).keep == 2  # only <act> failed: keep the words
    assert decide(np.array([True, True]), force_refresh=True).refresh


def test_a_rejected_word_written_again_lowers_its_threshold(bundle, frames):
    policy = _thresholded(bundle)
    policy.infer(frames[0])
    classes = list(policy.reasoning.state.classes)
    th = policy.reasoning.thresholds
    th.current[:] = 0.0
    j = _failing_position(classes)
    th.current[classes[j]] = 0.9999  # above what the model gives it on the same frame
    policy.infer(frames[0])  # same frame: the regeneration writes the same word again
    assert th.adaptations >= 1 and th.current[classes[j]] < 0.9999
    out = policy.infer(frames[0])
    assert out.stats["reasoning_reused_fraction"] == 1.0  # accepted now
    policy.reset()
    assert th.adaptations == 0 and th.current[classes[j]] == th.calibrated[classes[j]]


def test_calibration_is_written_by_the_command_and_used_at_load(bundle, bag, tmp_path):
    with pytest.raises(ConfigError, match="calibrate-reasoning"):
        _policy(bundle, mode="calibrated", calibration=str(tmp_path / "missing.json"))
    out = tmp_path / "cal.json"
    assert main(["calibrate-reasoning", "--bundle", str(bundle), "--bag", str(bag), "--max-frames", "4",
                 "--frame-stride", "2", "--threads", "1", "--out", str(out)]) == 0  # fmt: skip
    cal = Calibration.load(out, template_for("transfer_cube").words())
    assert cal.frames == 4 and cal.min_prob and set(cal.min_prob) <= {*template_for("transfer_cube").words(), ACT}
    assert all(0.0 < p <= 1.0 for p in cal.min_prob.values())
    assert abs(np.mean(list(cal.image_attention.values())) - 1.0) < 1.0  # relative to the average word

    # Used at load: each word's threshold is its min probability x relative image attention x scale.
    cal.min_prob = {w: 0.5 for w in cal.min_prob}
    cal.image_attention = {w: 1.5 for w in cal.min_prob}
    cal.save(out)
    policy = _policy(bundle, mode="calibrated", calibration=str(out), threshold_scale=0.8)
    words = policy.reasoning.thresholds.words
    for i, w in enumerate(words):
        expected = 0.5 * 1.5 * 0.8 if w in cal.min_prob else np.median(list(cal.min_prob.values())) * 0.8
        assert policy.reasoning.thresholds.calibrated[i] == pytest.approx(expected)
    # The default location: next to the bundle's weights.
    cal.save(bundle / CALIBRATION_FILE)
    try:
        assert _policy(bundle, mode="calibrated").reasoning.thresholds.calibrated[0] == pytest.approx(0.75)
    finally:
        (bundle / CALIBRATION_FILE).unlink()


def test_memo_needs_a_reasoning_bundle(tiny_bundles):
    with pytest.raises(ConfigError, match="memo.mode=exact.*no reasoning"):
        load_policy(tiny_bundles["ar"], PolicyConfig.from_dict({"parity_check": False, "memo": {"mode": "exact"}}))
    with pytest.raises(ConfigError, match="MemoConfig.mode=.sometimes. is not one of"):
        PolicyConfig.from_dict({"memo": {"mode": "sometimes"}})


def test_replay_reports_reuse_and_agreement_and_composes(bundle, bag, tmp_path):
    out = tmp_path / "R"
    cal = bundle / CALIBRATION_FILE
    assert main(["calibrate-reasoning", "--bundle", str(bundle), "--bag", str(bag), "--max-frames", "6", "--threads", "1"]) == 0
    try:
        modes = "baseline,memo-exact,memo+cache+prune,memo@bf16"
        assert main(["replay", str(bag), "--bundle", str(bundle), "--modes", modes, "--warmup", "1", "--report", str(out),
                     "--threads", "1", "--no-plots", "--no-progress", "--no-parity"]) == 0  # fmt: skip
    finally:
        cal.unlink()
    report = json.loads((out / "report.json").read_text())
    m = report["modes"]["memo-exact"]
    assert m["reasoning_agreement_vs_baseline"]["identical_share"] == 1.0
    assert m["deviation"]["identical_token_share"] == 1.0
    for name in modes.split(","):
        r = report["modes"][name]
        assert 0.0 <= r["reasoning_reused_fraction"]["mean"] <= 1.0 and 0.0 <= r["reasoning_truth_agreement"]["mean"] <= 1.0
        assert r["speedup_vs_baseline"] == pytest.approx(report["modes"]["baseline"]["latency_ms"]["p50"] / r["latency_ms"]["p50"]), name
        assert r["flops"]["by_component_gflops_mean"]["reason"] > 0, name  # the reasoning's work is counted
    assert report["modes"]["memo+cache+prune"]["tokens_kept_fraction"]["mean"] < 1.0  # pruning ran with memo
    assert report["modes"]["memo@bf16"]["precision"] != report["modes"]["baseline"]["precision"]
    assert report["modes"]["baseline"]["reasoning_reused_fraction"]["max"] == 0.0
    assert "Reasoning (MEMO-VLM)" in (out / "report.md").read_text()


def test_the_template_follows_the_scripted_demonstration():
    from vla_accel_ros.sim.scripted import TransferCubeScript

    start = np.zeros((2, 7))
    start[:, 3] = 1.0  # identity orientations
    script = TransferCubeScript(start, np.zeros(7))
    # Every phase starts where the script changes what it does: a right-arm waypoint, or the
    # left arm's reach or close.
    script_steps = {w.step for w in script.right.waypoints} | {script.reach[0], script.close[0]}
    assert {p.start for p in TRANSFER_CUBE_PHASES} <= script_steps
    template = template_for("transfer_cube")
    state = np.zeros(14)
    state[13] = 0.95  # right gripper open
    text = template.text(120, state)
    assert "subtask : lift the cube" in text and "right open , left closed" in text
    assert len(words_of(text)) <= template.max_tokens()
    assert set(words_of(text)) <= set(template.words())


@pytest.mark.ros
def test_the_policy_node_publishes_its_reasoning_with_memo_on(bundle, ros_params_file):
    """Real nodes over DDS: the reasoning bundle with memo.mode=exact set as a ROS parameter."""
    pytest.importorskip("rclpy")
    import threading

    from std_msgs.msg import String

    import helpers
    from test_ros_graph import TIMEOUT, Probe, wait_for
    from vla_accel_ros.ros import bringup, qos
    from vla_accel_ros.ros.graph import POLICY, describe

    with helpers.module_ros_context() as ctx:
        graph = describe(params_file=ros_params_file, bundle=str(bundle), shared_observations=False)
        graph = graph.with_parameters({POLICY: {"policy.memo.mode": "exact"}})
        running = bringup.start(graph, context=ctx, threads=6)
        probe = Probe(ctx)
        texts: list[str] = []
        lock = threading.Lock()

        def on_text(m: String) -> None:
            with lock:
                texts.append(m.data)

        probe.create_subscription(String, f"{POLICY}/reasoning", on_text, qos.RELIABLE)
        running.add_node("probe", probe)
        try:
            assert running.wait_ready(TIMEOUT) == ""
            wait_for(lambda: len(texts) >= 3 and probe.count("chunks") >= 3, what="3 reasoning texts and chunks")
            assert running.nodes[POLICY].policy.config.memo.mode == "exact"
            words = set(template_for("transfer_cube").words())
            with lock:
                assert all(t and set(t.split()) <= words for t in texts)
        finally:
            running.shutdown()


def test_eval_reports_reuse_and_ground_truth_agreement_in_closed_loop(bundle, tmp_path):
    out = tmp_path / "E"
    argv = ["eval", "--bundle", str(bundle), "--episodes", "1", "--steps", "8", "--modes", "baseline,memo-exact",
            "--report", str(out), "--open-loop-episodes", "1", "--open-loop-stride", "4", "--height", "120",
            "--width", "160", "--no-progress", "--no-parity"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    for mode in ("baseline", "memo-exact"):
        m = report["modes"][mode]
        assert m["reasoning_tokens_mean"] > 0 and 0.0 <= m["reasoning_truth_agreement"]["mean"] <= 1.0
    assert report["modes"]["baseline"]["reasoning_reused_fraction"]["max"] == 0.0
    assert "speedup_vs_baseline" in report["modes"]["memo-exact"]


def test_memo_switches_at_run_time_or_refuses_and_changes_nothing(bundle, frames, tmp_path):
    policy = _policy(bundle)
    assert policy.reasoning.thresholds is None
    bad = policy.config.replace(memo=policy.config.memo.replace(mode="calibrated", calibration=str(tmp_path / "none.json")))
    with pytest.raises(ConfigError, match="memo.calibration"):
        policy.configure(bad)
    assert policy.config.memo.mode == "off" and policy.reasoning.thresholds is None
    policy.infer(frames[0])
    policy.configure(policy.config.replace(memo=policy.config.memo.replace(mode="exact")))
    assert policy.reasoning.thresholds is not None
    policy.infer(frames[1])  # the first frame after the switch regenerates ...
    assert policy.infer(frames[1]).stats["reasoning_reused_fraction"] == 1.0  # ... then reuses
