"""The bucket: create-only writes, whole or ranged reads, batched polling, listing, deletion.

Every byte replicas exchange passes through one ``Store``. Keys are never overwritten: a write
either creates the key or raises ``FileExistsError``, which makes the create-only write the one
consensus primitive the collective builds on (first writer of a SEAL wins). The one exception is
``overwrite``, for what a person reads in a browser and a keeper rewrites each pass (the status
page); nothing a replica reads goes through it. A reader never sees a partial object, on every
backend:

- S3: ``PutObject`` / ``CompleteMultipartUpload`` with ``If-None-Match: *`` (s3fs ``mode="create"``;
  AWS docs, "Conditional writes"). A 409 ConditionalRequestConflict is retried.
- GCS: ``ifGenerationMatch=0`` (gcsfs ``mode="create"``; GCS docs, "Request preconditions").
- Azure Blob: ``If-None-Match: *`` (adlfs ``mode="create"`` -> ``upload_blob(overwrite=False)``).
- Local: write a temp file in the same folder, then ``os.link`` it to the final name; link(2)
  fails with EEXIST when the name exists and publishes the whole file at once. (fsspec's local
  ``pipe_file(mode="create")`` checks, then writes: two writers can both win, and a reader can
  see a half-written file.)
- Memory (tests, one process): a lock around check-and-write.

What ``Store`` builds on lives beside it: what a key may be (``keys.py``), which URLs it opens
(``schemes.py``), what each SDK is told (``sdk_options.py``), a local store's files
(``local_files.py``), credentials kept out of logs (``redaction.py``), its error
(``errors.py``), its traffic counters (``stats.py``) and its whole-file transfers
(``whole_files.py``).

This module imports no torch: processes that only move bytes start fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timezone
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from diloco_anywhere.bucket import hf_buckets
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.keys import check_key
from diloco_anywhere.bucket.local_files import (
    TEMP_PREFIX,
    create_local,
    open_regular,
    remove_empty_dirs,
    replace_local,
)
from diloco_anywhere.bucket.redaction import redact_url, scrub_secrets
from diloco_anywhere.bucket.retry import RetryPolicy, call_with_retry, http_status
from diloco_anywhere.bucket.schemes import (
    CONDITIONAL_PUT_PROTOCOLS,
    HF_SCHEME,
    LOCAL_PROTOCOLS,
    MEMORY_PROTOCOLS,
    SUPPORTED_SCHEMES,
    url_protocols,
    url_scheme,
)
from diloco_anywhere.bucket.sdk_options import (
    CONTENT_TYPE_ARGUMENTS,
    SDK_ATTRIBUTES,
    SIGNING_OPTIONS,
    merged,
    with_defaults,
)
from diloco_anywhere.bucket.stats import Counters, StoreStats
from diloco_anywhere.bucket.whole_files import WholeFiles

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

MAX_SIGNED_SECONDS = 7 * 24 * 3600
RANGE_NOT_SATISFIABLE = 416
_MEMORY_LOCK = threading.Lock()
log = logging.getLogger(__name__)


class Store(WholeFiles):
    """One bucket prefix, addressed by keys relative to ``url``.

    ``storage_options`` go to the fsspec filesystem (endpoint, credentials); by default each
    backend takes credentials from its platform's standard environment. ``max_workers`` bounds the
    concurrent requests of ``get_many``.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_workers: int = 32,
    ) -> None:
        self.url = redact_url(url)
        self._hf = url_scheme(url) == HF_SCHEME
        if self._hf:  # a Hugging Face bucket, through its S3 gateway (hf_buckets.py)
            bucket, user = hf_buckets.parse_bucket_url(url), storage_options or {}
            storage_options = merged(hf_buckets.gateway_options(bucket, user), user)
            url = bucket.s3_url
        protocols = url_protocols(url)
        if not protocols & (LOCAL_PROTOCOLS | MEMORY_PROTOCOLS | CONDITIONAL_PUT_PROTOCOLS):
            raise ValueError(
                f"store {self.url}: scheme {sorted(protocols)} has no create-only write; "
                f"use {SUPPORTED_SCHEMES}"
            )
        self._retry = retry or RetryPolicy()
        self._counters = Counters()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="store")
        self._options = with_defaults(protocols, storage_options or {})
        self._fs, root = fsspec.url_to_fs(url, **self._options)
        self._fs_url, self._protocols = url, protocols  # for a filesystem that signs (``sign``)
        self._is_local = bool(protocols & LOCAL_PROTOCOLS)
        self._in_memory = bool(protocols & MEMORY_PROTOCOLS)
        # a local root is resolved once (the user chose it); below it no link is followed
        self._root = os.path.realpath(root) if self._is_local else root.rstrip("/")
        for protocol in protocols:
            for attribute, value in SDK_ATTRIBUTES.get(protocol, {}).items():
                setattr(self._fs, attribute, value)
        # memory:// is one dict per process, which a listing iterates: every change to it and
        # every listing holds one lock (a put during a listing raised "dictionary changed size")
        self._one_at_a_time = _MEMORY_LOCK if self._in_memory else contextlib.nullcontext()
        self._create = self._exclusive_writer(protocols)
        self._replace = self._overwriter(protocols)
        self._strangers: set[str] = set()  # listed objects that are not keys, logged once

    @property
    def on_this_machine(self) -> bool:
        """A local or in-memory store: reading an object again is a copy in this machine's
        memory, not a request across a network (nor egress billed per GiB)."""
        return self._is_local or self._in_memory

    def _exclusive_writer(self, protocols: frozenset[str]) -> Callable[[str, Buffer], None]:
        if self._is_local:
            return create_local
        if protocols & MEMORY_PROTOCOLS:

            def create_in_memory(path: str, data: Buffer) -> None:
                with self._one_at_a_time:
                    self._fs.pipe_file(path, bytes(data), mode="create")

            return create_in_memory
        # bytes, not bytearray: azure-storage-blob iterates a bytearray as ints.
        return lambda path, data: self._fs.pipe_file(path, bytes(data), mode="create")

    def _overwriter(self, protocols: frozenset[str]) -> Callable[[str, Buffer, str | None], None]:
        if self._is_local:
            return lambda path, data, _content_type: replace_local(path, data)
        typed = next((CONTENT_TYPE_ARGUMENTS[p] for p in protocols if p in CONTENT_TYPE_ARGUMENTS),
                     None)  # fmt: skip

        def overwrite_remote(path: str, data: Buffer, content_type: str | None) -> None:
            extra = typed(content_type) if typed and content_type else {}
            with self._one_at_a_time:
                self._fs.pipe_file(path, bytes(data), mode="overwrite", **extra)

        return overwrite_remote

    # -- helpers -----------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        path = f"{self._root}/{check_key(key)}" if key else self._root
        if self._hf:
            hf_buckets.check_gateway_key(key, self._where(key))
        if self._is_local and self._through_link(path):
            raise StoreError(
                f"{self._where(key)}: a symbolic link is on its path; a local store follows "
                f"none (it could lead outside the store)"
            )
        return path

    @staticmethod
    def _through_link(path: str) -> bool:
        """Whether a component of ``path`` (below a resolved root) is a symbolic link."""
        return os.path.realpath(path) != path

    def _where(self, key: str) -> str:
        return f"{key!r} in store {self.url}"

    def _run(self, operation: str, key: str, call: Callable[[], T]) -> T:
        """Retry transient errors; name the key and the store in every error that surfaces."""
        try:
            return call_with_retry(call, self._retry, on_retry=lambda _: self._add(retries=1))
        except (FileNotFoundError, NotADirectoryError):
            # a local key below a key (a file where its folder would be) cannot exist, as S3
            # answers a GET of "a/b/c" with 404 when "a/b" is an object
            raise FileNotFoundError(f"{self._where(key)} does not exist") from None
        except FileExistsError:
            raise
        except PermissionError as exc:
            raise StoreError(
                f"{operation} {self._where(key)}: access denied ({scrub_secrets(str(exc))}); "
                f"check this store's credentials in the environment "
                f"(AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_*)"
            ) from None
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(
                f"{operation} {self._where(key)} failed: "
                f"{type(exc).__name__}: {scrub_secrets(str(exc))}"
            ) from None

    def _add(self, **increments: int) -> None:
        self._counters.add(**increments)

    # -- operations ----------------------------------------------------------------------------

    def put(self, key: str, data: Buffer) -> None:
        """Create ``key`` holding ``data``; never overwrites. Idempotent: succeeds when the key
        ends up holding exactly ``data``, and raises ``FileExistsError`` when it holds other bytes.

        Idempotence is what makes retries safe: an attempt may fail ambiguously (the store applied
        it, the response was lost; gcsfs and azure-storage-blob also retry inside one call), and
        the retry then finds the key taken, so a taken key is always read back and compared.
        Writers of identical bytes (e.g. the same deterministic reduction) therefore all succeed;
        callers must not treat success as "I alone wrote it" unless their bytes name the writer.
        """
        path = self._path(key)

        def attempt() -> None:
            self._add(puts=1)
            self._create(path, data)

        try:
            self._run("put", key, attempt)
        except FileExistsError:
            if self.get(key, 0, len(data) + 1) != data:
                raise FileExistsError(
                    f"{self._where(key)} already exists; keys are create-only"
                ) from None
        self._add(bytes_up=len(data))

    def overwrite(self, key: str, data: Buffer, *, content_type: str | None = None) -> None:
        """Write ``key`` holding ``data``, replacing what it held. Only for objects that one
        writer refreshes and people read (the status page), never for what replicas exchange:
        those are create-only (``put``). A reader sees the old object or the new one whole (S3,
        GCS and Azure replace an object in one request; a local store renames a temp file over
        it). ``content_type`` is kept with the object where the store keeps one (S3, GCS,
        Azure), so that a browser opening a link to it renders it instead of downloading it; a
        local file's type comes from its name's extension."""
        path = self._path(key)

        def attempt() -> None:
            self._add(puts=1)
            self._replace(path, data, content_type)

        self._run("overwrite", key, attempt)
        self._add(bytes_up=len(data))

    def sign(self, key: str, expires_seconds: int) -> str:
        """A URL that opens ``key`` in a browser: a local file's ``file://`` URL; else a URL
        signed with this store's credentials (S3 and HF buckets: SigV4 presigned; GCS: with a
        service account's key; Azure: a SAS from the account key), with which anyone may read
        the object until it expires: a bearer credential, never to be logged. ``StoreError``
        where the store cannot sign (memory://, GCS without a service account key, Azure
        without an account key)."""
        if not 1 <= expires_seconds <= MAX_SIGNED_SECONDS:
            raise ValueError(
                f"a signed URL lasts 1 to {MAX_SIGNED_SECONDS} seconds (7 days, the most S3 and "
                f"GCS accept), not {expires_seconds}"
            )
        path = self._path(key)
        if self._is_local:
            return Path(path).as_uri()
        return self._run("sign", key, lambda: self._signer().sign(path, expiration=expires_seconds))

    def _signer(self) -> fsspec.AbstractFileSystem:
        """The store's own filesystem, or one with ``SIGNING_OPTIONS`` for its protocol."""
        extra = next((SIGNING_OPTIONS[p] for p in self._protocols if p in SIGNING_OPTIONS), None)
        if extra is None:
            return self._fs
        return fsspec.url_to_fs(self._fs_url, **merged(self._options, extra))[0]

    def put_many(self, objects: Mapping[str, Buffer]) -> None:
        """``put`` every key concurrently (a contribution's parts, an owner's reduced shards);
        the first failure in key order is raised."""
        list(self._pool.map(lambda item: self.put(*item), objects.items()))

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or bytes ``[start, end)`` (fewer where the object ends first, none
        past its end); one GET, no HEAD before it. A reader of an object anyone could have
        written passes the most bytes it accepts plus one as ``end``: a larger object is then
        seen to be too large after that many bytes, not after downloading all of it."""
        if (start is None) != (end is None) or (start is not None and not 0 <= start <= end):
            raise ValueError(f"byte range [{start}, {end}) of {key!r}: give 0 <= start <= end")
        path = self._path(key)
        if start is not None and start == end:
            return b""  # s3fs would send "bytes=0--1", which S3 answers with the whole object

        def attempt() -> bytes:
            self._add(gets=1)
            if self._is_local:
                with open(open_regular(path), "rb") as file:
                    size = os.fstat(file.fileno()).st_size
                    file.seek(min(start or 0, size))
                    return file.read(min(size if end is None else end, size) - file.tell())
            return self._cat(path, start, end)

        data = self._run("get", key, attempt)
        self._add(bytes_down=len(data))
        return data

    def _cat(self, path: str, start: int | None, end: int | None) -> bytes:
        """A remote GET of ``path`` (bytes ``[start, end)`` when given). S3 and Azure answer a
        range that starts at or past the object's end with 416 (HTTP 416; S3 "InvalidRange"),
        even ``[0, n)`` of an empty object: no bytes are there, which is the answer."""
        try:
            return self._fs.cat_file(path, start=start, end=end)
        except Exception as exc:
            if start is not None and http_status(exc) == RANGE_NOT_SATISFIABLE:
                return b""
            raise

    def get_into(
        self, key: str, allocate: Callable[[int], memoryview], *, limit: int
    ) -> memoryview:
        """The object's first ``limit`` bytes (all of it, when smaller) in a buffer of the
        caller's: ``allocate(size)`` returns a writable view of at least ``size`` bytes (a
        reused buffer, whose pages are touched once; a fresh allocation per object costs more
        in page faults than the copy). ``limit`` bounds the memory whatever the bucket holds
        (see ``get``). A local store reads the file straight into it; the others download,
        then copy once."""
        path = self._path(key)

        def read_local() -> memoryview:
            with open(open_regular(path), "rb") as file:
                size = min(os.fstat(file.fileno()).st_size, limit)
                view = allocate(size)[:size]
                done = 0
                while done < size and (count := file.readinto(view[done:])):
                    done += count
            if done != size:
                raise OSError(f"{path} changed size while being read")
            return view

        def attempt() -> memoryview:
            self._add(gets=1)
            if self._is_local:
                return read_local()
            data = self._cat(path, 0, limit)
            view = allocate(len(data))[: len(data)]
            view[:] = data
            return view

        view = self._run("get", key, attempt)
        self._add(bytes_down=len(view))
        return view

    def get_many(self, keys: Iterable[str], *, limit: int) -> dict[str, bytes | None]:
        """Every key's first ``limit`` bytes (see ``get``), or None where the key does not
        exist, fetched concurrently.

        Used to poll all peers at once: one call, one GET per key, no listing.
        """

        def get_or_none(key: str) -> bytes | None:
            try:
                return self.get(key, 0, limit)
            except FileNotFoundError:
                return None

        keys = list(keys)
        return dict(zip(keys, self._pool.map(get_or_none, keys), strict=True))

    def list_prefix(self, prefix: str = "") -> list[str]:
        """Sorted keys under the folder ``prefix`` ('' for all), at any depth."""
        base = self._path(prefix)

        def attempt() -> list[str]:
            self._add(lists=1)
            with self._one_at_a_time:
                return self._fs.find(base)

        paths = self._run("list", prefix, attempt)  # a folder that is not there lists empty
        start = len(self._root) + 1
        names = (p[start:] for p in paths if not os.path.basename(p).startswith(TEMP_PREFIX))
        return sorted(name for name in names if self._is_key(name))

    def _is_key(self, name: str) -> bool:
        """Whether a listed object is one this store can address: a valid key, and on a local
        store a regular file reached through no link. Anything else (a ``.DS_Store``, an
        editor's backup, a link planted in a run's folders) is skipped and named in the log
        once, so it never fails a reader or the garbage collector, and nothing outside the
        store is ever read or deleted through it."""
        problem = None
        try:
            check_key(name)
        except ValueError:
            problem = "not a key this tool writes"
        path = f"{self._root}/{name}"
        if problem is None and self._is_local and not os.path.lexists(path):
            return False  # deleted since the listing (an old lease, a collected round): gone
        if problem is None and self._is_local and self._through_link(path):
            problem = "a symbolic link is on its path; a local store follows none"
        elif problem is None and self._is_local and not os.path.isfile(path):
            problem = "not a regular file"
        if problem is not None and name not in self._strangers:
            self._strangers.add(name)
            log.warning("%s: skipping %r: %s", self.url, name, problem)
        return problem is None

    def delete(self, key: str) -> None:
        """Delete one key; nothing happens if it does not exist (S3 and GCS deletes are
        idempotent too)."""
        path = self._path(key)

        def attempt() -> None:
            self._add(deletes=1)
            with self._one_at_a_time:
                self._fs.rm_file(path)

        with contextlib.suppress(FileNotFoundError):
            self._run("delete", key, attempt)

    def delete_prefix(self, prefix: str, keep: Callable[[str], bool] | None = None) -> int:
        """Delete every key under the folder ``prefix`` (but those ``keep`` selects) with one
        listing and one delete request; returns how many were deleted."""
        keys = [key for key in self.list_prefix(prefix) if not (keep and keep(key))]
        paths = [self._path(k) for k in keys]

        def attempt() -> None:
            self._add(deletes=1)
            with self._one_at_a_time:
                self._fs.rm(paths)

        if paths:
            try:
                self._run("delete", prefix, attempt)
            except FileNotFoundError:  # another deleter got some first: delete the rest
                for key in keys:
                    self.delete(key)
        if self._is_local:
            remove_empty_dirs(self._path(prefix))
        return len(keys)

    def modified(self, key: str) -> float:
        """When the store says ``key`` was written, in POSIX seconds of the store's own clock
        (S3's and Azure's are whole seconds). One HEAD (a stat on a local store)."""

        def attempt() -> float:
            self._add(gets=1)
            when = self._fs.modified(self._path(key))  # a datetime on every supported scheme
            return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()

        return self._run("modified", key, attempt)

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"
