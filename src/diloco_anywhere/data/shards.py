"""A token shard: consecutive tokens of one split of a corpus, as one checked object.

Layout: the prefix every object of this tool starts with (``bucket/format/framing.py``), with magic
``DLTK``; a JSON header (``ShardHeader``); then the tokens, little-endian, of the header's
``dtype``. The prefix's CRC32C covers the header and the tokens. The tokens are also checked in
blocks of ``block_tokens``, each block's CRC32C in the header, whose own CRC32C the corpus's
manifest holds (``manifest.py``): a reader that fetches the header and then one block by
ranged reads checks what it got without the rest, so a replica reads only what it trains on.
"""

from __future__ import annotations

from typing import Literal

import crc32c
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_anywhere.bucket.format.framing import (
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    Count,
    WireFormatError,
    check_prefix,
    field_errors,
    prefix_fields,
)
from diloco_anywhere.data.tokenizers import DtypeName

TOKENS_MAGIC = b"DLTK"
Split = Literal["train", "heldout"]
Checksum = Field(ge=0, lt=2**32)


class ShardHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    split: Split
    source: Count  # the corpus file's number in the manifest
    part: Count  # the shard's number among that file's shards of its split
    dtype: DtypeName
    tokens: Count
    block_tokens: Count = Field(ge=1)
    blocks: tuple[int, ...]  # each block's CRC32C, in order


def block_checksums(payload: memoryview, itemsize: int, block_tokens: int) -> tuple[int, ...]:
    step = itemsize * block_tokens
    return tuple(crc32c.crc32c(payload[start : start + step])
                 for start in range(0, len(payload), step))  # fmt: skip


def encode_shard(
    tokens: np.ndarray, split: Split, source: int, part: int, block_tokens: int
) -> tuple[bytes, ShardHeader]:
    """The shard object of ``tokens`` (already of the corpus's dtype), and its header."""
    payload = memoryview(np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<")))
    payload = payload.cast("B")
    header = ShardHeader(
        split=split, source=source, part=part, dtype=str(tokens.dtype), tokens=len(tokens),
        block_tokens=block_tokens,
        blocks=block_checksums(payload, tokens.dtype.itemsize, block_tokens),
    )  # fmt: skip
    header_bytes = header.model_dump_json().encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"a shard's header is {len(header_bytes)} bytes: raise block_tokens")
    checksum = crc32c.crc32c(payload, crc32c.crc32c(header_bytes))
    prefix = PREFIX.pack(TOKENS_MAGIC, VERSION, bytes(3), len(header_bytes), checksum)
    return prefix + header_bytes + bytes(payload), header


def decode_shard(data: bytes | bytearray | memoryview, key: str) -> tuple[ShardHeader, np.ndarray]:
    """Check a whole shard object (checksum, header, length, every block); its header and
    tokens (a read-only view of ``data``). ``WireFormatError`` naming ``key`` otherwise."""
    view = memoryview(data).cast("B")
    header_length = check_prefix(view, key, magic=TOKENS_MAGIC)
    try:
        header = ShardHeader.model_validate_json(
            bytes(view[PREFIX.size : PREFIX.size + header_length])
        )
    except ValidationError as exc:
        raise WireFormatError(key, field_errors(exc)) from None
    payload = view[PREFIX.size + header_length :]
    itemsize = np.dtype(header.dtype).itemsize
    if len(payload) != header.tokens * itemsize:
        raise WireFormatError(
            key, f"{len(payload)} bytes of tokens; the header says {header.tokens} {header.dtype}"
        )
    if block_checksums(payload, itemsize, header.block_tokens) != header.blocks:
        raise WireFormatError(key, "block checksums differ from the header's: corrupt")
    return header, np.frombuffer(payload, dtype=np.dtype(header.dtype).newbyteorder("<"))


def decode_header(data: bytes, key: str, header_crc32c: int) -> ShardHeader:
    """A shard's header from a ranged read of its first ``payload_offset`` bytes, checked
    against the checksum its corpus's manifest holds (the prefix's own checksum covers the
    tokens too, which a ranged reader does not fetch)."""
    view = memoryview(data).cast("B")
    header_length, _ = prefix_fields(view, key, TOKENS_MAGIC)
    header_bytes = view[PREFIX.size :]
    if len(header_bytes) != header_length:
        raise WireFormatError(
            key, f"header of {len(header_bytes)} bytes; its prefix says {header_length}"
        )
    if crc32c.crc32c(header_bytes) != header_crc32c:
        raise WireFormatError(
            key,
            "header checksum differs from the manifest's: corrupt, or the shard was replaced "
            "after its corpus's manifest was written",
        )
    try:
        return ShardHeader.model_validate_json(bytes(header_bytes))
    except ValidationError as exc:
        raise WireFormatError(key, field_errors(exc)) from None


def decode_blocks(data: bytes, header: ShardHeader, first_block: int, key: str) -> np.ndarray:
    """The tokens of consecutive blocks from ``first_block`` on, each block checked against its
    checksum in the header: what a ranged read of part of a shard's tokens returns."""
    itemsize = np.dtype(header.dtype).itemsize
    checksums = block_checksums(memoryview(data), itemsize, header.block_tokens)
    expected = header.blocks[first_block : first_block + len(checksums)]
    for number, (got, want) in enumerate(zip(checksums, expected, strict=False), first_block):
        if got != want:
            raise WireFormatError(
                key, f"token block {number} is corrupt: its checksum differs from the header's"
            )
    last = first_block + len(checksums) == len(header.blocks)
    whole = len(data) == len(checksums) * itemsize * header.block_tokens
    if len(checksums) > len(expected) or not (whole or last) or len(data) % itemsize:
        raise WireFormatError(
            key, f"{len(data)} bytes read from token block {first_block}: not whole blocks"
        )
    return np.frombuffer(data, dtype=np.dtype(header.dtype).newbyteorder("<"))
