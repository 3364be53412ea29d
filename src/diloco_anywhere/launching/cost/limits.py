"""The platform-limit plan: how long a run takes, and how many attempts each platform needs.

Every platform but your own ends one attempt of a replica after a limit (Modal's function
timeout, at most 24 h; HF Jobs' timeout; SageMaker's max runtime, and with spot its max wait;
a Kubernetes deadline). A run longer than that limit needs several attempts there, and only
the keeper (``diloco keep``) starts the next one: the plan says so before the launch, so a
3-day run is not left to die after its first day.

The run's length is ``outer_steps x sync_every`` inner steps of the reference pace, each
taking its wall time, waiting included (``round_plan.RoundPlan.wall_step``). Pure functions
of plain numbers: the caller asks each backend for ``attempt_limit()``, and where its
``capabilities.spot_wait`` says it has one, for ``spot_wait_limit()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.cost.round_plan import RoundPlan, StepTime


@dataclass(frozen=True)
class PlatformPlan:
    platform: str
    run_hours: float  # the run's expected wall time
    attempt_limit_hours: float | None  # None: nothing ends an attempt
    attempts: int
    attempt_ends_hours: tuple[float, ...]  # hours from the start at which each attempt ends
    spot_wait_hours: float | None  # SageMaker spot: an attempt's waiting plus running, at most
    sentence: str

    @property
    def needs_keeper(self) -> bool:
        return self.attempts > 1


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def _ends(hours: tuple[float, ...]) -> str:
    shown = [f"{h:.1f}" for h in hours]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def plan_platform(
    platform: str, run_seconds: float, limit: float | None, spot_wait: float | None = None
) -> PlatformPlan:
    """One platform's attempts: ``ceil(run / limit)``, each ending when the limit does, the
    last when the run does. A restart's own time (the keeper's wait and backoff, the job's
    start, healing from the last checkpoint) is not counted: a run that fills its last
    attempt exactly may need one more."""
    run_hours = run_seconds / 3600
    attempts = 1 if limit is None else max(1, math.ceil(run_seconds / limit))
    ends = tuple(limit * k / 3600 for k in range(1, attempts)) if limit else ()
    ends += (run_hours,)
    wait = f" (spot: waiting plus running, at most {_hours(spot_wait)})" if spot_wait else ""
    if limit is None:
        sentence = f"{platform}: no attempt limit; one attempt of {_hours(run_seconds)}."
    elif attempts == 1:
        sentence = (
            f"{platform}: one attempt; its {_hours(limit)} limit{wait} is after the run's "
            f"{_hours(run_seconds)}."
        )
    else:
        sentence = (
            f"{platform}: the run takes {_hours(run_seconds)} and an attempt may run "
            f"{_hours(limit)}{wait}: {attempts} attempts, ending at {_ends(ends)} h; the "
            f"keeper (`diloco keep`) starts the next attempt each time the limit ends one."
        )
    return PlatformPlan(
        platform=platform,
        run_hours=run_hours,
        attempt_limit_hours=None if limit is None else limit / 3600,
        attempts=attempts,
        attempt_ends_hours=ends,
        spot_wait_hours=None if spot_wait is None else spot_wait / 3600,
        sentence=sentence,
    )


@dataclass(frozen=True)
class LimitPlan:
    inner_steps: int
    step: StepTime
    platforms: tuple[PlatformPlan, ...]

    @property
    def run_hours(self) -> float:
        return self.inner_steps * self.step.seconds / 3600

    @property
    def needs_keeper(self) -> bool:
        return any(plan.needs_keeper for plan in self.platforms)

    def as_dict(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "step_seconds": self.step.seconds,
            "step_source": self.step.source,
            "run_hours": self.run_hours,
            "needs_keeper": self.needs_keeper,
            "platforms": [{**asdict(p), "needs_keeper": p.needs_keeper} for p in self.platforms],
        }

    def lines(self) -> list[str]:
        """A plain-text table, one row per platform, then each platform's sentence."""
        rows = [("platform", "run", "attempt limit", "attempts", "attempts end at (h)")]
        for p in self.platforms:
            limit = "none" if p.attempt_limit_hours is None else f"{p.attempt_limit_hours:.1f} h"
            rows.append(
                (p.platform, f"{p.run_hours:.1f} h", limit, str(p.attempts),
                 ", ".join(f"{h:.1f}" for h in p.attempt_ends_hours))
            )  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(map(str.ljust, row, widths)).rstrip() for row in rows]
        header = (
            f"{self.inner_steps:,} inner steps x {self.step.seconds:g} s "
            f"({self.step.source}) = {self.run_hours:.1f} h"
        )
        return [header, *table, *(p.sentence for p in self.platforms)]


def plan_limits(
    inner_steps: int,
    step: StepTime,
    limits: Mapping[str, float | None],
    spot_waits: Mapping[str, float | None] | None = None,
) -> LimitPlan:
    """The plan for a run of ``inner_steps`` steps of ``step`` seconds on each platform of
    ``limits`` (platform -> ``Backend.attempt_limit()``, seconds or None)."""
    run_seconds = inner_steps * step.seconds
    spot_waits = spot_waits or {}
    plans = tuple(
        plan_platform(platform, run_seconds, limit, spot_waits.get(platform))
        for platform, limit in limits.items()
    )
    return LimitPlan(inner_steps, step, plans)


def plan_for(
    config: RunConfig,
    limits: Mapping[str, float | None],
    rounds: RoundPlan,
    spot_waits: Mapping[str, float | None] | None = None,
) -> LimitPlan:
    """The plan for ``config``'s run of rounds as ``rounds`` (``round_plan.round_plan_for``)
    on the platforms of ``limits`` (``{name: backend.attempt_limit()}``), ``spot_waits`` from
    those that have one (``backend.spot_wait_limit()``)."""
    return plan_limits(config.diloco.total_steps, rounds.wall_step, limits, spot_waits)
