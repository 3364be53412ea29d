"""What every codec shares: the base class its parameters validate with, host views of a
payload, and the finiteness checks both ways (``codec.py`` says what a codec is)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

CPU = torch.device("cpu")


class CodecDataError(ValueError):
    """Payload bytes that the codec cannot turn into finite float32 values."""


def host_view(buffer: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A CPU tensor aliasing ``count`` items of ``buffer`` from byte ``offset`` (no copy)."""
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


def to_host(values: torch.Tensor, out: torch.Tensor) -> None:
    """``values`` (any device, ``out``'s dtype) into the host tensor ``out``."""
    out.view(-1).copy_(values.reshape(-1))


class CodecBase(BaseModel):
    """A codec's parameters travel in the wire header: frozen, strict, nothing extra."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    contiguous: ClassVar[bool] = True

    @property
    def align(self) -> int:
        """Ranges start on a multiple of this many elements."""
        return 1
