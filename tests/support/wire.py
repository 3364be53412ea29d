"""Wire objects crafted byte by byte, with a checksum that holds: what reaches the checks
behind the checksum (header fields, payload sizes, a codec's values)."""

from __future__ import annotations

import json

import crc32c

from diloco_anywhere.bucket.format import framing, wire


def craft_raw(header: bytes, payload: bytes) -> bytes:
    """A well-checksummed object with any header, to reach the checks behind the checksum."""
    body = header + payload
    checksum = crc32c.crc32c(body)
    return (
        framing.PREFIX.pack(framing.MAGIC, framing.VERSION, bytes(3), len(header), checksum) + body
    )


def craft(header: dict, payload: bytes) -> bytes:
    return craft_raw(json.dumps(header).encode(), payload)


def header_of(meta: wire.ObjectMeta, numel: int, codec: dict) -> dict:
    """The header of a flat float32 object of ``numel`` values in ``codec``."""
    return {**meta.model_dump(), "dtype": "float32", "shape": [numel], "codec": codec}
