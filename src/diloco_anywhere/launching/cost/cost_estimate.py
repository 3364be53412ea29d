"""What a run costs before it starts (``estimate``): per hour and in all, with the rendering
``diloco launch`` and ``--dry-run`` print. The one place that puts the run's length, its
traffic (``traffic``, ``model_size``) and the prices (``prices``, ``clouds``) together.

Three things cost money: the replicas' hardware (replica-hours x each platform's hourly price),
the bytes that leave a cloud (egress), and the store's requests. Egress is what the codec
moves (``[diloco] codec``): beside the run's own, the estimate prices the same run's egress
per day in every codec, so that the choice is made with its price in view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from diloco_anywhere.bucket.codecs.codec_names import CODEC_NAMES
from diloco_anywhere.config import BudgetSection, DilocoSection, RunConfig, describe_codec
from diloco_anywhere.launching.cost.clouds import GIB, Egress, egress, platform_cloud, store_cloud
from diloco_anywhere.launching.cost.model_size import parameter_count
from diloco_anywhere.launching.cost.prices import PriceTable, hourly_price, load_prices, request_usd
from diloco_anywhere.launching.cost.round_plan import RoundPlan, StepTime, round_plan_for
from diloco_anywhere.launching.cost.traffic import (
    RoundTraffic,
    heartbeat_requests_per_hour,
    round_traffic,
)


@dataclass(frozen=True)
class PlatformCost:
    platform: str
    hardware: str
    replicas: int
    cloud: str
    usd_per_replica_hour: float | None  # None: unpriced, counted as 0
    price_source: str
    price_reference: str  # the table's source of a list price
    egress_usd_per_round: float  # one replica's, per outer step
    waiting: float = 0.0  # the share of each round its replicas wait for others'


@dataclass(frozen=True)
class Estimate:
    hours: float  # the run's expected wall time
    rounds: int  # outer steps
    step: StepTime  # wall seconds per reference step, waiting included
    pace: str  # [diloco] pace, for the fix of waiting
    parameters: int | None
    parameters_source: str
    traffic: RoundTraffic | None  # per replica per outer step; None: parameters unknown
    store_cloud: str
    platforms: tuple[PlatformCost, ...]
    compute_usd_per_hour: float
    egress_usd_per_hour: float
    requests_usd_per_hour: float
    unpriced: tuple[str, ...]  # what counted $0 for want of a price
    codec: str = ""  # the run's, as ``egress_usd_per_day_by_codec`` names it
    # the same run's egress per day (all replicas) in each codec, the run's own included;
    # empty when the model's size is unknown
    egress_usd_per_day_by_codec: dict[str, float] = field(default_factory=dict)

    @property
    def usd_per_hour(self) -> float:
        return self.compute_usd_per_hour + self.egress_usd_per_hour + self.requests_usd_per_hour

    @property
    def usd(self) -> float:
        return self.usd_per_hour * self.hours

    @property
    def waiting_usd_per_hour(self) -> float:
        """What the replicas cost while they wait for others' rounds: billed, not training."""
        return sum((p.usd_per_replica_hour or 0.0) * p.replicas * p.waiting for p in self.platforms)

    @property
    def requests_usd_per_round(self) -> float:
        """All replicas' request bill per outer step: what ``spend`` takes as ``requests_usd``
        times the rounds done so far."""
        return self.requests_usd_per_hour * self.hours / self.rounds

    @property
    def waiting_fix(self) -> str:
        if self.pace == "steps":
            return 'with [diloco] pace = "time" they train instead'
        return "set [diloco] min_round_steps lower for the slowest, or round_seconds longer"

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "usd_per_hour": self.usd_per_hour,
            "usd": self.usd,
            "waiting_usd_per_hour": self.waiting_usd_per_hour,
            "requests_usd_per_round": self.requests_usd_per_round,
        }

    def lines(self) -> list[str]:
        """For people: the run, the traffic, a row per platform, the totals, what is unpriced."""
        lines = [
            f"cost estimate at list prices (override in run.toml [budget]): {self.hours:.1f} h, "
            f"{self.rounds:,} outer steps ({self.step.source})",
            f"model: {_count(self.parameters)} parameters ({self.parameters_source})",
        ]
        if self.traffic is not None:
            lines.append(
                f"per replica per outer step ({self.traffic.mode}): "
                f"{_size(self.traffic.up)} up, {_size(self.traffic.down)} down, "
                f"{self.traffic.put_list + self.traffic.get:,.0f} requests; "
                f"store in {self.store_cloud}"
            )
        for p in self.platforms:
            hourly = p.usd_per_replica_hour
            price = "unpriced" if hourly is None else f"${hourly:,.2f} ({p.price_source})"
            waits = f", waits {p.waiting:.0%} of each round" if p.waiting >= 0.005 else ""
            lines.append(
                f"  {p.platform} x{p.replicas} {p.hardware or '(own machines)'} in {p.cloud}: "
                f"{price} per replica-hour, egress ${p.egress_usd_per_round:,.4f} per replica "
                f"and outer step{waits}"
            )
        per_hour = (self.compute_usd_per_hour, self.egress_usd_per_hour, self.requests_usd_per_hour)
        for label, scale in (("per hour", 1.0), ("whole run", self.hours)):
            compute, egress_, requests = (value * scale for value in per_hour)
            lines.append(
                f"{label}: compute ${compute:,.2f} + egress ${egress_:,.2f} + requests "
                f"${requests:,.2f} = ${compute + egress_ + requests:,.2f}"
            )
        if self.waiting_usd_per_hour:
            lines.append(
                f"of it waiting for slower replicas: ${self.waiting_usd_per_hour:,.2f} per hour, "
                f"${self.waiting_usd_per_hour * self.hours:,.2f} in all ({self.waiting_fix})"
            )
        if self.egress_usd_per_day_by_codec:
            by_codec = ", ".join(
                f"{codec} ${usd:,.2f}" for codec, usd in self.egress_usd_per_day_by_codec.items()
            )
            lines.append(f"egress per day by codec ([diloco] codec; this run's: {self.codec}): "
                         f"{by_codec}")  # fmt: skip
        lines.extend(f"unpriced (counted as $0): {what}" for what in self.unpriced)
        return lines


