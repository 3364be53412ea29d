"""Checkpoint mirrors: every committed checkpoint copied to other stores, so that losing the
run's store (a deleted bucket, a region outage, an expired account) does not lose the run.

Writing: the replica that commits a checkpoint copies it, after the commit, to each store of
``[checkpoint] mirrors``, under the same keys (``copy_checkpoint``: the objects first, each
read back and compared, then the COMMIT). In a sharded replica every rank copies its own part,
and rank 0 the COMMIT once every part is in the mirror (``copy_part``). Old checkpoints are
pruned in each mirror as in the store. A mirror never holds training back: copies run on a
thread of their own, one checkpoint at a time per mirror (a copy still running when the next
checkpoint is committed is skipped for that mirror, logged; the run's last checkpoint waits for
it instead), and a mirror that fails is reported through ``report`` (the run's metrics:
``diloco status`` shows it), never raised.

Reading: healing takes a mirror's checkpoint when the store has no intact one as new
(``healing.py``), and ``diloco launch --resume-from URL`` starts a run whose store was lost
again from a mirror (``resume_from``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.objects import put_checked
from diloco_anywhere.training.checkpoints.reader import read_checkpoint
from diloco_anywhere.training.checkpoints.records import (
    CheckpointCommit,
    CheckpointError,
    StoredCheckpoint,
    StoredPart,
)
from diloco_anywhere.training.checkpoints.writer import (
    CheckpointPolicy,
    prune_checkpoints,
    wait_for_parts,
)

log = logging.getLogger(__name__)


class MirrorWriter:
    """Copies committed checkpoints to ``urls``; ``report(detail)`` hears of every failure."""

    def __init__(
        self,
        urls: list[str],
        layout: RunLayout,
        policy: CheckpointPolicy,
        report: Callable[[str], None],
    ) -> None:
        """``policy``: the checkpoints kept, and how long rank 0 of a sharded replica waits
        for the other ranks' parts in a mirror."""
        self.layout, self.policy, self.report = layout, policy, report
        self.stores = [Store(url) for url in urls]  # healing reads them too
        self._executor = ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="mirror")
        self._pending: dict[int, Future[None]] = {}  # by mirror

    def copy(self, checkpoint: StoredCheckpoint | StoredPart, last: bool = False) -> None:
        """Start copying ``checkpoint`` (or a rank's part of one) to every mirror not still
        busy with the previous one; the ``last`` (the run's final state) waits for it instead
        of being skipped. A sharded replica's ranks skip together: they write a checkpoint
        only when every rank's mirrors are ``idle``."""
        round_ = checkpoint.round if isinstance(checkpoint, StoredPart) else checkpoint.commit.round
        for index, store in enumerate(self.stores):
            pending = self._pending.get(index)
            if pending is not None and last:
                pending.result()  # _copy reports its failures, never raises
            elif pending is not None and not pending.done():
                log.warning("mirror %s: checkpoint of round %d skipped, the previous copy is "
                            "still running", store.url, round_)  # fmt: skip
                continue
            if checkpoint.spools is not None:
                checkpoint.spools.hold()  # its local files, until this copy is done
            self._pending[index] = self._executor.submit(self._copy, store, checkpoint, round_)
        if checkpoint.spools is not None:
            checkpoint.spools.release()  # the writer's hold, passed on to the copies

    def idle(self) -> bool:
        """No copy under way."""
        return all(pending.done() for pending in self._pending.values())

    def _copy(self, store: Store, checkpoint: StoredCheckpoint | StoredPart, round_: int) -> None:
        try:
            self._copy_to(store, checkpoint, round_)
        finally:
            if checkpoint.spools is not None:
                checkpoint.spools.release()

    def _copy_to(
        self, store: Store, checkpoint: StoredCheckpoint | StoredPart, round_: int
    ) -> None:
        try:
            if isinstance(checkpoint, StoredPart):
                copy_part(store, self.layout, checkpoint, self.policy)
                if checkpoint.commit is None:
                    return  # rank 0 commits and prunes
            else:
                copy_checkpoint(store, self.layout, checkpoint)
            prune_checkpoints(store, self.layout, self.policy.keep, round_)
            log.info("checkpoint of round %d mirrored to %s", round_, store.url)
        except Exception as exc:  # a mirror never stops training: it is reported instead
            detail = f"checkpoint of round {round_} not mirrored to {store.url}: {exc}"
            log.warning("%s", detail)
            self.report(detail)

    def close(self) -> None:
        """Wait for the copies under way (a run's last checkpoint should reach its mirrors)."""
        self._executor.shutdown(wait=True)
        for store in self.stores:
            store.close()


