"""The managers of a replica of several DDP processes (``torchrun``): only rank 0 talks to the
bucket (``replica_group.py`` says why), and ``make_manager`` picks this process's manager.

The leader runs the bucket's rounds and sends each sync's decision and mean on to the other
ranks from ``should_commit``, on the training thread, where every rank calls it at the same
point. The other ranks adopt the leader's decision for every sync, never one of their own (a
timeout only they saw would split the replica's global state).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from diloco_anywhere.bucket.format.layout import Participant
from diloco_anywhere.collective.allreduce import BucketCollective, RoundResult
from diloco_anywhere.collective.errors import DivergedError
from diloco_anywhere.collective.policy import CollectiveConfig
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.managers.sharded import ShardManager
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup


@dataclass(frozen=True)
class SyncOutcome:
    """What the leader decided for a sync, as the other ranks adopt it (no timeout of theirs)."""

    committed: bool
    diverged: bool = False  # then every rank heals alike
    error: str | None = None
    seal: Seal | None = None
    fingerprint: str = ""
    shared: bool = False  # the mean follows, tensor by tensor (committed syncs with a result)

    def exception(self) -> Exception | None:
        if self.error is None:
            return None
        return (DivergedError if self.diverged else RuntimeError)(self.error)


class LeaderManager(BucketManager):
    """Rank 0's manager: the bucket's rounds, and each sync's decision and mean sent on to the
    other ranks from ``should_commit``, on the training thread, where every rank calls it at
    the same point."""

    def __init__(self, group: ReplicaGroup, collective: BucketCollective, **kwargs: Any) -> None:
        super().__init__(collective, **kwargs)
        self._group = group
        group.broadcast(collective.me)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        sync = self._current
        commit = super().should_commit(timeout)
        # what ``conclude`` decided on; a round thread finishing late cannot change these
        result, error = self.last_result, self.last_sync_error
        shared = commit and result is not None
        self._group.broadcast(
            SyncOutcome(
                committed=commit,
                diverged=isinstance(error, DivergedError),
                error=None if error is None else f"{type(error).__name__}: {error}",
                seal=result.seal if result else None,
                fingerprint=result.fingerprint if result else "",
                shared=shared,
            )
        )
        if shared:
            for tensor, _ in sync.batch:
                self._group.broadcast_tensor(tensor)
        return commit


@dataclass(frozen=True)
class _Leader:
    """Who the other ranks sync as (a manager's ``collective``): the leader's participant,
    with the run's collective config, as the leader's own."""

    me: Participant
    config: CollectiveConfig

    def close(self) -> None:
        """Nothing of the bucket's to close: the leader holds it."""


class FollowerManager(BucketManager):
    """Another rank's manager: sends nothing, and takes each sync's decision and mean from the
    leader in ``should_commit``."""

    def __init__(self, group: ReplicaGroup, config: CollectiveConfig, **kwargs: Any) -> None:
        super().__init__(_Leader(group.broadcast(None), config), **kwargs)  # type: ignore[arg-type]
        self._group = group

    def send(self) -> None:
        """The leader sends."""

    def wait_for_round(self, timeout: timedelta | None = None) -> None:
        """The leader waits; ``should_commit`` receives."""

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        sync = self._current
        outcome: SyncOutcome = self._group.broadcast(None)
        if outcome.shared:
            for tensor, _ in sync.batch:
                self._group.broadcast_tensor(tensor)
            sync.result = RoundResult(outcome.seal, outcome.fingerprint)  # type: ignore[arg-type]
        sync.error = outcome.exception()
        self.complete_futures(sync)
        return self.conclude(sync, outcome.committed)


def make_manager(
    group: ReplicaGroup, collective: BucketCollective | None, config: CollectiveConfig,
    **kwargs: Any,
) -> BucketManager:  # fmt: skip
    """The manager of this process: the bucket's alone, a rank's of a sharded replica, the
    leader's, or a follower's (which holds no collective: ``config`` is the run's)."""
    if group.world_size == 1:
        return BucketManager(collective, **kwargs)  # type: ignore[arg-type]
    if group.sharded:
        return ShardManager(group, collective, **kwargs)  # type: ignore[arg-type]
    if group.is_leader:
        return LeaderManager(group, collective, **kwargs)  # type: ignore[arg-type]
    return FollowerManager(group, config, **kwargs)
