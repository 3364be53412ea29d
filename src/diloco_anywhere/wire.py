"""Wire format: one self-describing, checksummed object per tensor.

Layout (little-endian)::

    offset  size  field
    0       4     magic b"DLAW"
    4       1     format version (1)
    5       3     reserved, zero
    8       4     header length H, at most MAX_HEADER_BYTES
    12      4     CRC32C (Castagnoli) of every byte from offset 16 to the end
    16      H     header: UTF-8 JSON object, see ``Header``
    16+H    ...   payload: its length is fixed by codec, dtype and shape

Objects come from a bucket that other machines write, so decoding trusts nothing: no pickle
(``torch.load`` has been bypassed twice, CVE-2025-32434 and CVE-2026-24747), every length is
bounded before use, the checksum is verified before the header is parsed, the header is
validated field by field, and the payload length must equal what the header implies. Any
malformed input yields ``WireFormatError`` naming the object's key and the problem.

The checksum covers every bit after the prefix; the prefix's own fields are each checked
(magic, version, reserved zeros, header length bound), so any flipped bit is caught.
Encoding writes header and payload into one buffer, with no intermediate copies.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import crc32c
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from diloco_anywhere.codec import Codec, CodecDataError, require_finite
from diloco_anywhere.layout import NAME

if sys.byteorder != "little":  # every platform we target is little-endian; say so if not
    raise ImportError("diloco_anywhere.wire supports little-endian machines only")

MAGIC = b"DLAW"
KINDS = {MAGIC: "diloco-anywhere wire object", b"DLAR": "diloco-anywhere record"}
VERSION = 1
PREFIX = struct.Struct("<4sB3sII")
MAX_HEADER_BYTES = 64 * 1024
MAX_DIMS = 8
MAX_NUMEL = 2**63 - 1
DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES = {name: getattr(torch, name) for name in get_args(DtypeName)}

Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
# Run and replica names end up as store key segments.
Name = Annotated[str, Field(pattern=rf"^{NAME.pattern}$")]


class WireFormatError(ValueError):
    """Bytes that are not a valid wire object. ``key`` names the object, ``problem`` says why."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class ObjectMeta(BaseModel):
    """Where an object belongs: every object states it, so a misplaced one is detected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run: Name
    round: Count
    replica: Name
    incarnation: Count
    shard: Count


class Header(ObjectMeta):
    """``dtype`` is the encoded tensor's dtype; decoding always yields float32 for reduction."""

    dtype: DtypeName
    shape: tuple[Count, ...] = Field(max_length=MAX_DIMS)
    codec: Codec

    @field_validator("shape")
    @classmethod
    def _numel_fits(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Zero-size shapes too: torch refuses [2**62, 2**62, 0] although it holds nothing."""
        if math.prod(size for size in shape if size) > MAX_NUMEL:
            raise ValueError(f"the product of the non-zero sizes must be at most {MAX_NUMEL}")
        return shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Decoded:
    header: Header
    tensor: torch.Tensor


def stored_checksum(data: bytes | bytearray) -> int:
    """The CRC32C in an object's prefix (unchecked: ``decode`` verifies it)."""
    if len(data) < PREFIX.size:
        return 0
    return PREFIX.unpack_from(data)[4]


def _dtype_name(tensor: torch.Tensor) -> str:
    for name, dtype in DTYPES.items():
        if tensor.dtype == dtype:
            return name
    raise ValueError(f"cannot encode dtype {tensor.dtype}; allowed: {', '.join(DTYPES)}")


def encode(tensor: torch.Tensor, codec: Codec, meta: ObjectMeta) -> bytearray:
    """The wire object for ``tensor``: prefix, header and payload in one buffer."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"cannot encode a {tensor.dim()}-d tensor; at most {MAX_DIMS} dims")
    header = Header(
        **meta.model_dump(), dtype=_dtype_name(tensor), shape=tuple(tensor.shape), codec=codec
    )
    flat = tensor.detach().reshape(-1).float()
    require_finite(flat, f"tensor to encode for {meta} (as float32)", ValueError)
    header_bytes = header.model_dump_json().encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(header_bytes)} bytes; at most {MAX_HEADER_BYTES}")
    payload_start = PREFIX.size + len(header_bytes)
    buffer = bytearray(payload_start + codec.payload_nbytes(flat.numel()))
    view = memoryview(buffer)
    view[PREFIX.size : payload_start] = header_bytes
    codec.encode_into(flat, view[payload_start:])
    checksum = crc32c.crc32c(view[PREFIX.size :])
    PREFIX.pack_into(buffer, 0, MAGIC, VERSION, bytes(3), len(header_bytes), checksum)
    return buffer


def sent_values(encoded: bytearray, codec: Codec, numel: int) -> torch.Tensor:
    """The flat float32 values a receiver decodes from ``encoded``, an object this process has
    just made with ``encode``: the codec's dequantization alone. The checks of ``decode`` guard
    bytes from a bucket; a sender knows its own bytes (and skips a CRC pass over them)."""
    payload = memoryview(encoded)[len(encoded) - codec.payload_nbytes(numel) :]
    return codec.dequantize(payload, numel)


def _field_error(error: dict, what: str) -> str:
    field = ".".join(map(str, error["loc"]))
    got = "" if error["type"] == "missing" else f" (got {error['input']!r:.80})"
    return f"{what}{' field ' + field if field else ''}: {error['msg']}{got}"


def field_errors(exc: ValidationError, what: str = "header") -> str:
    """One '<what> field <path>: <problem> (got <value>)' per bad field, joined by '; '."""
    return "; ".join(_field_error(e, what) for e in exc.errors(include_url=False))


def check_prefix(view: memoryview, key: str, magic: bytes = MAGIC) -> int:
    """Validate the fixed prefix and the checksum; return the header length."""
    if len(view) < PREFIX.size:
        raise WireFormatError(key, f"{len(view)} bytes, shorter than the {PREFIX.size}-byte prefix")
    found, version, reserved, header_length, checksum = PREFIX.unpack_from(view)
    if found != magic:
        raise WireFormatError(key, f"magic {found!r} is not {magic!r}: not a {KINDS[magic]}")
    if version != VERSION:
        raise WireFormatError(key, f"format version {version}; this build reads {VERSION}")
    if reserved != bytes(3):
        raise WireFormatError(key, f"reserved prefix bytes {reserved!r} must be zero")
    if header_length > min(MAX_HEADER_BYTES, len(view) - PREFIX.size):
        raise WireFormatError(
            key,
            f"header length {header_length} exceeds the object ({len(view)} bytes) "
            f"or the {MAX_HEADER_BYTES}-byte cap",
        )
    actual = crc32c.crc32c(view[PREFIX.size :])
    if actual != checksum:
        raise WireFormatError(
            key, f"checksum mismatch (stored {checksum:#010x}, computed {actual:#010x}): corrupt"
        )
    return header_length


def decode(data: bytes | bytearray | memoryview, *, key: str = "<bytes>") -> Decoded:
    """Check and decode a wire object into its header and a float32 tensor of its shape.

    With a writable buffer (``bytearray``) the fp32 tensor is a view of it: no copy. Read-only
    ``bytes`` are copied once, so the returned tensor never aliases immutable memory.
    """
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    view = view.cast("B")
    header_length = check_prefix(view, key)
    if view.readonly:  # checked first, so junk is never copied
        view = memoryview(bytearray(view))
    payload_start = PREFIX.size + header_length
    try:
        header = Header.model_validate_json(bytes(view[PREFIX.size : payload_start]))
    except ValidationError as exc:
        raise WireFormatError(key, field_errors(exc)) from None
    payload = view[payload_start:]
    expected = header.codec.payload_nbytes(header.numel)
    if len(payload) != expected:
        raise WireFormatError(
            key,
            f"payload is {len(payload)} bytes; codec {header.codec.name} with shape "
            f"{list(header.shape)} needs {expected}",
        )
    try:
        flat = header.codec.decode(payload, header.numel)
    except CodecDataError as exc:
        raise WireFormatError(key, str(exc)) from None
    return Decoded(header, flat.view(header.shape))