def copy_checkpoint(store: Store, layout: RunLayout, checkpoint: StoredCheckpoint) -> None:
    """Put a committed checkpoint into ``store``: its objects, each read back and compared
    with the bytes committed, then its COMMIT, so that ``store`` never holds a COMMIT whose
    objects are not intact there. Whatever the round's folder held before, unless it is this
    very checkpoint, goes first: a copy cut short, or a checkpoint of the same round from an
    earlier run of the same name (a create-only put would refuse its keys)."""
    round_ = checkpoint.commit.round
    folder, commit_key = layout.checkpoint(round_), layout.checkpoint_commit(round_)
    if _holds(store, commit_key, checkpoint.commit_bytes):
        return  # copied before
    if removed := store.delete_prefix(folder):
        log.warning("%s: replaced %d objects under %s: a copy cut short, or another run's "
                    "checkpoint of round %d", store.url, removed, folder, round_)  # fmt: skip
    put_checked(store, checkpoint.objects)
    store.put(commit_key, checkpoint.commit_bytes)


def copy_part(
    store: Store, layout: RunLayout, stored: StoredPart, policy: CheckpointPolicy
) -> None:
    """Put one rank's part of a sharded checkpoint into ``store`` (a mirror): its objects,
    each read back and compared, then its PART record; rank 0's copy then waits for every
    rank's PART there, as it was committed, and puts the COMMIT. What the rank's folder held
    before, unless it is this very part, goes first, as in ``copy_checkpoint``; so does a
    COMMIT of the round that is not this one (an earlier run's), before any part is copied."""
    round_, commit_key = stored.round, layout.checkpoint_commit(stored.round)
    if stored.commit is not None:
        if _holds(store, commit_key, stored.commit_bytes):
            return  # copied before
        store.delete_prefix(commit_key)
    record, done_key = encode_record(stored.part), layout.checkpoint_rank_done(round_, stored.rank)
    if not _holds(store, done_key, record):
        folder = layout.checkpoint_part(round_, stored.rank)
        if removed := store.delete_prefix(folder):
            log.warning("%s: replaced %d objects under %s: a copy cut short, or another run's "
                        "checkpoint of round %d", store.url, removed, folder, round_)  # fmt: skip
        put_checked(store, stored.objects)
        store.put(done_key, record)
    if stored.commit is not None:
        ranks = range(len(stored.commit.ranks))
        committed = stored.commit.ranks
        wait_for_parts(
            store, layout, round_, ranks, policy, lambda k, part: part == committed[k],
            replaceable=True,
        )  # fmt: skip
        store.put(commit_key, stored.commit_bytes)


