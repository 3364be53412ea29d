"""``diloco data prepare``: a corpus tokenized once into token shards in a store.

Each corpus file (``documents.py``, in path order) is read a batch of about ``BATCH_BYTES`` of
text at a time and tokenized by the run's tokenizer over all cores (``tokenizers.py``); each
document goes whole to the training or to the held-out split by a hash of its text
(``heldout.py``), followed by the end-of-document token, and each split's tokens fill shards
of ``shard_tokens`` (``shards.py``; a file's last shard of each split is shorter), uploaded in
the background while the next batch is tokenized. Host memory is a batch, plus two shards per
split: one filling, one uploading.

An interrupted prepare goes on where it stopped when run again with the same settings: a file
whose entry is written (``sources/NNNNN``) is not read again, and a shard already in the store
is not written again (a shard is one create-only put, whole or absent, and the same file and
settings give the same bytes). Settings unlike the folder's are refused, naming them; so is a
corpus unlike a finished manifest's, which never changes under a run (``manifest.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c
import numpy as np

from diloco_anywhere.bucket.first_written import first_written
from diloco_anywhere.bucket.format.framing import PREFIX, stored_checksum
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.documents import Piece, Source, pieces, sources
from diloco_anywhere.data.heldout import held_out
from diloco_anywhere.data.manifest import (
    MANIFEST,
    SETTINGS,
    Manifest,
    PrepareSettings,
    ShardEntry,
    SourceEntry,
    shard_key,
    source_key,
)
from diloco_anywhere.data.shards import Split, encode_shard
from diloco_anywhere.data.tokenizers import (
    ByteTokenizer,
    HfTokenizer,
    TokenizerIdentity,
    dtype_for,
)

BATCH_BYTES = 4 << 20  # of text per call of the tokenizer
SPLITS: tuple[Split, ...] = ("train", "heldout")
Advance = Callable[[int], None]  # told the bytes of text each batch tokenized


class PrepareError(ValueError):
    """A prepare that cannot go on; the message says what differs and the fix."""


def settings_for(
    tokenizer: ByteTokenizer | HfTokenizer, text_field: str, heldout_fraction: float,
    shard_tokens: int, block_tokens: int,
) -> PrepareSettings:  # fmt: skip
    return PrepareSettings(
        tokenizer=tokenizer.identity, dtype=dtype_for(tokenizer.identity.vocab),
        text_field=text_field, heldout_fraction=heldout_fraction, shard_tokens=shard_tokens,
        block_tokens=block_tokens,
    )  # fmt: skip


class _ShardWriter:
    """One split of one file: tokens into shards, each uploaded in the background."""

    def __init__(
        self, store: Store, uploads: ThreadPoolExecutor, existing: set[str], split: Split,
        source: int, settings: PrepareSettings,
    ) -> None:  # fmt: skip
        self._store, self._uploads, self._existing = store, uploads, existing
        self._split, self._source, self._settings = split, source, settings
        self._buffer = np.empty(settings.shard_tokens, dtype=settings.dtype)
        self._filled = 0
        self._pending: list[Future[ShardEntry]] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            taken = min(len(tokens), len(self._buffer) - self._filled)
            self._buffer[self._filled : self._filled + taken] = tokens[:taken]
            self._filled, tokens = self._filled + taken, tokens[taken:]
            if self._filled == len(self._buffer):
                self._emit()

    def _emit(self) -> None:
        if not self._filled:
            return
        if self._pending:  # one shard uploading at a time: host memory stays two shards
            self._pending[-1].result()
        part = len(self._pending)
        data, header = encode_shard(
            self._buffer[: self._filled], self._split, self._source, part,
            self._settings.block_tokens,
        )  # fmt: skip
        key = shard_key(self._split, self._source, part)
        offset = len(data) - header.tokens * self._buffer.itemsize
        entry = ShardEntry(
            key=key, tokens=header.tokens, size=len(data), crc32c=stored_checksum(data),
            payload_offset=offset, header_crc32c=crc32c.crc32c(data[PREFIX.size : offset]),
        )  # fmt: skip
        self._pending.append(self._uploads.submit(self._upload, key, data, entry))
        self._filled = 0

    def _upload(self, key: str, data: bytes, entry: ShardEntry) -> ShardEntry:
        if key not in self._existing:
            self._store.put(key, data)
        return entry

    def close(self) -> tuple[ShardEntry, ...]:
        self._emit()
        return tuple(future.result() for future in self._pending)


def _record_at(store: Store, key: str, model: type[Record]) -> Record | None:
    try:
        data = store.get(key, 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        return None
    return decode_record(data, model, key=f"{store.url}/{key}")


def claim_settings(store: Store, settings: PrepareSettings) -> None:
    """Write the folder's settings, or refuse settings unlike those it was prepared with."""
    theirs = first_written(store, SETTINGS, settings)
    if theirs == settings:
        return
    differ = [name for name in PrepareSettings.model_fields
              if getattr(theirs, name) != getattr(settings, name)]  # fmt: skip
    shown = ", ".join(f"{name} {_shown(getattr(theirs, name))}" for name in differ)
    raise PrepareError(
        f"{store.url} holds a corpus prepared with another {shown}: prepare into an empty "
        f"folder, or give the same settings to finish that one"
    )