def _count(parameters: int | None) -> str:
    return "?" if parameters is None else f"{parameters:,}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes / 1024:,.1f} KiB"


def estimate(
    config: RunConfig,
    replicas: Mapping[str, tuple[str, int]],
    *,
    rounds: RoundPlan | None = None,
    parameters: tuple[int | None, str] | None = None,
    prices: PriceTable | None = None,
) -> Estimate:
    """What ``config``'s run costs with ``replicas`` (platform -> (``Backend.hardware()``,
    replica count)): per hour and in all. ``rounds`` (``round_plan.round_plan_for``) defaults
    to the round of ``[budget] step_seconds`` and ``platform_step_seconds``, or the stated
    assumption; ``parameters`` to ``parameter_count(config)``."""
    prices = prices or load_prices()
    budget = config.budget
    paced = rounds or round_plan_for(config, replicas)
    count, count_source = parameters or parameter_count(config)
    n = sum(number for _, number in replicas.values())
    rounds = config.diloco.outer_steps
    round_hours = config.diloco.fragments * paced.round_seconds / 3600  # an outer step's
    store = store_cloud(config.store_url(), budget)
    traffic = None if count is None else _traffic(config, config.diloco, count, n)
    unpriced = [] if count is not None else [f"egress and per-round requests: {count_source}"]
    platforms = []
    for platform, (hardware, number) in replicas.items():
        cost, missing = _platform_cost(platform, hardware, number, traffic, store, budget, prices)
        platforms.append(replace(cost, waiting=paced.waiting_of(platform)))
        unpriced.extend(missing)
    compute = sum((p.usd_per_replica_hour or 0.0) * p.replicas for p in platforms)
    egress_per_round = sum(p.egress_usd_per_round * p.replicas for p in platforms)
    by_codec = {} if count is None else {
        describe_codec(codec.codec, codec.sparse): 24 / round_hours * _egress_per_round(
            _traffic(config, codec, count, n), replicas, store, budget, prices
        )
        for codec in _codecs(config.diloco)
    }  # fmt: skip
    requests = _requests_per_hour(traffic, n, round_hours, config.sync.lease_period, store, prices)
    if requests is None:
        unpriced.append(f"requests to a store in {store} (no request prices)")
    return Estimate(
        hours=rounds * round_hours,
        rounds=rounds,
        step=paced.wall_step,
        pace=config.diloco.pace,
        parameters=count,
        parameters_source=count_source,
        traffic=traffic,
        store_cloud=store,
        platforms=tuple(platforms),
        compute_usd_per_hour=compute,
        egress_usd_per_hour=egress_per_round / round_hours,
        requests_usd_per_hour=requests or 0.0,
        unpriced=tuple(unpriced),
        codec=describe_codec(config.diloco.codec, config.diloco.sparse),
        egress_usd_per_day_by_codec=by_codec,
    )


