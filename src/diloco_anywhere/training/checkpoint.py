"""Global checkpoints in the bucket: the run's global state after a round, never pickled.

A checkpoint of round ``r`` lives under ``checkpoints/{r}/`` (docs/checkpoints.md):

- ``shard-{s}.safetensors``: the state's tensors, named by their path in the state tree
  (``['fragments']['StreamingDiLoCoFragment_0']['original_parameters']['0.weight']``), so any
  safetensors reader can take the run's weights out of the bucket;
- ``state``: a record with the tree's structure (torch's pytree spec) and its other leaves
  (counters, optimizer hyperparameters) as JSON;
- ``COMMIT``: written last, create-only, listing the size and CRC32C of every object above.

A sharded replica (``sharding = "fsdp"``) writes one part per rank instead, each under
``checkpoints/{r}/rank-{k}/`` (its ``state`` and shards: that rank's local shards of the global
weights and outer momentum, each DTensor's whole shape, offset, mesh and placements recorded
in the structure as data). Rank k > 0 writes a ``PART`` record last; rank 0 waits for every
rank's, then writes the one COMMIT, which lists every rank's objects and fingerprint. A rank
heals from its own part; ``diloco export`` puts the parts together.

The state is torchft's PGTransport idea (a state dict flattened to metadata plus tensors) with
the bucket as the wire. Every sealed contributor of round ``r`` holds the same state, so they
write the shards in parallel, shard ``s`` by ``contributors[s % n]`` (the sharded exchange's
rule). The first contributor commits: it waits for the other shards, writes any still missing
after ``orphan_grace`` itself (identical bytes, which the create-only put accepts), then puts the
COMMIT. A reader takes only committed checkpoints, checks every object's size and checksum, the
safetensors header and the tensor names against the structure, and falls back to the previous
checkpoint, logging why, when anything is off.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Annotated, Any

import crc32c
import torch
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from diloco_anywhere.bucket.layout import MAX_COUNT, MAX_RANK, MAX_ROUND, RunLayout, parse_count
from diloco_anywhere.bucket.record import RECORD_READ_LIMIT, Record, decode_record, encode_record
from diloco_anywhere.bucket.store import Store, StoreError, check_key
from diloco_anywhere.bucket.wire import Count, Name, WireFormatError
from diloco_anywhere.training.global_state import (
    LocalShard,
    combine_fingerprints,
    fingerprint,
    tree_checksum,
)

log = logging.getLogger(__name__)
JSON_LEAVES = (bool, int, float, str, type(None))
COUNTERS = ("step", "batches_committed", "sync")  # the manager's, as ``state_dict`` gives them
Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]  # a round that has a key (``RunLayout``)
# ``fingerprint(step, checksum)``, or ranks' fingerprints combined: the same form
Fingerprint = Annotated[str, Field(pattern=r"^step-[0-9]{1,19}-[0-9a-f]{8}$")]


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the message names the key and what is wrong."""


class StoredObject(Record):
    key: str
    size: Count
    crc32c: Annotated[int, Field(ge=0, le=2**32 - 1)]


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
    # when it was committed (seconds since the epoch, the committer's clock), at most the
    # last second of year 9999, the last a ``datetime`` can show (``diloco launch`` does)
    time: Annotated[float, Field(ge=0, le=253_402_300_799, allow_inf_nan=False)] = 0.0
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


# Sees a COMMIT before its objects are read; says why it must not be used, or None.
Confirm = Callable[[CheckpointCommit], str | None]


@dataclass(frozen=True)
class Checkpoint:
    commit: CheckpointCommit
    tree: Any  # the state as it was saved (one rank's part, or the whole), tensors on CPU
    source: str  # the store it was read from (its URL, credentials masked)
    fingerprint: str  # of ``tree``: the part's, or the COMMIT's for the whole
    from_mirror: bool = False  # read from a mirror, not from the run's store


@dataclass(frozen=True)
class StoredPart:
    """One rank's part of a sharded checkpoint as bytes: what a mirror copy of that rank
    writes (``mirrors.copy_part``). Rank 0's carries the COMMIT, written once every rank's
    part is in."""

    round: int
    rank: int
    part: RankPart
    objects: dict[str, bytes]  # the part's state and shards, by key
    commit: CheckpointCommit | None = None
    commit_bytes: bytes = b""


