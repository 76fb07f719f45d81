"""Action draft (ar): the previous chunk's action tokens verified in the prefill give the tokens
of sequential greedy decoding, with fewer decode steps; a wrong draft is cut at its first wrong
token; the replay benchmark runs and reports the draft modes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("gym_aloha", reason="requirements-sim.txt is not installed")
pytest.importorskip("rosbags", reason="requirements-sim.txt is not installed")

from helpers import record_sim_bag  # noqa: E402
from vla_accel_ros.bench import modes as bm  # noqa: E402
from vla_accel_ros.bench import replay as rp  # noqa: E402
from vla_accel_ros.bench.report import markdown  # noqa: E402
from vla_accel_ros.core.bundle import load_bundle  # noqa: E402
from vla_accel_ros.core.errors import ConfigError  # noqa: E402
from vla_accel_ros.core.policy_config import PolicyConfig  # noqa: E402
from vla_accel_ros.models.action_draft import DRAFT_WINDOW  # noqa: E402
from vla_accel_ros.models.factory import load_policy  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    return record_sim_bag(tmp_path_factory.mktemp("draft") / "demos", 1, STEPS)


@pytest.fixture(scope="module")
def frames(bag):
    from vla_accel_ros.io.bag_reader import BagReader

    with BagReader(bag) as b:
        return [s.observation for s in b.samples()]


def _policies(bundle, **fields):
    plain = load_policy(bundle, PolicyConfig.from_dict({"parity_check": False, **fields}))
    drafted = load_policy(bundle, PolicyConfig.from_dict({"parity_check": False, "action_draft": "previous", **fields}))
    return plain, drafted


@pytest.mark.parametrize("accel", ["none", "cache+prune"])
def test_drafted_tokens_equal_sequential_decoding(tiny_bundles, frames, accel):
    plain, drafted = _policies(tiny_bundles["ar"], accel=accel)
    n = drafted.num_action_tokens
    assert n > 2
    order = frames + frames[::-1][:3] + [frames[2]] * 2  # changes, reversals, a repeat
    accepted = 0
    for i, obs in enumerate(order):
        a, b = plain.infer(obs), drafted.infer(obs)
        assert b.stats["action_tokens"] == a.stats["action_tokens"], f"frame {i}"
        assert (b.actions == a.actions).all()
        assert b.stats["draft_rows"] == (0 if i == 0 else n - 1)
        assert b.stats["decode_steps"] == n - 1 - b.stats["draft_accepted"]
        assert a.stats["draft_rows"] == 0 and a.stats["decode_steps"] == n - 1
        accepted += b.stats["draft_accepted"]
    assert accepted > 0
    drafted.reset()
    assert drafted.infer(frames[0]).stats["draft_rows"] == 0  # reset forgets the last chunk


def test_another_episode_or_instruction_starts_without_a_draft(tiny_bundles, frames):
    """The last chunk of one episode (or task) is no draft for the next: with a reduced-precision
    LM the tokens a draft confirms can differ from a fresh decode's."""
    import dataclasses

    _, drafted = _policies(tiny_bundles["ar"])
    drafted.infer(frames[0])
    assert drafted.infer(frames[1]).stats["draft_rows"] > 0
    other_episode = dataclasses.replace(frames[2], episode=frames[2].episode + 1)
    assert drafted.infer(other_episode).stats["draft_rows"] == 0
    assert drafted.infer(frames[3] if len(frames) > 3 else frames[2]).stats["draft_rows"] == 0  # back: no draft of that one either
    other_task = dataclasses.replace(frames[2], instruction="stack the blocks")
    drafted.infer(frames[2])
    assert drafted.infer(other_task).stats["draft_rows"] == 0


