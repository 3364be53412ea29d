"""The COMMIT records of a store's checkpoints: which rounds are committed, and each one's COMMIT
read and checked against its key. Torch-free: the keeper and ``diloco status`` list and read
commits without loading any checkpoint (``reader.py`` does that).
"""

from __future__ import annotations

from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import RECORD_READ_LIMIT, R, decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.records import CheckpointCommit, CheckpointError


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


def read_commit_record(store: Store, key: str, model: type[R]) -> tuple[R, bytes]:
    """The COMMIT-like record at ``key`` (a checkpoint's, a replica state's) and its bytes;
    ``CheckpointError`` naming the key if it is missing or not one."""
    try:
        data = store.get(key, 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        raise CheckpointError(f"{key}: missing") from None
    try:
        return decode_record(data, model, key=key), data
    except WireFormatError as exc:  # names the key
        raise CheckpointError(str(exc)) from None


def read_commit(store: Store, layout: RunLayout, round_: int) -> tuple[CheckpointCommit, bytes]:
    """The COMMIT of ``round_``, checked against its key; ``CheckpointError`` if it is not one."""
    key = layout.checkpoint_commit(round_)
    commit, data = read_commit_record(store, key, CheckpointCommit)
    if (commit.run, commit.round) != (layout.run, round_):
        raise CheckpointError(f"{key}: the COMMIT is for run {commit.run} round {commit.round}")
    return commit, data
