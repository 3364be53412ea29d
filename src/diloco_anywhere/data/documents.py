"""Where a corpus's documents come from: a path, a store URL or a glob of files, each read as
its suffix says, decompressed as its last suffix says, one document at a time.

- ``.txt``: the whole file is one document, read in pieces of about ``TEXT_PIECE`` characters
  that end at a line (a 10 GB file is never held whole);
- ``.jsonl``: one document per line, its ``text_field``;
- ``.parquet``: one document per row of its ``text_field`` column, read a batch of rows at a
  time (pyarrow);
- then ``.gz``, ``.bz2``, ``.xz`` or ``.zst`` after the suffix (``data.jsonl.zst``), inferred
  by fsspec from the name (zstandard for ``.zst``);
- ``stdlib``, a name of its own: the interpreter's standard library (``stdlib.py``).

Any other name is refused before anything is read, naming the file and what is read: a file read
as the wrong kind would be trained on as garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import fsspec
from fsspec.utils import infer_compression

from diloco_anywhere.data import stdlib
from diloco_anywhere.data.stdlib import STDLIB, stdlib_files

KINDS = (".txt", ".jsonl", ".parquet")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
TEXT_PIECE = 1 << 20  # characters of a .txt document tokenized at a time
PARQUET_ROWS = 1024


class DataSourceError(ValueError):
    """A corpus that cannot be read as documents; the message names the file and the fix."""


@dataclass(frozen=True)
class Source:
    """One file of a corpus: where it is, how big, and how to read it."""

    path: str  # as fsspec names it (no credentials)
    size: int
    kind: str  # one of KINDS, or STDLIB
    compression: str | None


@dataclass(frozen=True)
class Piece:
    """Text of one document; ``ends``: the document's last piece (a .txt file comes in many)."""

    text: str
    ends: bool = True


def kind_of(path: str) -> tuple[str, str | None]:
    """(kind, compression) of a file, from its name; ``DataSourceError`` for any other name."""
    suffixes = PurePosixPath(path).suffixes
    compressed = bool(suffixes) and suffixes[-1] in COMPRESSIONS
    kind = suffixes[-2] if compressed and len(suffixes) > 1 else (suffixes or [""])[-1]
    if kind not in KINDS or (compressed and kind == ".parquet"):
        raise DataSourceError(
            f"{path}: not a corpus file this reads; name files .txt, .jsonl or .parquet, "
            f"the first two optionally compressed ({', '.join(COMPRESSIONS)} after the suffix)"
        )
    return kind, infer_compression(path) if compressed else None


def sources(
    url: str, storage_options: dict[str, Any] | None = None, max_bytes: int | None = None
) -> list[Source]:
    """The files of ``url`` (a file, a folder, whose files are all read, a glob, or
    ``stdlib``), sorted by path: the corpus's order. Every name is checked before any file is
    read. ``max_bytes``: the first files only, until their sizes reach it."""
    listed = _stdlib() if url == STDLIB else _files(url, storage_options)
    if max_bytes is None:
        return listed
    kept, size = [], 0
    for source in listed:
        if size >= max_bytes:
            break
        kept.append(source)
        size += source.size
    return kept


def _stdlib() -> list[Source]:
    return [Source(str(path), path.stat().st_size, STDLIB, None) for path in stdlib_files()]


def _files(url: str, storage_options: dict[str, Any] | None) -> list[Source]:
    fs, path = fsspec.url_to_fs(url, **(storage_options or {}))
    if fs.isdir(path):
        found = fs.find(path, detail=True)
    elif any(char in path for char in "*?["):
        found = fs.glob(path, detail=True)
    else:
        found = {path: fs.info(path)} if fs.exists(path) else {}
    files = {name: info for name, info in found.items() if info.get("type") != "directory"}
    if not files:
        raise DataSourceError(f"{url}: no file there (give a file, a folder or a glob of them)")
    listed = []
    for name in sorted(files):
        kind, compression = kind_of(name)
        listed.append(
            Source(fs.unstrip_protocol(name), int(files[name]["size"]), kind, compression)
        )
    return listed


def pieces(source: Source, text_field: str = "text", **storage_options: Any) -> Iterator[Piece]:
    """Every document of ``source`` in order, as pieces of text."""
    binary = source.kind == ".parquet"
    mode, encoding = ("rb", None) if binary else ("rt", "utf-8")
    try:
        with fsspec.open(
            source.path, mode, encoding=encoding, compression=source.compression,
            **storage_options,
        ) as file:  # fmt: skip
            if binary:
                yield from _parquet(file, source.path, text_field)
            elif source.kind == STDLIB:
                yield from (Piece(text) for text in stdlib.documents(file))
            elif source.kind == ".jsonl":
                yield from _jsonl(file, source.path, text_field)
            else:
                yield from _text(file)
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"{source.path}: not UTF-8 text ({exc.reason})") from None


def _text(file: Any) -> Iterator[Piece]:
    """One document in pieces that end at a line where the text has one within reach."""
    pending = ""
    while chunk := file.read(TEXT_PIECE):
        text = pending + chunk
        cut = text.rfind("\n") + 1
        pending, text = (text[cut:], text[:cut]) if 0 < cut < len(text) else ("", text)
        yield Piece(text, ends=False)
    yield Piece(pending, ends=True)


def _jsonl(raw: Any, path: str, field: str) -> Iterator[Piece]:
    for number, line in enumerate(raw, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataSourceError(f"{path}, line {number}: not a JSON object ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataSourceError(
                f"{path}, line {number}: no string {field!r} field (choose it with --text-field)"
            )
        yield Piece(record[field])


def _parquet(raw: Any, path: str, field: str) -> Iterator[Piece]:
    import pyarrow.parquet as parquet

    table = parquet.ParquetFile(raw)
    if field not in table.schema_arrow.names:
        raise DataSourceError(
            f"{path}: no {field!r} column (it has {table.schema_arrow.names}; choose it with "
            f"--text-field)"
        )
    for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield Piece(str(value))
