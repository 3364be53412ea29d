"""A local store's files: published whole, read only when regular, folders tidied after.

A folder on disk has no create-only PUT. fsspec's local ``pipe_file(mode="create")`` checks,
then writes: two writers can both win, and a reader can see a half-written file. So a local
store writes a temp file beside the key and links it into place (``link(2)`` fails with EEXIST
when the name exists and publishes the whole file at once), or renames it over the old file for
an overwrite; it opens only regular files, without following a link or blocking; and it removes
the empty folders a deletion leaves behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable

from diloco_anywhere.bucket.errors import StoreError

TEMP_PREFIX = ".tmp-"


def open_regular(path: str) -> int:
    """A descriptor of the regular file at ``path``, opened without following a link and
    without blocking: a FIFO or a device planted in a local store would otherwise block a
    read (past the round's timeout) or stream forever."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise StoreError(f"{path} is not a regular file; a local store reads only files")
    return descriptor


def create_local(path: str, data: bytes | bytearray | memoryview) -> None:
    _write_local(path, data, os.link)


def replace_local(path: str, data: bytes | bytearray | memoryview) -> None:
    """rename(2) over the old file: a reader opens the old file or the new, never a part."""
    _write_local(path, data, os.replace)


def _write_local(
    path: str, data: bytes | bytearray | memoryview, publish: Callable[[str, str], None]
) -> None:
    """Write a temp file beside ``path``, then ``publish`` it there (link: create-only; replace:
    overwrite). Not fsynced: a process crash loses nothing (the page cache survives it); an OS
    crash takes the local store's replicas down with it anyway."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise StoreError(
            f"cannot create {path}: a folder on its path is already a key; on a local store a "
            f"key cannot also be a folder of keys"
        ) from None
    if os.path.isdir(path):
        raise StoreError(
            f"cannot create {path}: it is a folder of other keys; on a local store a key "
            f"cannot also be a folder of keys"
        )
    temp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(temp, "xb") as file:
            file.write(data)
        publish(temp, path)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise StoreError(
                f"cannot publish {path} atomically: this filesystem does not support hard "
                f"links ({exc.strerror}); put the store on a local disk or use a bucket URL"
            ) from exc
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def remove_empty_dirs(top: str) -> None:
    """Remove ``top`` and folders below it that are empty (local stores leave them behind)."""
    for directory, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):  # not empty: a key was created there meanwhile
            os.rmdir(directory)
