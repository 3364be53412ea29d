"""The caller's tensors as one flat float32 vector, read and written in place by element range.

A sync's contribution is many tensors (one per parameter, as torchft's DiLoCo sends them). The
collective encodes each part of the contribution straight from them and writes each part of the
result back into them, so no flat copy of the whole contribution is ever made
(docs/collective.md, "Memory"). Reading a range that lies in one float32 tensor is a view;
any other range is copied chunk by chunk on the tensors' device.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import torch


class FlatTensors:
    """``tensors`` (contiguous, floating point, on one device), in order, as one vector."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("allreduce needs at least one tensor")
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError(
                    f"allreduce writes the mean in place, so it needs contiguous tensors; got "
                    f"one of shape {tuple(tensor.shape)} and stride {tensor.stride()}: pass "
                    f"tensor.contiguous() and read the result from that"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"allreduce averages floating-point tensors; got {tensor.dtype}")
        devices = {tensor.device for tensor in tensors}
        if len(devices) > 1:
            raise ValueError(
                f"allreduce's tensors must share one device; got {sorted(map(str, devices))}"
            )
        self.device = tensors[0].device
        self._flat = [tensor.detach().view(-1) for tensor in tensors]
        self._starts = [0, *itertools.accumulate(flat.numel() for flat in self._flat)]
        self.numel = self._starts[-1]

    def _segments(self, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int]]:
        """(slice of one tensor, its offset from ``start``) covering ``[start, stop)``."""
        index = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            begin = self._starts[index]
            flat = self._flat[index]
            end = min(stop, begin + flat.numel())
            if end > start:
                yield flat[start - begin : end - begin], start
            start, index = max(start, end), index + 1

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` as float32 on the tensors' device: a view where they lie
        in one float32 tensor, else a copy. The caller must not write to it."""
        segments = list(self._segments(start, stop))
        if len(segments) == 1 and segments[0][0].dtype == torch.float32:
            return segments[0][0]
        values = torch.empty(stop - start, dtype=torch.float32, device=self.device)
        for piece, offset in segments:
            values[offset - start : offset - start + piece.numel()].copy_(piece)
        return values

    def write(self, start: int, values: torch.Tensor) -> None:
        """``values`` (float32, any device) into elements ``[start, start + len(values))``."""
        for piece, offset in self._segments(start, start + values.numel()):
            piece.copy_(values[offset - start : offset - start + piece.numel()])
