"""LeRobot's own SmolVLA as a worker process, for ``vla-accel bench lerobot``.

Runs in the Python whose environment has LeRobot (its side venv: LeRobot pins torch and
transformers versions this package does not use), so it imports nothing of this package: only
the standard library, torch, safetensors and LeRobot. Started as

    PY lerobot_worker.py --policy DIR [--vlm DIR] --threads N --exchange DIR

it loads LeRobot's saved policy with its pre- and post-processor pipelines and answers one JSON
line per request on stdin: ``{"request": NAME, "task": TEXT}`` where ``DIR/NAME.safetensors``
holds the observation (``observation.images.<camera>`` [3, h, w] float in [0, 1],
``observation.state`` [S]) and ``noise`` [1, H, A]. It runs exactly what a LeRobot user runs
(preprocessor, ``predict_action_chunk`` with that noise, postprocessor), writes the actions to
``DIR/NAME.out.safetensors`` and answers ``{"ms": total, "stages_ms": {...}}``. Stages come from
forward hooks on LeRobot's modules (timing only; nothing it computes changes): the vision
tower and connector, the VLM's prefix pass (with the prefix embedding), the denoising steps.
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
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--exchange", required=True)
    args = ap.parse_args()
    # Answers go to the real stdout; whatever LeRobot prints (it prints progress) to stderr.
    answers, sys.stdout = sys.stdout, sys.stderr

    import torch

    _define_torchvision_ops(torch)
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor import converters as conv
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(args.threads)
    cfg = PreTrainedConfig.from_pretrained(args.policy)
    overrides = {}
    if args.vlm:
        cfg.vlm_model_name = args.vlm
        overrides = {"tokenizer_processor": {"tokenizer_name": args.vlm}}
    t0 = time.perf_counter()
    policy = SmolVLAPolicy.from_pretrained(args.policy, config=cfg).eval()
    # As LeRobot's own factory loads them (lerobot.policies.factory imports every policy and env,
    # which the side venv does not all have): the batch in and out, the action in and out.
    pre = PolicyProcessorPipeline.from_pretrained(
        args.policy, "policy_preprocessor.json", overrides=overrides, to_transition=conv.batch_to_transition,
        to_output=conv.transition_to_batch,
    )
    post = PolicyProcessorPipeline.from_pretrained(
        args.policy, "policy_postprocessor.json", to_transition=conv.policy_action_to_transition,
        to_output=conv.transition_to_policy_action,
    )
    load_s = time.perf_counter() - t0

    clock = _StageClock()
    vwe = policy.model.vlm_with_expert
    vm = vwe.get_vlm_model()
    clock.hook(vm.vision_model, "vision")
    clock.hook(vm.connector, "vision")

    # LeRobot calls its VLM-with-expert's forward directly (no module hooks fire there): the
    # prefix pass is what runs between the last camera's connector and the first action
    # embedding, the denoising what runs from there to the end of predict_action_chunk.
    marks: dict[str, float] = {}
    vm.connector.register_forward_hook(lambda *_: marks.__setitem__("vision_end", time.perf_counter()))
    policy.model.action_in_proj.register_forward_pre_hook(lambda *_: marks.setdefault("denoise_start", time.perf_counter()))
    exchange = Path(args.exchange)
    import lerobot
    import transformers

    print(json.dumps({"ready": True, "load_s": round(load_s, 2), "parameters": sum(p.numel() for p in policy.parameters()),
                      "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                                   "transformers": transformers.__version__}, "threads": torch.get_num_threads()}),
          file=answers, flush=True)  # fmt: skip
    for line in sys.stdin:
        req = json.loads(line)
        tensors = load_file(str(exchange / f"{req['request']}.safetensors"))
        noise = tensors.pop("noise")
        clock.ms = {}
        marks.clear()
        policy.reset()
        t0 = time.perf_counter()  # what a LeRobot user runs, as they run it (its own no_grad inside)
        batch = pre({**tensors, "task": req["task"]})
        t1 = time.perf_counter()
        actions = policy.predict_action_chunk(batch, noise=noise)
        t2 = time.perf_counter()
        actions = post(actions)
        t3 = time.perf_counter()
        save_file({"actions": actions[0].contiguous().float()}, str(exchange / f"{req['request']}.out.safetensors"))
        stages = {
            "preprocess": (t1 - t0) * 1e3, **clock.ms, "prefill": (marks["denoise_start"] - marks["vision_end"]) * 1e3,
            "denoise": (t2 - marks["denoise_start"]) * 1e3, "postprocess": (t3 - t2) * 1e3,
        }
        print(json.dumps({"ms": (t3 - t0) * 1e3, "stages_ms": stages}), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
