"""How long a round takes before the run has measured one, and what share of it each platform
waits for the others: what the platform-limit plan and the cost estimate price.

A step's wall time is ``[budget] step_seconds``, else measured from the run's metrics, else
``ASSUMED_STEP_SECONDS``, said as an assumption.

Every replica is billed for the whole round, training or waiting. With ``[diloco] pace =
"steps"`` every replica trains the same steps, so a round lasts as long as the slowest
platform needs and the faster ones wait the rest; with ``"time"`` each trains the steps that
fit the round (``DilocoSection.steps_to_fit``, the rule the replicas' pacers use), so only
one too slow to reach ``min_round_steps`` holds the others up. A platform's step time is ``[budget]
platform_step_seconds`` where its hardware differs, else the run's one step time
(``step_time``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from diloco_anywhere.backends import BACKENDS
from diloco_anywhere.config import ConfigError, DilocoSection, RunConfig

ASSUMED_STEP_SECONDS = 1.0  # a guess, said as one; a 1B model on one GPU is about this
# A pair of step lines further apart than this many times the median step is a restart or a
# heal in between, not training: left out of the measured step time.
GAP_FACTOR = 10.0


class _StepLine(Protocol):
    step: int
    time: float


class _Replica(Protocol):
    steps: list[Any]


@dataclass(frozen=True)
class StepTime:
    seconds: float
    source: str  # where it came from, for people: "[budget] step_seconds", "measured ..."


def step_time(configured: float | None, measured: float | None = None) -> StepTime:
    """``[budget] step_seconds`` wins (the user knows the hardware); then the run's own
    measurement; then an assumption that says how to replace it."""
    if configured is not None:
        return StepTime(configured, "[budget] step_seconds")
    if measured is not None:
        return StepTime(measured, "measured from the run's metrics")
    return StepTime(
        ASSUMED_STEP_SECONDS,
        f"assumed {ASSUMED_STEP_SECONDS:g} s per inner step: set [budget] step_seconds",
    )


def _seconds_per_step(lines: list[_StepLine]) -> tuple[float, float] | None:
    """(seconds, steps) between consecutive step lines of one replica, without the gaps where
    it restarted or healed (a step count that did not go up, or a pause of many steps)."""
    pairs = [
        (b.time - a.time, b.step - a.step)
        for a, b in itertools.pairwise(lines)
        if b.step > a.step and b.time > a.time
    ]
    if not pairs:
        return None
    typical = statistics.median(seconds / steps for seconds, steps in pairs)
    kept = [(s, n) for s, n in pairs if s / n <= GAP_FACTOR * typical]
    return sum(s for s, _ in kept), sum(n for _, n in kept)


def measured_step_seconds(metrics: Mapping[str, _Replica]) -> float | None:
    """Wall seconds per inner step, the median over replicas, from their step lines (each a
    ``step`` count and a ``time``: ``training.metrics.ReplicaMetrics.steps``). Sync waits are
    inside it, as they are inside the run's length. None before two lines of one replica."""
    rates = []
    for replica in metrics.values():
        measured = _seconds_per_step(replica.steps)
        if measured is not None:
            rates.append(measured[0] / measured[1])
    return statistics.median(rates) if rates else None


@dataclass(frozen=True)
class PlatformPace:
    platform: str
    step_seconds: float
    round_steps: int  # the inner steps one of its replicas trains a round
    waiting: float  # the share of each round it waits for the others, 0 to 1


@dataclass(frozen=True)
class RoundPlan:
    pace: str  # [diloco] pace
    round_seconds: float  # wall seconds of one round (one fragment's sync)
    reference_steps: int  # [diloco] round_steps: what the run's length is counted in
    platforms: tuple[PlatformPace, ...]
    step: StepTime  # the run's one step time, for platforms not given their own

    @property
    def wall_step(self) -> StepTime:
        """Wall seconds per reference step, waiting included: ``total_steps`` of them make
        the run's length."""
        seconds = self.round_seconds / self.reference_steps
        if abs(seconds - self.step.seconds) <= 1e-9 * seconds:
            return self.step
        return StepTime(
            seconds,
            f"{self.step.source}; with pace = {self.pace!r} a round of {self.reference_steps} "
            f"steps takes {self.round_seconds:,.4g} s",
        )

    def waiting_of(self, platform: str) -> float:
        return next((p.waiting for p in self.platforms if p.platform == platform), 0.0)

    def lines(self) -> list[str]:
        """One line per platform whose replicas wait, with the fix where there is one."""
        fix = ' (pace = "time" lets them train instead)' if self.pace == "steps" else ""
        return [
            f"  {p.platform} waits {p.waiting:.0%} of each round ({p.round_steps} steps of "
            f"{p.step_seconds:g} s in a round of {self.round_seconds:.3g} s){fix}"
            for p in self.platforms
            if p.waiting >= 0.005
        ]


def plan_rounds(
    diloco: DilocoSection,
    step: StepTime,
    platforms: Iterable[str],
    platform_step_seconds: Mapping[str, float] | None = None,
) -> RoundPlan:
    """The round of a run on ``platforms`` whose steps take ``platform_step_seconds`` (a
    platform absent from it: ``step``); ``ConfigError`` for a key that names no platform."""
    names = tuple(platforms)
    given = dict(platform_step_seconds or {})
    unknown = sorted(set(given) - set(BACKENDS))
    if unknown:
        raise ConfigError(
            f"[budget] platform_step_seconds: {', '.join(map(repr, unknown))}: not a platform; "
            f"the platforms are {', '.join(BACKENDS)}"
        )
    seconds = {name: given.get(name, step.seconds) for name in names}
    steps = _steps_per_round(diloco, seconds)
    round_seconds = max((steps[n] * seconds[n] for n in names), default=0.0)
    round_seconds = round_seconds or diloco.round_steps * step.seconds
    paces = tuple(
        PlatformPace(n, seconds[n], steps[n], 1 - steps[n] * seconds[n] / round_seconds)
        for n in names
    )
    return RoundPlan(diloco.pace, round_seconds, diloco.round_steps, paces, step)


def _steps_per_round(diloco: DilocoSection, seconds: Mapping[str, float]) -> dict[str, int]:
    """Each platform's steps a round, as its replicas' pacers decide them once measured."""
    if diloco.pace == "steps" or not seconds:
        return {name: diloco.round_steps for name in seconds}
    length = diloco.round_seconds or diloco.round_steps * min(seconds.values())
    return {name: diloco.steps_to_fit(length, each) for name, each in seconds.items()}


def round_plan_for(
    config: RunConfig, platforms: Iterable[str], metrics: Mapping[str, _Replica] | None = None
) -> RoundPlan:
    """The round of ``config``'s run on ``platforms``: ``metrics`` (``MetricsReader.read()``)
    once the run has some, for its measured step time."""
    measured = measured_step_seconds(metrics) if metrics else None
    step = step_time(config.budget.step_seconds or None, measured)
    return plan_rounds(config.diloco, step, platforms, config.budget.platform_step_seconds)
