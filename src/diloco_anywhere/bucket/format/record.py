"""Records: small checksummed JSON objects (manifests, SEALs, incarnation claims, leases).

A record is the wire format's prefix with magic ``DLAR`` and a JSON body, and no payload:

    offset  size  field
    0       4     magic b"DLAR"
    4       1     format version (1)
    5       3     reserved, zero
    8       4     body length B, at most MAX_RECORD_BYTES (8 MiB)
    12      4     CRC32C of the body
    16      B     body: UTF-8 JSON, validated against the record's pydantic model

JSON alone is not enough for a bucket: a flipped digit in a weight still parses. The checksum
catches it, and the strict model (no extra fields, no coercion) catches anything written by
something other than this code. Errors are ``WireFormatError`` naming the key.

A manifest names every part of a contribution (about 120 bytes each): a 28 GiB pseudo-gradient
(a 7B model in fp32) in 4 MiB parts is 7,168 parts, some 900 KB. The 8 MiB cap holds about
68,000 parts (272 GiB in 4 MiB parts) while still refusing a runaway object.
"""

from __future__ import annotations

from typing import TypeVar

import crc32c
from pydantic import BaseModel, ConfigDict, ValidationError

from diloco_anywhere.bucket.format.framing import (
    PREFIX,
    VERSION,
    WireFormatError,
    check_prefix,
    field_errors,
)

RECORD_MAGIC = b"DLAR"
MAX_RECORD_BYTES = 8 << 20
# What a reader fetches of an object where a record should be: one byte past the largest
# valid record, so that a larger object is refused after that many bytes (Store.get's ``end``).
RECORD_READ_LIMIT = PREFIX.size + MAX_RECORD_BYTES + 1
R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """Base of every record model: immutable, strict, no unknown fields. Non-finite floats are
    written as JSON's ``NaN``/``Infinity`` extensions and read back as such (a training loss
    that went NaN is what a user most needs to see; pydantic's default writes ``null``, which
    a float field then refuses). Fields that must be finite say so in their own validators."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, ser_json_inf_nan="constants"
    )


def encode_record(record: Record) -> bytes:
    body = record.model_dump_json().encode()
    if len(body) > MAX_RECORD_BYTES:
        raise ValueError(
            f"{type(record).__name__} is {len(body)} bytes; at most {MAX_RECORD_BYTES}"
        )
    prefix = PREFIX.pack(RECORD_MAGIC, VERSION, bytes(3), len(body), crc32c.crc32c(body))
    return prefix + body


def decode_record(data: bytes | bytearray, model: type[R], *, key: str) -> R:
    """Check and parse a record of type ``model``; ``WireFormatError`` naming ``key`` if bad."""
    view = memoryview(data).cast("B")
    if len(view) >= RECORD_READ_LIMIT:  # what a reader fetches of anything larger
        raise WireFormatError(
            key, f"object is larger than a record may be ({RECORD_READ_LIMIT - 1} bytes at most)"
        )
    body_length = check_prefix(view, key, magic=RECORD_MAGIC, max_length=MAX_RECORD_BYTES)
    if len(view) != PREFIX.size + body_length:
        raise WireFormatError(
            key, f"record is {len(view)} bytes; its prefix says {PREFIX.size + body_length}"
        )
    try:
        return model.model_validate_json(bytes(view[PREFIX.size :]))
    except ValidationError as exc:
        raise WireFormatError(key, field_errors(exc, what=model.__name__)) from None
