"""Reading one global checkpoint: the committed state of a round, every byte checked, or a
``CheckpointError`` naming the key and what is wrong.

A reader takes only committed checkpoints and checks every object's size and CRC32C against the
COMMIT, the safetensors header, the tensor names against the structure, that every value is
finite, and that the state's counters, device meshes and fingerprint are the COMMIT's.
Whatever is wrong with the bucket's bytes is a ``CheckpointError``, never another exception,
so that healing falls back to the previous checkpoint (``catalogue.py``) instead of failing;
a store that cannot be reached is not a bad checkpoint and propagates.

It reads with host memory bounded by a slice of a tensor, whatever the model
(``open_checkpoint``): each shard is a local file, the store's own (a local store, pinned) or
a download of it in chunks, of the size its COMMIT gives; its tensors are ``TensorRef``s,
which a heal fills into the replica's own tensors and an export writes out a shard at a time
(``staging.py``), and each file's CRC32C is taken as its tensors are read, not in a read of its
own (``PartCheck``): a checkpoint is used (trained from, exported, copied) only once every
file is confirmed. ``load_checkpoint`` loads every tensor (what
a test or a small tool wants).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import torch
from torch.utils._pytree import tree_leaves, tree_map

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.crc_combine import crc32c_combine
from diloco_anywhere.bucket.format.layout import MAX_COUNT, RunLayout
from diloco_anywhere.bucket.keys import check_key
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import read_commit
from diloco_anywhere.training.checkpoints.objects import Spools
from diloco_anywhere.training.checkpoints.records import (
    Checkpoint,
    CheckpointCommit,
    CheckpointError,
    Confirm,
    LocalCopy,
    RankPart,
    ShardOf,
    StoredCheckpoint,
    StoredObject,
)
from diloco_anywhere.training.checkpoints.staging import PartFile, PartTensor, part_tensors
from diloco_anywhere.training.checkpoints.tree import LazyTensor, unflatten, whole_tree
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import LocalShard, tree_checksum

COUNTERS = ("step", "batches_committed", "sync")  # the manager's, as ``state_dict`` gives them


def checked_object(key: str, data: bytes | None, entry: StoredObject) -> bytes:
    if data is None:
        raise CheckpointError(f"{key}: missing")
    checksum = crc32c.crc32c(data)
    if len(data) != entry.size or checksum != entry.crc32c:
        raise CheckpointError(
            f"{key}: {len(data)} bytes with CRC32C {checksum:#010x}; the COMMIT says "
            f"{entry.size} bytes, {entry.crc32c:#010x}"
        )
    return data


def check_keys(key: str, folder: str, entries: list[StoredObject]) -> None:
    """The COMMIT ``key`` must name plain keys inside ``folder`` (its checkpoint's, or for a
    sharded one each rank's own part's)."""
    for entry in entries:
        try:
            check_key(entry.key)
        except ValueError as exc:
            raise CheckpointError(f"{key}: {exc}") from None
        if not entry.key.startswith(folder):
            raise CheckpointError(f"{key}: the COMMIT names {entry.key}, outside {folder}")


def local_copy(store: Store, entry: StoredObject, spools: Spools) -> str:
    """A local file holding the object ``entry`` names, kept in ``spools``: the store's own
    file, pinned (a local store: a link, so that a checkpoint pruned meanwhile still reads),
    else a download of at most one byte past the size the COMMIT gives, a chunk at a time.
    Its size is checked here; its CRC32C as its tensors are read (``PartCheck``)."""
    try:
        path = store.pinned_local_file(entry.key)
        if path is None:
            path = store.spool(entry.key)
            spools.add(path)
            store.get_file(entry.key, path, entry.size + 1)
        else:
            spools.add(path)
    except FileNotFoundError:
        raise CheckpointError(f"{entry.key}: missing") from None
    if (size := os.path.getsize(path)) != entry.size:
        raise CheckpointError(f"{entry.key}: {size} bytes; the COMMIT says {entry.size} bytes")
    return path


class PartCheck:
    """One local file of a checkpoint checked against its COMMIT's CRC32C as its tensors are
    read, not in a read of its own: a tensor's bytes get a CRC of their own as they land
    (``TensorRef``), and ``confirm`` puts the header's and these together in file order
    (``crc32c_combine``), reading only the tensors nobody read. Until it is confirmed, what
    was read of the file may be damage, and nothing of it is used: an export, a mirror copy
    and a verified open confirm before they go on, a replica's own state before any of it
    is loaded, a heal before it fills the replica (``open_checkpoint``)."""

    def __init__(self, entry: StoredObject, path: str, tensors: list[PartTensor]) -> None:
        self.entry, self.path, self.key = entry, path, entry.key
        self.tensors = sorted(tensors, key=lambda tensor: tensor.offset)
        self._read: dict[int, int] = {}  # a tensor's offset: the CRC32C of its bytes
        self._confirmed = False

    def record(self, tensor: PartTensor, checksum: int) -> None:
        self._read[tensor.offset] = checksum

    def confirm(self) -> None:
        """``CheckpointError`` naming the key unless the file's bytes are the COMMIT's."""
        if self._confirmed:
            return
        with open(self.path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = file.read(length)
        checksum = crc32c.crc32c(header, crc32c.crc32c(length.to_bytes(8, "little")))
        position = 8 + length
        with PartFile(self.path) as part:
            for tensor in self.tensors:  # safetensors' data: the tensors, each after the last
                if tensor.offset != position:
                    raise CheckpointError(f"{self.key}: its tensors do not tile the file")
                own = self._read.get(tensor.offset)
                if own is None:
                    own = 0
                    for values in part.chunks(tensor):
                        own = crc32c.crc32c(_bytes(values), own)
                checksum = crc32c_combine(checksum, own, tensor.nbytes)
                position += tensor.nbytes
        if (position, checksum) != (self.entry.size, self.entry.crc32c):
            raise CheckpointError(
                f"{self.key}: {position} bytes with CRC32C {checksum:#010x}; the COMMIT says "
                f"{self.entry.size} bytes, {self.entry.crc32c:#010x}"
            )
        self._confirmed = True


def _bytes(values: torch.Tensor) -> Any:
    """A contiguous tensor's bytes, for a CRC, without a copy."""
    return values.reshape(-1).view(torch.uint8).numpy()


