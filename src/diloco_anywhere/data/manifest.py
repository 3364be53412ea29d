"""A prepared corpus's manifest: how it was prepared, and every shard with its checksums.

Keys under the corpus's folder (a store URL, ``prepare.py``):

    settings               how it is prepared (``PrepareSettings``): written first, create-only;
                           a later prepare into the folder must match it
    sources/00000          what corpus file 0 became (``SourceEntry``): its shards, written once
                           they all are, so an interrupted prepare goes on after the last file
    train/00000-0000       file 0's first training shard (``shards.py``)
    heldout/00000-0000     file 0's first held-out shard
    manifest               the whole corpus (``Manifest``): the settings and every source
                           entry, written last, create-only: a corpus never changes under a run

Every record is a checked record (``bucket/record.py``); nothing is pickled.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from diloco_anywhere.bucket.framing import Count
from diloco_anywhere.bucket.record import Record
from diloco_anywhere.data.shards import Split
from diloco_anywhere.data.tokenizers import DtypeName, TokenizerIdentity

SETTINGS, MANIFEST = "settings", "manifest"


def source_key(index: int) -> str:
    return f"sources/{index:05d}"


def shard_key(split: Split, source: int, part: int) -> str:
    return f"{split}/{source:05d}-{part:04d}"


class PrepareSettings(Record):
    tokenizer: TokenizerIdentity
    dtype: DtypeName
    text_field: str = Field(min_length=1, max_length=256)
    heldout_fraction: float = Field(ge=0, le=1)
    shard_tokens: Count = Field(ge=1)
    block_tokens: Count = Field(ge=1)


class ShardEntry(Record):
    key: str = Field(min_length=1, max_length=1024)
    tokens: Count
    size: Count  # bytes of the whole object
    crc32c: int = Field(ge=0, lt=2**32)  # the object's prefix checksum
    payload_offset: Count  # where its tokens start: blocks are read from here
    blocks: tuple[int, ...]  # each block's CRC32C


class SourceEntry(Record):
    path: str = Field(min_length=1, max_length=4096)
    size: Count  # bytes of the file as stored
    text_bytes: Count  # of UTF-8 text read from it
    documents: Count
    heldout_documents: Count
    train: tuple[ShardEntry, ...]
    heldout: tuple[ShardEntry, ...]


class Manifest(Record):
    format: Literal[1] = 1
    settings: PrepareSettings
    sources: tuple[SourceEntry, ...]

    def shards(self, split: Split) -> list[ShardEntry]:
        return [shard for source in self.sources for shard in getattr(source, split)]

    def tokens(self, split: Split) -> int:
        return sum(shard.tokens for shard in self.shards(split))
