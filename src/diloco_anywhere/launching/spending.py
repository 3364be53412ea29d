"""A launch's spend so far, from its records in the bucket (``cost.spend`` on real attempts).

Every attempt of every replica has a job record with its start. An attempt is billed from its
start until the next attempt of its replica starts, or, for the newest, until now while its job
may run, else until the replica's last metrics line: an upper bound (a replica waiting out a
backoff is not billed on any platform), which is the side a budget should err on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.record import RECORD_READ_LIMIT, decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.cost import Attempt, Spend, spend, traffic_so_far
from diloco_anywhere.launching.launches import JobRecord, Launch
from diloco_anywhere.training.metrics import ReplicaMetrics


def attempts_of(store: Store, launch: Launch) -> dict[str, list[JobRecord]]:
    """Every job record of the launch, by replica, oldest attempt first."""
    folder = RunLayout(launch.record.run).launch_folder(launch.number)
    keys = store.list_prefix(f"{folder}/jobs")
    records = [decode_record(data, JobRecord, key=key)
               for key, data in store.get_many(keys, limit=RECORD_READ_LIMIT).items()
               if data is not None]  # fmt: skip
    by_replica: dict[str, list[JobRecord]] = {}
    for record in sorted(records, key=lambda record: record.attempt):
        by_replica.setdefault(record.replica_id, []).append(record)
    return by_replica


def launch_spend(
    store: Store,
    config: RunConfig,
    launch: Launch,
    metrics: Mapping[str, ReplicaMetrics],
    running: Callable[[str], bool],
    hardware: Callable[[str], str],
    now: float | None = None,
) -> Spend:
    """The launch's spend so far. ``running(replica)``: its current job may still run;
    ``hardware(platform)``: what a replica there runs on (``Backend.hardware``)."""
    now = now or time.time()
    attempts = []
    for replica, jobs in attempts_of(store, launch).items():
        seen = metrics.get(replica)
        for job, following in zip(jobs, [*jobs[1:], None], strict=True):
            end = following.started_at if following else None
            if following is None and not running(replica):
                end = max(job.started_at, seen.last_seen()) if seen else job.started_at
            attempts.append(Attempt(job.platform, hardware(job.platform), job.started_at, end))
    return spend(attempts, traffic_so_far(metrics), config, now=now)


def spend_shown(spent: Spend, config: RunConfig) -> dict[str, str]:
    """The spend as the status page shows it: label -> value."""
    shown = {"est. spent": f"${spent.usd:,.2f}"}
    if config.budget.max_usd:
        shown["budget"] = f"${config.budget.max_usd:,.2f}"
    if config.budget.max_hours:
        shown["hours cap"] = f"{config.budget.max_hours:g} h"
    if spent.unpriced:
        shown["unpriced"] = ", ".join(spent.unpriced)
    return shown
