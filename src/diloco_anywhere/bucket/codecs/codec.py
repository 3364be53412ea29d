"""Codecs: how a pseudo-gradient becomes payload bytes, and back to float32 for reduction.

- ``fp32``: exact.
- ``bf16``: half the bytes; round-to-nearest-even, relative error <= 2**-8 per element.
- ``int8``: blockwise absmax quantization, one float32 scale per ``block`` elements
  (``q = round(x * 127 / absmax(block))``). Per-block scales keep heavy-tailed tensors accurate
  where one scale for a whole tensor does not: one outlier coarsens the steps of only its own
  block. ``diloco bench store`` measures ~1% relative L2 error on Student-t(3) data at block 64.
  Payload: ``ceil(n / block)`` float32 scales, then ``n`` int8 values: 0.266x fp32 at block 64.
- ``sparse``: per chunk of 4,096 values the 328 largest magnitudes (8%), 2 bits each, their
  positions in Elias-Fano form (``sparse_codec.py``): 1/51 of fp32. It leaves out most of every
  pseudo-gradient, so a run sends it only with error feedback (``feedback.py``), which sends
  the rest later.

A codec is a pydantic model, so its parameters travel in the wire header and are validated on
decode. Codecs reject non-finite values both ways, including values that only overflow in the
codec (float32 beyond bfloat16's range, an int8 scale whose 127 steps overflow): a NaN or inf in
one replica's pseudo-gradient would otherwise poison every replica's average.

Codecs work on element ranges of one object (``encode_range`` / ``decode_range``), so the wire
layer can stream an object chunk by chunk. The arithmetic runs on the device of the values: on a
GPU replica the quantization happens there, and only the encoded bytes cross to the host
payload; decoding copies encoded bytes to the device and dequantizes there. A range starts on a
block boundary (``align``); the bytes of a range are one contiguous span of the payload when
``contiguous`` (the cast codecs), so a checksum can follow the chunks in order. The shared
base, views and checks are in ``codec_base.py``.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field, TypeAdapter

from diloco_anywhere.bucket.codecs.codec_base import (
    CPU,
    CodecBase,
    CodecDataError,
    host_view,
    require_finite,
    to_host,
)
from diloco_anywhere.bucket.codecs.codec_names import CODEC_NAMES, CodecName
from diloco_anywhere.bucket.codecs.sparse_codec import SparseCodec


class _CastCodec(CodecBase):
    """Values cast to ``wire_dtype`` and sent as its raw bytes."""

    wire_dtype: ClassVar[torch.dtype]
    narrows: ClassVar[bool]  # the cast can overflow a finite float32 to inf

    def payload_nbytes(self, numel: int) -> int:
        return self.wire_dtype.itemsize * numel

    def byte_span(self, start: int, stop: int) -> tuple[int, int]:
        """The payload bytes of elements ``[start, stop)``."""
        size = self.wire_dtype.itemsize
        return start * size, stop * size

    def encode_range(
        self, values: torch.Tensor, payload: memoryview, numel: int, start: int
    ) -> None:
        """Elements ``[start, start + len(values))`` of a ``numel``-element object, from float32
        ``values`` into ``payload``."""
        cast = values.to(self.wire_dtype)
        if self.narrows:
            require_finite(cast, f"tensor cast to {self.name} (beyond its range?)", ValueError)
        begin, _ = self.byte_span(start, start)
        to_host(cast, host_view(payload, self.wire_dtype, values.numel(), begin))

    def decode_range(
        self, payload: memoryview, numel: int, start: int, stop: int, device: torch.device = CPU
    ) -> torch.Tensor:
        """Float32 values of elements ``[start, stop)`` on ``device``, unchecked (a view of the
        payload for fp32 on the CPU)."""
        begin, _ = self.byte_span(start, start)
        encoded = host_view(payload, self.wire_dtype, stop - start, begin)
        return encoded.to(device).float()

    def check(self, payload: memoryview, numel: int, start: int, values: torch.Tensor) -> None:
        """Raise ``CodecDataError`` unless ``decode_range``'s ``values`` are usable."""
        require_finite(values, f"{self.name} payload")


class Fp32Codec(_CastCodec):
    """Exact: the float32 bytes themselves."""

    name: Literal["fp32"] = "fp32"
    wire_dtype: ClassVar[torch.dtype] = torch.float32
    narrows: ClassVar[bool] = False


class Bf16Codec(_CastCodec):
    """bfloat16: float32's range with 8 bits of mantissa."""

    name: Literal["bf16"] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    narrows: ClassVar[bool] = True


