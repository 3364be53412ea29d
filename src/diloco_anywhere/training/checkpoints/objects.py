"""A checkpoint's objects on their way into a store: each as bytes (the small ones: a structure,
a record) or as a local file (a part of the tensors: ``LocalCopy``), so that no checkpoint is
ever held in memory whole; put, read back and compared, described for a COMMIT, and the local
files removed once every copy made from them is done (``Spools``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Protocol

from diloco_anywhere.bucket.local_files import file_checksum
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.checkpoints.records import Blob, StoredObject


def describe(key: str, blob: Blob) -> StoredObject:
    """The COMMIT's entry for ``blob`` stored at ``key``: its size and CRC32C."""
    if isinstance(blob, bytes):
        return StoredObject.of(key, blob)
    size, checksum = file_checksum(blob.path)
    return StoredObject(key=key, size=size, crc32c=checksum)


def put(store: Store, key: str, blob: Blob) -> None:
    if isinstance(blob, bytes):
        store.put(key, blob)
    else:
        store.put_file(key, blob.path)


def holds(store: Store, key: str, entry: StoredObject) -> bool:
    """Whether ``key`` holds exactly the object ``entry`` describes (read a chunk at a time)."""
    try:
        return store.checksum(key, entry.size + 1) == (entry.size, entry.crc32c)
    except FileNotFoundError:
        return False


def put_checked(store: Store, objects: dict[str, Blob]) -> None:
    """Put ``objects``, then read each back: a copy is done only when its bytes are there."""
    for key, blob in objects.items():
        put(store, key, blob)
    for key, blob in objects.items():
        if not holds(store, key, describe(key, blob)):
            raise OSError(f"{key} in {store.url} reads back other bytes than were written")


class FileCheck(Protocol):
    """Whether a local file holds an object's bytes, found as it is read
    (``reader.PartCheck``)."""

    key: str
    path: str

    def confirm(self) -> None: ...


class Spools:
    """Local files that one checkpoint's copies read from: removed when the last holder lets
    go (the writer, then each mirror it handed them to); a reader's, with the check of each
    against its COMMIT (``confirm``)."""

    def __init__(self) -> None:
        self._paths: list[str] = []
        self._checks: list[FileCheck] = []
        self._holders = 1  # whoever made it
        self._lock = threading.Lock()

    def add(self, path: str) -> str:
        self._paths.append(path)
        return path

    def check(self, check: FileCheck) -> FileCheck:
        self._checks.append(check)
        return check

    def confirm(self) -> None:
        """Every file checked as its ``FileCheck`` says (raises what it raises)."""
        for check in self._checks:
            check.confirm()

    def local_file(self, key: str) -> str:
        """The checked local file of the object at ``key``."""
        return next(check.path for check in self._checks if check.key == key)

    def __enter__(self) -> Spools:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def hold(self) -> Spools:
        with self._lock:
            self._holders += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            done = self._holders == 0
        if done:
            for path in self._paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
