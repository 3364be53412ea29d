"""Whole files to and from a store, their bytes never all in memory: what checkpoints and
exports stream through (docs/checkpoints.md). A part of ``Store``, kept apart: the methods
here build on its single-object operations (``put``'s create-only write, ranged ``get``) and
add nothing to what a key may hold."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import crc32c

from diloco_anywhere.bucket.local_files import (
    create_local_from_file,
    file_checksum,
    pinned_copy,
    temp_beside,
)
from diloco_anywhere.bucket.schemes import MEMORY_PROTOCOLS
from diloco_anywhere.bucket.sdk_options import UPLOAD_OPTIONS

if TYPE_CHECKING:
    from collections.abc import Callable

    import fsspec

DOWNLOAD_BYTES = 16 << 20  # ``get_file`` and ``checksum``: bytes a GET
DOWNLOADS = 4  # ``get_file``: GETs at a time (one connection reads at a fraction of a link)


class WholeFiles:
    """``Store``'s whole-file methods. What they use of the store, set by ``Store.__init__``:"""

    _fs: fsspec.AbstractFileSystem
    _protocols: frozenset[str]
    _is_local: bool
    _pool: ThreadPoolExecutor
    _create: Callable[[str, bytes], None]
    _path: Callable[[str], str]
    _where: Callable[[str], str]
    _run: Callable[..., object]
    _add: Callable[..., None]
    get: Callable[..., bytes]

    def spool(self, key: str) -> str:
        """A local path to write ``key``'s bytes into before ``put_file``: beside the key in a
        local store (the put is then a link: no byte is copied), else a new file in the
        system's temp folder (``TMPDIR``). The caller removes it when done."""
        if self._is_local:
            return temp_beside(self._path(key))
        descriptor, path = tempfile.mkstemp(prefix="diloco-spool-")
        os.close(descriptor)
        return path

    def put_file(self, key: str, path: str) -> None:
        """``put`` of the local file at ``path``, its bytes never all in memory: linked (or
        copied a chunk at a time) into a local store, uploaded in parts of ``UPLOAD_BYTES``
        by the SDK to a remote one (S3's multipart upload, GCS's resumable one, Azure's
        blocks, all create-only). Idempotent as ``put``: a key that holds these bytes
        already (compared by size and CRC32C, read a chunk at a time) is success."""
        target = self._path(key)
        size = os.path.getsize(path)

        def attempt() -> None:
            self._add(puts=1)
            if self._is_local:
                create_local_from_file(target, path)
            elif self._protocols & MEMORY_PROTOCOLS:
                with open(path, "rb") as file:
                    self._create(target, file.read())
            else:
                options = next((UPLOAD_OPTIONS[p] for p in self._protocols if p in UPLOAD_OPTIONS),
                               {})  # fmt: skip
                self._fs.put_file(path, target, mode="create", **options)

        try:
            self._run("put", key, attempt)
        except FileExistsError:
            if self.checksum(key, size + 1) != file_checksum(path):
                raise FileExistsError(
                    f"{self._where(key)} already exists; keys are create-only"
                ) from None
        self._add(bytes_up=size)

    def checksum(self, key: str, limit: int) -> tuple[int, int]:
        """The size and CRC32C of ``key``'s first ``limit`` bytes, read ``DOWNLOAD_BYTES`` at a
        time."""
        size = checksum = 0
        while size < limit:
            chunk = self.get(key, size, min(limit, size + DOWNLOAD_BYTES))
            checksum, size = crc32c.crc32c(chunk, checksum), size + len(chunk)
            if len(chunk) < DOWNLOAD_BYTES:
                break
        return size, checksum

    def pinned_local_file(self, key: str) -> str | None:
        """In a local store, a new name for the file that holds ``key`` (``pinned_copy``: a
        link beside it, the caller's to remove), read in place while later puts or deletions
        of ``key`` leave its bytes alone; None for any other store."""
        if not self._is_local:
            return None
        path = self._path(key)
        return self._run("get", key, lambda: pinned_copy(path))

    def get_file(self, key: str, path: str, limit: int) -> int:
        """Download ``key``'s first ``limit`` bytes into the local file ``path`` (created or
        truncated), ``DOWNLOAD_BYTES`` a GET, ``DOWNLOADS`` at a time, each written at its
        offset: memory is bounded by those, whatever the object's size. Its size."""
        with open(path, "wb") as file:
            descriptor, done, offset = file.fileno(), 0, 0
            while offset < limit:
                starts = [offset + k * DOWNLOAD_BYTES for k in range(DOWNLOADS)]
                starts = [start for start in starts if start < limit]
                ends = [min(limit, start + DOWNLOAD_BYTES) for start in starts]
                chunks = list(self._pool.map(self.get, [key] * len(starts), starts, ends))
                for start, chunk in zip(starts, chunks, strict=True):
                    os.pwrite(descriptor, chunk, start)
                    done = max(done, start + len(chunk))
                if any(len(c) < e - s for c, s, e in zip(chunks, starts, ends, strict=True)):
                    break
                offset = ends[-1]
            file.truncate(done)
        return done
