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
Encoding writes header and payload into one buffer, with no intermediate copies; encoding and
reading run chunk by chunk (``chunk_elements``), with the copy, the finiteness check and the
checksum of each chunk fused while it is in cache.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import crc32c
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from diloco_anywhere.bucket.codecs.codec import (
    CPU,
    Codec,
    CodecDataError,
    Fp32Codec,
    require_finite,
)
from diloco_anywhere.bucket.format.framing import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    Count,
    Name,
    WireFormatError,
    check_prefix,
    checksum_error,
    field_errors,
    prefix_fields,
)

if sys.byteorder != "little":  # every platform we target is little-endian; say so if not
    raise ImportError("diloco_anywhere.bucket.format.wire supports little-endian machines only")

CHUNK_BYTES = 1 << 20  # float32 bytes per fused step on the CPU (``chunk_elements``)
MAX_DIMS = 8
MAX_NUMEL = 2**63 - 1
DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES = {name: getattr(torch, name) for name in get_args(DtypeName)}


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


def _dtype_name(tensor: torch.Tensor) -> str:
    for name, dtype in DTYPES.items():
        if tensor.dtype == dtype:
            return name
    raise ValueError(f"cannot encode dtype {tensor.dtype}; allowed: {', '.join(DTYPES)}")


def chunk_elements(codec: Codec, device: torch.device, numel: int) -> int:
    """Elements per fused step. On the CPU, ``CHUNK_BYTES`` of float32 at a time, so that the
    copy, the finiteness check and the checksum of a chunk read it from cache, not memory: one
    pass over memory instead of three. On a GPU, the whole object in one step (a kernel per
    step; only the encoded bytes cross to the host)."""
    if device.type != "cpu":
        return max(numel, 1)
    step = CHUNK_BYTES // 4
    return max(codec.align, step - step % codec.align)


def max_object_nbytes(codec: Codec, numel: int) -> int:
    """The most bytes the wire object of ``numel`` values can take (with the largest header):
    what a buffer to encode into must hold."""
    return PREFIX.size + MAX_HEADER_BYTES + codec.payload_nbytes(numel)


