"""Writing global checkpoints: every sealed contributor of a round writes its share of the
state, and one commits it.

Every sealed contributor of round ``r`` holds the same state, so they write the shards in
parallel, shard ``s`` by ``contributors[s % n]`` (the sharded exchange's rule). The first
contributor commits: it waits for the other shards, writes any still missing after
``orphan_grace`` itself (identical bytes, which the create-only put accepts), then puts the
COMMIT. The run's last checkpoint is committed by every contributor (the first COMMIT stands),
and by a replica that healed to the end and found it missing: the run ends on that COMMIT
(``keeper.run_done``), so a committer killed while writing it (an attempt's time limit) must
not leave a run whose replicas all say done and that never ends.

A sharded replica's ranks each write their own part and PART record, and rank 0 commits once
every rank's is in (``wait_for_parts``). The committer then prunes the old checkpoints
(``prune_checkpoints``) and hands the new one to the mirrors (``mirrors.py``).

Writing runs on a thread of its own, from the state as it is, by reference: no copy of it is
made. Its shards, of about ``part_bytes`` each, are written to local files one at a time
(``staging.py``: safetensors' own writer, straight from host memory; a device tensor through a
pinned buffer a part at a time) and uploaded from there (``Store.put_file``, in parts of
16 MiB), so host memory holds one part of device tensors at most, whatever the model. The
state is read only until its shards are on local disk: training goes on meanwhile, and the
outer step that would change it waits for that (``release``, which ``BucketManager`` calls
before every outer step): at disk speed, seconds, never the upload. The committer writes every
shard to its local disk (others only theirs), so that it can write a late writer's shards and
check every other shard's bytes by its size and CRC32C without holding any of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.format.layout import MAX_ROUND, RunLayout, parse_count
from diloco_anywhere.bucket.format.record import RECORD_READ_LIMIT, decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.objects import Spools, describe, holds, put
from diloco_anywhere.training.checkpoints.records import (
    WHOLE,
    Blob,
    CheckpointCommit,
    CheckpointError,
    LocalCopy,
    RankPart,
    ShardOf,
    StoredCheckpoint,
    StoredObject,
    StoredPart,
)
from diloco_anywhere.training.checkpoints.staging import HostStaging, write_part
from diloco_anywhere.training.checkpoints.tree import flatten, plan_shards
from diloco_anywhere.training.state.fingerprints import combine_fingerprints, fingerprint
from diloco_anywhere.training.state.global_state import tree_checksum

log = logging.getLogger(__name__)
# Shards of this size: a device tensor is staged in host memory a shard at a time, and a
# heal or an export reads one at a time; a tensor larger than it is a shard of its own.
PART_BYTES = 256 << 20


def _commit_fields(layout: RunLayout, round_: int, tree: dict[str, Any]) -> dict[str, Any]:
    """A COMMIT's description of the state ``tree`` (the whole, or one rank's part)."""
    counters = tree["manager"]
    return {
        "run": layout.run,
        "round": round_,
        "step": counters["step"],
        "sync": counters["sync"],
        "fingerprint": fingerprint(counters["step"], tree_checksum(tree["fragments"])),
        "time": time.time(),
    }


@dataclass(frozen=True)
class CheckpointPolicy:
    """How checkpoints are written and kept, from run.toml (``of``), which holds the defaults."""

    keep: int  # committed checkpoints kept (rounds after the oldest kept are kept too)
    orphan_grace: float  # seconds the committer waits for other writers' shards
    part_bytes: int = PART_BYTES  # a checkpoint is written in shards of about this size
    part_wait: float = 600.0  # seconds rank 0 of a sharded replica waits for the others' parts
    poll: float = 0.2

    @classmethod
    def of(cls, config: RunConfig, **overrides: Any) -> CheckpointPolicy:
        """``[checkpoint] keep``; a round's grace three times over for the other writers'
        shards, and a sync's timeout for a sharded replica's parts."""
        settings = {"keep": config.checkpoint.keep, "orphan_grace": 3 * config.sync.grace,
                    "part_wait": config.sync.timeout}  # fmt: skip
        return cls(**{**settings, **overrides})


class CheckpointWriter:
    """Writes this replica's share of checkpoints on a background thread, one at a time.

    A store error (an ``OSError``) loses one checkpoint, logged; the previous one stays usable.
    Any other error (a state that cannot be checkpointed), and any error writing the run's last
    checkpoint, is raised on the training thread at the next ``write`` or at ``close``, so a
    run never goes on, or ends, without checkpoints unnoticed."""

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        me: str,
        policy: CheckpointPolicy,
        mirror: Callable[[StoredCheckpoint | StoredPart, bool], None] | None = None,
        shard: ShardOf = WHOLE,
    ) -> None:
        """``mirror(checkpoint, last)`` hears of every checkpoint this replica commits
        (``mirrors.MirrorWriter.copy``), or of every part this rank writes. ``shard``: the
        part of a sharded replica this process writes (then ``me`` names the replica, whose
        ranks all write theirs)."""
        self.store, self.layout, self.me, self.policy = store, layout, me, policy
        self.mirror, self.shard = mirror, shard
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: Future[None] | None = None
        self._staging = HostStaging()
        self._released = threading.Event()  # the write in progress reads the state no more
        self._released.set()

    def write(
        self,
        round_: int,
        contributors: tuple[str, ...],
        tree: dict[str, Any],
        *,
        last: bool,
        parts: tuple[str, ...] = (),
    ) -> bool:
        """Start writing the checkpoint of ``round_``, whose state is ``tree`` (``{"manager":
        counters, "fragments": DiLoCo's state}``), if this replica is among ``contributors``
        (the round's SEAL), or whatever its part when it is the ``last`` (the run's final
        state, which this replica then commits too). The tree is the state itself, read until
        ``release`` returns; True if a write started. While the previous checkpoint is still
        being written a new one is skipped, except the last, which waits for it; the last
        one's failure is raised.
        ``parts``: a sharded replica's ranks' fingerprints of the state they write, gathered;
        rank 0 commits only those parts."""
        if self.me not in contributors and not last:
            return False
        if not (last or self.idle()):
            log.warning("checkpoint of round %d skipped: the previous one is still being "
                        "written (raise checkpoint.every)", round_)  # fmt: skip
            return False
        self.wait()  # raises what went wrong, other than the store
        self._released.clear()
        if self.shard.sharded:
            work = (self._write_part, round_, parts, tree, last)
        else:
            work = (self._write, round_, contributors, tree, last)
        self._pending = self._executor.submit(*work)
        return True

    def release(self) -> None:
        """Wait until the checkpoint being written reads the state no more (its shards are on
        local disk; their upload goes on): what must come before the state changes."""
        if self._released.is_set():
            return
        started = time.monotonic()
        self._released.wait()
        if (waited := time.monotonic() - started) >= 1.0:
            log.warning("the outer step waited %.1f s for the checkpoint's shards to reach "
                        "local disk", waited)  # fmt: skip

    def wait(self) -> None:
        """Wait for the checkpoint being written, raising what went wrong."""
        if self._pending is not None:
            self._pending.result()

    def committed(self, round_: int) -> bool:
        """The checkpoint of ``round_`` has its COMMIT in the store."""
        key = self.layout.checkpoint_commit(round_)
        return key in self.store.list_prefix(self.layout.checkpoint(round_))

    def idle(self) -> bool:
        """No checkpoint being written."""
        return self._pending is None or self._pending.done()

    def _write(
        self, round_: int, contributors: tuple[str, ...], tree: dict[str, Any], last: bool
    ) -> None:
        tensors, structure = flatten(tree)
        plan = plan_shards(tensors, self._shard_count(tensors, len(contributors)))
        owners = [contributors[s % len(contributors)] for s in range(len(plan))]
        keys = [self.layout.checkpoint_shard(round_, s) for s in range(len(plan))]
        committer = owners[0] == self.me or last
        spools = Spools()
        try:
            with self._reading_state():
                commit = _commit_fields(self.layout, round_, tree)
                staged = {
                    keys[s]: self._stage(keys[s], plan[s], tensors, spools)
                    for s, owner in enumerate(owners)
                    if committer or owner == self.me
                }
            for key, owner in zip(keys, owners, strict=True):
                if owner == self.me:
                    put(self.store, key, staged[key])
            if committer:
                self._commit(commit, staged, owners, structure, last, spools)
        except (OSError, CheckpointError) as exc:  # the store's errors are OSErrors
            _not_written(round_, exc, last)
        finally:
            spools.release()

    @contextmanager
    def _reading_state(self) -> Iterator[None]:
        """While inside, this write reads the state (``release`` waits for the end)."""
        try:
            yield
        finally:
            self._staging.release()
            self._released.set()

    def _shard_count(self, tensors: dict[str, torch.Tensor], writers: int) -> int:
        """One shard per writer at least, and shards of about ``part_bytes``."""
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return max(writers, -(-total // self.policy.part_bytes))

    def _stage(
        self, key: str, names: list[str], tensors: dict[str, torch.Tensor], spools: Spools
    ) -> LocalCopy:
        """Shard ``key`` (``names`` of ``tensors``) in a local file, ready to upload."""
        path = spools.add(self.store.spool(key))
        write_part({name: tensors[name] for name in names}, path, self._staging)
        return LocalCopy(path)

    def _write_part(
        self, round_: int, expected: tuple[str, ...], tree: dict[str, Any], last: bool
    ) -> None:
        """This rank's part of a sharded replica's checkpoint: its objects, then (rank k > 0)
        its PART record, or (rank 0) the COMMIT once every rank's PART is in."""
        rank, layout = self.shard.rank, self.layout
        tensors, structure = flatten(tree)
        plan = plan_shards(tensors, self._shard_count(tensors, 1))
        keys = [layout.checkpoint_shard(round_, s, rank=rank) for s in range(len(plan))]
        spools = Spools()
        try:
            with self._reading_state():
                commit = _commit_fields(layout, round_, tree)
                objects: dict[str, Blob] = {
                    key: self._stage(key, names, tensors, spools)
                    for key, names in zip(keys, plan, strict=True)
                }
            state_key = layout.checkpoint_state(round_, rank)
            part = RankPart(
                state=StoredObject.of(state_key, structure),
                shards=tuple(describe(key, blob) for key, blob in objects.items()),
                fingerprint=commit["fingerprint"],
            )
            objects[state_key] = structure
            for key, blob in objects.items():
                put(self.store, key, blob)
            if rank > 0:
                self.store.put(layout.checkpoint_rank_done(round_, rank), encode_record(part))
                self._mirror(StoredPart(round_, rank, part, objects, spools=spools.hold()), last)
                return
            parts = (part, *self._other_parts(round_, expected))
            commit["fingerprint"] = combine_fingerprints([p.fingerprint for p in parts])
            done = CheckpointCommit(**commit, ranks=parts)
            commit_bytes = encode_record(done)
            if self._put_commit(done, commit_bytes):
                log.info("checkpoint of round %d committed (%d ranks)", round_, len(parts))
                prune_checkpoints(self.store, self.layout, self.policy.keep, round_)
                stored = StoredPart(round_, 0, part, objects, done, commit_bytes, spools.hold())
                self._mirror(stored, last)
        except (OSError, CheckpointError) as exc:
            _not_written(round_, exc, last)
        finally:
            spools.release()

    def _mirror(self, stored: StoredCheckpoint | StoredPart, last: bool) -> None:
        """Hand ``stored`` to the mirrors, which let go of its spools once copied (this
        writer holds them for the mirrors until then)."""
        if self.mirror is not None:
            self.mirror(stored, last)
        elif stored.spools is not None:
            stored.spools.release()

    def _other_parts(self, round_: int, expected: tuple[str, ...]) -> list[RankPart]:
        """The PART records of ranks 1 and up, once all are in (``part_wait`` at most), each
        of the state its rank held (``expected``: the fingerprints the ranks gathered) with
        its objects in its own folder."""

        def fits(rank: int, part: RankPart) -> bool:
            folder = f"{self.layout.checkpoint_part(round_, rank)}/"
            keys = [entry.key for entry in (part.state, *part.shards)]
            return part.fingerprint == expected[rank] and all(k.startswith(folder) for k in keys)

        ranks = range(1, self.shard.ranks)
        return wait_for_parts(self.store, self.layout, round_, ranks, self.policy, fits)

    def _commit(
        self,
        commit: dict[str, Any],
        shards: dict[str, Blob],
        owners: list[str],
        structure: bytes,
        last: bool,
        spools: Spools,
    ) -> None:
        """Check the other writers' shards are this state's bytes, by size and CRC32C (a
        writer whose state diverged must not leave a checkpoint that fails every reader),
        write a late writer's shards from this replica's own local copies, then the state,
        then the COMMIT; then hand it to the mirrors (``last``: the run's final state, which
        no mirror may skip)."""
        round_ = commit["round"]
        entries = {key: describe(key, blob) for key, blob in shards.items()}
        missing = self._wait_for(list(shards), self.layout.checkpoint(round_))
        theirs = [k for k, owner in zip(shards, owners, strict=True) if owner != self.me]
        for key in (key for key in theirs if key not in missing):
            if not holds(self.store, key, entries[key]):
                raise CheckpointError(f"{key}: its writer stored other bytes than this "
                                      f"replica's state (its global state differs)")  # fmt: skip
        for key in sorted(missing):  # its writer died or stalls: the bytes are anyone's
            log.warning("checkpoint round %d: writing %s in place of a late writer", round_, key)
            put(self.store, key, shards[key])
        state_key = f"{self.layout.checkpoint(round_)}/state"
        self.store.put(state_key, structure)
        state = StoredObject.of(state_key, structure)
        done = CheckpointCommit(**commit, state=state, shards=tuple(entries.values()))
        commit_bytes = encode_record(done)
        if not self._put_commit(done, commit_bytes):
            return
        log.info("checkpoint of round %d committed (%d shards)", round_, len(entries))
        prune_checkpoints(self.store, self.layout, self.policy.keep, round_)
        objects = {**shards, state_key: structure}
        self._mirror(StoredCheckpoint(done, commit_bytes, objects, spools.hold()), last)

    def _put_commit(self, done: CheckpointCommit, data: bytes) -> bool:
        """Put the COMMIT; False if another replica committed this same checkpoint first
        (replicas joining together each write their first one alone; only the time differs),
        and then it is theirs to prune and mirror."""
        key = self.layout.checkpoint_commit(done.round)
        try:
            self.store.put(key, data)
            return True
        except FileExistsError:
            theirs, _ = read_commit(self.store, self.layout, done.round)
            if theirs.model_copy(update={"time": done.time}) != done:
                raise CheckpointError(f"{key}: another writer committed another state") from None
            log.info("checkpoint of round %d was committed by another replica", done.round)
            return False

    def _wait_for(self, keys: list[str], folder: str) -> set[str]:
        """Poll until every key exists under ``folder`` or ``orphan_grace`` has passed; the
        keys still missing."""
        deadline = time.monotonic() + self.policy.orphan_grace
        while missing := set(keys) - set(self.store.list_prefix(folder)):
            if time.monotonic() >= deadline:
                break
            time.sleep(self.policy.poll)
        return missing

    def close(self, wait: bool = True) -> None:
        """Wait for the checkpoint being written (raising what went wrong) and stop."""
        if wait:
            self.wait()
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


def _not_written(round_: int, error: Exception, last: bool) -> None:
    """One checkpoint lost is logged (the previous one stays usable); the run's last is raised:
    the replica must not report done on a run that cannot end without it."""
    if last:
        raise CheckpointError(f"the run's last checkpoint (round {round_}) was not written: "
                              f"{error}") from error  # fmt: skip
    log.warning("checkpoint of round %d not written: %s", round_, error)


PartCheck = Callable[[int, RankPart], bool]  # whether rank k's PART record is the one expected


def wait_for_parts(
    store: Store,
    layout: RunLayout,
    round_: int,
    ranks: Iterable[int],
    policy: CheckpointPolicy,
    fits: PartCheck,
    *,
    replaceable: bool = False,
) -> list[RankPart]:
    """The PART records of ``ranks`` in ``store`` once every one is in and ``fits``, polling
    ``policy.part_wait`` seconds at most; else ``CheckpointError`` naming the first missing.
    A record that does not fit is final in the run's store (create-only: another replica's
    part, whose state differs), but ``replaceable`` in a mirror (an older copy's, which that
    rank's copy replaces)."""
    ranks = list(ranks)
    keys = [layout.checkpoint_rank_done(round_, rank) for rank in ranks]
    deadline = time.monotonic() + policy.part_wait
    while True:
        parts, missing, unlike = _read_parts(store, keys, ranks, fits)
        if unlike is not None and not replaceable:
            raise CheckpointError(f"{unlike}: another part than this replica's rank wrote "
                                  f"(another replica's state differs)")  # fmt: skip
        if missing is None and unlike is None:
            return parts
        if time.monotonic() >= deadline:
            waited = f"{policy.part_wait:g}s"
            raise CheckpointError(
                f"{missing or unlike}: not written after {waited} (that rank stalled or died)"
            )
        time.sleep(policy.poll)


def _read_parts(
    store: Store, keys: list[str], ranks: list[int], fits: PartCheck
) -> tuple[list[RankPart], str | None, str | None]:
    """The PART records at ``keys``, the first key missing, and the first whose record does
    not fit (None: none)."""
    folders = {key.rsplit("/", 2)[0] for key in keys}
    listed = {key for folder in folders for key in store.list_prefix(folder)}
    if missing := [key for key in keys if key not in listed]:
        return [], missing[0], None
    found = store.get_many(keys, limit=RECORD_READ_LIMIT)
    try:
        parts = [decode_record(found[key], RankPart, key=key) for key in keys]
    except WireFormatError as exc:
        raise CheckpointError(str(exc)) from None
    unlike = [
        key for key, rank, part in zip(keys, ranks, parts, strict=True) if not fits(rank, part)
    ]
    return parts, None, (unlike[0] if unlike else None)


def prune_checkpoints(store: Store, layout: RunLayout, keep: int, newest: int) -> None:
    """Delete every checkpoint (committed or not) older than the ``keep`` newest committed up
    to round ``newest`` (the one just written). Counting from the round written, not from the
    store's newest, keeps a mirror useful when it still holds checkpoints of later rounds from
    an earlier run of the same name (started over, or resumed from an older checkpoint): those
    are replaced as the run reaches their rounds (``mirrors.copy_checkpoint``)."""
    committed = committed_rounds(store, layout)
    prune_rounds(store, layout.checkpoints(), committed, keep, newest, layout.checkpoint)


def prune_rounds(
    store: Store,
    prefix: str,
    committed: list[int],
    keep: int,
    newest: int,
    folder: Callable[[int], str],
) -> None:
    """Delete every round's folder under ``prefix`` (``folder(round)``, committed or not) older
    than the ``keep`` newest of the ``committed`` rounds up to ``newest``."""
    committed = sorted((round_ for round_ in committed if round_ <= newest), reverse=True)
    if len(committed) < keep:
        return
    oldest_kept = committed[keep - 1]
    folders = {key.removeprefix(f"{prefix}/").split("/")[0] for key in store.list_prefix(prefix)}
    rounds = (parse_count(name, MAX_ROUND) for name in folders)  # None: no round's folder
    for round_ in sorted(r for r in rounds if r is not None and r < oldest_kept):
        store.delete_prefix(folder(round_))
