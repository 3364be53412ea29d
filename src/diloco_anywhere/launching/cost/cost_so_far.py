"""What a run has cost so far (``spend``), from its replicas' attempts and the bytes their
metrics count, and when to stop it (``over_budget``): what ``diloco keep`` checks against
``[budget] max_usd`` and ``max_hours`` while the run goes on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from diloco_anywhere.config import BudgetSection, RunConfig
from diloco_anywhere.launching.cost.clouds import egress, platform_cloud, store_cloud
from diloco_anywhere.launching.cost.prices import PriceTable, hourly_price, load_prices
from diloco_anywhere.launching.watch.status import waiting_share

if TYPE_CHECKING:
    from diloco_anywhere.training.records.metrics import ReplicaMetrics


class Attempt(NamedTuple):
    """One attempt of one replica (the keeper's records), times in epoch seconds."""

    platform: str
    hardware: str
    started_at: float
    ended_at: float | None = None  # None: still running


class ReplicaTraffic(NamedTuple):
    platform: str
    bytes_up: int
    bytes_down: int
    waiting: float | None = None  # the share of its time it waited on syncs, idle but billed


def traffic_so_far(metrics: Mapping[str, ReplicaMetrics]) -> list[ReplicaTraffic]:
    """Each replica's bytes so far from its metrics (``MetricsReader.read()``): every
    incarnation's last sync line holds that process's counters; and its waiting share."""
    return [
        ReplicaTraffic(
            replica.platform,
            sum(sync.bytes_up for sync in replica.last_sync_by_incarnation.values()),
            sum(sync.bytes_down for sync in replica.last_sync_by_incarnation.values()),
            waiting_share(replica.syncs, recent=None),
        )
        for replica in metrics.values()
    ]


@dataclass(frozen=True)
class Spend:
    compute_usd: float
    egress_usd: float
    requests_usd: float
    replica_hours: dict[str, float] = field(default_factory=dict)  # by platform
    compute_by_platform: dict[str, float] = field(default_factory=dict)
    egress_by_platform: dict[str, float] = field(default_factory=dict)
    unpriced: tuple[str, ...] = ()
    # the compute billed while replicas waited on syncs (``[diloco] pace = "time"`` trims it)
    idle_by_platform: dict[str, float] = field(default_factory=dict)

    @property
    def usd(self) -> float:
        return self.compute_usd + self.egress_usd + self.requests_usd

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "usd": self.usd}

    def lines(self) -> list[str]:
        lines = [
            f"spent so far (list prices): compute ${self.compute_usd:,.2f} + egress "
            f"${self.egress_usd:,.2f} + requests ${self.requests_usd:,.2f} = ${self.usd:,.2f}"
        ]
        for platform, hours in self.replica_hours.items():
            idle = self.idle_by_platform.get(platform, 0.0)
            lines.append(
                f"  {platform}: {hours:,.1f} replica-h, ${self.compute_by_platform[platform]:,.2f}"
                f" compute"
                + (f" (${idle:,.2f} of it waiting on syncs)" if idle >= 0.005 else "")
                + f", ${self.egress_by_platform.get(platform, 0.0):,.2f} egress"
            )
        lines.extend(f"unpriced (counted as $0): {what}" for what in self.unpriced)
        return lines


def spend(
    attempts: Iterable[Attempt],
    traffic: Iterable[ReplicaTraffic],
    config: RunConfig,
    *,
    now: float,
    requests_usd: float = 0.0,
    prices: PriceTable | None = None,
) -> Spend:
    """The run's spend so far: each attempt's hours at its hourly price, from ``started_at``
    (the job's start: platforms bill its start-up too) to its end, or ``now`` while it runs;
    and the egress of the bytes each replica's metrics say it moved. Nothing counts requests
    as they are made: pass ``requests_usd``, e.g. ``Estimate.requests_usd_per_round`` x the
    outer steps done. Billing granularity (HF Jobs bills whole minutes) is not modelled."""
    prices = prices or load_prices()
    budget = config.budget
    hours: dict[str, float] = {}
    compute: dict[str, float] = {}
    unpriced: list[str] = []
    for attempt in attempts:
        end = now if attempt.ended_at is None else attempt.ended_at
        elapsed = max(0.0, end - attempt.started_at) / 3600
        price = hourly_price(attempt.platform, attempt.hardware, budget, prices)
        hours[attempt.platform] = hours.get(attempt.platform, 0.0) + elapsed
        compute[attempt.platform] = compute.get(attempt.platform, 0.0) + elapsed * (price.usd or 0)
        if price.usd is None:
            unpriced.append(price.source)
    store = store_cloud(config.store_url(), budget)
    moved: dict[str, float] = {}
    traffic = list(traffic)
    for replica in traffic:
        cloud = platform_cloud(replica.platform, budget)
        bill = egress(cloud, store, replica.bytes_up, replica.bytes_down, budget, prices)
        moved[replica.platform] = moved.get(replica.platform, 0.0) + bill.usd
        unpriced.extend(f"{replica.platform}: {what}" for what in bill.unpriced)
    return Spend(
        compute_usd=sum(compute.values()),
        egress_usd=sum(moved.values()),
        requests_usd=requests_usd,
        replica_hours=hours,
        compute_by_platform=compute,
        egress_by_platform=moved,
        unpriced=tuple(dict.fromkeys(unpriced)),  # each once, in order
        idle_by_platform=_idle(compute, traffic),
    )


def _idle(compute: dict[str, float], traffic: list[ReplicaTraffic]) -> dict[str, float]:
    """Each platform's compute times the mean waiting share of its replicas."""
    shares: dict[str, list[float]] = {}
    for replica in traffic:
        if replica.waiting is not None:
            shares.setdefault(replica.platform, []).append(replica.waiting)
    return {
        platform: compute.get(platform, 0.0) * sum(found) / len(found)
        for platform, found in shares.items()
    }


def over_budget(budget: BudgetSection, spent: Spend, hours: float) -> str | None:
    """Why the keeper must stop the run, or None: the spend reached ``[budget] max_usd``, or
    ``hours`` since the launch reached ``max_hours`` (0: no cap)."""
    if budget.max_usd and spent.usd >= budget.max_usd:
        return (
            f"the run's spend at list prices, ${spent.usd:,.2f}, reached [budget] max_usd = "
            f"${budget.max_usd:,.2f}"
        )
    if budget.max_hours and hours >= budget.max_hours:
        return (
            f"the run has run {hours:,.1f} h since its launch, reaching [budget] max_hours = "
            f"{budget.max_hours:g}"
        )
    return None