def _shown(value: object) -> str:
    if isinstance(value, TokenizerIdentity):
        return f"{value.name!r} (sha256 {value.sha256[:12]}...)"
    return repr(value)


class _Batch:
    """Pieces of text waiting for the tokenizer, each with the split its document went to."""

    def __init__(self) -> None:
        self.pieces: list[tuple[Piece, Split]] = []
        self.nbytes = 0

    def add(self, piece: Piece, split: Split) -> None:
        self.pieces.append((piece, split))
        self.nbytes += len(piece.text.encode("utf-8"))


def _tokenize(
    batch: _Batch, tokenizer: ByteTokenizer | HfTokenizer, writers: dict[Split, _ShardWriter]
) -> None:
    identity = tokenizer.identity
    end = np.array([identity.end_of_document], dtype=np.uint32)
    encoded = tokenizer.encode([piece.text for piece, _ in batch.pieces])
    for (piece, split), tokens in zip(batch.pieces, encoded, strict=True):
        if len(tokens) and int(tokens.max()) >= identity.vocab:
            raise PrepareError(
                f"tokenizer {identity.name} gave id {int(tokens.max())}, past its vocabulary "
                f"of {identity.vocab}"
            )
        writers[split].add(tokens)
        if piece.ends:
            writers[split].add(end)


def prepare_source(
    store: Store, index: int, source: Source, tokenizer: ByteTokenizer | HfTokenizer,
    settings: PrepareSettings, advance: Advance, existing: set[str],
) -> SourceEntry:  # fmt: skip
    """Corpus file ``index`` into its shards; its entry, once every shard is in the store.
    ``existing``: the shards in the store already (an interrupted prepare's), not put again."""
    with ThreadPoolExecutor(1, thread_name_prefix="shard-upload") as uploads:
        writers: dict[Split, _ShardWriter] = {
            split: _ShardWriter(store, uploads, existing, split, index, settings)
            for split in SPLITS
        }
        documents = {"train": 0, "heldout": 0}
        batch, text_bytes, split = _Batch(), 0, "train"
        starts = True
        for piece in pieces(source, settings.text_field):
            if starts:
                split = "heldout" if held_out(piece.text, settings.heldout_fraction) else "train"
                documents[split] += 1
            batch.add(piece, split)
            starts = piece.ends
            if batch.nbytes >= BATCH_BYTES:
                _tokenize(batch, tokenizer, writers)
                text_bytes += batch.nbytes
                advance(batch.nbytes)
                batch = _Batch()
        _tokenize(batch, tokenizer, writers)
        text_bytes += batch.nbytes
        advance(batch.nbytes)
        train, heldout = writers["train"].close(), writers["heldout"].close()
    return SourceEntry(
        path=source.path, size=source.size, text_bytes=text_bytes,
        documents=sum(documents.values()), heldout_documents=documents["heldout"],
        train=train, heldout=heldout,
    )  # fmt: skip


def _finished_entry(store: Store, index: int, source: Source) -> SourceEntry | None:
    entry = _record_at(store, source_key(index), SourceEntry)
    if entry is None:
        return None
    if (entry.path, entry.size) != (source.path, source.size):
        raise PrepareError(
            f"{store.url}/{source_key(index)} was prepared from {entry.path} ({entry.size} "
            f"bytes), not {source.path} ({source.size} bytes): the corpus changed; prepare "
            f"into an empty folder"
        )
    return entry  # type: ignore[return-value]


def _finished_manifest(store: Store, files: list[Source]) -> Manifest | None:
    manifest = _record_at(store, MANIFEST, Manifest)
    if manifest is None:
        return None
    theirs = [(entry.path, entry.size) for entry in manifest.sources]  # type: ignore[attr-defined]
    if theirs != [(source.path, source.size) for source in files]:
        raise PrepareError(
            f"{store.url} holds a finished corpus of {len(theirs)} files, not these "
            f"{len(files)}: a corpus never changes under a run; prepare into an empty folder"
        )
    return manifest  # type: ignore[return-value]


def prepare(
    corpus: str, store: Store, tokenizer: ByteTokenizer | HfTokenizer, settings: PrepareSettings,
    advance: Advance = lambda _: None, max_bytes: int | None = None,
) -> Manifest:  # fmt: skip
    """Every file of ``corpus`` (a path, URL or glob; its first files up to ``max_bytes``) into
    ``store``'s folder; its manifest."""
    if settings.tokenizer != tokenizer.identity:
        raise ValueError("the settings are another tokenizer's")
    files = sources(corpus, max_bytes=max_bytes)
    claim_settings(store, settings)
    if (manifest := _finished_manifest(store, files)) is not None:
        return manifest
    entries, existing = [], {key for split in SPLITS for key in store.list_prefix(split)}
    for index, source in enumerate(files):
        entry = _finished_entry(store, index, source)
        if entry is None:
            entry = prepare_source(store, index, source, tokenizer, settings, advance, existing)
            store.put(source_key(index), encode_record(entry))
        entries.append(entry)
    manifest = Manifest(settings=settings, sources=tuple(entries))
    store.put(MANIFEST, encode_record(manifest))
    return manifest