def _codecs(diloco: DilocoSection) -> list[DilocoSection]:
    """Every codec, with the run's sparse settings: the alternatives to price."""
    return [diloco.model_copy(update={"codec": name}) for name in CODEC_NAMES]


def _traffic(config: RunConfig, diloco: DilocoSection, count: int, replicas: int) -> RoundTraffic:
    """One replica's traffic per outer step of ``config``'s run sent in ``diloco``'s codec."""
    return round_traffic(
        count, diloco.codec, replicas, config.sync.mode, diloco.fragments,
        int(config.sync.part_size), diloco.codec_params(),
    )  # fmt: skip


def _egress_per_round(
    traffic: RoundTraffic,
    replicas: Mapping[str, tuple[str, int]],
    store: str,
    budget: BudgetSection,
    prices: PriceTable,
) -> float:
    """All replicas' egress bill for one outer step of ``traffic`` each."""
    return sum(
        egress(
            platform_cloud(platform, budget), store, traffic.up, traffic.down, budget, prices
        ).usd
        * number
        for platform, (_, number) in replicas.items()
    )


def _platform_cost(
    platform: str,
    hardware: str,
    replicas: int,
    traffic: RoundTraffic | None,
    store: str,
    budget: BudgetSection,
    prices: PriceTable,
) -> tuple[PlatformCost, list[str]]:
    """One platform's row of the estimate, and what in it has no price."""
    price = hourly_price(platform, hardware, budget, prices)
    cloud = platform_cloud(platform, budget)
    bill = Egress(0.0)
    if traffic is not None:
        bill = egress(cloud, store, traffic.up, traffic.down, budget, prices)
    cost = PlatformCost(
        platform=platform,
        hardware=hardware,
        replicas=replicas,
        cloud=cloud,
        usd_per_replica_hour=price.usd,
        price_source=price.source,
        price_reference=price.reference,
        egress_usd_per_round=bill.usd,
    )
    unpriced = [price.source] if price.usd is None else []
    return cost, unpriced + [f"{platform}: {what}" for what in bill.unpriced]


def _requests_per_hour(
    traffic: RoundTraffic | None,
    replicas: int,
    round_hours: float,
    lease_period: float,
    store: str,
    prices: PriceTable,
) -> float | None:
    """All replicas' request bill per hour: their rounds' requests and their heartbeats'."""
    put_list, get = heartbeat_requests_per_hour(lease_period)
    if traffic is not None:
        put_list += traffic.put_list / round_hours
        get += traffic.get / round_hours
    usd = request_usd(put_list, get, store, prices)
    return None if usd is None else usd * replicas