class TensorRef(LazyTensor):
    """One tensor of a checkpoint, read when asked, from a local file of its shard (its size
    checked against the COMMIT, its CRC32C as it is read: ``PartCheck``): its name, shape and
    dtype from the shard's safetensors header. ``fill`` reads it into a tensor of the
    caller's a run of rows at a time (``staging.PartFile``), each run checked finite, so that
    a heal fills the replica's own tensors and nothing of the model's size is allocated."""

    def __init__(self, key: str, check: PartCheck, place: PartTensor) -> None:
        self.key, self.check, self.path, self.place = key, check, check.path, place
        self.name, self.dtype = place.name, place.dtype
        self.shape = torch.Size(place.shape)
        self.verified = False  # its values read and checked finite (``checksum``)

    def fill(self, destination: torch.Tensor) -> torch.Tensor:
        """Read this tensor into ``destination`` (of its shape and dtype); ``destination``."""
        if (destination.shape, destination.dtype) != (self.shape, self.dtype):
            raise CheckpointError(f"{self.key}: tensor {self.name} is {self.dtype} "
                                  f"{list(self.shape)}; it fills a {destination.dtype} "
                                  f"{list(destination.shape)}")  # fmt: skip
        own = 0

        def check(values: torch.Tensor) -> None:
            nonlocal own
            if not self.verified:
                self._require_finite(values)
            own = crc32c.crc32c(_bytes(values), own)

        with PartFile(self.path) as part:
            part.fill(self.place, destination, check)
        self.check.record(self.place, own)
        return destination

    def checksum(self, checksum: int) -> int:
        """``checksum`` (CRC32C) carried over this tensor's bytes, read a run of rows at a
        time, each checked finite: what ``open_checkpoint`` verifies a checkpoint with."""
        own = 0
        with PartFile(self.path) as part:
            for values in part.chunks(self.place):
                self._require_finite(values)
                data = _bytes(values)
                checksum, own = crc32c.crc32c(data, checksum), crc32c.crc32c(data, own)
        self.verified = True
        self.check.record(self.place, own)
        return checksum

    def _require_finite(self, values: torch.Tensor) -> None:
        _require_finite(self.key, self.name, values)