class Int8Codec(CodecBase):
    """Blockwise absmax int8 with a float32 scale per block (the last block may be short).

    Payload: every block's scale, then every int8 value, so a range's bytes are two spans
    (``contiguous`` is False)."""

    name: Literal["int8"] = "int8"
    block: int = Field(default=64, ge=8, le=4096)
    contiguous: ClassVar[bool] = False

    @property
    def align(self) -> int:
        return self.block

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def payload_nbytes(self, numel: int) -> int:
        return 4 * self._blocks(numel) + numel

    def _views(
        self, payload: memoryview, numel: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host views of the scales and the int8 values of elements ``[start, stop)``."""
        first, last = start // self.block, self._blocks(stop)
        scales = host_view(payload, torch.float32, last - first, 4 * first)
        quantized = host_view(payload, torch.int8, stop - start, 4 * self._blocks(numel) + start)
        return scales, quantized

    def _rows(self, values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole blocks as rows, and the short tail block (or None)."""
        full = count - count % self.block
        tail = values[full:] if full < count else None
        return values[:full].view(-1, self.block), tail

    def encode_range(
        self, values: torch.Tensor, payload: memoryview, numel: int, start: int
    ) -> None:
        stop = start + values.numel()
        scales_out, quantized_out = self._views(payload, numel, start, stop)
        rows, tail = self._rows(values, values.numel())
        blocks = [rows] + ([tail.view(1, -1)] if tail is not None else [])
        scales, levels = [], []
        for block_values in blocks:
            # the same exact maximum as vector_norm(ord=inf), 13x faster on a CPU thread
            # (0.07 s against 0.96 s per GiB: docs/benchmarks.md, "Sync")
            absmax = block_values.abs().amax(dim=1)
            # by a tensor, not a Python number: CUDA divides by a number as a multiply by its
            # reciprocal (1 ulp off the quotient), so a GPU's scales would differ from a CPU's
            scale = absmax / absmax.new_tensor(127.0)
            require_finite(scale * 127, "int8 block range (beyond float32?)", ValueError)
            inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
            levels.append((block_values * inverse[:, None]).round_().clamp_(-127, 127).reshape(-1))
            scales.append(scale)
        to_host(scales[0] if len(scales) == 1 else torch.cat(scales), scales_out)
        quantized = levels[0] if len(levels) == 1 else torch.cat(levels)
        to_host(quantized.to(torch.int8), quantized_out)

    def decode_range(
        self, payload: memoryview, numel: int, start: int, stop: int, device: torch.device = CPU
    ) -> torch.Tensor:
        scales, quantized = self._views(payload, numel, start, stop)
        scales, quantized = scales.to(device), quantized.to(device)
        values = quantized.float()
        rows, tail = self._rows(values, stop - start)
        rows.mul_(scales[: rows.shape[0], None])
        if tail is not None:
            tail.mul_(scales[-1])
        return values

    def check(self, payload: memoryview, numel: int, start: int, values: torch.Tensor) -> None:
        scales, _ = self._views(payload, numel, start, start + values.numel())
        require_finite(scales, "int8 scales")
        if bool((scales < 0).any()):
            raise CodecDataError("int8 scales must be >= 0 (they are absmax / 127)")
        require_finite(values, "int8 payload (scale x 127 overflows)")


Codec = Annotated[Fp32Codec | Bf16Codec | Int8Codec | SparseCodec, Field(discriminator="name")]
_CODEC_ADAPTER: TypeAdapter[Codec] = TypeAdapter(Codec)
# A sparse round's reduced shards: the mean of n sparse contributions is as dense as the union
# of their kept positions, which top-k again would cut down; int8 keeps all of it.
_SPARSE_REDUCED = Int8Codec(block=64)


def make_codec(name: CodecName | str, **params: int) -> Codec:
    """A codec by name (``fp32``, ``bf16``, ``int8``, ``sparse``) and parameters (``block``
    for int8; ``chunk``, ``k`` and ``bits`` for sparse)."""
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    return _CODEC_ADAPTER.validate_python({"name": name, **params})


def reduced_codec(codec: Codec) -> Codec:
    """The codec a reduced shard of ``codec``'s contributions is written in (``sharded``
    exchange): the same codec, except for ``sparse`` (int8; its blocks of 64 divide every
    sparse chunk, so the shards' ranges suit it)."""
    return _SPARSE_REDUCED if isinstance(codec, SparseCodec) else codec
