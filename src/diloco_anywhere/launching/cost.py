"""What a run costs: before it starts (``estimate``) and so far (``spend``), and when to stop it
(``over_budget``).

Three things cost money: the replicas' hardware (replica-hours x each platform's hourly price),
the bytes that leave a cloud (egress), and the store's requests. Prices are public list prices
with their date and source, in ``prices.toml``; run.toml's ``[budget] hourly_usd`` and
``egress_usd_per_gb`` override them (your discounts, your own cluster). Hardware with no price
(local processes, your own Kubernetes cluster, a GPU the table lacks) counts $0 and is named as
unpriced, never hidden.

Where the bytes go (docs/collective.md, "One round"): per outer step each replica puts its
encoded pseudo-gradient, ``P`` bytes, and reads the others'. ``gather`` reads ``(n - 1) P``;
``sharded`` puts ``P (1 + 1/n)`` (its contribution and its reduced shard) and reads
``2 P (n - 1) / n``; ``[sync] mode = "auto"`` picks per round as the sealer does
(``RoundPolicy.exchange_mode``). Wire headers, manifests and records are small and not counted.

Egress, by where each replica runs against where the store is (``[budget] clouds`` overrides
both): ``s3://`` is AWS, ``gs://`` GCP, ``az://`` Azure, ``hf://`` Hugging Face, a path this
machine. SageMaker runs in AWS (and, assumed, the bucket's region: free between them); Modal
and HF Jobs run outside the bucket's cloud unless it is HF's own for HF Jobs; a Kubernetes
cluster's cloud is unknown unless run.toml says. Bytes a replica reads from a store in
another cloud are billed at the store cloud's egress price; bytes it writes from another cloud
are billed at its own cloud's (Modal and HF list none; an unknown cloud's is named as
unpriced). Bytes to or from this machine cost nothing per GB. Checkpoints (written
every ``[checkpoint] every`` syncs and read when a replica heals) and a container's CPU and
memory on Modal are not counted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from fsspec.utils import get_protocol
from pydantic import BaseModel, ConfigDict, Field

from diloco_anywhere.config import BudgetSection, RunConfig
from diloco_anywhere.launching.limits import StepTime, step_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from diloco_anywhere.training.metrics import ReplicaMetrics

GIB = 1 << 30  # a GB of data transfer as AWS and GCP bill it
GPT_ENTRYPOINT = "diloco_anywhere.tasks.gpt:build"
# Where each platform's replicas run, for egress; ``[budget] clouds`` overrides.
PLATFORM_CLOUDS = {
    "sagemaker": "aws", "modal": "modal", "hf_jobs": "hf", "local": "local", "k8s": "unknown",
}  # fmt: skip
STORE_CLOUDS = {
    "s3": "aws", "s3a": "aws", "gs": "gcp", "gcs": "gcp", "az": "azure", "abfs": "azure",
    "abfss": "azure", "hf": "hf", "file": "local", "local": "local", "memory": "local",
}  # fmt: skip
# Requests of one round beyond its parts (docs/collective.md, "One round" and "What it
# costs"), approximate: the listings of members/ at its start and before its SEAL, and its
# polls (one get_many of the SEAL and the manifests still missing, every 50-200 ms while the
# contributions arrive, then slower): 50 polls of about 2 keys, ~10 s of waiting.
LISTS_PER_ROUND = 2
POLL_GETS_PER_ROUND = 100


class Price(BaseModel):
    """One entry of ``prices.toml``: a list price, its unit, when and where it was read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    usd: float = Field(ge=0)
    per: Literal["GPU-second", "hour", "GB", "1000 requests"]
    date: str = Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$")
    source: str = Field(min_length=1)