def shard_tensors(store: Store, entry: StoredObject, spools: Spools) -> dict[str, TensorRef]:
    """Every tensor of the shard ``entry`` names, by name, read from its local copy
    (``local_copy``); the copy and its ``PartCheck`` kept in ``spools``, to be confirmed."""
    path = local_copy(store, entry, spools)
    places = part_tensors(entry.key, path)
    check = PartCheck(entry, path, places)
    spools.check(check)
    return {place.name: TensorRef(entry.key, check, place) for place in places}


def read_tree(
    store: Store, state: StoredObject, shards: Sequence[StoredObject], spools: Spools
) -> Any:
    """The tree of a checkpoint's (or an own state's) ``state`` structure, checked, and its
    ``shards``' tensors as ``TensorRef``s (``shard_tensors``)."""
    try:
        structure = store.get(state.key, 0, state.size + 1)
    except FileNotFoundError:
        structure = None
    structure = checked_object(state.key, structure, state)
    tensors: dict[str, Any] = {}
    for entry in shards:
        tensors.update(shard_tensors(store, entry, spools))
    return unflatten(structure, tensors, state.key)


def materialized(tree: Any) -> Any:
    """``tree`` with every ``TensorRef`` loaded (on the CPU): the whole state in memory."""

    def load(leaf: Any) -> Any:
        if isinstance(leaf, LazyTensor):
            return leaf.load()
        if isinstance(leaf, LocalShard) and isinstance(leaf.tensor, TensorRef):
            return dataclasses.replace(leaf, tensor=leaf.tensor.load())
        return leaf

    return tree_map(load, tree)


def open_checkpoint(
    store: Store,
    layout: RunLayout,
    round_: int,
    confirm: Confirm | None = None,
    shard: ShardOf | None = None,
    *,
    verify: bool = True,
) -> Checkpoint:
    """The committed checkpoint of ``round_``, every object checked (sizes: ``local_copy``;
    CRC32Cs as its tensors are read: ``PartCheck``), its tensors ``TensorRef``s read when
    filled; else ``CheckpointError`` naming the key and why,
    whatever is wrong with the bucket's bytes (a dtype torch does not have, a size no file
    has, counters unlike its COMMIT), so healing falls back to the previous checkpoint.
    ``shard``: the part one process of a replica heals from (its rank's, of a
    sharded checkpoint written by replicas of as many ranks); None: the whole state, a sharded
    checkpoint's parts put together (``JoinedRef``). Its values are read once, a run of rows
    at a time, to check them finite and each part fingerprinted as the COMMIT says
    (``check_fingerprint``), every file's CRC32C taken in the same read, before it is
    returned; unless not ``verify``: the files are confirmed in a read of their own, and a
    heal checks each value finite as it reads it into the replica and the replica's
    fingerprint after (a heal moves on to another copy or an older checkpoint only while its
    state is still intact). ``confirm`` sees the COMMIT before
    anything else is read and may refuse it (says why); what it raises propagates. A store
    that cannot be reached (``StoreError``) is not a bad checkpoint: it propagates. Its
    ``close()`` removes what it downloaded."""
    commit, _ = read_commit(store, layout, round_)
    key = layout.checkpoint_commit(round_)
    parts = _parts_read(commit, key, shard)  # a sharding unlike the reader's is refused first
    if confirm is not None and (refusal := confirm(commit)):
        raise CheckpointError(f"{key} in {store.url}: {refusal}")
    spools = Spools()
    try:
        trees = [guarded(key, lambda r=rank, p=part: _open_part(store, layout, commit, r, p,
                                                               spools))
                 for rank, part in parts]  # fmt: skip
        try:
            for (_, part), tree in zip(parts, trees, strict=True) if verify else ():
                guarded(key, lambda t=tree, p=part: check_fingerprint(
                    p.state.key, t, commit.step, p.fingerprint))  # fmt: skip
        except CheckpointError:
            guarded(key, spools.confirm)  # a file unlike its COMMIT is the cause to name
            raise
        guarded(key, spools.confirm)
        if shard is not None:
            return Checkpoint(commit, trees[0], store.url, parts[0][1].fingerprint, spools=spools)
        tree = guarded(key, lambda: whole_tree(trees))  # a one-rank FSDP's too
        return Checkpoint(commit, tree, store.url, commit.fingerprint, spools=spools)
    except BaseException:
        spools.release()
        raise