def encode(
    tensor: torch.Tensor, codec: Codec, meta: ObjectMeta, *, into: memoryview | None = None
) -> bytearray | memoryview:
    """The wire object for ``tensor``: prefix, header and payload in one buffer (``into``, when
    given: the object is its first bytes, returned as a view)."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"cannot encode a {tensor.dim()}-d tensor; at most {MAX_DIMS} dims")
    flat = tensor.detach().reshape(-1)
    return encode_values(
        lambda start, stop: flat[start:stop].float(),
        flat.numel(),
        codec,
        meta,
        dtype=_dtype_name(tensor),
        shape=tuple(tensor.shape),
        device=tensor.device,
        into=into,
    )


def encode_values(
    read: Callable[[int, int], torch.Tensor],
    numel: int,
    codec: Codec,
    meta: ObjectMeta,
    *,
    dtype: str = "float32",
    shape: tuple[int, ...] | None = None,
    device: torch.device = CPU,
    into: memoryview | None = None,
) -> bytearray | memoryview:
    """The wire object of ``numel`` float32 values that ``read(start, stop)`` yields (on
    ``device``), built chunk by chunk: each chunk is checked finite, encoded into the payload
    and, for a contiguous codec, added to the checksum while it is in cache."""
    header = Header(
        **meta.model_dump(), dtype=dtype, shape=(numel,) if shape is None else shape, codec=codec
    )
    header_bytes = header.model_dump_json().encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(header_bytes)} bytes; at most {MAX_HEADER_BYTES}")
    payload_start = PREFIX.size + len(header_bytes)
    total = payload_start + codec.payload_nbytes(numel)
    buffer: bytearray | memoryview = bytearray(total) if into is None else into[:total]
    if len(buffer) < total:
        raise ValueError(f"the object needs {total} bytes; the buffer has {len(buffer)}")
    view = memoryview(buffer)
    view[PREFIX.size : payload_start] = header_bytes
    payload = view[payload_start:]
    checksum = crc32c.crc32c(header_bytes)
    step = chunk_elements(codec, device, numel)
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        values = read(start, stop)
        require_finite(values, f"tensor to encode for {meta} (as float32)", ValueError)
        codec.encode_range(values, payload, numel, start)
        if codec.contiguous:
            checksum = crc32c.crc32c(payload[slice(*codec.byte_span(start, stop))], checksum)
    if not codec.contiguous:
        checksum = crc32c.crc32c(payload, checksum)
    PREFIX.pack_into(view, 0, MAGIC, VERSION, bytes(3), len(header_bytes), checksum)
    return buffer


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


class WireReader:
    """A wire object opened for reading in chunks, in one pass over its bytes.

    Opening checks the prefix, the header and the payload length; ``chunks`` then yields the
    values chunk by chunk, each checked (finite, codec rules), and verifies the checksum as it
    goes: for a contiguous codec the last chunk's step raises if the object is corrupt, so a
    consumer must treat what it did with the chunks as provisional until the iteration ends
    without error (a reduction discards its accumulator; a write in place fails the round).
    A problem found before the checksum is reported as a checksum mismatch when the checksum
    does not match: corruption is the likelier cause, and the fix (write it again) the same.
    """

    def __init__(self, data: bytes | bytearray | memoryview, key: str = "<bytes>") -> None:
        self.key = key
        self._view = _byte_view(data)
        header_length, self._stored = prefix_fields(self._view, key, MAGIC)
        payload_start = PREFIX.size + header_length
        try:
            self.header = Header.model_validate_json(bytes(self._view[PREFIX.size : payload_start]))
        except ValidationError as exc:
            raise self._error(field_errors(exc)) from None
        self._header_bytes = self._view[PREFIX.size : payload_start]
        self.payload = self._view[payload_start:]
        expected = self.header.codec.payload_nbytes(self.header.numel)
        if len(self.payload) != expected:
            raise self._error(
                f"payload is {len(self.payload)} bytes; codec {self.header.codec.name} with "
                f"shape {list(self.header.shape)} needs {expected}"
            )

    def _error(self, problem: str) -> WireFormatError:
        actual = crc32c.crc32c(self._view[PREFIX.size :])
        if actual != self._stored:
            return checksum_error(self.key, self._stored, actual)
        return WireFormatError(self.key, problem)

    def verify_checksum(self) -> None:
        actual = crc32c.crc32c(self._view[PREFIX.size :])
        if actual != self._stored:
            raise checksum_error(self.key, self._stored, actual)

    def chunks(
        self,
        device: torch.device = CPU,
        *,
        check_values: bool = True,
        check_checksum: bool = True,
        step: int | None = None,
        on_time: Callable[[str, float], None] | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, float32 values on device)`` for consecutive element ranges. Bytes this
        process made (``encode``) or has verified already skip the checks they passed.
        ``on_time(phase, seconds)`` hears the CPU seconds this thread spent on the
        ``checksum`` and on the ``decode`` (with its checks) of each chunk."""
        codec, numel = self.header.codec, self.header.numel
        step = step or chunk_elements(codec, device, numel)
        stream_checksum = check_checksum and codec.contiguous
        timed = on_time or _untimed
        begun = time.thread_time()
        if check_checksum and not codec.contiguous:
            self.verify_checksum()  # two spans per range: check the (small) payload first
        checksum = crc32c.crc32c(self._header_bytes)
        for start in range(0, numel, step):
            stop = min(numel, start + step)
            if stream_checksum:
                span = self.payload[slice(*codec.byte_span(start, stop))]
                checksum = crc32c.crc32c(span, checksum)
            checked = time.thread_time()
            timed("checksum", checked - begun)
            try:  # decoding refuses what it cannot place (a sparse position out of range)
                values = codec.decode_range(self.payload, numel, start, stop, device)
                if check_values:
                    codec.check(self.payload, numel, start, values)
            except CodecDataError as exc:
                raise self._error(str(exc)) from None
            timed("decode", time.thread_time() - checked)
            yield start, values
            begun = time.thread_time()
        if stream_checksum and checksum != self._stored:
            raise checksum_error(self.key, self._stored, checksum)


def _untimed(phase: str, seconds: float) -> None:
    """``WireReader.chunks``'s ``on_time`` when nobody listens."""


def decode(
    data: bytes | bytearray | memoryview, *, key: str = "<bytes>", device: torch.device = CPU
) -> Decoded:
    """Check and decode a wire object into its header and a float32 tensor of its shape, on
    ``device`` (a GPU dequantizes there: only the encoded bytes cross to it).

    With a writable buffer (``bytearray``) the fp32 tensor is a view of it on the CPU: no
    copy. Read-only ``bytes`` are copied once, so the returned tensor never aliases immutable
    memory. The checksum is verified before the header is parsed. Other codecs decode chunk by
    chunk into the result, so what decoding adds beyond it is a chunk's temporaries, whatever
    the size.
    """
    view = _byte_view(data)
    check_prefix(view, key)
    if view.readonly:  # checked first, so junk is never copied
        view = memoryview(bytearray(view))
    reader = WireReader(view, key)
    numel = reader.header.numel
    if isinstance(reader.header.codec, Fp32Codec):
        chunks = reader.chunks(device, check_checksum=False, step=max(numel, 1))
        flat = next((chunk for _, chunk in chunks), torch.empty(0, device=device))
    else:
        flat = torch.empty(numel, device=device)
        for start, chunk in reader.chunks(device, check_checksum=False):
            flat[start : start + chunk.numel()] = chunk
    return Decoded(reader.header, flat.view(reader.header.shape))
