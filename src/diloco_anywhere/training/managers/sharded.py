"""A rank's manager in a sharded replica (``sharding = "fsdp"``): its own shard's rounds
through its own collective, and each sync's decision taken with the replica's other ranks.

The ranks agree in ``should_commit``, on the training thread, where every rank is at the same
point: they gather each rank's outcome over the replica's gloo group and all take the same
decision, the same error (a divergence on any rank heals every rank) and one fingerprint,
their shards' fingerprints combined (``training/ranks/sharding.py`` says how the model is sharded).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from diloco_anywhere.bucket.format.layout import parse_contributor
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import DivergedError
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.state.fingerprints import combine_fingerprints


@dataclass(frozen=True)
class RankOutcome:
    """One rank's sync, as the replica's ranks decide from."""

    committed: bool
    diverged: bool
    error: str | None
    fingerprint: str
    contributed: bool
    contributors: int  # in this rank's SEAL (0: none)
    first_contributor: str | None  # of this rank's SEAL: who writes its checkpoint part
    traffic: tuple[int, int]  # bytes up and down, this rank's so far


class ShardManager(BucketManager):
    """A rank's manager in a sharded replica: its own shard's rounds through its own
    collective, and each sync's decision taken with the replica's other ranks."""

    def __init__(self, group: ReplicaGroup, collective: BucketCollective, **kwargs: Any) -> None:
        super().__init__(collective, **kwargs)
        self._group = group
        self._contributed = False
        self._participants = 1  # agreed by the ranks: see ``num_participants``
        self._traffic = (0, 0)
        self.leading_replica: str | None = None  # writes the checkpoint after a due sync

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        self.send()
        self.wait_for_round(timeout)
        sync = self._current
        stats, seal = self._collective.store.stats(), sync.result.seal if sync.result else None
        outcomes: list[RankOutcome] = self._group.gather(RankOutcome(
            committed=sync.error is None and (
                sync.result is None or len(sync.result.seal.contributors) >= self._min_replicas
            ),
            diverged=isinstance(sync.error, DivergedError),
            error=None if sync.error is None else f"{type(sync.error).__name__}: {sync.error}",
            fingerprint=sync.fingerprint,
            contributed=seal is not None and self._collective.me.name in seal.contributors,
            contributors=len(seal.contributors) if seal else 0,
            first_contributor=seal.contributors[0] if seal else None,
            traffic=(stats.bytes_up, stats.bytes_down),
        ))  # fmt: skip
        sync.error = _replica_error(outcomes)
        commit = all(outcome.committed for outcome in outcomes)
        if commit:
            self._participants = min(outcome.contributors for outcome in outcomes)
        self.conclude(sync, commit)
        self.last_fingerprint = combine_fingerprints([o.fingerprint for o in outcomes])
        self._contributed = all(outcome.contributed for outcome in outcomes)
        self._traffic = tuple(sum(o.traffic[i] for o in outcomes) for i in (0, 1))  # type: ignore[assignment]
        leader = outcomes[0].first_contributor
        self.leading_replica = parse_contributor(leader)[0] if leader else None
        return commit

    def contributed(self) -> bool:
        """Whether every rank's contribution is in its SEAL."""
        return self._contributed

    def num_participants(self) -> int:
        """Replicas in the last committed sync, the same on every rank: the fewest in any of
        its ranks' SEALs (each rank's round has its own, and a late rank may miss one). It
        counts the batches committed, which every rank's checkpoint part holds alike."""
        return self._participants

    def traffic(self) -> tuple[int, int]:
        """The replica's bytes up and down (every rank's), as of the last sync."""
        return self._traffic


def _replica_error(outcomes: list[RankOutcome]) -> Exception | None:
    """The one error every rank keeps for the sync: a divergence on any rank (then every rank
    heals), else the first rank's error, else none."""
    for diverged in (True, False):
        for rank, outcome in enumerate(outcomes):
            if outcome.error is not None and outcome.diverged == diverged:
                if diverged:  # its text without the type, which stays DivergedError
                    return DivergedError(f"rank {rank}: {outcome.error.partition(': ')[2]}")
                return RuntimeError(f"rank {rank}: {outcome.error}")
    return None
