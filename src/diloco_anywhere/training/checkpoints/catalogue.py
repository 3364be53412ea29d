"""Which checkpoints exist and which one to use: the committed rounds in a store and its
mirrors, newest first, and of each the first copy that loads intact, the others passed over
with the reason logged. Healing and ``diloco export`` take their checkpoint from here, the
keeper and the mirrors list the rounds, and collection keeps what healing may replay from
(``retained_after``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.checkpoints.reader import open_checkpoint
from diloco_anywhere.training.checkpoints.records import (
    Checkpoint,
    CheckpointError,
    Confirm,
    ShardOf,
)

log = logging.getLogger(__name__)


def newest_checkpoints(
    store: Store,
    layout: RunLayout,
    mirrors: Sequence[Store] = (),
    confirm_mirrored: Confirm | None = None,
    shard: ShardOf | None = None,
    *,
    verify: bool = True,
) -> Iterator[Checkpoint]:
    """Committed checkpoints that read back intact (``shard``'s part, or the whole: as
    ``open_checkpoint``, whose ``close`` is the caller's), newest first (lazily), each from
    ``store`` or, where it has none of that round or its copy there does not load, from the
    first of ``mirrors`` whose copy does;
    ``confirm_mirrored`` may refuse a mirror's COMMIT. The ones that do not load, and mirrors
    that cannot be listed, are logged with the reason and skipped; ``store`` itself not
    answering propagates. ``verify``: as ``open_checkpoint``'s."""
    for round_, holders in checkpoint_holders(store, layout, mirrors):
        checkpoint = first_intact(store, mirrors, holders, layout, round_, confirm_mirrored, shard,
                                  verify=verify)  # fmt: skip
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
    *,
    verify: bool = True,
) -> Checkpoint | None:
    """The checkpoint of ``round_`` from the first of ``holders`` (``checkpoint_holders``)
    whose copy loads intact; None (logged) if none does. ``store`` not answering propagates."""
    for holder in holders:
        source = store if holder == 0 else mirrors[holder - 1]
        confirm = None if holder == 0 else confirm_mirrored
        try:
            checkpoint = open_checkpoint(source, layout, round_, confirm, shard, verify=verify)
            return replace(checkpoint, from_mirror=holder != 0)
        except CheckpointError as exc:
            log.warning("checkpoint of round %d not used: %s", round_, exc)
        except StoreError as exc:
            if holder == 0:
                raise
            log.warning("checkpoint of round %d in mirror %s not used: %s",
                        round_, source.url, exc)  # fmt: skip
    return None