def _holds(store: Store, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` (a record)."""
    try:
        return store.get(key, 0, len(data) + 1) == data
    except FileNotFoundError:
        return False


class ResumeError(ValueError):
    """A run cannot be resumed from that mirror; the message says why and what to do."""


@dataclass(frozen=True)
class Resumed:
    mirror: str
    round: int  # the checkpoint's
    sync: int  # the round the replicas join
    damaged: tuple[int, ...]  # checkpoints there passed over: they did not read back intact
    earlier: tuple[int, ...]  # checkpoints of later rounds committed before it: an earlier run

    def describe(self) -> str:
        passed = [
            f"rounds {', '.join(map(str, rounds))} {why}"
            for rounds, why in (
                (self.damaged, "are damaged (see the warnings)"),
                (self.earlier, "were committed before it, by an earlier run of the same name"),
            )
            if rounds
        ]
        passed_over = f" (the mirror's checkpoints of {'; '.join(passed)})" if passed else ""
        return (
            f"resuming from the checkpoint of round {self.round} in {self.mirror}{passed_over}: "
            f"the replicas heal from it and join round {self.sync}; the rounds the lost store "
            f"had sealed after round {self.round} are lost and trained again"
        )


def resume_from(url: str, store: Store, layout: RunLayout, *, fresh: bool = False) -> Resumed:
    """Copy the run's latest checkpoint that reads back intact from the mirror at ``url`` into
    ``store`` (the run's store, which lost the run), so that the replicas launched next heal
    from it. Latest by the time the mirror recorded for its COMMIT, not by round: a mirror
    keeps checkpoints of an earlier run of the same name until this run reaches their rounds.
    A store that still holds objects of the run is refused (healing already uses them and the
    mirrors in run.toml) unless ``fresh``, which deletes them, once the mirror's checkpoint
    has read back intact."""
    if url == store.url:
        raise ResumeError(f"--resume-from {url} is the run's store itself: name a mirror")
    if not fresh and store.list_prefix(layout.run):
        raise ResumeError(
            f"run {layout.run} still has objects in {store.url}: a plain `diloco launch` heals "
            f"from them and from the mirrors in run.toml. --resume-from is for a store that "
            f"lost the run; add --fresh to delete what is left there first"
        )
    with Store(url) as mirror:
        commits, damaged = latest_commits(mirror, layout)
        checkpoint = _first_intact(mirror, layout, commits, damaged)
        if fresh:
            store.delete_prefix(layout.run)
        copy_checkpoint(store, layout, checkpoint)
        commit = checkpoint.commit
        later = (c.round for c in commits if c.round > commit.round and c.round not in damaged)
        earlier = tuple(sorted(later, reverse=True))  # committed before it: an earlier run's
        return Resumed(mirror.url, commit.round, commit.sync, tuple(damaged), earlier)


def latest_commits(mirror: Store, layout: RunLayout) -> tuple[list[CheckpointCommit], list[int]]:
    """The COMMITs of the run's checkpoints in ``mirror``, the most recently committed first,
    and the rounds whose COMMIT does not read back (logged). Recency is the mirror's own time
    for each COMMIT object, one clock: the ``time`` inside a COMMIT is its writer's, and the
    replicas that commit checkpoints need not agree on the time (docs/collective.md,
    "Membership"); a writer 5 minutes behind would make its newer checkpoint look older."""
    commits, damaged = [], []
    for round_ in committed_rounds(mirror, layout):
        try:
            commits.append(read_commit(mirror, layout, round_)[0])
        except CheckpointError as exc:
            log.warning("checkpoint of round %d in %s not used: %s", round_, mirror.url, exc)
            damaged.append(round_)
    written = {c.round: mirror.modified(layout.checkpoint_commit(c.round)) for c in commits}
    return sorted(commits, key=lambda c: (written[c.round], c.round), reverse=True), damaged


def _first_intact(
    mirror: Store, layout: RunLayout, commits: list[CheckpointCommit], damaged: list[int]
) -> StoredCheckpoint:
    """The first of ``commits`` (latest first) whose checkpoint reads back intact; the rounds
    passed over are added to ``damaged``."""
    for commit in commits:
        try:
            return read_checkpoint(mirror, layout, commit.round)
        except CheckpointError as exc:
            log.warning("checkpoint of round %d in %s not used: %s", commit.round, mirror.url, exc)
            damaged.append(commit.round)
    raise ResumeError(
        f"no checkpoint of run {layout.run} in {mirror.url} reads back intact"
        + (f" ({len(damaged)} damaged, see the warnings)" if damaged else " (none committed)")
        + ": check the URL against [checkpoint] mirrors in run.toml"
    )
