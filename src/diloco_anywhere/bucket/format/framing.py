"""What every object in the bucket starts with, and the checks that need no torch.

Wire objects (``wire.py``: a tensor) and records (``record.py``: a JSON body) share a 16-byte
prefix: magic, format version, reserved zeros, the header's length and a CRC32C of the rest
(the layout is in ``wire.py``'s docstring). Here are that prefix, its checks, the field types
every header and record validates names and counts with, and the error that names an object's
key and its problem. Torch-free: the CLI reads records (launches, leases, metrics) without it.
"""

from __future__ import annotations

import struct
from typing import Annotated

import crc32c
from pydantic import Field, ValidationError

from diloco_anywhere.bucket.format.layout import NAME

MAGIC = b"DLAW"
KINDS = {
    MAGIC: "diloco-anywhere wire object", b"DLAR": "diloco-anywhere record",
    b"DLTK": "diloco-anywhere token shard",
}  # fmt: skip
VERSION = 1
PREFIX = struct.Struct("<4sB3sII")
MAX_HEADER_BYTES = 64 * 1024

Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
# Run and replica names end up as store key segments.
Name = Annotated[str, Field(pattern=rf"^{NAME.pattern}$")]


class WireFormatError(ValueError):
    """Bytes that are not a valid wire object. ``key`` names the object, ``problem`` says why."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def stored_checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC32C in an object's prefix (unchecked: ``decode`` verifies it)."""
    if len(data) < PREFIX.size:
        return 0
    return PREFIX.unpack_from(data)[4]


def _field_error(error: dict, what: str) -> str:
    field = ".".join(map(str, error["loc"]))
    got = "" if error["type"] == "missing" else f" (got {error['input']!r:.80})"
    return f"{what}{' field ' + field if field else ''}: {error['msg']}{got}"


def field_errors(exc: ValidationError, what: str = "header") -> str:
    """One '<what> field <path>: <problem> (got <value>)' per bad field, joined by '; '."""
    return "; ".join(_field_error(e, what) for e in exc.errors(include_url=False))


def prefix_fields(
    view: memoryview, key: str, magic: bytes, max_length: int = MAX_HEADER_BYTES
) -> tuple[int, int]:
    """Validate the fixed prefix's fields; return (header length, stored checksum)."""
    if len(view) < PREFIX.size:
        raise WireFormatError(key, f"{len(view)} bytes, shorter than the {PREFIX.size}-byte prefix")
    found, version, reserved, header_length, checksum = PREFIX.unpack_from(view)
    if found != magic:
        raise WireFormatError(key, f"magic {found!r} is not {magic!r}: not a {KINDS[magic]}")
    if version != VERSION:
        raise WireFormatError(key, f"format version {version}; this build reads {VERSION}")
    if reserved != bytes(3):
        raise WireFormatError(key, f"reserved prefix bytes {reserved!r} must be zero")
    if header_length > min(max_length, len(view) - PREFIX.size):
        raise WireFormatError(
            key,
            f"header length {header_length} exceeds the object ({len(view)} bytes) "
            f"or the {max_length}-byte cap",
        )
    return header_length, checksum


def checksum_error(key: str, stored: int, actual: int) -> WireFormatError:
    return WireFormatError(
        key, f"checksum mismatch (stored {stored:#010x}, computed {actual:#010x}): corrupt"
    )


def check_prefix(
    view: memoryview, key: str, magic: bytes = MAGIC, max_length: int = MAX_HEADER_BYTES
) -> int:
    """Validate the fixed prefix and the checksum; return the header length."""
    header_length, stored = prefix_fields(view, key, magic, max_length)
    actual = crc32c.crc32c(view[PREFIX.size :])
    if actual != stored:
        raise checksum_error(key, stored, actual)
    return header_length
