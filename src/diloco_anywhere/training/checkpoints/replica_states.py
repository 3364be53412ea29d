"""One replica's own state in the bucket (what it holds and how it is put back into a replica:
``training/recovery/own_state.py``), stored as a checkpoint is and read back as strictly.

A saved state of round ``r`` lives under ``replicas/{replica}/state/{r}/``: ``tree.py``'s
safetensors shards and JSON structure (never pickled), then a create-only COMMIT
(``ReplicaStateCommit``) listing each object's key, size and CRC32C. It moves as a global
checkpoint does, a shard at a time through local files: staged on the training thread, from
the state itself (it changes at the next inner step), at disk speed (``stage_replica_state``),
then uploaded on a thread of its own (``write_replica_state``). A reader takes committed
states only, reads at most ``limit`` bytes of objects and each object only up to the size the
COMMIT gives, and checks every size and CRC32C, the safetensors headers, that every value is
finite and that the names match the structure, with the reader's own helpers (``reader.py``):
anything off is a ``CheckpointError`` naming the key. Its tensors are read as they are loaded
into the replica. The ``KEEP`` newest of each replica stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import read_commit_record
from diloco_anywhere.training.checkpoints.objects import Spools, describe, put
from diloco_anywhere.training.checkpoints.reader import check_keys, guarded, read_tree
from diloco_anywhere.training.checkpoints.records import (
    CheckpointError,
    LocalCopy,
    ReplicaStateCommit,
    StoredObject,
)
from diloco_anywhere.training.checkpoints.staging import HostStaging, write_part
from diloco_anywhere.training.checkpoints.tree import flatten, plan_shards
from diloco_anywhere.training.checkpoints.writer import PART_BYTES, prune_rounds

KEEP = 2  # saved states kept per replica: the newest, and one to fall back on while it is written


@dataclass(frozen=True)
class StagedState:
    """A replica's own state of ``round`` in local files, ready to upload."""

    round: int
    shards: dict[str, LocalCopy]  # by key
    structure: bytes
    spools: Spools


def stage_replica_state(
    store: Store,
    layout: RunLayout,
    replica: str,
    round_: int,
    tree: Any,
    staging: HostStaging,
    part_bytes: int = PART_BYTES,
) -> StagedState:
    """``tree`` (the replica's own state, by reference) in local files of about
    ``part_bytes`` each (device tensors through ``staging``): what ``write_replica_state``
    uploads. It reads the state only here."""
    tensors, structure = flatten(tree)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    plan = plan_shards(tensors, -(-total // part_bytes))
    spools = Spools()
    shards = {}
    try:
        for index, names in enumerate(plan):
            key = layout.replica_state_shard(replica, round_, index)
            path = spools.add(store.spool(key))
            write_part({name: tensors[name] for name in names}, path, staging)
            shards[key] = LocalCopy(path)
    except BaseException:
        spools.release()
        raise
    finally:
        staging.release()
    return StagedState(round_, shards, structure, spools)


def write_replica_state(
    store: Store, layout: RunLayout, replica: str, step: int, staged: StagedState
) -> None:
    """Upload ``staged`` as ``replica``'s own state after its round (the manager at ``step``):
    its objects, then its COMMIT, create-only; then delete its states older than the ``KEEP``
    newest. Its local files are removed, whatever happens."""
    round_ = staged.round
    try:
        state_key = layout.replica_state_structure(replica, round_)
        commit = ReplicaStateCommit(
            run=layout.run, replica=replica, round=round_, step=step, time=time.time(),
            state=StoredObject.of(state_key, staged.structure),
            shards=tuple(describe(key, blob) for key, blob in staged.shards.items()),
        )  # fmt: skip
        for key, blob in staged.shards.items():
            put(store, key, blob)
        store.put(state_key, staged.structure)
        store.put(layout.replica_state_commit(replica, round_), encode_record(commit))
    finally:
        staged.spools.release()
    prune_rounds(
        store, layout.replica_states(replica), saved_rounds(store, layout, replica), KEEP,
        round_, partial(layout.replica_state, replica),
    )  # fmt: skip


def save_replica_state(
    store: Store, layout: RunLayout, replica: str, round_: int, step: int, tree: Any
) -> None:
    """Stage ``tree`` and upload it, here and now (``stage_replica_state`` then
    ``write_replica_state``): a tool's or a test's save, off the training path."""
    staged = stage_replica_state(store, layout, replica, round_, tree, HostStaging())
    write_replica_state(store, layout, replica, step, staged)


def saved_rounds(store: Store, layout: RunLayout, replica: str) -> list[int]:
    """The rounds ``replica`` has a committed own state of, newest first."""
    keys = store.list_prefix(layout.replica_states(replica))
    rounds = (layout.parse_replica_state_commit(replica, key) for key in keys)
    return sorted((r for r in rounds if r is not None), reverse=True)


def read_replica_state(
    store: Store, layout: RunLayout, replica: str, round_: int, limit: int, spools: Spools,
    *, verify: bool = True,
) -> tuple[ReplicaStateCommit, Any]:  # fmt: skip
    """``replica``'s own state of ``round_``: its COMMIT and its tree, every object checked,
    its tensors ``TensorRef``s read from local copies kept in ``spools`` (the caller's to
    release; not ``verify``: the caller confirms them, ``Spools.confirm``, once it has read
    the tensors, before it uses any); ``CheckpointError`` naming the key and what is wrong
    otherwise, including objects of more than ``limit`` bytes in all (what this replica's
    state can hold). A store that cannot be reached is not a bad state: its ``StoreError``
    propagates."""
    commit = _read_commit(store, layout, replica, round_)
    key = layout.replica_state_commit(replica, round_)
    entries = commit.entries()
    check_keys(key, f"{layout.replica_state(replica, round_)}/", entries)
    if (total := sum(entry.size for entry in entries)) > limit:
        raise CheckpointError(f"{key}: the COMMIT names {total} bytes of objects; allowed: at "
                              f"most {limit}, what this replica's own state can hold")  # fmt: skip

    def read() -> Any:
        tree = read_tree(store, commit.state, commit.shards, spools)
        if verify:
            spools.confirm()
        return tree

    return commit, guarded(key, read)


def _read_commit(store: Store, layout: RunLayout, replica: str, round_: int) -> ReplicaStateCommit:
    """The COMMIT of ``replica``'s state of ``round_``, checked against its key."""
    key = layout.replica_state_commit(replica, round_)
    commit, _ = read_commit_record(store, key, ReplicaStateCommit)
    if (commit.run, commit.replica, commit.round) != (layout.run, replica, round_):
        raise CheckpointError(f"{key}: the COMMIT is for run {commit.run}, replica "
                              f"{commit.replica}, round {commit.round}")  # fmt: skip
    return commit
