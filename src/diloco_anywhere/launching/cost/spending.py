"""A launch's spend so far, from its records in the bucket (``cost_so_far.spend`` on real
attempts).

Every attempt of every replica has a job record with its start. An attempt is billed from its
start until the next attempt of its replica starts, or, for the newest, until now while its job
may run, else until the replica's last metrics line: an upper bound (a replica waiting out a
backoff is not billed on any platform), which is the side a budget should err on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.cost.cost_so_far import Attempt, Spend, spend, traffic_so_far
from diloco_anywhere.launching.start.launches import Launch, Launches
from diloco_anywhere.training.records.metrics import ReplicaMetrics


def launch_spend(
    launches: Launches,
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
    for replica, jobs in launches.job_records(launch).items():
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