@dataclass(frozen=True)
class StoredCheckpoint:
    """A committed checkpoint as bytes, each object checked against its COMMIT: what a copy
    to another store writes (``mirrors.copy_checkpoint``)."""

    commit: CheckpointCommit
    commit_bytes: bytes
    objects: dict[str, bytes]  # the objects read (every part's, or one rank's), by key


# -- the state as bytes ---------------------------------------------------------------------


def snapshot(tree: Any) -> Any:
    """A copy of ``tree`` with every tensor copied to CPU (a DTensor as its ``LocalShard``):
    training may change the original while the copy is written."""

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            return LocalShard.of(leaf)
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().to("cpu", copy=True)
        return leaf

    return tree_map(copy, tree)


def _name(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{key!r}]" for key in path)


def _encode(node: Any, path: tuple[str | int, ...], tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors[_name(path)] = node.contiguous()
        return {"tensor": _name(path)}
    if isinstance(node, LocalShard):
        tensors[_name(path)] = node.tensor.contiguous()
        return {"dtensor": {
            "tensor": _name(path), "shape": list(node.shape), "offset": list(node.offset),
            "mesh": list(node.mesh), "placements": list(node.placements),
        }}  # fmt: skip
    if isinstance(node, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in node):
            raise TypeError(f"state node {_name(path)} has keys other than str and int")
        return {"dict": [[k, _encode(v, (*path, k), tensors)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode(v, (*path, i), tensors) for i, v in enumerate(node)]}
    if isinstance(node, JSON_LEAVES):
        return {"value": node}
    raise TypeError(
        f"state leaf {_name(path)} is a {type(node).__name__}: only tensors, JSON scalars, "
        f"and dicts, lists and tuples of them go into a checkpoint"
    )


def flatten(tree: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors by path name, and the structure with the other leaves as JSON.

    The structure is this module's own small format (dict, list, tuple, tensor, value nodes),
    not torch's pytree spec: ``treespec_loads`` imports modules named in its input, and a
    checkpoint is bucket data, which must never choose code to run."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, (), tensors)
    return tensors, json.dumps(structure).encode()


def _decode(node: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if not (isinstance(node, dict) and len(node) == 1):
        raise ValueError(f"a node must be an object with one field, not {str(node)[:80]}")
    ((kind, value),) = node.items()
    if kind == "tensor" and isinstance(value, str) and value in tensors:
        used.add(value)
        return tensors[value]
    if kind == "dtensor" and isinstance(value, dict) and value.get("tensor") in tensors:
        used.add(value["tensor"])
        return _local_shard(value, tensors[value["tensor"]])
    if kind == "value" and isinstance(value, JSON_LEAVES):
        return value
    if kind in ("list", "tuple") and isinstance(value, list):
        items = [_decode(item, tensors, used) for item in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(value, list):
        pairs = [pair for pair in value if isinstance(pair, list) and len(pair) == 2]
        keys = [pair[0] for pair in pairs]
        if len(pairs) != len(value) or not all(
            isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys
        ):
            raise ValueError("a dict node must be [key, node] pairs with str or int keys")
        return {k: _decode(v, tensors, used) for k, v in pairs}
    raise ValueError(f"node {kind!r} with {str(value)[:80]} is not a tensor, value, list, tuple "
                     f"or dict node (or names a tensor the shards lack)")  # fmt: skip


def _local_shard(node: dict[str, Any], tensor: torch.Tensor) -> LocalShard:
    """A ``dtensor`` node's shard, its place checked: whole numbers, the local tensor inside
    the whole one."""
    fields = {name: node.get(name) for name in ("shape", "offset", "mesh")}
    if (
        not all(
            isinstance(v, list) and all(type(n) is int and 0 <= n <= MAX_COUNT for n in v)
            for v in fields.values()
        )
        or len(fields["shape"]) != tensor.dim()
        or len(fields["offset"]) != tensor.dim()
    ):
        raise ValueError(f"dtensor node {node.get('tensor')}: shape, offset and mesh must be "
                         f"lists of whole numbers, one per dimension")  # fmt: skip
    ends = [o + n for o, n in zip(fields["offset"], tensor.shape, strict=True)]
    if any(end > whole for end, whole in zip(ends, fields["shape"], strict=True)):
        raise ValueError(f"dtensor node {node['tensor']}: the local shard at {fields['offset']} "
                         f"reaches past the whole shape {fields['shape']}")  # fmt: skip
    placements = node.get("placements")
    if not (
        isinstance(placements, list)
        and all(isinstance(p, str) for p in placements)
        and len(placements) == len(fields["mesh"])
        and all(fields["mesh"])
    ):
        raise ValueError(f"dtensor node {node['tensor']}: placements must be a list of strings, "
                         f"one per dimension of the mesh, whose sizes are at least 1")  # fmt: skip
    return LocalShard(
        tensor, tuple(fields["shape"]), tuple(fields["offset"]), tuple(fields["mesh"]),
        tuple(placements),
    )  # fmt: skip


def unflatten(structure: bytes, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """The tree back from ``flatten``'s parts; ``CheckpointError`` naming ``key`` if they do not
    fit together (a tensor missing or extra, or a structure that does not parse)."""
    used: set[str] = set()
    try:
        parsed = json.loads(structure, parse_constant=_not_finite, parse_float=_finite)
        tree = _decode(parsed, tensors, used)
    except Exception as exc:  # bucket data: whatever it is, it is not a checkpoint to load
        raise CheckpointError(f"{key}: state structure does not parse: {exc}") from None
    if extra := sorted(tensors.keys() - used):
        raise CheckpointError(f"{key}: the shards hold tensors the structure lacks: {extra[:3]}")
    return tree


def _finite(text: str) -> float:
    """A JSON number of the structure, which must be finite: ``json`` reads ``1e999`` as inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is not finite; a checkpoint's values must be")
    return value


def _not_finite(text: str) -> float:
    """``NaN`` and ``Infinity``, which ``json`` accepts by default, are no checkpoint value."""
    raise ValueError(f"{text} is not finite; a checkpoint's values must be")


def plan_shards(tensors: dict[str, torch.Tensor], count: int) -> list[list[str]]:
    """Tensor names split into at most ``count`` runs of about equal bytes, in order."""
    names = list(tensors)
    count = max(1, min(count, len(names)))
    sizes = [tensors[name].numel() * tensors[name].element_size() for name in names]
    total, shards, done = sum(sizes), [[] for _ in range(count)], 0
    for name, size in zip(names, sizes, strict=True):
        shard = min(count - 1, done * count // max(total, 1))
        shards[shard].append(name)
        done += size
    return [shard for shard in shards if shard] or [[]]


def encode_shard(names: list[str], tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({name: tensors[name] for name in names})


def _entry(key: str, data: bytes) -> StoredObject:
    return StoredObject(key=key, size=len(data), crc32c=crc32c.crc32c(data))


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


# -- writing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPolicy:
    keep: int = 2  # committed checkpoints kept (rounds after the oldest kept are kept too)
    orphan_grace: float = 30.0  # seconds the committer waits for other writers' shards
    poll: float = 0.2
    part_wait: float = 600.0  # seconds rank 0 of a sharded replica waits for the others' parts
    part_bytes: int = 1 << 30  # a rank's part is written in objects of about this size


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


class CheckpointWriter:
    """Writes this replica's share of checkpoints on a background thread, one at a time.

    A store error (an ``OSError``) loses one checkpoint, logged; the previous one stays usable.
    Any other error
    (a state that cannot be checkpointed) is raised on the training thread at the next
    ``write`` or at ``close``, so a run never goes on without checkpoints unnoticed."""

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
        (the round's SEAL). The tree is copied first; True if a write started. While the
        previous checkpoint is still being written a new one is skipped, except the ``last``
        (the run's final state), which waits for it. ``parts``: a sharded replica's ranks'
        fingerprints of the state they write, gathered; rank 0 commits only those parts."""
        if self.me not in contributors:
            return False
        if self._pending is not None:
            if not (last or self.idle()):
                log.warning("checkpoint of round %d skipped: the previous one is still being "
                            "written (raise checkpoint.every)", round_)  # fmt: skip
                return False
            self._pending.result()  # raises what went wrong, other than the store
        if self.shard.sharded:
            work = (self._write_part, round_, parts, snapshot(tree), last)
        else:
            work = (self._write, round_, contributors, snapshot(tree), last)
        self._pending = self._executor.submit(*work)
        return True

    def idle(self) -> bool:
        """No checkpoint being written."""
        return self._pending is None or self._pending.done()

    def _write(
        self, round_: int, contributors: tuple[str, ...], tree: dict[str, Any], last: bool
    ) -> None:
        tensors, structure = flatten(tree)
        plan = plan_shards(tensors, len(contributors))
        shards = [encode_shard(names, tensors) for names in plan]
        owners = [contributors[s % len(contributors)] for s in range(len(plan))]
        keys = [self.layout.checkpoint_shard(round_, s) for s in range(len(plan))]
        try:
            self.store.put_many(
                {keys[s]: shards[s] for s, owner in enumerate(owners) if owner == self.me}
            )
            if owners[0] == self.me:
                commit = _commit_fields(self.layout, round_, tree)
                shards_by_key = dict(zip(keys, shards, strict=True))
                self._commit(commit, shards_by_key, owners, structure, last)
        except (OSError, CheckpointError) as exc:  # the store's errors are OSErrors
            log.warning("checkpoint of round %d not written: %s", round_, exc)

    def _write_part(
        self, round_: int, expected: tuple[str, ...], tree: dict[str, Any], last: bool
    ) -> None:
        """This rank's part of a sharded replica's checkpoint: its objects, then (rank k > 0)
        its PART record, or (rank 0) the COMMIT once every rank's PART is in."""
        rank, layout = self.shard.rank, self.layout
        tensors, structure = flatten(tree)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        plan = plan_shards(tensors, -(-total // self.policy.part_bytes))
        objects = {
            layout.checkpoint_shard(round_, s, rank): encode_shard(names, tensors)
            for s, names in enumerate(plan)
        }
        state_key = layout.checkpoint_state(round_, rank)
        commit = _commit_fields(layout, round_, tree)
        part = RankPart(
            state=_entry(state_key, structure),
            shards=tuple(_entry(key, data) for key, data in objects.items()),
            fingerprint=commit["fingerprint"],
        )
        objects[state_key] = structure
        try:
            self.store.put_many(objects)
            if rank > 0:
                self.store.put(layout.checkpoint_rank_done(round_, rank), encode_record(part))
                self._mirror(StoredPart(round_, rank, part, objects), last)
                return
            parts = (part, *self._other_parts(round_, expected))
            commit["fingerprint"] = combine_fingerprints([p.fingerprint for p in parts])
            done = CheckpointCommit(**commit, ranks=parts)
            commit_bytes = encode_record(done)
            if self._put_commit(done, commit_bytes):
                log.info("checkpoint of round %d committed (%d ranks)", round_, len(parts))
                prune_checkpoints(self.store, self.layout, self.policy.keep, round_)
                self._mirror(StoredPart(round_, 0, part, objects, done, commit_bytes), last)
        except (OSError, CheckpointError) as exc:
            log.warning("checkpoint of round %d not written: %s", round_, exc)

    def _mirror(self, stored: StoredCheckpoint | StoredPart, last: bool) -> None:
        if self.mirror is not None:
            self.mirror(stored, last)

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
        shards: dict[str, bytes],
        owners: list[str],
        structure: bytes,
        last: bool,
    ) -> None:
        """Check the other writers' shards are this state's bytes (a writer whose state
        diverged must not leave a checkpoint that fails every reader), write a late writer's
        shards, then the state, then the COMMIT; then hand it to the mirrors (``last``: the
        run's final state, which no mirror may skip)."""
        round_ = commit["round"]
        missing = self._wait_for(list(shards), self.layout.checkpoint(round_))
        theirs = [k for k, owner in zip(shards, owners, strict=True) if owner != self.me]
        present = [key for key in theirs if key not in missing]
        # one byte past our largest shard: a larger object differs without being downloaded
        limit = max((len(shards[key]) for key in present), default=0) + 1
        stored = self.store.get_many(present, limit=limit)
        for key, data in stored.items():
            if data != shards[key]:
                raise CheckpointError(f"{key}: its writer stored other bytes than this "
                                      f"replica's state (its global state differs)")  # fmt: skip
        for key in sorted(missing):  # its writer died or stalls: the bytes are anyone's
            log.warning("checkpoint round %d: writing %s in place of a late writer", round_, key)
            self.store.put(key, shards[key])
        state_key = f"{self.layout.checkpoint(round_)}/state"
        self.store.put(state_key, structure)
        entries = tuple(_entry(key, data) for key, data in shards.items())
        done = CheckpointCommit(**commit, state=_entry(state_key, structure), shards=entries)
        commit_bytes = encode_record(done)
        if not self._put_commit(done, commit_bytes):
            return
        log.info("checkpoint of round %d committed (%d shards)", round_, len(entries))
        prune_checkpoints(self.store, self.layout, self.policy.keep, round_)
        self._mirror(StoredCheckpoint(done, commit_bytes, {**shards, state_key: structure}), last)

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
        if wait and self._pending is not None:
            self._pending.result()
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


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
    committed = [round_ for round_ in committed_rounds(store, layout) if round_ <= newest]
    if len(committed) < keep:
        return
    oldest_kept = committed[keep - 1]
    folders = {
        key.removeprefix(f"{layout.checkpoints()}/").split("/")[0]
        for key in store.list_prefix(layout.checkpoints())
    }
    rounds = (parse_count(folder, MAX_ROUND) for folder in folders)  # None: no checkpoint's
    for round_ in sorted(r for r in rounds if r is not None and r < oldest_kept):
        store.delete_prefix(layout.checkpoint(round_))


# -- reading -------------------------------------------------------------------------------


def committed_rounds(store: Store, layout: RunLayout) -> list[int]:
    """Rounds with a COMMIT, newest first."""
    rounds = (
        layout.parse_checkpoint_commit(key) for key in store.list_prefix(layout.checkpoints())
    )
    return sorted((r for r in rounds if r is not None), reverse=True)


def retained_after(store: Store, layout: RunLayout, keep: int) -> int:
    """Rounds up to this one may be collected: healing starts from one of the ``keep`` newest
    committed checkpoints and replays the rounds after it (-1: none committed, keep all)."""
    committed = committed_rounds(store, layout)
    return committed[min(keep, len(committed)) - 1] if committed else -1


def _checked(key: str, data: bytes | None, entry: StoredObject) -> bytes:
    if data is None:
        raise CheckpointError(f"{key}: missing")
    checksum = crc32c.crc32c(data)
    if len(data) != entry.size or checksum != entry.crc32c:
        raise CheckpointError(
            f"{key}: {len(data)} bytes with CRC32C {checksum:#010x}; the COMMIT says "
            f"{entry.size} bytes, {entry.crc32c:#010x}"
        )
    return data


def _check_keys(key: str, folder: str, entries: list[StoredObject]) -> None:
    """The COMMIT ``key`` must name plain keys inside ``folder`` (its checkpoint's, or for a
    sharded one each rank's own part's)."""
    for entry in entries:
        try:
            check_key(entry.key)
        except ValueError as exc:
            raise CheckpointError(f"{key}: {exc}") from None
        if not entry.key.startswith(folder):
            raise CheckpointError(f"{key}: the COMMIT names {entry.key}, outside {folder}")


def _read_objects(store: Store, entries: list[StoredObject]) -> dict[str, bytes | None]:
    """The objects the COMMIT names, each read up to one byte past the size it gives (so the
    memory used is what the COMMIT claims, whatever the bucket holds)."""

    def read(entry: StoredObject) -> bytes | None:
        try:
            return store.get(entry.key, 0, entry.size + 1)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(min(16, len(entries))) as pool:
        return dict(zip((e.key for e in entries), pool.map(read, entries), strict=True))


def load_checkpoint(
    store: Store,
    layout: RunLayout,
    round_: int,
    confirm: Confirm | None = None,
    shard: ShardOf | None = None,
) -> Checkpoint:
    """The committed checkpoint of ``round_``, every object checked; else ``CheckpointError``
    naming the key and why, whatever is wrong with the bucket's bytes (a dtype torch does not
    have, a size no file has, a state unlike its COMMIT), so healing falls back to the previous
    checkpoint. ``shard``: the part one process of a replica heals from (its rank's, of a
    sharded checkpoint written by replicas of as many ranks); None: the whole state, a sharded
    checkpoint's parts put together. ``confirm`` sees the COMMIT before anything else is read
    and may refuse it (says why); what it raises propagates. A store that cannot be reached
    (``StoreError``) is not a bad checkpoint: it propagates."""
    stored = _read_checkpoint(store, layout, round_, confirm, shard)
    parts = _guarded(layout, round_, lambda: _decode_checkpoint(stored))
    if shard is not None:
        fingerprint_ = stored.commit.parts()[shard.rank].fingerprint
        return Checkpoint(stored.commit, parts[0], store.url, fingerprint_)
    tree = _guarded(layout, round_, lambda: whole_tree(parts))  # a one-rank FSDP's too
    return Checkpoint(stored.commit, tree, store.url, stored.commit.fingerprint)


def read_checkpoint(store: Store, layout: RunLayout, round_: int) -> StoredCheckpoint:
    """The committed checkpoint of ``round_`` as bytes (every part), checked as
    ``load_checkpoint`` checks it (its tensors and structure decoded once, then dropped)."""
    stored = _read_checkpoint(store, layout, round_, None, None)
    _guarded(layout, round_, lambda: _decode_checkpoint(stored))
    return stored


def read_commit(store: Store, layout: RunLayout, round_: int) -> tuple[CheckpointCommit, bytes]:
    """The COMMIT of ``round_``, checked against its key; ``CheckpointError`` if it is not one."""
    key = layout.checkpoint_commit(round_)
    try:
        data = store.get(key, 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{key}: missing") from None
    try:
        commit = decode_record(data, CheckpointCommit, key=key)
    except WireFormatError as exc:  # names the key
        raise CheckpointError(str(exc)) from None
    if (commit.run, commit.round) != (layout.run, round_):
        raise CheckpointError(f"{key}: the COMMIT is for run {commit.run} round {commit.round}")
    return commit, data


def _guarded(layout: RunLayout, round_: int, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (CheckpointError, StoreError):
        raise
    except Exception as exc:  # bucket data: whatever fails in it, this is no checkpoint to load
        key = layout.checkpoint_commit(round_)
        raise CheckpointError(f"{key}: {type(exc).__name__}: {exc}") from None


def _parts_read(
    commit: CheckpointCommit, key: str, shard: ShardOf | None
) -> list[tuple[int, RankPart]]:
    """The parts ``shard`` reads, by rank: every one (None), or its rank's, which exists only
    when the checkpoint's replicas had as many ranks as the reader's (``sharding = "fsdp"``)."""
    parts = commit.parts()
    if shard is None:
        return list(enumerate(parts))
    if len(parts) != shard.ranks:
        written = f"sharded over {len(parts)} ranks" if commit.ranks else "unsharded (one part)"
        reader = f"sharded over {shard.ranks} ranks" if shard.sharded else "unsharded"
        raise CheckpointError(
            f"{key}: the checkpoint is {written}; this replica is {reader}. Every replica of a "
            f"run must have the same [run] sharding and, with fsdp, the same "
            f"processes_per_replica"
        )
    return [(shard.rank, parts[shard.rank])]


def _read_checkpoint(
    store: Store, layout: RunLayout, round_: int, confirm: Confirm | None, shard: ShardOf | None
) -> StoredCheckpoint:
    commit, commit_bytes = read_commit(store, layout, round_)
    key = layout.checkpoint_commit(round_)
    parts = _parts_read(commit, key, shard)  # a sharding unlike the reader's is refused first
    if confirm is not None and (refusal := confirm(commit)):
        raise CheckpointError(f"{key} in {store.url}: {refusal}")
    for rank, part in parts:
        folder = layout.checkpoint_part(round_, rank if commit.ranks else None)
        _check_keys(key, f"{folder}/", [part.state, *part.shards])
    entries = [entry for _, part in parts for entry in (part.state, *part.shards)]
    objects = _guarded(layout, round_, lambda: _read_objects(store, entries))
    checked = {e.key: _checked(e.key, objects[e.key], e) for e in entries}
    return StoredCheckpoint(commit, commit_bytes, checked)


def _decode_part(commit: CheckpointCommit, part: RankPart, objects: dict[str, bytes]) -> Any:
    """One part's state tree, which must hold the COMMIT's counters and fingerprint to the
    part's fingerprint: objects and a COMMIT that do not belong together are refused."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in part.shards:
        tensors.update(_load_shard(entry.key, objects[entry.key]))
    tree = unflatten(objects[part.state.key], tensors, part.state.key)
    _check_counters(part.state.key, tree, commit)
    _check_meshes(part.state.key, tree, len(commit.parts()))
    found = fingerprint(commit.step, tree_checksum(tree["fragments"]))
    if found != part.fingerprint:
        raise CheckpointError(f"{part.state.key}: the state fingerprints as {found}, its COMMIT "
                              f"says {part.fingerprint}")  # fmt: skip
    return tree


def _load_shard(key: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of the shard at ``key``, each checked finite."""
    try:
        tensors = load_safetensors(data)
    except SafetensorError as exc:
        raise CheckpointError(f"{key}: not a safetensors file: {exc}") from None
    except Exception as exc:  # valid safetensors torch cannot hold (e.g. a dtype it lacks)
        raise CheckpointError(
            f"{key}: safetensors this torch cannot load: {type(exc).__name__}: {exc}"
        ) from None
    for name, tensor in tensors.items():
        _require_finite(key, name, tensor)
    return tensors


def _require_finite(key: str, name: str, tensor: torch.Tensor) -> None:
    """A NaN or inf in a checkpoint is damage, whatever its checksums say: the run never holds
    one (every replica refuses a mean that is not finite, ``mean.py``), and a replica healed
    from it would train on garbage, or spread it through the rounds it seals."""
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    if not values.is_floating_point():
        return
    if values.element_size() == 1:  # float8: no isfinite kernel on the CPU; widening is exact
        values = values.float()
    if bad := int((~torch.isfinite(values)).sum()):
        raise CheckpointError(f"{key}: tensor {name} holds {bad} NaN or infinite values; a "
                              f"checkpoint's values must be finite")  # fmt: skip


def _check_counters(key: str, tree: Any, commit: CheckpointCommit) -> None:
    """The state's manager counters (its ``state`` object at ``key``): exactly ``COUNTERS``,
    whole numbers in range, step and sync the COMMIT's, and at least one batch per committed
    step (a commit adds its round's contributors, ``BucketManager.conclude``)."""
    counters = tree.get("manager") if isinstance(tree, dict) else None
    if not (isinstance(counters, dict) and set(counters) == set(COUNTERS) and "fragments" in tree):
        raise CheckpointError(f"{key}: the state must hold fragments and the manager's counters "
                              f"{', '.join(COUNTERS)}; it holds {str(counters)[:200]}")  # fmt: skip
    for name, value in counters.items():
        if not (type(value) is int and 0 <= value <= MAX_COUNT):
            raise CheckpointError(f"{key}: counter {name} is {value!r:.80}; allowed: an integer "
                                  f"from 0 to {MAX_COUNT}")  # fmt: skip
    expected = {"step": commit.step, "sync": commit.sync}
    if {name: counters[name] for name in expected} != expected:
        raise CheckpointError(f"{key}: its counters {counters} are not its COMMIT's {expected}")
    if counters["batches_committed"] < counters["step"]:
        raise CheckpointError(f"{key}: counter batches_committed is {counters['batches_committed']}"
                              f"; allowed: at least step, {counters['step']}")  # fmt: skip


def _check_meshes(key: str, tree: Any, ranks: int) -> None:
    """Each sharded leaf's device mesh spans as many ranks as the COMMIT has parts (a sharded
    replica's mesh is its ranks, ``sharded_replica.py``)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, LocalShard) and math.prod(leaf.mesh) != ranks:
            raise CheckpointError(f"{key}: a tensor is sharded over a mesh of {list(leaf.mesh)}; "
                                  f"the checkpoint has {ranks} parts")  # fmt: skip


def _decode_checkpoint(stored: StoredCheckpoint) -> list[Any]:
    """The state tree of each part read (the parts whose objects ``stored`` holds)."""
    parts = [part for part in stored.commit.parts() if part.state.key in stored.objects]
    return [_decode_part(stored.commit, part, stored.objects) for part in parts]


def whole_tree(parts: list[Any]) -> Any:
    """The state of a sharded checkpoint as one tree: each ``LocalShard`` leaf put together
    from the ranks' shards at their offsets (every element exactly once), every other leaf
    (counters, hyperparameters) the same in every part."""

    def whole(*leaves: Any) -> Any:
        first = leaves[0]
        if isinstance(first, LocalShard):
            return _put_together(leaves)
        if any(not _same(leaf, first) for leaf in leaves):
            raise CheckpointError(f"the ranks' parts differ in an unsharded leaf: {first!r:.80}")
        return first

    return tree_map(whole, parts[0], *parts[1:])


def _put_together(shards: tuple[Any, ...]) -> torch.Tensor:
    """One tensor from its ranks' ``LocalShard``s, each element covered exactly once. Checked
    before anything the size of the whole is allocated: the shapes come from the bucket."""
    first, kind = shards[0], (shards[0].shape, shards[0].tensor.dtype)
    if not all(isinstance(s, LocalShard) and (s.shape, s.tensor.dtype) == kind for s in shards):
        raise CheckpointError("the ranks' parts hold one tensor in different shapes or dtypes")
    numel, held = math.prod(first.shape), sum(s.tensor.numel() for s in shards)
    if held != numel:
        raise CheckpointError(
            f"the ranks' shards of a {list(first.shape)} tensor hold {held} elements, not {numel}"
        )
    tensor = torch.empty(first.shape, dtype=first.tensor.dtype)
    covered = torch.zeros(first.shape, dtype=torch.bool)
    for shard in shards:
        where = tuple(
            slice(o, o + n) for o, n in zip(shard.offset, shard.tensor.shape, strict=True)
        )
        if covered[where].any():
            raise CheckpointError(f"the ranks' shards of a {list(first.shape)} tensor overlap")
        tensor[where], covered[where] = shard.tensor, True
    return tensor


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def newest_checkpoints(
    store: Store,
    layout: RunLayout,
    mirrors: Sequence[Store] = (),
    confirm_mirrored: Confirm | None = None,
    shard: ShardOf | None = None,
) -> Iterator[Checkpoint]:
    """Committed checkpoints that load intact (``shard``'s part, or the whole: as
    ``load_checkpoint``), newest first (lazily), each from ``store`` or, where it has none of
    that round or its copy there does not load, from the first of ``mirrors`` whose copy does;
    ``confirm_mirrored`` may refuse a mirror's COMMIT. The ones that do not load, and mirrors
    that cannot be listed, are logged with the reason and skipped; ``store`` itself not
    answering propagates."""
    for round_, holders in checkpoint_holders(store, layout, mirrors):
        checkpoint = first_intact(store, mirrors, holders, layout, round_, confirm_mirrored, shard)
        if checkpoint is not None:
            yield checkpoint


def checkpoint_holders(
    store: Store, layout: RunLayout, mirrors: Sequence[Store] = ()
) -> list[tuple[int, list[int]]]:
    """Every committed round, newest first, with the stores holding a COMMIT of it: 0 for
    ``store``, k for ``mirrors[k - 1]``, in that order (mirrors that cannot be listed are
    logged and left out)."""
    listed = [committed_rounds(store, layout)]
    for mirror in mirrors:
        try:
            listed.append(committed_rounds(mirror, layout))
        except OSError as exc:
            log.warning("mirror %s not used: its checkpoints cannot be listed: %s", mirror.url, exc)
            listed.append([])
    rounds = sorted({round_ for found in listed for round_ in found}, reverse=True)
    return [(r, [k for k, found in enumerate(listed) if r in found]) for r in rounds]


def first_intact(
    store: Store,
    mirrors: Sequence[Store],
    holders: list[int],
    layout: RunLayout,
    round_: int,
    confirm_mirrored: Confirm | None,
    shard: ShardOf | None,
) -> Checkpoint | None:
    """The checkpoint of ``round_`` from the first of ``holders`` (``checkpoint_holders``)
    whose copy loads intact; None (logged) if none does. ``store`` not answering propagates."""
    for holder in holders:
        source = store if holder == 0 else mirrors[holder - 1]
        confirm = None if holder == 0 else confirm_mirrored
        try:
            checkpoint = load_checkpoint(source, layout, round_, confirm, shard)
            return replace(checkpoint, from_mirror=holder != 0)
        except CheckpointError as exc:
            log.warning("checkpoint of round %d not used: %s", round_, exc)
        except StoreError as exc:
            if holder == 0:
                raise
            log.warning("checkpoint of round %d in mirror %s not used: %s",
                        round_, source.url, exc)  # fmt: skip
    return None
