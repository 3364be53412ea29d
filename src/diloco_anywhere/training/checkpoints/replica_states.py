"""One replica's own state in the bucket (what it holds and how it is put back into a replica:
``training/own_state.py``), stored as a checkpoint is and read back as strictly.

A saved state of round ``r`` lives under ``replicas/{replica}/state/{r}/``: ``tree.py``'s
safetensors shards and JSON structure (never pickled), then a create-only COMMIT
(``ReplicaStateCommit``) listing each object's key, size and CRC32C. A reader takes committed
states only, reads at most ``limit`` bytes of objects and each object only up to the size the
COMMIT gives, and checks every size and CRC32C, the safetensors headers, that every value is
finite and that the names match the structure, with the reader's own helpers (``reader.py``):
anything off is a ``CheckpointError`` naming the key. The ``KEEP`` newest of each replica
stay.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import read_commit_record
from diloco_anywhere.training.checkpoints.reader import (
    check_keys,
    checked_object,
    decode_tree,
    guarded,
    read_objects,
)
from diloco_anywhere.training.checkpoints.records import (
    CheckpointError,
    ReplicaStateCommit,
    StoredObject,
)
from diloco_anywhere.training.checkpoints.tree import encode_in_parts
from diloco_anywhere.training.checkpoints.writer import prune_rounds

KEEP = 2  # saved states kept per replica: the newest, and one to fall back on while it is written
PART_BYTES = 1 << 30  # a state is written in objects of about this size


def write_replica_state(
    store: Store,
    layout: RunLayout,
    replica: str,
    round_: int,
    step: int,
    tree: Any,
    part_bytes: int = PART_BYTES,
) -> None:
    """Save ``tree`` (on CPU) as ``replica``'s own state after ``round_`` (the manager at
    ``step``): its objects, then its COMMIT, create-only; then delete its states older than
    the ``KEEP`` newest."""
    objects, structure = encode_in_parts(
        tree, part_bytes, partial(layout.replica_state_shard, replica, round_)
    )
    state_key = layout.replica_state_structure(replica, round_)
    commit = ReplicaStateCommit(
        run=layout.run, replica=replica, round=round_, step=step, time=time.time(),
        state=StoredObject.of(state_key, structure),
        shards=tuple(StoredObject.of(key, data) for key, data in objects.items()),
    )  # fmt: skip
    store.put_many({**objects, state_key: structure})
    store.put(layout.replica_state_commit(replica, round_), encode_record(commit))
    prune_rounds(
        store, layout.replica_states(replica), saved_rounds(store, layout, replica), KEEP,
        round_, partial(layout.replica_state, replica),
    )  # fmt: skip


def saved_rounds(store: Store, layout: RunLayout, replica: str) -> list[int]:
    """The rounds ``replica`` has a committed own state of, newest first."""
    keys = store.list_prefix(layout.replica_states(replica))
    rounds = (layout.parse_replica_state_commit(replica, key) for key in keys)
    return sorted((r for r in rounds if r is not None), reverse=True)


def read_replica_state(
    store: Store, layout: RunLayout, replica: str, round_: int, limit: int
) -> tuple[ReplicaStateCommit, Any]:
    """``replica``'s own state of ``round_``: its COMMIT and its tree (tensors on CPU), every
    object checked; ``CheckpointError`` naming the key and what is wrong otherwise, including
    objects of more than ``limit`` bytes in all (what this replica's state can hold). A store
    that cannot be reached is not a bad state: its ``StoreError`` propagates."""
    commit = _read_commit(store, layout, replica, round_)
    key = layout.replica_state_commit(replica, round_)
    entries = commit.entries()
    check_keys(key, f"{layout.replica_state(replica, round_)}/", entries)
    if (total := sum(entry.size for entry in entries)) > limit:
        raise CheckpointError(f"{key}: the COMMIT names {total} bytes of objects; allowed: at "
                              f"most {limit}, what this replica's own state can hold")  # fmt: skip
    objects = guarded(key, lambda: read_objects(store, entries))
    checked = {e.key: checked_object(e.key, objects[e.key], e) for e in entries}
    return commit, guarded(key, lambda: decode_tree(commit.state, commit.shards, checked))


def _read_commit(store: Store, layout: RunLayout, replica: str, round_: int) -> ReplicaStateCommit:
    """The COMMIT of ``replica``'s state of ``round_``, checked against its key."""
    key = layout.replica_state_commit(replica, round_)
    commit, _ = read_commit_record(store, key, ReplicaStateCommit)
    if (commit.run, commit.replica, commit.round) != (layout.run, replica, round_):
        raise CheckpointError(f"{key}: the COMMIT is for run {commit.run}, replica "
                              f"{commit.replica}, round {commit.round}")  # fmt: skip
    return commit
