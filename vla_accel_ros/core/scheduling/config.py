"""The action-chunk scheduler's knobs, one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from vla_accel_ros.core.config import Config, param
from vla_accel_ros.core.errors import ConfigError

AGGREGATIONS = ("latest_only", "weighted_average", "average", "conservative", "temporal_ensemble")
RTC_SCHEDULES = ("exp", "linear", "ones", "zeros")


@dataclass(frozen=True)
class SchedulerConfig(Config):
    control_rate_hz: float = param(50.0, doc="control loop rate; one action per tick", range=(1.0, 1000.0))
    mode: str = param(
        "async",
        doc="sync: infer, execute execute_horizon actions (holding while inferring), infer again; "
        "async: request the next chunk while the current one executes",
        choices=("sync", "async"),
    )
    execute_horizon: int = param(
        25, doc="sync: actions executed from each chunk before re-inferring", range=(1, 10_000)
    )
    async_threshold: float = param(
        0.5, doc="async: request inference when the queue holds fewer than this fraction of a chunk", range=(0.0, 1.0)
    )
    latency_aware_trigger: bool = param(
        True,
        doc="async: also request once the queue is shorter than the p-latency in steps plus a margin, "
        "so a slow policy cannot starve the queue whatever async_threshold says",
    )
    trigger_margin_steps: int = param(
        1, doc="async: steps of slack on top of the latency-aware trigger", range=(0, 1000)
    )
    aggregation: str = param(
        "weighted_average",
        doc="how overlapping chunks combine on shared time steps (old/new weights: weighted_average 0.3/0.7, "
        "conservative 0.7/0.3, average = running mean of every prediction, temporal_ensemble = ACT exp weights)",
        choices=AGGREGATIONS,
    )
    ensemble_coeff: float = param(
        0.01,
        doc="temporal_ensemble: prediction j of a step (0 = oldest) weighs exp(-coeff*j); negative favours newer",
        range=(-1.0, 1.0),
    )
    hold: str = param(
        "last",
        doc="when the queue runs dry: 'last' repeats the last commanded action, "
        "'none' commands nothing (the robot's own controller holds)",
        choices=("last", "none"),
    )
    blend_steps: int = param(
        5, doc="steps to blend from the held action into a chunk arriving after a hold", range=(0, 1000)
    )
    rtc: bool = param(False, doc="Real-Time Chunking: send guidance so a flow policy continues the executing chunk")
    rtc_execution_horizon: int = param(
        0,
        doc="RTC: new-chunk step where guidance reaches 0, capped by what the previous chunk still covers; "
        "0 = the previous chunk's end (the paper's H - s). LeRobot's 10 leaves no soft region once d >= 10",
        range=(0, 10_000),
    )
    rtc_max_guidance: float = param(10.0, doc="RTC: cap on the guidance gain (beta)", range=(0.0, 1000.0))
    rtc_schedule: str = param(
        "exp", doc="RTC: prefix weight schedule between the frozen prefix and the horizon", choices=RTC_SCHEDULES
    )
    latency_percentile: float = param(95.0, doc="latency percentile used for the delay estimate", range=(50.0, 100.0))
    latency_window: int = param(50, doc="latest latencies kept for the percentile", range=(1, 100_000))
    initial_latency_ms: float = param(
        100.0, doc="latency assumed until the first chunk is measured", range=(0.0, 60_000.0)
    )
    request_timeout_ms: float = param(
        2000.0, doc="an unanswered inference request is given up after this long", range=(1.0, 600_000.0)
    )

    @property
    def dt(self) -> float:
        return 1.0 / self.control_rate_hz

    def validate(self) -> None:
        if self.rtc and self.mode != "async":
            raise ConfigError(
                "SchedulerConfig.rtc=True needs mode='async' (RTC freezes the actions executed while the "
                "next chunk is inferred; in sync mode nothing executes then); set mode='async' or rtc=False"
            )
        if self.rtc and self.aggregation != "latest_only":
            raise ConfigError(
                f"SchedulerConfig.rtc=True splices chunks itself, so aggregation={self.aggregation!r} would "
                "average away the guided continuation; set aggregation='latest_only'"
            )