class PriceTable(BaseModel):
    """``compute``: platform -> hardware -> price of one replica (per GPU-second, or per
    hour); ``egress``: cloud -> per GB leaving it; ``requests``: store cloud -> put_list, get
    per 1,000."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute: dict[str, dict[str, Price]]
    egress: dict[str, Price]
    requests: dict[str, dict[Literal["put_list", "get"], Price]]


@cache
def load_prices() -> PriceTable:
    """The price table shipped with the package (``launching/prices.toml``)."""
    text = resources.files("diloco_anywhere.launching").joinpath("prices.toml").read_text()
    return PriceTable.model_validate(tomllib.loads(text))


# -- Prices of one replica-hour, and of a GB leaving a cloud ---------------------------------


@dataclass(frozen=True)
class HourlyPrice:
    usd: float | None  # None: no price, counted as $0 and named
    source: str  # short: the override, the list price's date, or what to set
    reference: str = ""  # a list price's source, from the table


def hourly_price(
    platform: str, hardware: str, budget: BudgetSection, prices: PriceTable
) -> HourlyPrice:
    """USD per replica-hour: ``[budget] hourly_usd`` ("platform/hardware", then "platform"),
    else the table's list price (a Modal ``NAME:count`` is count GPUs billed per second)."""
    for key in (f"{platform}/{hardware}", platform):
        if key in budget.hourly_usd:
            return HourlyPrice(budget.hourly_usd[key], f'run.toml [budget] hourly_usd."{key}"')
    if not hardware:
        return HourlyPrice(
            None,
            f"{platform}: no hardware named, so no list price (your own machines, or CPU only): "
            f"set [budget] hourly_usd.{platform}",
        )
    name, _, count = hardware.partition(":")
    table = prices.compute.get(platform, {})
    entry = table.get(name) or table.get(name.upper())
    if entry is None:
        return HourlyPrice(
            None,
            f"{platform} {hardware}: not in the price table: set [budget] "
            f'hourly_usd."{platform}/{hardware}"',
        )
    per_hour = entry.usd * (3600 if entry.per == "GPU-second" else 1)
    gpus = int(count) if count.isdigit() else 1
    return HourlyPrice(per_hour * gpus, f"list price of {entry.date}", entry.source)


def egress_price(cloud: str, budget: BudgetSection, prices: PriceTable) -> float | None:
    """USD per GB leaving ``cloud``: ``[budget] egress_usd_per_gb``, else the table's; 0 from
    this machine (a connection is not billed per GB); None where unknown."""
    if cloud in budget.egress_usd_per_gb:
        return budget.egress_usd_per_gb[cloud]
    if cloud == "local":
        return 0.0
    entry = prices.egress.get(cloud)
    return None if entry is None else entry.usd


def platform_cloud(platform: str, budget: BudgetSection) -> str:
    return budget.clouds.get(platform, PLATFORM_CLOUDS.get(platform, "unknown"))


def store_cloud(url: str, budget: BudgetSection) -> str:
    """The cloud a store URL lives in (an ``s3://`` URL with another endpoint, such as R2 or
    MinIO, is still read as AWS: say ``[budget] clouds.store``)."""
    scheme = get_protocol(url) if "://" in url else "file"
    return budget.clouds.get("store", STORE_CLOUDS.get(scheme, "unknown"))


@dataclass(frozen=True)
class Egress:
    usd: float
    unpriced: tuple[str, ...] = ()  # traffic leaving a place with no price, for people


def egress(
    replica_cloud: str,
    store: str,
    up: float,
    down: float,
    budget: BudgetSection,
    prices: PriceTable,
) -> Egress:
    """The egress bill of ``up`` bytes a replica in ``replica_cloud`` writes to a store in
    ``store`` and ``down`` bytes it reads: free within one cloud (one region assumed); else the
    reads leave the store's cloud and the writes the replica's."""
    if replica_cloud == store and store != "unknown":
        return Egress(0.0)
    usd, unpriced = 0.0, []
    for cloud, nbytes, what in ((store, down, "reads"), (replica_cloud, up, "writes")):
        price = egress_price(cloud, budget, prices)
        if not nbytes:
            continue
        if price is None and cloud == "unknown":
            unpriced.append(f"{what} from an unknown cloud: say where it runs in [budget] clouds")
        elif price is None:
            unpriced.append(f"{what} leaving {cloud}: set [budget] egress_usd_per_gb.{cloud}")
        else:
            usd += price * nbytes / GIB
    return Egress(usd, tuple(unpriced))


# -- Traffic and requests of one outer step ----------------------------------------------------


@dataclass(frozen=True)
class RoundTraffic:
    """One replica's bytes and requests per outer step (every fragment synced once)."""

    mode: str  # gather or sharded (the first fragment's, where they differ)
    payload: int  # bytes of one encoded contribution
    up: int
    down: int
    parts: int  # objects of one contribution
    put_list: float  # requests: puts and listings
    get: float


def fragment_sizes(parameters: int, fragments: int) -> list[int]:
    """Elements per fragment: consecutive parameters in about equal shares."""
    base, extra = divmod(parameters, fragments)
    return [base + (index < extra) for index in range(fragments)]


def exchange_bytes(mode: str, payload: int, replicas: int) -> tuple[int, int]:
    """(up, down) bytes per replica for one round of ``payload`` bytes (docs/collective.md)."""
    n = replicas
    if mode == "gather":
        return payload, (n - 1) * payload
    return payload * (n + 1) // n, 2 * payload * (n - 1) // n


