"""The records of a global checkpoint: what the bucket holds for one, and the data classes the
writer, the reader, the catalogue and the mirrors pass around. Kept apart from the code that
writes and reads them (nothing here touches a store or a tensor), so that every other module
can name them without a cycle.

A checkpoint of round ``r`` lives under ``checkpoints/{r}/`` (docs/checkpoints.md):

- ``shard-{s}.safetensors``: the state's tensors, named by their path in the state tree
  (``['fragments']['StreamingDiLoCoFragment_0']['original_parameters']['0.weight']``), so any
  safetensors reader can take the run's weights out of the bucket (``tree.py``);
- ``state``: a record with the tree's structure and its other leaves (counters, optimizer
  hyperparameters) as JSON;
- ``COMMIT``: written last, create-only, listing the size and CRC32C of every object above
  (``CheckpointCommit``).

A sharded replica (``sharding = "fsdp"``) writes one part per rank instead, each under
``checkpoints/{r}/rank-{k}/`` (its ``state`` and shards: that rank's local shards of the global
weights and outer momentum, each DTensor's whole shape, offset, mesh and placements recorded
in the structure as data). Rank k > 0 writes a ``PART`` record last (``RankPart``); rank 0
waits for every rank's, then writes the one COMMIT, which lists every rank's objects and
fingerprint. A rank heals from its own part (``ShardOf``); ``diloco export`` puts the parts
together.

A replica's own state (``ReplicaStateCommit``) is laid out the same way under
``replicas/{replica}/state/{r}/``: its ``state``, its shards, then its COMMIT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import crc32c
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from diloco_anywhere.bucket.format.framing import Count, Name
from diloco_anywhere.bucket.format.layout import MAX_RANK, MAX_ROUND
from diloco_anywhere.bucket.format.record import Record
from diloco_anywhere.training.state.fingerprints import combine_fingerprints

Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]  # a round that has a key (``RunLayout``)
# ``fingerprint(step, checksum)``, or ranks' fingerprints combined: the same form
Fingerprint = Annotated[str, Field(pattern=r"^step-[0-9]{1,19}-[0-9a-f]{8}$")]
# when it was committed (seconds since the epoch, the committer's clock), at most the last
# second of year 9999, the last a ``datetime`` can show (``diloco launch`` does)
CommitTime = Annotated[float, Field(ge=0, le=253_402_300_799, allow_inf_nan=False)]


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the message names the key and what is wrong."""


class StoredObject(Record):
    key: str
    size: Count
    crc32c: Annotated[int, Field(ge=0, le=2**32 - 1)]

    @classmethod
    def of(cls, key: str, data: bytes) -> StoredObject:
        """The entry that describes ``data`` stored at ``key``."""
        return cls(key=key, size=len(data), crc32c=crc32c.crc32c(data))


class RankPart(Record):
    """One rank's part of a sharded replica's checkpoint: its objects and the fingerprint of
    the state it holds (an unsharded checkpoint is one part, the COMMIT's own fields)."""

    state: StoredObject
    shards: tuple[StoredObject, ...] = Field(max_length=4096)
    fingerprint: Fingerprint


class CheckpointCommit(Record):
    """The last object of a checkpoint: without it, the checkpoint does not exist."""

    run: Name
    round: Round  # the state after this round
    step: Count  # committed syncs (the manager's step)
    sync: Round  # the next round to run: round + 1
    fingerprint: Fingerprint
    time: CommitTime = 0.0
    state: StoredObject | None = None  # unsharded: the structure ...
    shards: tuple[StoredObject, ...] = Field(default=(), max_length=4096)  # ... and tensors
    ranks: tuple[RankPart, ...] = Field(default=(), max_length=MAX_RANK + 1)  # sharded

    @model_validator(mode="after")
    def _one_layout(self) -> CheckpointCommit:
        """Either the whole state (``state``, ``shards``) or one part per rank (``ranks``)."""
        if (self.state is None) == (not self.ranks) or (self.ranks and self.shards):
            raise ValueError("a COMMIT lists either state and shards, or ranks")
        if (
            self.ranks
            and combine_fingerprints([p.fingerprint for p in self.ranks]) != self.fingerprint
        ):
            raise ValueError("the COMMIT's fingerprint is not its ranks' fingerprints combined")
        return self

    @model_validator(mode="after")
    def _counters_agree(self) -> CheckpointCommit:
        """The counters as the manager keeps them: a checkpoint of round r is written after
        round r, so the next round to run is r + 1 (``last_round``), and every round commits
        at most one step (healing would otherwise replay from a round the run never reached,
        or join one past the live replicas)."""
        if self.sync != self.round + 1:
            raise ValueError(f"sync {self.sync} must be round + 1 = {self.round + 1}")
        if self.step > self.sync:
            raise ValueError(f"step {self.step} must be at most sync {self.sync}: one per round")
        prefix = f"step-{self.step}-"
        if any(not p.fingerprint.startswith(prefix) for p in (self, *self.ranks)):
            raise ValueError(f"every fingerprint must be of step {self.step} ({prefix}...)")
        keys = [entry.key for entry in self.entries()]
        if len(set(keys)) != len(keys):
            raise ValueError("the COMMIT names one object twice")
        return self

    @model_serializer(mode="wrap")
    def _as_before_when_unsharded(self, handler: SerializerFunctionWrapHandler) -> Any:
        """An unsharded COMMIT is written without ``ranks``, byte for byte as before sharded
        replicas existed: older readers (a mirror read by an older release) refuse fields
        they do not know."""
        data = handler(self)
        if not self.ranks:
            data.pop("ranks", None)
        return data

    def parts(self) -> tuple[RankPart, ...]:
        """Every part: one per rank of a sharded checkpoint, else the whole state as one."""
        if self.ranks:
            return self.ranks
        return (RankPart(state=self.state, shards=self.shards, fingerprint=self.fingerprint),)  # type: ignore[arg-type]

    def entries(self) -> list[StoredObject]:
        """Every object the COMMIT names."""
        return [entry for part in self.parts() for entry in (part.state, *part.shards)]