def _open_part(
    store: Store, layout: RunLayout, commit: CheckpointCommit, rank: int, part: RankPart,
    spools: Spools,
) -> Any:  # fmt: skip
    """One part's state tree, its tensors ``TensorRef``s, its counters and meshes the
    COMMIT's."""
    folder = layout.checkpoint_part(commit.round, rank if commit.ranks else None)
    check_keys(layout.checkpoint_commit(commit.round), f"{folder}/", [part.state, *part.shards])
    tree = read_tree(store, part.state, part.shards, spools)
    _check_counters(part.state.key, tree, commit)
    _check_meshes(part.state.key, tree, len(commit.parts()))
    return tree


def check_fingerprint(key: str, tree: Any, step: int, expected: str) -> None:
    """The part's state (its ``state`` object at ``key``) fingerprints as its COMMIT says,
    its values read a slice at a time and checked finite (``TensorRef.checksum``): objects
    and a COMMIT that do not belong together are refused."""
    found = fingerprint(step, tree_checksum(tree["fragments"]))
    if found != expected:
        raise CheckpointError(f"{key}: the state fingerprints as {found}, its COMMIT says "
                              f"{expected}")  # fmt: skip


def load_checkpoint(
    store: Store,
    layout: RunLayout,
    round_: int,
    confirm: Confirm | None = None,
    shard: ShardOf | None = None,
) -> Checkpoint:
    """``open_checkpoint``, every tensor then loaded on the CPU: the whole state in memory (a
    test's, a small tool's); a heal and an export read through ``open_checkpoint`` instead."""
    opened = open_checkpoint(store, layout, round_, confirm, shard)
    try:
        key = layout.checkpoint_commit(round_)
        tree = guarded(key, lambda: materialized(opened.tree))
        return dataclasses.replace(opened, tree=tree, spools=None)
    finally:
        opened.close()


def read_checkpoint(store: Store, layout: RunLayout, round_: int) -> StoredCheckpoint:
    """The committed checkpoint of ``round_`` as local copies of its objects (every part),
    checked as ``load_checkpoint`` checks it, its tensors read a slice at a time: what a copy
    to another store puts (``mirrors.resume_from``), which releases its ``spools``."""
    checkpoint = open_checkpoint(store, layout, round_)
    try:
        commit, commit_bytes = read_commit(store, layout, round_)
        objects: dict[str, Any] = {}
        for part in commit.parts():
            objects[part.state.key] = store.get(part.state.key, 0, part.state.size + 1)
            for entry in part.shards:
                objects[entry.key] = LocalCopy(checkpoint.spools.local_file(entry.key))  # type: ignore[union-attr]
        return StoredCheckpoint(commit, commit_bytes, objects, checkpoint.spools.hold())  # type: ignore[union-attr]
    finally:
        checkpoint.close()


def guarded(key: str, read: Callable[[], Any]) -> Any:
    """``read()``, whatever fails in it (bucket data) a ``CheckpointError`` naming ``key`` (the
    record that named the data); a store that cannot be reached propagates."""
    try:
        return read()
    except (CheckpointError, StoreError):
        raise
    except Exception as exc:  # bucket data: whatever fails in it, this is no checkpoint to load
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


def _require_finite(key: str, name: str, tensor: torch.Tensor) -> None:
    """A NaN or inf in a checkpoint is damage, whatever its checksums say: the run never holds
    one (every replica refuses a mean that is not finite, ``mean.py``), and a replica healed
    from it would train on garbage, or spread it through the rounds it seals."""
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    if not values.is_floating_point():
        return
    if values.element_size() == 1:  # float8: no isfinite kernel on the CPU; widening is exact
        values = values.float()
    if math.isfinite(float(values.sum())):  # a NaN or an inf makes the sum one: all finite
        return  # (a sum that overflows is counted exactly below; this one pass is 20x faster)
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
    replica's mesh is its ranks, ``training/ranks/sharding.py``)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, LocalShard) and math.prod(leaf.mesh) != ranks:
            raise CheckpointError(f"{key}: a tensor is sharded over a mesh of {list(leaf.mesh)}; "
                                  f"the checkpoint has {ranks} parts")  # fmt: skip
