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

Reading a part goes the other way: ``safe_open`` maps the file (the store's own file for a local
store, else a download of it, checked first against its COMMIT), and each tensor is copied into
its destination a slice of rows at a time (``ROWS_BYTES``): a heal fills the replica's own
tensors, so nothing the size of the model is allocated besides what the replica holds anyway.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import crc32c
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diloco_anywhere.training.checkpoints.records import CheckpointError

READ_BYTES = 8 << 20  # a file's bytes are checksummed this many at a time
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


def write_part(tensors: dict[str, torch.Tensor], path: Path, staging: HostStaging) -> None:
    """The safetensors file of ``tensors`` at ``path`` (``safetensors.torch.save_file``; the
    same bytes ``save`` gives), device tensors staged through ``staging``."""
    save_file(staging.host(tensors), path)


def file_crc32c(path: Path) -> tuple[int, int]:
    """The file's size and CRC32C, read ``READ_BYTES`` at a time."""
    checksum, size = 0, 0
    with open(path, "rb") as file:
        while chunk := file.read(READ_BYTES):
            checksum, size = crc32c.crc32c(chunk, checksum), size + len(chunk)
    return size, checksum


@contextmanager
def opened_part(key: str, path: Path) -> Iterator[safe_open]:
    """``safe_open`` on a part's file (already checked against its COMMIT); whatever is
    wrong with its bytes a ``CheckpointError`` naming ``key``."""
    try:
        handle = safe_open(os.fspath(path), framework="pt")
    except SafetensorError as exc:
        raise CheckpointError(f"{key}: not a safetensors file: {exc}") from None
    except Exception as exc:  # bucket data: whatever fails in it, this is no part to load
        raise CheckpointError(f"{key}: {type(exc).__name__}: {exc}") from None
    with handle as part:
        yield part


def fill_from_part(
    key: str,
    part: safe_open,
    name: str,
    destination: torch.Tensor,
    check: Callable[[str, str, torch.Tensor], None],
) -> None:
    """Copy tensor ``name`` of ``part`` (the file of ``key``) into ``destination``, a slice
    of rows at a time, each checked by ``check(key, name, rows)`` (finite values) before it
    is copied; ``CheckpointError`` if the part's tensor is not of ``destination``'s shape and
    dtype (checked before any byte is copied)."""
    try:
        view = part.get_slice(name)
        shape, dtype = tuple(view.get_shape()), view.get_dtype()
    except Exception as exc:
        raise CheckpointError(f"{key}: tensor {name}: {type(exc).__name__}: {exc}") from None
    if shape != tuple(destination.shape) or dtype != _safetensors_dtype(destination.dtype):
        raise CheckpointError(
            f"{key}: tensor {name} is {dtype} {list(shape)}; it fills a {destination.dtype} "
            f"{list(destination.shape)}"
        )
    if destination.dim() == 0:
        rows = part.get_tensor(name)
        check(key, name, rows)
        destination.copy_(rows)
        return
    row_bytes = max(1, destination[0].numel() * destination.element_size())
    step = max(1, ROWS_BYTES // row_bytes)
    for start in range(0, shape[0], step):
        rows = view[start : start + step]
        check(key, name, rows)
        destination[start : start + step].copy_(rows)


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _safetensors_dtype(dtype: torch.dtype) -> str:
    return SAFETENSORS_DTYPES.get(dtype, str(dtype))