def test_a_wrong_draft_is_cut_at_its_first_wrong_token(tiny_bundles, frames):
    plain, drafted = _policies(tiny_bundles["ar"])
    obs = frames[1]
    truth = plain.infer(obs).stats["action_tokens"]
    n = len(truth)
    first, bins = drafted._first_action_id, drafted.spec.action_bins
    for j in (0, 1, n // 2, n - 2, n - 1):
        wrong = list(truth)
        wrong[j] = first + (wrong[j] - first + 1) % bins  # another action token
        drafted.draft.remember(wrong, (obs.episode, obs.instruction))
        chunk = drafted.infer(obs)
        assert chunk.stats["action_tokens"] == truth, f"wrong token at {j}"
        # The prefill's draft rows give tokens 1..j; then each forward takes the last token and
        # the next DRAFT_WINDOW - 1 guesses, all right from j + 1 on.
        steps = math.ceil((n - 1 - j) / DRAFT_WINDOW)
        assert (chunk.stats["decode_steps"], chunk.stats["draft_accepted"]) == (steps, n - 1 - steps), f"wrong token at {j}"
        # the rejected rows' K/V was overwritten: the next frame decodes the same as without a draft
        assert drafted.infer(frames[2]).stats["action_tokens"] == plain.infer(frames[2]).stats["action_tokens"]
    drafted.draft.remember(list(truth), (obs.episode, obs.instruction))
    full = drafted.infer(obs)
    assert full.stats["draft_accepted"] == n - 1 and full.stats["decode_steps"] == 0


def test_flow_and_the_pipelined_decode_leave_the_draft_alone(tiny_bundles, frames):
    """A flow bundle ignores the option; ActionFlow's pipelined decode over a drafting ar policy
    neither drafts (no draft rows, the tokens of the pipeline over a plain policy) nor replaces
    the draft the policy holds."""
    flow = load_policy(tiny_bundles["flow"], PolicyConfig(parity_check=False, action_draft="previous"))
    assert "draft_rows" not in flow.infer(frames[0]).stats
    plain, drafted = _policies(tiny_bundles["ar"])
    drafted.infer(frames[-1])  # a draft the pipeline must neither use nor replace
    held = (list(drafted.draft.tokens), drafted.draft.key)

    def pipelined(policy) -> list:
        pipe = policy.pipeline(depth=2)
        return [c for obs in frames for c in pipe.push(obs)] + pipe.flush()

    ours, reference = pipelined(drafted), pipelined(plain)
    assert len(ours) == len(frames) == len(reference)
    assert [c.stats["action_tokens"] for c in ours] == [c.stats["action_tokens"] for c in reference]
    assert not any(c.stats.get("draft_rows") or c.stats.get("draft_accepted") for c in ours)
    assert (drafted.draft.tokens, drafted.draft.key) == held


def test_replay_runs_the_draft_modes(bag, tiny_bundles, tmp_path):
    cfg = rp.ReplayConfig(
        bag=bag, bundle=tiny_bundles["ar"], modes=("baseline", "draft", "cache+prune+draft@bf16"), warmup=1,
        parity_check=False,
    )  # fmt: skip
    rep = rp.run_replay(cfg)
    draft = rep["modes"]["draft"]
    assert draft["deviation"]["identical_token_share"] == 1.0
    sm = draft["stats_mean"]
    assert sm["draft_rows"] > 0 and 0 < sm["draft_accepted"] <= sm["draft_rows"]
    assert rep["modes"]["baseline"]["stats_mean"]["draft_rows"] == 0
    decode = {m: rep["modes"][m]["flops"]["by_component_gflops_mean"]["decode"] for m in ("baseline", "draft")}
    assert decode["draft"] < decode["baseline"]  # confirmed tokens cost no decode step
    assert rep["modes"]["cache+prune+draft@bf16"]["policy_config"]["action_draft"] == "previous"
    assert "Action draft" in markdown(rep, [])
    flow = tiny_bundles["flow"]
    with pytest.raises(ConfigError, match="draft ar action tokens"):
        bm.build_runs(load_bundle(flow), ["baseline", "draft"], rp.ReplayConfig(bag=bag, bundle=flow))
