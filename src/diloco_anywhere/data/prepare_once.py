"""A raw corpus prepared on the fly into the run's store, by one replica, for all of them.

A small run may name raw text as its data (``[task] data = "text/*.jsonl"``). The first replica
to start takes the ``preparing`` key (create-only) and prepares the corpus (``prepare.py``)
into ``{run}/data/corpus``, rewriting that key as it goes (its heartbeat, with how far it got);
the others wait for the manifest, saying who prepares and how far. A waiter that sees the key
unchanged for ``STALE_SECONDS`` of its own clock takes over: preparing is resumable and writes
the same bytes whoever writes them, so two replicas preparing at once lose nothing but time.
A finished copy is checked against the raw corpus's files at every start (a changed corpus is
refused, naming the fix), and read as any prepared corpus is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from pydantic import Field

from diloco_anywhere.bucket.format.framing import Count
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.manifest import MANIFEST, SETTINGS, Manifest, PrepareSettings
from diloco_anywhere.data.prepare import prepare
from diloco_anywhere.data.tokenizers import ByteTokenizer, HfTokenizer

log = logging.getLogger(__name__)
PREPARING = "preparing"
STALE_SECONDS = 120.0
BEAT_SECONDS = 10.0
POLL_SECONDS = 1.0


class Preparing(Record):
    """Who prepares the run's copy, and how far it got: rewritten as it goes."""

    holder: str = Field(min_length=1, max_length=512)
    text_bytes: Count


def is_prepared(url: str) -> bool:
    """Whether ``url`` is a folder ``diloco data prepare`` wrote (or is writing): its settings
    are written first. A glob or a file of text is not."""
    if any(char in url for char in "*?["):
        return False
    with Store(url) as store:
        try:
            store.get(SETTINGS, 0, 1)
        except (FileNotFoundError, NotADirectoryError):
            return False
    return True


def prepare_once(
    raw: str,
    copy: Store,
    tokenizer: ByteTokenizer | HfTokenizer,
    settings: PrepareSettings,
    holder: str,
    clock: Callable[[], float] = time.monotonic,
    max_bytes: int | None = None,
) -> Manifest:
    """The run's copy of ``raw`` (its first files up to ``max_bytes``) in ``copy``: prepared
    here, or by whoever took it first."""
    prepared = partial(_prepare, raw, copy, tokenizer, settings, holder, max_bytes)
    if _finished(copy) or _take(copy, holder):
        return prepared()
    seen, since = b"", clock()
    while not _finished(copy):
        current = _lock_bytes(copy)
        if current != seen:
            seen, since = current, clock()
            _say_who_prepares(raw, copy, current)
        elif clock() - since > STALE_SECONDS:
            log.warning("the prepare of %s stalled for %.0f s: taking it over", raw, STALE_SECONDS)
            return prepared()
        time.sleep(POLL_SECONDS)
    return prepared()


def _say_who_prepares(raw: str, copy: Store, lock: bytes) -> None:
    if lock:
        preparing = decode_record(lock, Preparing, key=f"{copy.url}/{PREPARING}")
        log.info(
            "waiting for %s to prepare %s into %s: %.1f MB of text so far", preparing.holder,
            raw, copy.url, preparing.text_bytes / 1e6,
        )  # fmt: skip


def _finished(copy: Store) -> bool:
    try:
        copy.get(MANIFEST, 0, 1)
    except FileNotFoundError:
        return False
    return True


def _take(copy: Store, holder: str) -> bool:
    try:
        copy.put(PREPARING, encode_record(Preparing(holder=holder, text_bytes=0)))
    except FileExistsError:
        return False
    return True


def _lock_bytes(copy: Store) -> bytes:
    try:
        return copy.get(PREPARING, 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        return b""


def _prepare(
    raw: str, copy: Store, tokenizer: ByteTokenizer | HfTokenizer, settings: PrepareSettings,
    holder: str, max_bytes: int | None,
) -> Manifest:  # fmt: skip
    """Prepare (or check a finished copy against ``raw``), beating every ``BEAT_SECONDS``."""
    done, last_beat = 0, time.monotonic()

    def advance(text_bytes: int) -> None:
        nonlocal done, last_beat
        done += text_bytes
        if time.monotonic() - last_beat >= BEAT_SECONDS:
            copy.overwrite(PREPARING, encode_record(Preparing(holder=holder, text_bytes=done)))
            last_beat = time.monotonic()

    return prepare(raw, copy, tokenizer, settings, advance, max_bytes)
