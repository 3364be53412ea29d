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

Every record is a checked record (``bucket/format/record.py``); nothing is pickled. The manifest
holds a few hundred bytes per shard, whatever the corpus's size (a shard's block checksums are
in its own header): 8 MiB, the most a record holds, is tens of thousands of shards.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco_anywhere.bucket.format.framing import Count
from diloco_anywhere.bucket.format.record import Record
from diloco_anywhere.data.shards import Split
from diloco_anywhere.data.tokenizers import DtypeName, TokenizerIdentity

SETTINGS, MANIFEST = "settings", "manifest"


def source_key(index: int) -> str:
    return f"sources/{index:05d}"


def shard_key(split: Split, source: int, part: int) -> str:
    return f"{split}/{source:05d}-{part:04d}"


MAX_BLOCKS_PER_SHARD = 4096  # their checksums fit a shard's header (64 KiB at most)


class PrepareSettings(Record):
    tokenizer: TokenizerIdentity
    dtype: DtypeName
    text_field: str = Field(min_length=1, max_length=256)
    heldout_fraction: float = Field(ge=0, le=1)
    shard_tokens: Count = Field(ge=1)
    block_tokens: Count = Field(ge=1)

    @model_validator(mode="after")
    def _blocks_fit_a_header(self) -> PrepareSettings:
        if -(-self.shard_tokens // self.block_tokens) > MAX_BLOCKS_PER_SHARD:
            raise ValueError(
                f"shard_tokens / block_tokens is at most {MAX_BLOCKS_PER_SHARD} (each block's "
                f"checksum is in its shard's header): raise block_tokens or lower shard_tokens"
            )
        return self


class ShardEntry(Record):
    """A shard as a reader fetches it: its header by a ranged read of its first
    ``payload_offset`` bytes, checked against ``header_crc32c`` (the header holds each block's
    checksum), then any block by a ranged read, checked against the header's."""

    key: str = Field(min_length=1, max_length=1024)
    tokens: Count
    size: Count  # bytes of the whole object
    crc32c: int = Field(ge=0, lt=2**32)  # the object's prefix checksum
    payload_offset: Count  # where its tokens start: the prefix and the header come before
    header_crc32c: int = Field(ge=0, lt=2**32)  # of the header's JSON


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

    def documents(self, split: Split) -> int:
        held = sum(source.heldout_documents for source in self.sources)
        return held if split == "heldout" else sum(s.documents for s in self.sources) - held
