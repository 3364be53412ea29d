"""Where a run's bytes leave a cloud, and what that egress costs: the one part of the bill that
depends on where each replica runs against where the store is, for the estimate
(``cost_estimate``) and the spend so far (``cost_so_far``) alike.

Egress, by where each replica runs against where the store is (``[budget] clouds`` overrides
both): ``s3://`` is AWS, ``gs://`` GCP, ``az://`` Azure, ``hf://`` Hugging Face, a path this
machine. SageMaker runs in AWS (and, assumed, the bucket's region: free between them); Modal
and HF Jobs run outside the bucket's cloud unless it is HF's own for HF Jobs; a Kubernetes
cluster's cloud is unknown unless run.toml says. Bytes a replica reads from a store in
another cloud are billed at the store cloud's egress price; bytes it writes from another cloud
are billed at its own cloud's (Modal and HF list none; an unknown cloud's is named as
unpriced). Bytes to or from this machine cost nothing per GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsspec.utils import get_protocol

from diloco_anywhere.config import BudgetSection
from diloco_anywhere.launching.cost.prices import PriceTable, egress_price

GIB = 1 << 30  # a GB of data transfer as AWS and GCP bill it
# Where each platform's replicas run, for egress; ``[budget] clouds`` overrides.
PLATFORM_CLOUDS = {
    "sagemaker": "aws", "modal": "modal", "hf_jobs": "hf", "local": "local", "k8s": "unknown",
}  # fmt: skip
STORE_CLOUDS = {
    "s3": "aws", "s3a": "aws", "gs": "gcp", "gcs": "gcp", "az": "azure", "abfs": "azure",
    "abfss": "azure", "hf": "hf", "file": "local", "local": "local", "memory": "local",
}  # fmt: skip


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
