"""The policy node's worker without ROS: which observation to infer on, the state and the
resets that go with it, one inference, and its statistics.

:class:`InferenceWorker` is driven from one worker thread (:meth:`~InferenceWorker.run`: ``apply``
/ ``next_job`` / ``infer`` in a loop that no single failure ends), never inside a callback; its
liveness (time since the last chunk, how long the current inference runs) is read by the node's
diagnostics. The graph's inputs reach it from any thread through
``set_instruction``, ``reset_episode``, ``set_motion_mode``, ``requests`` (latest-only) and
the observation channel. It talks to the policy only through its public interface
(``infer``, ``reset``, ``configure``, ``set_motion_mode``, ``check_config``, and ``text_ids`` to
ask whether an instruction fits).

* ``trigger: request``: the controller names an observation by the stamp the node announced;
  the request waits ``request_wait_ms`` for it, and when the history no longer holds it the
  newest observation serves (counted as ``superseded``; its RTC guidance, indexed to the old
  stamp, is dropped).
* ``trigger: continuous``: the newest observation, each one once.
* ``trigger: pipelined`` (ar bundles): the newest observation, each one once, pushed into
  ActionFlow's pipeline (:class:`~vla_accel_ros.models.pipeline.PipelinedAr`); each push hands
  back the chunks whose decode completed, stamped with their own observations.

Whatever the trigger, an observation older than ``max_age_ms`` when its inference would start is
not used (dropped as ``stale_observation``): a request is then served by a newer observation that
is fresh (waiting up to ``request_wait_ms`` for one; ``superseded``) or not at all, and the
controller holds on its watchdog. The age of each inference's observation at its start is kept
(``obs_age_ms``) for diagnostics and the bringup summary.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from vla_accel_ros.core.config import changed_fields, flatten
from vla_accel_ros.core.errors import ConfigError, ObservationError, VlaAccelError
from vla_accel_ros.core.interrupt import Interrupted, interruptible
from vla_accel_ros.core.policy_config import PolicyConfig
from vla_accel_ros.core.robot.config import PolicyNodeConfig
from vla_accel_ros.core.robot.loop_stats import Percentiles
from vla_accel_ros.core.robot.motion import COARSE, MODE_NAMES
from vla_accel_ros.core.robot.observation import AssembledObservation, LatestSlot, ObservationChannel, StateGate
from vla_accel_ros.core.types import ActionChunk, ChunkGuidance, Observation


@dataclass
class Request:
    """A chunk request, converted from its message."""

    stamp_ns: int  # the observation it names
    request_id: int
    motion_mode: int
    guidance: ChunkGuidance | None = None
    has_guidance: bool = False
    guidance_error: str = ""  # the message's guidance could not be read


@dataclass
class Job:
    obs: AssembledObservation
    stamp_ns: int
    request_id: int = 0
    guidance: ChunkGuidance | None = None
    motion_mode: int | None = None


@dataclass
class Served:
    """One inference, for the node to publish."""

    chunk: ActionChunk
    request_id: int
    latency_ms: float  # observation stamp -> chunk, on the caller's clock
    motion_mode: str
    reset_reason: str  # why it started from an empty cache ('' when it did not)


class InferenceWorker:
    def __init__(
        self,
        config: PolicyNodeConfig,
        channel: ObservationChannel,
        *,
        drop: Callable[[str, str], None],
        log: Callable[[str, str], None],
        restore: Callable[[PolicyConfig], None] = lambda _cfg: None,
    ) -> None:
        """``drop(reason, detail)``: an input not used; ``log(level, text)``: info | error;
        ``restore(options)``: new policy options could not be applied and these still run (the
        node sets its parameters back to them)."""
        self.cfg = config  # what the worker runs with (swapped between inferences)
        self.channel = channel
        self._drop, self._log, self._restore = drop, log, restore
        self.lock = threading.Lock()  # instruction, episode, pending resets, the state gate
        self.state = StateGate(config.robot, max_state_age_ns=int(config.max_state_age_ms * 1e6))  # the rule's state half
        self.requests: LatestSlot[Request] = LatestSlot()
        self.policy: Any = None  # a ConfigurablePolicy once loaded
        self.pipeline: Any = None  # trigger pipelined: a PipelinedAr over the policy, built on first use
        self._stop = threading.Event()
        self._seen_seq = 0
        self._instruction = ""  # from the topic; '' = the parameter / the bundle's default
        self.episode = 0
        self._pending_reset = ""
        self._reset_reason = ""
        self.motion_mode = COARSE
        self.chunks = self.superseded = self.resets_total = 0  # superseded: served with a newer observation
        self.latency, self.infer_ms = Percentiles(), Percentiles()
        self.obs_age_ms = Percentiles()  # the observation's age when its inference started
        self.staleness_ms = Percentiles()  # pipelined: the pipeline's compute from push to chunk
        # Liveness, on the monotonic clock (sim time may stand still during an inference).
        self.errors = 0  # loop steps that raised (counted, logged; the loop goes on)
        self.started_at = time.monotonic()
        self.last_chunk_at: float | None = None
        self.busy_since: float | None = None  # an inference is running since then
        self._tracebacks: set[str] = set()

    # -- inputs, from any thread -------------------------------------------------------------------
    def set_instruction(self, text: str) -> str:
        """A new instruction from the topic; returns '' when it is taken, else why not (the
        previous one stays): longer than ``max_instruction_chars``, or, once the policy is
        loaded, more tokens than the model takes."""
        why = self.refuse_instruction(text)
        if why:
            return why
        with self.lock:
            if text != self._instruction:
                self._instruction = text
                self._pending_reset = self._pending_reset or "instruction"
        return ""

    def refuse_instruction(self, text: str) -> str:
        """Why ``text`` cannot be the instruction ('' when it can)."""
        limit = self.cfg.max_instruction_chars
        if len(text) > limit:
            return f"it has {len(text)} characters > max_instruction_chars {limit}"
        policy = self.policy
        if policy is not None:
            try:
                policy.text_ids(text)
            except ObservationError as e:
                return str(e)
        return ""

    def recheck_instruction(self) -> str:
        """Once the policy is loaded: the topic's instruction, taken while only its length could
        be checked, is checked by the model; refused, it is forgotten (the parameter's or the
        bundle's serves). Returns why ('' when it stays)."""
        with self.lock:
            text = self._instruction
        why = self.refuse_instruction(text) if text else ""
        if why:
            with self.lock:
                if self._instruction == text:
                    self._instruction = ""
        return why

    def reset_episode(self) -> int:
        """A new episode: the policy resets before the next inference. Returns its index."""
        with self.lock:
            self.episode += 1
            self._pending_reset = "episode"
            episode = self.episode
        self.channel.clear()  # frames of the old episode must not seed the new one
        return episode

    def set_motion_mode(self, mode: int) -> None:
        self.motion_mode = int(mode)

    def stop(self) -> None:
        """End :meth:`run`: an inference in progress stops at its next layer (and a load or
        warm-up run inside :meth:`interruptible`)."""
        self._stop.set()
        self.requests.put(Request(-1, -1, COARSE))  # wake a worker waiting for one

    def interruptible(self):
        """Context for work on the worker's thread that :meth:`stop` interrupts between two
        layers (:class:`~vla_accel_ros.core.interrupt.Interrupted`): inference, the model's load."""
        return interruptible(self._stop)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def instruction_text(self) -> str:
        return self._instruction or self.cfg.instruction or ""

    def reset_counts(self) -> None:
        self.chunks = self.errors = 0
        self.latency, self.infer_ms, self.obs_age_ms = Percentiles(), Percentiles(), Percentiles()

    def since_last_chunk_s(self) -> float:
        """Seconds since the last chunk (since the worker started when there was none)."""
        return time.monotonic() - (self.last_chunk_at if self.last_chunk_at is not None else self.started_at)

    def running_s(self) -> float:
        """How long the inference in progress has run (0 when none is)."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def health(self, *, failure: str, alive: bool, ready: bool) -> tuple[str, str, dict[str, object]]:
        """What diagnostics say of the worker: level ("ok", "warn" or "error"), message, values.
        ``failure``: why the policy or the worker ended ("" when neither did); ``alive``: the
        worker's thread runs; ``ready``: the bundle has loaded."""
        running = self.running_s()
        if failure:
            level, message = "error", f"not running: {failure}"
        elif not alive and not self.stopped:
            level, message = "error", "not running: the inference worker stopped"
        elif not ready:
            level, message = "warn", "loading the bundle"
        elif running > self.cfg.slow_inference_s:
            level, message = "warn", f"one inference has run for {running:.1f} s (> slow_inference_s {self.cfg.slow_inference_s:g})"
        elif self.errors:
            level, message = "warn", f"{self.errors} inference errors"
        else:
            level, message = "ok", "ready"
        values: dict[str, object] = {
            "ready": ready,
            "bundle": self.cfg.bundle,
            "trigger": self.cfg.trigger,
            "worker alive": alive,
            "s since last chunk": self.since_last_chunk_s(),
            "inference running s": running,
            "errors": self.errors,
            "chunks": self.chunks,
            "inference ms p50": self.infer_ms.get(50),
            "obs-to-chunk ms p50": self.latency.get(50),
            "obs-to-chunk ms p95": self.latency.get(95),
            "observation age at start ms p50": self.obs_age_ms.get(50),
            "observation age at start ms max": self.obs_age_ms.max,
            "cache resets": self.resets_total,
            "motion mode": MODE_NAMES.get(self.motion_mode, "?"),
            "requests overwritten": self.requests.overwritten,
            "requests served newer": self.superseded,
        }
        if self.cfg.trigger == "pipelined" and self.pipeline is not None:
            values.update({"pipeline depth": self.pipeline.depth, "pipeline in flight": self.pipeline.in_flight,
                           "staleness ms p50": self.staleness_ms.get(50)})  # fmt: skip
        return level, message, values

    # -- the loop -------------------------------------------------------------------------------
    def run(self, take_pending: Callable[[], PolicyNodeConfig | None], publish: Callable[[Served], None], now_ns: Callable[[], int]) -> None:
        """The worker thread, until :meth:`stop`: apply what was set, take the next job, infer,
        hand the result to ``publish``. A step that raises (a planner that fails to build, a
        bug, bad input) is counted in ``errors`` and logged (with its traceback once per type
        when it is not one of the package's own errors); the loop goes on. :meth:`stop` ends it
        within one layer of the inference in progress, which publishes nothing."""
        while not self.stopped:
            try:
                self.apply(take_pending())
                job = self.next_job()
                if job is None or self.stopped:
                    continue
                self.busy_since = time.monotonic()
                with self.interruptible():
                    served = self.infer(job, now_ns)
                self.busy_since = None
                for one in served if isinstance(served, list) else ([] if served is None else [served]):
                    if self.stopped:  # the node may be closing its publishers
                        return
                    publish(one)
            except Interrupted:
                self.busy_since = None
                return
            except Exception as e:  # noqa: BLE001 - one bad step must not stop the worker
                self.busy_since = None
                self.errors += 1
                self._report(e)

    def _report(self, e: Exception) -> None:
        if not isinstance(e, VlaAccelError) and type(e).__name__ not in self._tracebacks:
            self._tracebacks.add(type(e).__name__)  # a bug, not bad input: show where, once per type
            self._log("error", traceback.format_exc())
        self._drop("inference_error", f"{type(e).__name__}: {e}")

    # -- the worker thread ----------------------------------------------------------------------
    def apply(self, new: PolicyNodeConfig | None) -> None:
        """Between two inferences: swap in an accepted config, run pending resets. Policy
        options the policy refuses (or whose planner fails to build) are not applied: the
        running ones stay, in the worker's config too, and ``restore`` is told."""
        if new is not None:
            old = self.cfg
            if self.policy is not None and new.policy != old.policy and not self._configure(old, new):
                new = new.replace(policy=old.policy)
                self._restore(old.policy)
            elif new.policy != old.policy:
                self.pipeline = None  # rebuilt with the new options' planner
            self.cfg = new
            with self.lock:
                self.state.set_limit(max_state_age_ns=int(new.max_state_age_ms * 1e6))
            if new.instruction != old.instruction and not self._instruction:
                with self.lock:
                    self._pending_reset = self._pending_reset or "instruction"
        with self.lock:
            reason, self._pending_reset = self._pending_reset, ""
        if reason and self.policy is not None:
            self.policy.reset()
            if self.pipeline is not None:
                self.pipeline.reset()  # frames in flight belong to the old episode / instruction
            self._reset_reason = reason

    def _configure(self, old: PolicyNodeConfig, new: PolicyNodeConfig) -> bool:
        flat = flatten(new.policy)
        changed = ", ".join(f"policy.{k}={flat[k]!r}" for k in changed_fields(old.policy, new.policy))
        try:
            if self.policy.configure(new.policy):  # a fresh planner: its caches start empty
                self._reset_reason = "config"
        except Exception as e:  # noqa: BLE001 - checked when set; whatever still fails, the old options run on
            detail = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            self._log("error", f"{changed} not applied, the running options stay: {detail}")
            return False
        self._log("info", f"applied {changed}")
        return True

    def next_job(self, timeout_s: float = 0.1) -> Job | None:
        """The observation to infer on next, or None (nothing within ``timeout_s``, or stopped)."""
        if self._stop.is_set():
            return None
        if self.cfg.trigger in ("continuous", "pipelined"):
            if not self.channel.wait_newer(self._seen_seq, timeout_s):
                return None
            self._seen_seq = self.channel.seq
            latest = self.channel.latest()
            return None if latest is None else Job(latest[1], latest[0])
        if not self.requests.wait(timeout_s):
            return None
        req = self.requests.take()
        if req is None or self._stop.is_set():
            return None
        obs = self.channel.wait_for_stamp(req.stamp_ns, self.cfg.request_wait_ms / 1e3)
        if obs is not None:
            if req.guidance_error:
                self._drop("bad_guidance", req.guidance_error)
            return Job(obs, req.stamp_ns, req.request_id, req.guidance, req.motion_mode)
        latest = self.channel.latest()
        if latest is None:
            self._drop("no_observation", f"request {req.request_id}: no observation held")
            return None
        # The request waited longer than the history covers (the worker was busy or still
        # loading): the newest observation serves it, stamped as what it is. Only the RTC
        # guidance, indexed to the old stamp, cannot be used.
        self.superseded += 1
        if req.has_guidance:
            self._drop(
                "guidance_dropped",
                f"request {req.request_id}: observation {req.stamp_ns} no longer held; inferring on the newest without guidance",
            )
        return Job(latest[1], latest[0], req.request_id, None, req.motion_mode)

    def fresh(self, job: Job, now_ns: Callable[[], int]) -> tuple[Job, float] | None:
        """(``job``, its observation's age in ms) when that is at most ``max_age_ms`` now; else
        (dropped as ``stale_observation``) a request's job on the newest observation if that one
        is fresh, after waiting up to ``request_wait_ms`` for a newer one; None when none is."""
        limit_ns = self.cfg.max_age_ms * 1e6
        age_ns = now_ns() - job.stamp_ns
        if age_ns <= limit_ns:
            return job, age_ns / 1e6
        why = f"{age_ns / 1e6:.0f} ms old at inference start > max_age_ms {self.cfg.max_age_ms:g}"
        self._drop("stale_observation", f"observation {job.stamp_ns} is {why}")
        if self.cfg.trigger != "request":
            return None  # the next observation makes the next job
        latest = self.channel.latest()
        if latest is None or now_ns() - latest[0] > limit_ns:
            self.channel.wait_newer(self.channel.seq, self.cfg.request_wait_ms / 1e3)
            latest = self.channel.latest()
        age_ns = float("inf") if latest is None else now_ns() - latest[0]
        if age_ns > limit_ns:
            return None  # nothing fresh: no chunk; the controller holds, then asks for a fresh one
        self.superseded += 1
        if job.guidance is not None:
            self._drop("guidance_dropped", f"request {job.request_id}: served by a fresh observation without guidance")
        return Job(latest[1], latest[0], job.request_id, None, job.motion_mode), age_ns / 1e6

    def infer(self, job: Job, now_ns: Callable[[], int]) -> Served | list[Served] | None:
        """One inference on ``job`` (None: its observation was too old or its state was
        rejected, and dropped with the reason; pipelined: the chunks this push completed, maybe
        none)."""
        fresh = self.fresh(job, now_ns)
        if fresh is None:
            return None
        job, age_ms = fresh
        policy = self.policy
        with self.lock:
            state = self.state.state_for(job.stamp_ns) if policy.spec.state_dim else None
            reason, why = self.state.last_reason, self.state.last_reject
            episode = self.episode
        if policy.spec.state_dim and state is None:
            self._drop(reason, why)
            return None
        self.obs_age_ms.add(age_ms)
        mode = MODE_NAMES.get(self.motion_mode if job.motion_mode is None else job.motion_mode, "coarse")
        policy.set_motion_mode(mode)
        obs = Observation(images=job.obs.images, instruction=self.instruction_text(), stamp_ns=job.stamp_ns, state=state, episode=episode)
        if self.cfg.trigger == "pipelined":
            return [self._served(c, job.request_id, now_ns, mode) for c in self._pipeline().push(obs)]
        return self._served(policy.infer(obs, guidance=job.guidance), job.request_id, now_ns, mode)

    def _pipeline(self):
        if self.pipeline is None:  # an ar policy's pipelined decode (its own KV cache and planner)
            self.pipeline = self.policy.pipeline(depth=self.cfg.pipeline_depth, steps=self.cfg.pipeline_steps)
        return self.pipeline

    def _served(self, chunk: ActionChunk, request_id: int, now_ns: Callable[[], int], mode: str) -> Served:
        latency_ms = (now_ns() - chunk.stamp_ns) / 1e6
        # One count per inference that started from an empty cache, whoever decided it: the
        # node (instruction, episode, config) or the planner itself (scene cut, camera change).
        reset, self._reset_reason = self._reset_reason or str(chunk.stats.get("reset_reason", "")), ""
        self.resets_total += bool(reset)
        self.chunks += 1
        self.last_chunk_at = time.monotonic()
        self.latency.add(latency_ms)
        self.infer_ms.add(float(chunk.timings_ms.get("total", float("nan"))))
        if "staleness_busy_ms" in chunk.stats:
            self.staleness_ms.add(float(chunk.stats["staleness_busy_ms"]))
        return Served(chunk, request_id, latency_ms, mode, reset)