class ReplicaStateCommit(Record):
    """The last object of one replica's own state (``own_state.py``), saved after round
    ``round``: its inner optimizer, random generators and local weights, which no other
    replica holds. Without it, the saved state does not exist."""

    run: Name
    replica: Name
    round: Round  # the state after this round's sync
    step: Count  # the manager's committed syncs then
    time: CommitTime
    state: StoredObject  # the structure ...
    shards: tuple[StoredObject, ...] = Field(max_length=4096)  # ... and the tensors

    @model_validator(mode="after")
    def _each_object_once(self) -> ReplicaStateCommit:
        keys = [entry.key for entry in self.entries()]
        if len(set(keys)) != len(keys):
            raise ValueError("the COMMIT names one object twice")
        return self

    def entries(self) -> list[StoredObject]:
        return [self.state, *self.shards]


# Sees a COMMIT before its objects are read; says why it must not be used, or None.
Confirm = Callable[[CheckpointCommit], str | None]


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint, checked (``reader.py``): its ``tree`` holds ``TensorRef``s read
    from local files (``open_checkpoint``; ``close()`` removes what was downloaded), or
    tensors on the CPU (``load_checkpoint``)."""

    commit: CheckpointCommit
    tree: Any  # the state as it was saved (one rank's part, or the whole)
    source: str  # the store it was read from (its URL, credentials masked)
    fingerprint: str  # of ``tree``: the part's, or the COMMIT's for the whole
    from_mirror: bool = False  # read from a mirror, not from the run's store
    spools: Spools | None = None  # the local copies its ``TensorRef``s read

    def close(self) -> None:
        if self.spools is not None:
            self.spools.release()


@dataclass(frozen=True)
class LocalCopy:
    """An object's bytes in a local file: a spool written for it, or a download of it (a
    checkpoint's parts are never held in memory whole: ``objects.py``)."""

    path: str


Blob = bytes | LocalCopy  # an object on its way into a store


class Spools(Protocol):
    """Local files that whoever holds them lets go of once done (``objects.Spools``)."""

    def hold(self) -> Spools: ...

    def release(self) -> None: ...

    def confirm(self) -> None: ...


@dataclass(frozen=True)
class StoredPart:
    """One rank's part of a sharded checkpoint: what a mirror copy of that rank writes
    (``mirrors.copy_part``). Rank 0's carries the COMMIT, written once every rank's part is
    in. ``spools``: the local files its parts are in, let go of once copied."""

    round: int
    rank: int
    part: RankPart
    objects: dict[str, Blob]  # the part's state and shards, by key
    commit: CheckpointCommit | None = None
    commit_bytes: bytes = b""
    spools: Spools | None = None


@dataclass(frozen=True)
class StoredCheckpoint:
    """A committed checkpoint, each object checked against its COMMIT: what a copy to
    another store writes (``mirrors.copy_checkpoint``). ``spools``: the local files its parts
    are in, let go of once copied."""

    commit: CheckpointCommit
    commit_bytes: bytes
    objects: dict[str, Blob]  # the objects read (every part's, or one rank's), by key
    spools: Spools | None = None


@dataclass(frozen=True)
class ShardOf:
    """Which part of a sharded replica's checkpoint a process writes or reads: rank ``rank``
    of ``ranks``. An unsharded replica's processes all hold the whole state: rank 0 of 1."""

    rank: int = 0
    ranks: int = 1

    @property
    def sharded(self) -> bool:
        return self.ranks > 1


WHOLE = ShardOf()
