"""A checkpoint's parts written to local files one at a time, and read back into the tensors
they fill: how a checkpoint moves with host memory bounded by one part, not by the model.

Writing a part is safetensors' own ``serialize_file``: it writes a dict of host tensors straight
from their memory into a file (no bytes object of the whole, as ``safetensors.torch.save``
makes and copies once more). The global weights DiLoCo keeps are host tensors already, so they
go in as they are; a tensor on a GPU (the outer momentum) is copied into a host buffer first,
pinned so the copy is a DMA (``HostStaging``), a part's at a time, and reused for the next
part. The file is the spool the upload reads from (``Store.put_file``), so the state itself is
read only while its parts are written to local disk, at disk speed: the training may change it
as soon as that is done (``CheckpointWriter.release``), however slow the store.

Reading a part goes the other way: the file (the store's own for a local store, else a
download of it, checked first against its COMMIT) is validated by safetensors' own reader
(``safe_open``), and each tensor's bytes are read with positioned reads straight into the
tensor it fills (``PartFile``), a run of rows of about ``ROWS_BYTES`` at a time, or through one
reused host buffer where that tensor is on a GPU: a heal fills the replica's own tensors, so
nothing the size of the model is allocated besides what the replica holds anyway, and no page
of the file is mapped or copied twice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diloco_anywhere.training.checkpoints.records import CheckpointError

ROWS_BYTES = 16 << 20  # a tensor is copied into its destination about this many at a time


class HostStaging:
    """One host buffer that device tensors are copied into before they are written: pinned
    where CUDA is in use (the copy is a DMA), grown to the largest part it stages, reused."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` in host memory: a host tensor as it is (contiguous), a device tensor
        as a view of this buffer holding a copy of it."""
        device = {name: t for name, t in tensors.items() if t.device.type != "cpu"}
        needed = sum(_aligned(t.numel() * t.element_size()) for t in device.values())
        buffer = self._grown(needed)
        hosted, offset = {}, 0
        for name, tensor in tensors.items():
            if name not in device:
                hosted[name] = tensor.detach().contiguous()
                continue
            size = tensor.numel() * tensor.element_size()
            view = buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            hosted[name], offset = view, offset + _aligned(size)
        return hosted

    def _grown(self, size: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # the old one goes before the new one is allocated
            pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._buffer

    def release(self) -> None:
        self._buffer = None


def _aligned(size: int) -> int:
    """Offsets in the staging buffer at 64 bytes, as any dtype's view needs."""
    return math.ceil(size / 64) * 64


def write_part(tensors: dict[str, torch.Tensor], path: str, staging: HostStaging) -> None:
    """The safetensors file of ``tensors`` at ``path`` (``safetensors.torch.save_file``; the
    same bytes ``save`` gives), device tensors staged through ``staging``."""
    save_file(staging.host(tensors), path)


@dataclass(frozen=True)
class PartTensor:
    """Where one tensor of a part's file is: its bytes ``[offset, offset + nbytes)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def part_tensors(key: str, path: str) -> list[PartTensor]:
    """The tensors of the part at ``key`` (its local file ``path``, checked against its
    COMMIT), as safetensors' own reader validates the file (``safe_open``: a header it can
    parse, offsets that tile the data) and their places in it (the header's
    ``data_offsets``, after the 8 bytes of its length and the header itself); a
    ``CheckpointError`` naming ``key`` for anything off, a dtype torch lacks included."""
    try:
        with safe_open(os.fspath(path), framework="pt") as part:
            names = list(part.keys())
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
    except SafetensorError as exc:
        raise CheckpointError(f"{key}: not a safetensors file: {exc}") from None
    except Exception as exc:  # bucket data: whatever fails in it, this is no part to load
        raise CheckpointError(f"{key}: {type(exc).__name__}: {exc}") from None
    tensors = []
    for name in names:
        entry = header[name]
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{key}: tensor {name} is {entry['dtype']}, a dtype this "
                                  f"torch cannot load")  # fmt: skip
        begin, end = entry["data_offsets"]
        tensors.append(PartTensor(name, tuple(entry["shape"]), dtype, 8 + length + begin,
                                  end - begin))  # fmt: skip
    return tensors


def row_chunks(tensor: PartTensor) -> list[tuple[int, int]]:
    """``tensor``'s rows (its first dimension) in runs of about ``ROWS_BYTES`` (at least one
    row each; a scalar is one run): each run's bytes are contiguous in its file."""
    rows = tensor.shape[0] if tensor.shape else 1
    row_bytes = tensor.nbytes // rows if rows else 0
    step = max(1, ROWS_BYTES // max(1, row_bytes))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def rows_of(tensor: torch.Tensor | None, start: int, end: int, shape: tuple[int, ...]) -> Any:
    """Rows ``[start, end)`` of ``tensor`` (itself, for a scalar)."""
    return tensor if not shape else tensor[start:end]  # type: ignore[index]


class PartFile:
    """A part's file, open for positioned reads of its tensors' bytes (``os.preadv``): into a
    host tensor's own memory where it is contiguous (no copy in between), else into one
    reused host buffer, pinned where CUDA is in use, then copied on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._descriptor = os.open(path, os.O_RDONLY)
        self._buffer: torch.Tensor | None = None

    def close(self) -> None:
        os.close(self._descriptor)
        self._buffer = None

    def __enter__(self) -> PartFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _read_into(self, target: torch.Tensor, offset: int) -> None:
        """``target``'s bytes (a contiguous host tensor) from the file at ``offset``."""
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            read = os.preadv(self._descriptor, [view[done:]], offset + done)
            if read <= 0:
                raise OSError(f"{self.path} ended {len(view) - done} bytes short")
            done += read

    def _staged(self, tensor: PartTensor, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``tensor`` read into the reused buffer, as its dtype."""
        rows = end - start if tensor.shape else 1
        size = tensor.nbytes // (tensor.shape[0] if tensor.shape else 1) * rows
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None
            pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._buffer = torch.empty(max(size, ROWS_BYTES), dtype=torch.uint8, pin_memory=pinned)
        shape = (rows, *tensor.shape[1:]) if tensor.shape else ()
        values = self._buffer[:size].view(tensor.dtype).view(shape)
        self._read_into(values, tensor.offset + self._row_offset(tensor, start))
        return values

    @staticmethod
    def _row_offset(tensor: PartTensor, row: int) -> int:
        return tensor.nbytes // tensor.shape[0] * row if tensor.shape else 0

    def fill(
        self,
        tensor: PartTensor,
        destination: torch.Tensor,
        check: Callable[[torch.Tensor], None],
    ) -> None:
        """``tensor`` into ``destination`` (of its shape and dtype, any device and layout),
        a run of rows at a time, each run passed to ``check`` as it lands."""
        direct = destination.device.type == "cpu" and destination.is_contiguous()
        for start, end in row_chunks(tensor):
            place = rows_of(destination, start, end, tensor.shape)
            if direct:
                self._read_into(place, tensor.offset + self._row_offset(tensor, start))
                check(place)
            else:
                values = self._staged(tensor, start, end)
                check(values)
                place.copy_(values)

    def chunks(self, tensor: PartTensor) -> Iterator[torch.Tensor]:
        """``tensor``'s values, a run of rows at a time, in the reused buffer."""
        for start, end in row_chunks(tensor):
            yield self._staged(tensor, start, end)


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def _safetensors_dtype(dtype: torch.dtype) -> str:
    return SAFETENSORS_DTYPES.get(dtype, str(dtype))
