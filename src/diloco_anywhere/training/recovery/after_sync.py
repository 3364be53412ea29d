"""What a replica does after a sync besides recording it: write the run's global checkpoint
when one is due, and heal to the run's newest sealed round (on joining, and after a
divergence). ``Training`` (``training.py``) runs these inside the inner optimizer's ``step``
that synced.

A checkpoint is written by the round's contributors together (or by a sharded replica's ranks
together, each its own part), then copied to the mirrors; healing is the leader's, from the
bucket (``healing.py``), the other ranks taking the leader's state, or every rank of a sharded
replica its own shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.records import ShardOf
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.records.metrics import MetricsWriter
from diloco_anywhere.training.recovery.healing import ALONE, heal
from diloco_anywhere.training.recovery.mirrors import MirrorWriter
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import GlobalState

log = logging.getLogger(__name__)


class GlobalCheckpoints:
    """This process's writer of the run's global checkpoints and of their mirrors (none for a
    rank that does not talk to the bucket)."""

    def __init__(
        self,
        config: RunConfig,
        collective: BucketCollective | None,
        group: ReplicaGroup,
        report: Callable[[str], None],
    ) -> None:
        self.config, self.group, self.collective = config, group, collective
        self.committed_before = False  # a sync of this process
        policy = CheckpointPolicy.of(config)
        self.shard = ShardOf(group.rank, group.world_size) if group.sharded else ShardOf()
        self.mirrors = (
            MirrorWriter(config.mirror_urls(), collective.layout, policy, report)
            if collective is not None and config.checkpoint.mirrors
            else None
        )
        self.writer = (
            CheckpointWriter(
                collective.store, collective.layout,
                collective.me.replica if self.shard.sharded else collective.me.name, policy,
                mirror=self.mirrors.copy if self.mirrors else None, shard=self.shard,
            )
            if collective is not None
            else None
        )  # fmt: skip

    def release(self) -> None:
        """Before the global state changes (the outer step, a heal): wait until a checkpoint
        being written from it reads it no more."""
        if self.writer is not None:
            self.writer.release()

    def write_now(self, manager: BucketManager, state: GlobalState) -> bool:
        """A checkpoint of the round just synced, by this process alone, whether one is due or
        not (``diloco bench checkpoint``); True if a write started."""
        if self.writer is None:
            return False
        return self.writer.write(manager.last_round(), (self.writer.me,), _tree(manager, state),
                                 last=False)  # fmt: skip

    @property
    def mirror_stores(self) -> tuple:
        """The mirrors' stores, where healing also looks for a checkpoint."""
        return self.mirrors.stores if self.mirrors else ()

    def write_if_due(self, manager: BucketManager, state: GlobalState) -> None:
        """Write the run's checkpoint with the round's other contributors when one is due (a
        sharded replica: the one first in rank 0's SEAL, all its ranks). After its own first
        commit, a process writes one alone as well: a run resumed with new outer
        hyperparameters then has a checkpoint under them at once, and healing never replays
        rounds across the change."""
        step, result = manager.current_step(), manager.last_result
        last = self.config.diloco.last_step
        first, self.committed_before = not self.committed_before, True
        if self.writer is None or result is None:
            return
        if checkpoint_due(step, self.config.checkpoint.every, last):
            writers = (
                (manager.leading_replica,)  # type: ignore[attr-defined]
                if self.shard.sharded
                else result.seal.contributors
            )
        elif first:
            writers = (self.writer.me,)
        else:
            return
        if self.writer.me not in writers:
            return
        parts = self._agree_on_parts(manager, state, step, last=step == last)
        if parts is None:
            return
        self.writer.write(
            manager.last_round(), writers, _tree(manager, state), last=step == last, parts=parts
        )

    def write_last_if_missing(self, manager: BucketManager, state: GlobalState) -> None:
        """At the run's end, commit its last checkpoint if nobody has: this replica healed to
        the end (no sync of its own wrote it) after the round's contributors died writing it.
        The shards are planned as the SEAL's contributors planned them, so that the bytes any
        of them stored are the same bytes (create-only puts accept them)."""
        step, last = manager.current_step(), self.config.diloco.last_step
        if self.writer is None or step != last:
            return
        self.writer.wait()
        missing = not self.writer.committed(manager.last_round())
        if self.group.broadcast(missing) if self.shard.sharded else missing:
            self._write_last(manager, state, step)

    def _write_last(self, manager: BucketManager, state: GlobalState, step: int) -> None:
        assert self.writer is not None
        assert self.collective is not None
        round_ = manager.last_round()
        log.warning("the run's last checkpoint (round %d) is missing: this replica writes it",
                    round_)  # fmt: skip
        fragment = (step - 1) % self.config.diloco.fragments
        writers = (
            (self.writer.me,)
            if self.shard.sharded
            else self.collective.sealed_contributors(round_, fragment)
        )
        parts = self._agree_on_parts(manager, state, step, last=True)
        self.writer.write(round_, writers, _tree(manager, state), last=True, parts=parts or ())

    def _agree_on_parts(
        self, manager: BucketManager, state: GlobalState, step: int, *, last: bool
    ) -> tuple[str, ...] | None:
        """A sharded replica's ranks write a checkpoint together or not at all: each rank's
        part's fingerprint, for rank 0 to commit only those parts; None (skipped) while any
        rank still writes or mirrors the previous one, unless this is the run's ``last``.
        Nothing to agree for an unsharded replica: ``()``."""
        if not self.shard.sharded:
            return ()
        gathered = self.group.gather((self._idle(), state.checksum()))
        if not (last or all(idle for idle, _ in gathered)):
            log.warning("checkpoint of round %d skipped: a rank is still writing or "
                        "mirroring the previous one (raise checkpoint.every)",
                        manager.last_round())  # fmt: skip
            return None
        return tuple(fingerprint(step, checksum) for _, checksum in gathered)

    def _idle(self) -> bool:
        """This process writes and mirrors no checkpoint now."""
        return self.writer.idle() and (self.mirrors is None or self.mirrors.idle())  # type: ignore[union-attr]

    def close(self) -> None:
        """The last checkpoint is committed (and mirrored) before the replica reports done."""
        if self.writer is not None:
            self.writer.close()
        if self.mirrors is not None:
            self.mirrors.close()


