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
import shutil
import stat
import uuid
from collections.abc import Callable
from typing import BinaryIO

import crc32c

from diloco_anywhere.bucket.errors import StoreError

TEMP_PREFIX = ".tmp-"
COPY_BYTES = 8 << 20  # a file copied into a local store moves this many bytes at a time


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
    _write_local(path, lambda file: file.write(data), os.link)


def replace_local(path: str, data: bytes | bytearray | memoryview) -> None:
    """rename(2) over the old file: a reader opens the old file or the new, never a part."""
    _write_local(path, lambda file: file.write(data), os.replace)


def create_local_from_file(path: str, source: str) -> None:
    """Publish the local file ``source`` at ``path``, create-only: linked where it is on the
    same filesystem (a spool file beside the key: no byte is copied), else copied beside
    ``path`` a chunk at a time, then linked. ``source`` stays where it is."""
    _check_target(path)
    try:
        os.link(source, path)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            _raise_unlinkable(path, exc)
            raise

    def copy(file: BinaryIO) -> None:
        with open(source, "rb") as original:
            shutil.copyfileobj(original, file, COPY_BYTES)

    _write_local(path, copy, os.link)


def pinned_copy(path: str) -> str:
    """A new name for the regular file at ``path``, beside it (a temp file's name): a hard
    link, so its bytes stay readable whatever later puts or deletions do to ``path`` (a local
    store never writes a file in place); copied where the filesystem has no links."""
    os.close(open_regular(path))
    pinned = temp_beside(path)
    try:
        os.link(path, pinned)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        shutil.copyfile(path, pinned, follow_symlinks=False)
    return pinned


def temp_beside(path: str) -> str:
    """A temp file's path in ``path``'s folder (created), named as a store's temp files are:
    one that is published with ``create_local_from_file`` is linked, not copied."""
    _check_target(path)
    return os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{uuid.uuid4().hex}")


def _check_target(path: str) -> None:
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


def _raise_unlinkable(path: str, exc: OSError) -> None:
    """A filesystem without hard links cannot publish a file whole: say so."""
    if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
        raise StoreError(
            f"cannot publish {path} atomically: this filesystem does not support hard "
            f"links ({exc.strerror}); put the store on a local disk or use a bucket URL"
        ) from exc


def _write_local(
    path: str, fill: Callable[[BinaryIO], object], publish: Callable[[str, str], None]
) -> None:
    """Write a temp file beside ``path`` (``fill`` writes into it), then ``publish`` it there
    (link: create-only; replace: overwrite). Not fsynced: a process crash loses nothing (the
    page cache survives it); an OS crash takes the local store's replicas down with it anyway."""
    _check_target(path)
    temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(temp, "xb") as file:
            fill(file)
        publish(temp, path)
    except OSError as exc:
        _raise_unlinkable(path, exc)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def remove_empty_dirs(top: str) -> None:
    """Remove ``top`` and folders below it that are empty (local stores leave them behind)."""
    for directory, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):  # not empty: a key was created there meanwhile
            os.rmdir(directory)


def file_checksum(path: str) -> tuple[int, int]:
    """The size and CRC32C of the local file at ``path``, read ``COPY_BYTES`` at a time into
    one buffer (a new one per read would fault its pages in every time)."""
    size = checksum = 0
    buffer = bytearray(COPY_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            checksum, size = crc32c.crc32c(view[:read], checksum), size + read
    return size, checksum
