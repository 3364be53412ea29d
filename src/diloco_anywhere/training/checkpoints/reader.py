"""Reading one global checkpoint: the committed state of a round, every byte checked, or a
``CheckpointError`` naming the key and what is wrong.

A reader takes only committed checkpoints and checks every object's size and CRC32C against the
COMMIT, the safetensors header, the tensor names against the structure, that every value is
finite, and that the state's counters, device meshes and fingerprint are the COMMIT's.
Whatever is wrong with the bucket's bytes is a ``CheckpointError``, never another exception,
so that healing falls back to the previous checkpoint (``catalogue.py``) instead of failing;
a store that cannot be reached is not a bad checkpoint and propagates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch.utils._pytree import tree_leaves

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.keys import check_key
from diloco_anywhere.bucket.layout import MAX_COUNT, RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import read_commit
from diloco_anywhere.training.checkpoints.records import (
    Checkpoint,
    CheckpointCommit,
    CheckpointError,
    Confirm,
    RankPart,
    ShardOf,
    StoredCheckpoint,
    StoredObject,
)
from diloco_anywhere.training.checkpoints.tree import unflatten, whole_tree
from diloco_anywhere.training.fingerprints import fingerprint
from diloco_anywhere.training.global_state import LocalShard, tree_checksum

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


def read_objects(store: Store, entries: list[StoredObject]) -> dict[str, bytes | None]:
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
    key = layout.checkpoint_commit(round_)
    parts = guarded(key, lambda: _decode_checkpoint(stored))
    if shard is not None:
        fingerprint_ = stored.commit.parts()[shard.rank].fingerprint
        return Checkpoint(stored.commit, parts[0], store.url, fingerprint_)
    tree = guarded(key, lambda: whole_tree(parts))  # a one-rank FSDP's too
    return Checkpoint(stored.commit, tree, store.url, stored.commit.fingerprint)


def read_checkpoint(store: Store, layout: RunLayout, round_: int) -> StoredCheckpoint:
    """The committed checkpoint of ``round_`` as bytes (every part), checked as
    ``load_checkpoint`` checks it (its tensors and structure decoded once, then dropped)."""
    stored = _read_checkpoint(store, layout, round_, None, None)
    guarded(layout.checkpoint_commit(round_), lambda: _decode_checkpoint(stored))
    return stored


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
        check_keys(key, f"{folder}/", [part.state, *part.shards])
    entries = [entry for _, part in parts for entry in (part.state, *part.shards)]
    objects = guarded(key, lambda: read_objects(store, entries))
    checked = {e.key: checked_object(e.key, objects[e.key], e) for e in entries}
    return StoredCheckpoint(commit, commit_bytes, checked)


def _decode_part(commit: CheckpointCommit, part: RankPart, objects: dict[str, bytes]) -> Any:
    """One part's state tree, which must hold the COMMIT's counters and fingerprint to the
    part's fingerprint: objects and a COMMIT that do not belong together are refused."""
    tree = decode_tree(part.state, part.shards, objects)
    _check_counters(part.state.key, tree, commit)
    _check_meshes(part.state.key, tree, len(commit.parts()))
    found = fingerprint(commit.step, tree_checksum(tree["fragments"]))
    if found != part.fingerprint:
        raise CheckpointError(f"{part.state.key}: the state fingerprints as {found}, its COMMIT "
                              f"says {part.fingerprint}")  # fmt: skip
    return tree


def decode_tree(
    state: StoredObject, shards: Iterable[StoredObject], objects: dict[str, bytes]
) -> Any:
    """The tree a ``state`` structure and its ``shards`` hold (``objects``: their bytes, each
    already checked against its entry), every tensor checked finite."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in shards:
        tensors.update(_load_shard(entry.key, objects[entry.key]))
    return unflatten(objects[state.key], tensors, state.key)


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
    replica's mesh is its ranks, ``training/sharding.py``)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, LocalShard) and math.prod(leaf.mesh) != ranks:
            raise CheckpointError(f"{key}: a tensor is sharded over a mesh of {list(leaf.mesh)}; "
                                  f"the checkpoint has {ranks} parts")  # fmt: skip


def _decode_checkpoint(stored: StoredCheckpoint) -> list[Any]:
    """The state tree of each part read (the parts whose objects ``stored`` holds)."""
    parts = [part for part in stored.commit.parts() if part.state.key in stored.objects]
    return [_decode_part(stored.commit, part, stored.objects) for part in parts]