def exchange_requests(mode: str, parts: int, replicas: int) -> tuple[float, float]:
    """(put_list, get) requests per replica for one round of ``parts`` parts each: the parts,
    the manifest, the round's listings and polls; sharded adds the reduced shards it owns and
    reads the others' instead of whole contributions."""
    n = replicas
    put_list = parts + 1 + LISTS_PER_ROUND
    if mode == "gather":
        return put_list, (n - 1) * (parts + 1) + POLL_GETS_PER_ROUND
    shard = parts / n
    return put_list + shard, 2 * (n - 1) * shard + (n - 1) + POLL_GETS_PER_ROUND


def round_traffic(
    parameters: int,
    codec: str,
    replicas: int,
    mode: str = "auto",
    fragments: int = 1,
    part_size: int = 4 << 20,
) -> RoundTraffic:
    """Bytes and requests per replica per outer step: a round per fragment, each split into
    parts and exchanged as the round does (``collective/round.py``), plus one metrics chunk."""
    from diloco_anywhere.bucket.codec import make_codec
    from diloco_anywhere.collective.policy import RoundPolicy
    from diloco_anywhere.collective.round import part_ranges

    encoder, policy = make_codec(codec), RoundPolicy(mode=mode)  # type: ignore[arg-type]
    modes, totals = [], [0.0] * 6  # payload, parts, up, down, put_list, get
    for numel in fragment_sizes(parameters, fragments):
        payload = encoder.payload_nbytes(numel)
        parts = len(part_ranges(numel, encoder, part_size // 4, replicas))
        chosen = policy.exchange_mode(replicas, payload)
        modes.append(chosen)
        values = (payload, parts, *exchange_bytes(chosen, payload, replicas),
                  *exchange_requests(chosen, parts, replicas))  # fmt: skip
        totals = [total + value for total, value in zip(totals, values, strict=True)]
    payload, parts, up, down, put_list, get = totals
    return RoundTraffic(
        modes[0], int(payload), int(up), int(down), int(parts), put_list + 1, get
    )  # + 1: the metrics chunk


def heartbeat_requests_per_hour(lease_period: float) -> tuple[float, float]:
    """(put_list, get) a replica's heartbeat makes per hour: each lease period a listing of
    members/, its lease's put and its claim's read (the delete is free; the clock's HEAD
    every 30 periods is left out)."""
    periods = 3600 / lease_period
    return 2 * periods, periods


def request_usd(put_list: float, get: float, store: str, prices: PriceTable) -> float | None:
    """The store cloud's bill for these requests; 0 on this machine; None where unpriced."""
    if store == "local":
        return 0.0
    table = prices.requests.get(store)
    if table is None:
        return None
    return (put_list * table["put_list"].usd + get * table["get"].usd) / 1000


# -- The model's size, before any training -----------------------------------------------------


def _gpt_parameters(options: Mapping[str, Any]) -> int:
    """The built-in GPT's parameter count, its modules built on the meta device: shapes, no
    memory, no weights, no corpus (``tasks/gpt.py`` reads ``preset`` and ``seq_len`` so)."""
    import torch

    from diloco_anywhere.tasks import gpt

    name = options.get("preset", "tiny")
    if name not in gpt.PRESETS:
        raise ValueError(f"task preset {name!r} unknown; choose one of {list(gpt.PRESETS)}")
    preset = gpt.PRESETS[name]
    seq_len = int(options.get("seq_len", preset.seq_len))
    with torch.device("meta"):
        model = gpt.GPT(gpt.Preset(preset.layers, preset.d_model, preset.heads, seq_len),
                        torch.Generator())  # fmt: skip
    return sum(parameter.numel() for parameter in model.parameters())


def parameter_count(config: RunConfig) -> tuple[int | None, str]:
    """(parameters, where the number came from): ``[budget] parameters``; else the built-in
    GPT task counted on the meta device; else None, saying what to set. Other tasks are not
    built here: building one may download weights or data (the Hugging Face task does)."""
    if config.budget.parameters:
        return config.budget.parameters, "[budget] parameters"
    missing = "unknown: set [budget] parameters (the model's parameter count)"
    if config.task.command or config.task.entrypoint != GPT_ENTRYPOINT:
        what = "[task] command" if config.task.command else config.task.entrypoint
        return None, f"{missing}; {what} is not built before training"
    try:
        return _gpt_parameters(config.task.options), "the built-in GPT task, counted on meta"
    except (ValueError, TypeError, RuntimeError) as exc:  # what a bad option raises in torch
        return None, f"{missing}; the GPT task's [task.options] do not build: {exc}"


# -- The estimate --------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Estimate:
    hours: float  # the run's expected wall time
    rounds: int  # outer steps
    step: StepTime
    parameters: int | None
    parameters_source: str
    traffic: RoundTraffic | None  # per replica per outer step; None: parameters unknown
    store_cloud: str
    platforms: tuple[PlatformCost, ...]
    compute_usd_per_hour: float
    egress_usd_per_hour: float
    requests_usd_per_hour: float
    unpriced: tuple[str, ...]  # what counted $0 for want of a price

    @property
    def usd_per_hour(self) -> float:
        return self.compute_usd_per_hour + self.egress_usd_per_hour + self.requests_usd_per_hour

    @property
    def usd(self) -> float:
        return self.usd_per_hour * self.hours

    @property
    def requests_usd_per_round(self) -> float:
        """All replicas' request bill per outer step: what ``spend`` takes as ``requests_usd``
        times the rounds done so far."""
        return self.requests_usd_per_hour * self.hours / self.rounds

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "usd_per_hour": self.usd_per_hour,
            "usd": self.usd,
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
            lines.append(
                f"  {p.platform} x{p.replicas} {p.hardware or '(own machines)'} in {p.cloud}: "
                f"{price} per replica-hour, egress ${p.egress_usd_per_round:,.4f} per replica "
                f"and outer step"
            )
        per_hour = (self.compute_usd_per_hour, self.egress_usd_per_hour, self.requests_usd_per_hour)
        for label, scale in (("per hour", 1.0), ("whole run", self.hours)):
            compute, egress_, requests = (value * scale for value in per_hour)
            lines.append(
                f"{label}: compute ${compute:,.2f} + egress ${egress_:,.2f} + requests "
                f"${requests:,.2f} = ${compute + egress_ + requests:,.2f}"
            )
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
    step: StepTime | None = None,
    parameters: tuple[int | None, str] | None = None,
    prices: PriceTable | None = None,
) -> Estimate:
    """What ``config``'s run costs with ``replicas`` (platform -> (``Backend.hardware()``,
    replica count)): per hour and in all. ``step`` defaults to ``[budget] step_seconds`` or
    the stated assumption (``limits.step_time``; pass the plan's ``step`` once the run has
    measured one); ``parameters`` to ``parameter_count(config)``."""
    prices = prices or load_prices()
    budget = config.budget
    step = step or step_time(budget.step_seconds or None)
    count, count_source = parameters or parameter_count(config)
    n = sum(number for _, number in replicas.values())
    rounds = config.diloco.outer_steps
    round_hours = config.diloco.sync_every * step.seconds / 3600
    store = store_cloud(config.store_url(), budget)
    traffic = None if count is None else round_traffic(
        count, config.diloco.codec, n, config.sync.mode, config.diloco.fragments,
        int(config.sync.part_size),
    )  # fmt: skip
    unpriced = [] if count is not None else [f"egress and per-round requests: {count_source}"]
    platforms = []
    for platform, (hardware, number) in replicas.items():
        cost, missing = _platform_cost(platform, hardware, number, traffic, store, budget, prices)
        platforms.append(cost)
        unpriced.extend(missing)
    compute = sum((p.usd_per_replica_hour or 0.0) * p.replicas for p in platforms)
    egress_per_round = sum(p.egress_usd_per_round * p.replicas for p in platforms)
    requests = _requests_per_hour(traffic, n, round_hours, config.sync.lease_period, store, prices)
    if requests is None:
        unpriced.append(f"requests to a store in {store} (no request prices)")
    return Estimate(
        hours=rounds * round_hours,
        rounds=rounds,
        step=step,
        parameters=count,
        parameters_source=count_source,
        traffic=traffic,
        store_cloud=store,
        platforms=tuple(platforms),
        compute_usd_per_hour=compute,
        egress_usd_per_hour=egress_per_round / round_hours,
        requests_usd_per_hour=requests or 0.0,
        unpriced=tuple(unpriced),
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


# -- Spend so far, and the cap ----------------------------------------------------------------


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


def traffic_so_far(metrics: Mapping[str, ReplicaMetrics]) -> list[ReplicaTraffic]:
    """Each replica's bytes so far from its metrics (``MetricsReader.read()``): every
    incarnation's last sync line holds that process's counters."""
    return [
        ReplicaTraffic(
            replica.platform,
            sum(sync.bytes_up for sync in replica.last_sync_by_incarnation.values()),
            sum(sync.bytes_down for sync in replica.last_sync_by_incarnation.values()),
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
            lines.append(
                f"  {platform}: {hours:,.1f} replica-h, ${self.compute_by_platform[platform]:,.2f}"
                f" compute, ${self.egress_by_platform.get(platform, 0.0):,.2f} egress"
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
    )


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
