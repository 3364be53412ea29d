"""Codecs: how a pseudo-gradient becomes payload bytes, and back to float32 for reduction.

- ``fp32``: exact.
- ``bf16``: half the bytes; round-to-nearest-even, relative error <= 2**-8 per element.
- ``int8``: blockwise absmax quantization, one float32 scale per ``block`` elements
  (``q = round(x * 127 / absmax(block))``). Per-block scales keep heavy-tailed tensors accurate
  where one scale for a whole tensor does not: one outlier coarsens the steps of only its own
  block. ``diloco bench store`` measures ~1% relative L2 error on Student-t(3) data at block 64.
  Payload: ``ceil(n / block)`` float32 scales, then ``n`` int8 values: 0.266x fp32 at block 64.

A codec is a pydantic model, so its parameters travel in the wire header and are validated on
decode. Codecs reject non-finite values both ways, including values that only overflow in the
codec (float32 beyond bfloat16's range, an int8 scale whose 127 steps overflow): a NaN or inf in
one replica's pseudo-gradient would otherwise poison every replica's average.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, ClassVar, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class CodecDataError(ValueError):
    """Payload bytes that the codec cannot turn into finite float32 values."""


def _view(buffer: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A tensor aliasing ``buffer`` (writable, so no copy and no torch warning)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def require_finite(
    values: torch.Tensor, what: str, error: type[ValueError] = CodecDataError
) -> None:
    """Raise ``error`` naming how many values are NaN or inf.

    Fast path: a sum is NaN or inf whenever any element is (one vectorised pass, ~20x faster
    than ``isfinite(values).all()``). Only a non-finite sum, which finite values can also give by
    overflowing, pays for the exact element-wise check.
    """
    if values.numel() == 0 or bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise error(f"{what} has {bad} non-finite values (NaN or inf); only finite values are sent")


class _CodecBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class _CastCodec(_CodecBase):
    """Values cast to ``wire_dtype`` and sent as its raw bytes."""

    wire_dtype: ClassVar[torch.dtype]
    narrows: ClassVar[bool]  # the cast can overflow a finite float32 to inf

    def payload_nbytes(self, numel: int) -> int:
        return self.wire_dtype.itemsize * numel

    def encode_into(self, flat: torch.Tensor, out: memoryview) -> None:
        values = _view(out, self.wire_dtype, flat.numel())
        values.copy_(flat)
        if self.narrows:
            require_finite(values, f"tensor cast to {self.name} (beyond its range?)", ValueError)

    def dequantize(self, payload: memoryview, numel: int) -> torch.Tensor:
        return _view(payload, self.wire_dtype, numel).float()  # fp32: the view itself

    def decode(self, payload: memoryview, numel: int) -> torch.Tensor:
        values = self.dequantize(payload, numel)
        require_finite(values, f"{self.name} payload")
        return values


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


class Int8Codec(_CodecBase):
    """Blockwise absmax int8 with a float32 scale per block (the last block may be short)."""

    name: Literal["int8"] = "int8"
    block: int = Field(default=64, ge=8, le=4096)

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def _spans(self, numel: int) -> Iterator[tuple[slice, slice]]:
        """(element span, scale span) of the full blocks, then of the short tail block."""
        full = numel - numel % self.block
        if full:
            yield slice(0, full), slice(0, full // self.block)
        if full < numel:
            yield slice(full, numel), slice(full // self.block, full // self.block + 1)

    def payload_nbytes(self, numel: int) -> int:
        return 4 * self._blocks(numel) + numel

    def encode_into(self, flat: torch.Tensor, out: memoryview) -> None:
        numel, blocks = flat.numel(), self._blocks(flat.numel())
        scales = _view(out, torch.float32, blocks)
        quantized = _view(out, torch.int8, numel, offset=4 * blocks)
        for elements, scale_span in self._spans(numel):
            rows = scale_span.stop - scale_span.start
            block_values = flat[elements].view(rows, -1)
            absmax = torch.linalg.vector_norm(block_values, ord=math.inf, dim=1)
            scales[scale_span] = absmax / 127
            require_finite(
                scales[scale_span] * 127, "int8 block range (beyond float32?)", ValueError
            )
            inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
            levels = (block_values * inverse[:, None]).round_().clamp_(-127, 127)
            quantized[elements].view(rows, -1).copy_(levels)

    def dequantize(self, payload: memoryview, numel: int) -> torch.Tensor:
        scales = _view(payload, torch.float32, self._blocks(numel))
        quantized = _view(payload, torch.int8, numel, offset=4 * len(scales))
        values = torch.empty(numel, dtype=torch.float32)
        for elements, scale_span in self._spans(numel):
            rows = scale_span.stop - scale_span.start
            block_values = values[elements].view(rows, -1)
            block_values.copy_(quantized[elements].view(rows, -1))
            block_values.mul_(scales[scale_span][:, None])
        return values

    def decode(self, payload: memoryview, numel: int) -> torch.Tensor:
        scales = _view(payload, torch.float32, self._blocks(numel))
        require_finite(scales, "int8 scales")
        if bool((scales < 0).any()):
            raise CodecDataError("int8 scales must be >= 0 (they are absmax / 127)")
        values = self.dequantize(payload, numel)
        require_finite(values, "int8 payload (scale x 127 overflows)")
        return values


Codec = Annotated[Fp32Codec | Bf16Codec | Int8Codec, Field(discriminator="name")]
CODEC_NAMES = tuple(
    get_args(codec.model_fields["name"].annotation)[0] for codec in get_args(get_args(Codec)[0])
)
_CODEC_ADAPTER: TypeAdapter[Codec] = TypeAdapter(Codec)


def make_codec(name: str, **params: int) -> Codec:
    """A codec by name (``fp32``, ``bf16``, ``int8``) and parameters (``block`` for int8)."""
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    return _CODEC_ADAPTER.validate_python({"name": name, **params})
