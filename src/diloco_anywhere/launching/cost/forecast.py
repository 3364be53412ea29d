"""What a launch will take before it starts: when each platform's limits end an attempt (and
that the keeper starts the next), and what the run costs at list prices. ``diloco launch``
says it, and ``--dry-run`` prints it with the requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco_anywhere.launching.cost.cost_estimate import Estimate, estimate
from diloco_anywhere.launching.cost.limits import LimitPlan, plan_for
from diloco_anywhere.launching.cost.round_plan import round_plan_for
from diloco_anywhere.launching.start.launch import LaunchPlan


@dataclass(frozen=True)
class Forecast:
    limits: LimitPlan
    cost: Estimate

    def as_dict(self) -> dict[str, Any]:
        return {"limits": self.limits.as_dict(), "cost": self.cost.as_dict()}

    @property
    def billed(self) -> bool:
        """Something of the run costs money, or may: a price, a platform off this machine, or
        attempts a time limit ends."""
        cost = self.cost
        here = all(p.cloud == "local" for p in cost.platforms) and cost.store_cloud == "local"
        return cost.usd_per_hour > 0 or not here or self.limits.needs_keeper

    def lines(self) -> list[str]:
        """The plan and the estimate; one line where nothing is billed (replicas on this
        machine and a local store), instead of a table of $0.00."""
        if not self.billed:
            return [
                f"on this machine, with a local store: nothing billed; about "
                f"{_about(self.limits.run_hours)} ({self.limits.step.source})"
            ]
        return [*self.limits.lines(), "", *self.cost.lines()]


def _about(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{max(1, round(hours * 60))} min"


def forecast(plan: LaunchPlan) -> Forecast:
    """The launch's limits and cost, from each platform's settings (``attempt_limit``,
    ``spot_wait_limit``, ``hardware``) and ``[budget]``; contacts nothing. Both count the
    rounds' waiting where platforms' step times differ (``round_plan``)."""
    backends = plan.backends
    attempts = {platform: backend.attempt_limit() for platform, backend in backends.items()}
    spot_waits = {platform: backend.spot_wait_limit() for platform, backend in backends.items()
                  if backend.capabilities.spot_wait}  # fmt: skip
    rounds = round_plan_for(plan.config, backends)
    limits = plan_for(plan.config, attempts, rounds, spot_waits)
    replicas = {platform: (backend.hardware(), len(plan.specs_on(platform)))
                for platform, backend in plan.backends.items()}  # fmt: skip
    return Forecast(limits, estimate(plan.config, replicas, rounds=rounds))
