"""A fleet's throughput against what its replicas can do (``diloco report``, ``diloco bench
hetero``): replicas of unlike speed that sync every ``sync_every`` steps wait for the slowest
(``[diloco] pace``, docs/tuning.md "Mixed hardware").

Fleet: tokens of committed contributions a second, from the end of the run's first round (its
last sync) to the run's last sync; the first round's tokens, trained before, are left out.
Own: the sum of each replica's tokens a step over its median measured step time, the sync's
waiting left out (``SyncLine.step_seconds``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from diloco_anywhere.training.records.metrics import ReplicaMetrics, SyncLine


@dataclass(frozen=True)
class FleetThroughput:
    fleet_tokens_per_second: float
    own_tokens_per_second: dict[str, float]  # per replica

    @property
    def fleet_over_own(self) -> float | None:
        own = sum(self.own_tokens_per_second.values())
        return self.fleet_tokens_per_second / own if own else None

    def as_dict(self) -> dict:
        return {**asdict(self), "fleet_over_own": self.fleet_over_own}


def contributed(syncs: list[SyncLine]) -> list[SyncLine]:
    """The syncs whose round committed this replica's contribution."""
    return [sync for sync in syncs if sync.committed and sync.contributed]


def tokens_per_step(metrics: ReplicaMetrics) -> float:
    """The tokens one inner step of the replica trains (all its processes')."""
    last = metrics.syncs[-1] if metrics.syncs else None
    return last.tokens / last.inner_steps if last and last.inner_steps else 0.0


def fleet_throughput(metrics: dict[str, ReplicaMetrics]) -> FleetThroughput | None:
    """The run's throughput against its replicas' own; None before two syncs, or without
    measured step times (metrics of an older release)."""
    syncs = [sync for m in metrics.values() for sync in m.syncs]
    if not syncs:
        return None
    first = min(sync.round for sync in syncs)  # its tokens were trained before any sync
    start = max(sync.time for sync in syncs if sync.round == first)
    last = max(sync.time for sync in syncs)
    tokens = sum(
        sync.round_steps * tokens_per_step(m)
        for m in metrics.values()
        for sync in contributed(m.syncs)
        if sync.round > first
    )
    own = {
        replica: tokens_per_step(m) / statistics.median(steps)
        for replica, m in sorted(metrics.items())
        if (steps := [s.step_seconds for s in m.syncs if s.step_seconds])
    }
    if last <= start or not own:
        return None
    return FleetThroughput(tokens / (last - start), own)
