"""What one unit costs: a replica-hour, a GB leaving a cloud, 1,000 requests to a store.

Prices are public list prices with their date and source, in ``prices.toml``; run.toml's
``[budget] hourly_usd`` and ``egress_usd_per_gb`` override them (your discounts, your own
cluster). Hardware with no price (local processes, your own Kubernetes cluster, a GPU the table
lacks) counts $0 and is named as unpriced, never hidden. A container's CPU and memory on Modal
are not counted. Kept apart from how much a run uses (``traffic``, ``clouds``), so that the
estimate (``cost_estimate``) and the spend so far (``cost_so_far``) price it the same way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_anywhere.config import BudgetSection

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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
    """The price table shipped with the package (``launching/cost/prices.toml``)."""
    text = resources.files("diloco_anywhere.launching.cost").joinpath("prices.toml").read_text()
    return PriceTable.model_validate(tomllib.loads(text))


# -- Prices of one replica-hour, of a GB leaving a cloud, of requests --------------------------


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


def request_usd(put_list: float, get: float, store: str, prices: PriceTable) -> float | None:
    """The store cloud's bill for these requests; 0 on this machine; None where unpriced."""
    if store == "local":
        return 0.0
    table = prices.requests.get(store)
    if table is None:
        return None
    return (put_list * table["put_list"].usd + get * table["get"].usd) / 1000