def _tree(manager: BucketManager, state: GlobalState) -> dict:
    """What a checkpoint holds: the manager's counters, the global weights and outer optimizer
    state of every fragment, and the parameter names."""
    return {"manager": manager.state_dict(), "fragments": state.checkpoint_tree(),
            "names": state.names}  # fmt: skip


def checkpoint_due(step: int, every: int, last: int) -> bool:
    """After the first committed sync (so a replica can heal early on), every ``every``, and
    after the last (the run's final weights, in the bucket)."""
    return step == 1 or step % every == 0 or step == last


def heal_replica(
    collective: BucketCollective | None,
    state: GlobalState,
    manager: BucketManager,
    group: ReplicaGroup,
    checkpoints: GlobalCheckpoints,
    metrics: MetricsWriter | None,
    *,
    min_replicas: int,
    from_initial: bool,
) -> None:
    """Bring the global state to the run's newest sealed round: the leader from the bucket
    (``healing.py``) and the other ranks from the leader, or every rank of a sharded replica
    its own shard, together."""
    shard = checkpoints.shard
    checkpoints.release()  # healing changes the state a checkpoint may still be read from
    if group.is_leader or shard.sharded:
        report = heal(
            collective,  # type: ignore[arg-type]  (held by the leader, or every rank of a sharded replica)
            state, manager, min_replicas, from_initial=from_initial,
            mirrors=checkpoints.mirror_stores, shard=shard,
            ranks=group if shard.sharded else ALONE,
        )  # fmt: skip
        if metrics and (report.checkpoint is not None or report.replayed or report.skipped):
            log.info("%s", report.describe())
            outer_step = manager.current_step() // checkpoints.config.diloco.fragments
            metrics.event("healed", report.describe(), seconds=report.seconds,
                          outer_step=outer_step)  # fmt: skip
    if not shard.sharded:
        _share_leaders_state(manager, state, group)


def _share_leaders_state(manager: BucketManager, state: GlobalState, group: ReplicaGroup) -> None:
    """The other ranks of an unsharded replica take the state the leader healed to."""
    tree = group.share_state({"manager": manager.state_dict(), "fragments": state.fragments_tree()})
    if not group.is_leader:
        manager.load_state_dict(tree["manager"])
        state.load_fragments_tree(tree["fragments"])
        state.reset_local_weights()
