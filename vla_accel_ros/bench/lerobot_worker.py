"""LeRobot's own SmolVLA, pi0 or pi0.5 as a worker process, for ``vla-accel bench lerobot``.

Runs in the Python whose environment has LeRobot (its side venv: LeRobot pins torch and
transformers versions this package does not use), so it imports nothing of this package: only
the standard library, torch, safetensors and LeRobot. Started as

    PY lerobot_worker.py --policy DIR [--vlm DIR] [--tokenizer DIR] --threads N --exchange DIR

it loads LeRobot's saved policy (the family its config.json ``type`` names) and answers one JSON
line per request on stdin: ``{"request": NAME, "task": TEXT}`` where ``DIR/NAME.safetensors``
holds the observation (``observation.images.<camera>`` [3, h, w] float in [0, 1],
``observation.state`` [S]) and ``noise`` [1, H, A]. It runs exactly what a LeRobot user runs,
writes the actions to ``DIR/NAME.out.safetensors`` and answers ``{"ms": total, "stages_ms": {...}}``:

- smolvla and pi05 (LeRobot 0.4): the policy with its pre- and post-processor pipelines
  (preprocessor, ``predict_action_chunk`` with that noise, postprocessor); pi05's tokenizer
  step loads PaliGemma's by hub name, answered from ``--tokenizer`` as for pi0 (below);
- pi0 (LeRobot 0.3.3, whose pi0 has no ``predict_action_chunk``): ``select_action`` with that
  noise computes the chunk (normalization inside the policy) and queues it; the chunk is that
  action and the queue drained, as a user's next calls would; the time is the first call's. LeRobot as shipped: its own bf16
  casts, LeRobot's default sizes (0.3.3 has no config field for others). Its tokenizer is
  loaded by the hub name PaliGemma's (hard-coded); ``--tokenizer`` answers that name from a
  private Hugging Face cache in offline mode, so no LeRobot code is touched.

Stages come from forward hooks on LeRobot's modules (timing only; nothing it computes changes):
the vision tower and its connector/projector, the VLM's prefix pass (with the prefix embedding),
the denoising steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _define_torchvision_ops(torch) -> None:
    # PyPI's torchvision is a CUDA build whose compiled part does not load beside the CPU torch;
    # LeRobot imports it at import time (never calls it on SmolVLA's path). Declaring its two
    # op schemas first lets its Python part import.
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass


class _StageClock:
    """Wall time of hooked modules per call of the policy (ms, summed by stage)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._t: dict[int, float] = {}

    def hook(self, module, stage: str) -> None:
        def pre(mod, args):
            self._t[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            self.ms[stage] = self.ms.get(stage, 0.0) + (time.perf_counter() - self._t.pop(id(mod))) * 1e3

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--vlm", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--exchange", required=True)
    args = ap.parse_args()
    # Answers go to the real stdout; whatever LeRobot prints (it prints progress) to stderr.
    answers, sys.stdout = sys.stdout, sys.stderr
    kind = json.loads((Path(args.policy) / "config.json").read_text()).get("type")
    if kind in ("pi0", "pi05") and args.tokenizer:
        _offline_hub_cache(PALIGEMMA_TOKENIZER, Path(args.tokenizer))  # before transformers is imported

    import torch

    _define_torchvision_ops(torch)
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(args.threads)
    loaders = {"smolvla": _smolvla, "pi0": _pi0, "pi05": _pi05}
    if kind not in loaders:
        raise SystemExit(f"{args.policy}/config.json: type {kind!r}; this worker runs {', '.join(loaders)}")
    clock, marks = _StageClock(), {}
    t0 = time.perf_counter()
    policy, run, calls = loaders[kind](args, clock, marks)
    load_s = time.perf_counter() - t0
    exchange = Path(args.exchange)
    import lerobot
    import transformers

    print(json.dumps({"ready": True, "type": kind, "calls": calls, "load_s": round(load_s, 2), "parameters": sum(p.numel() for p in policy.parameters()),
                      "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                                   "transformers": transformers.__version__}, "threads": torch.get_num_threads()}),
          file=answers, flush=True)  # fmt: skip
    for line in sys.stdin:
        req = json.loads(line)
        tensors = load_file(str(exchange / f"{req['request']}.safetensors"))
        noise = tensors.pop("noise")
        clock.ms = {}
        marks.clear()
        t0 = time.perf_counter()
        actions, stages = run(tensors, noise, req["task"])
        total = (marks.get("untimed", time.perf_counter()) - t0) * 1e3
        save_file({"actions": actions.contiguous().float()}, str(exchange / f"{req['request']}.out.safetensors"))
        stages = {**stages, **clock.ms, "prefill": (marks["denoise_start"] - marks["vision_end"]) * 1e3}
        print(json.dumps({"ms": total, "stages_ms": stages}), file=answers, flush=True)
    return 0


def _mark(marks: dict[str, float], name: str, first: bool = False):
    """A hook that notes the time (the first call's only when ``first``). A hook that returns a
    value replaces the module's input or output: this one returns None."""

    def hook(*_) -> None:
        if first:
            marks.setdefault(name, time.perf_counter())
        else:
            marks[name] = time.perf_counter()

    return hook


def _processors(policy_dir: str, overrides: dict | None = None):
    """The pre- and post-processor pipelines as LeRobot's own factory loads them
    (lerobot.policies.factory imports every policy and env, which the side venv does not all
    have): the batch in and out, the action in and out."""
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor import converters as conv

    pre = PolicyProcessorPipeline.from_pretrained(
        policy_dir, "policy_preprocessor.json", overrides=overrides or {}, to_transition=conv.batch_to_transition,
        to_output=conv.transition_to_batch,
    )
    post = PolicyProcessorPipeline.from_pretrained(
        policy_dir, "policy_postprocessor.json", to_transition=conv.policy_action_to_transition,
        to_output=conv.transition_to_policy_action,
    )
    return pre, post


def _chunk_runner(policy, pre, post, marks: dict[str, float]):
    """What a LeRobot 0.4 user runs for one chunk, timed by stage."""

    def run(tensors, noise, task):
        policy.reset()
        t0 = time.perf_counter()  # as they run it (its own no_grad inside)
        batch = pre({**tensors, "task": task})
        t1 = time.perf_counter()
        actions = policy.predict_action_chunk(batch, noise=noise)
        t2 = time.perf_counter()
        actions = post(actions)
        t3 = time.perf_counter()
        return actions[0], {"preprocess": (t1 - t0) * 1e3, "denoise": (t2 - marks["denoise_start"]) * 1e3,
                            "postprocess": (t3 - t2) * 1e3}  # fmt: skip

    return run


def _smolvla(args, clock: _StageClock, marks: dict[str, float]):
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    cfg = PreTrainedConfig.from_pretrained(args.policy)
    overrides = {}
    if args.vlm:
        cfg.vlm_model_name = args.vlm
        overrides = {"tokenizer_processor": {"tokenizer_name": args.vlm}}
    policy = SmolVLAPolicy.from_pretrained(args.policy, config=cfg).eval()
    pre, post = _processors(args.policy, overrides)
    vm = policy.model.vlm_with_expert.get_vlm_model()
    clock.hook(vm.vision_model, "vision")
    clock.hook(vm.connector, "vision")
    # LeRobot calls its VLM-with-expert's forward directly (no module hooks fire there): the
    # prefix pass is what runs between the last camera's connector and the first action
    # embedding, the denoising what runs from there to the end of predict_action_chunk.
    vm.connector.register_forward_hook(_mark(marks, "vision_end"))
    policy.model.action_in_proj.register_forward_pre_hook(_mark(marks, "denoise_start", first=True))
    return policy, _chunk_runner(policy, pre, post, marks), "preprocessor, predict_action_chunk, postprocessor"


def _pi05(args, clock: _StageClock, marks: dict[str, float]):
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    policy = PI05Policy.from_pretrained(args.policy).eval()
    pre, post = _processors(args.policy)
    _hook_paligemma(policy, clock, marks)
    return policy, _chunk_runner(policy, pre, post, marks), "preprocessor, predict_action_chunk, postprocessor"


# The name LeRobot 0.3.3's PI0Policy loads (models/lerobot/paligemma.TOKENIZER_ID; this worker
# imports nothing of the package).
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"


def _offline_hub_cache(repo_id: str, tokenizer_dir: Path) -> None:
    """Answer ``repo_id`` from ``tokenizer_dir`` through a private Hugging Face cache, offline."""
    import os
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="vla-hf-"))
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / "local"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")
    for f in tokenizer_dir.iterdir():
        (snap / f.name).symlink_to(f.resolve())
    os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _hook_paligemma(policy, clock: _StageClock, marks: dict[str, float]) -> None:
    """Stage clocks on pi0's and pi0.5's PaliGemma: its tower and projector are the vision stage;
    embed_suffix projects the noisy actions first thing in every denoising step."""
    pg = policy.model.paligemma_with_expert.paligemma
    clock.hook(pg.vision_tower, "vision")
    clock.hook(pg.multi_modal_projector, "vision")
    pg.multi_modal_projector.register_forward_hook(_mark(marks, "vision_end"))
    policy.model.action_in_proj.register_forward_pre_hook(_mark(marks, "denoise_start", first=True))


def _pi0(args, clock: _StageClock, marks: dict[str, float]):
    import torch
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy

    policy = PI0Policy.from_pretrained(args.policy).eval()
    _hook_paligemma(policy, clock, marks)

    @torch.no_grad()
    def run(tensors, noise, task):
        batch = {k: v[None] for k, v in tensors.items()}
        batch["task"] = [task]
        policy.reset()
        first = policy.select_action(dict(batch), noise=noise)
        t = time.perf_counter()
        # The rest of the chunk, as a user's next calls would pop it: outside the chunk's time
        # (each of those calls repeats the input normalization: LeRobot's per-tick cost, not the chunk's).
        marks["untimed"] = t
        rest = [policy.select_action(dict(batch)) for _ in range(len(policy._action_queue))]
        return torch.stack([first, *rest], dim=1)[0], {"denoise": (t - marks["denoise_start"]) * 1e3}

    return policy, run, "the select_action call that computes the chunk"


if __name__ == "__main__":
    sys.exit(main())
