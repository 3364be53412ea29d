"""Fixed-width unsigned integers packed into bytes, row by row: the sparse codec's indices
(12 bits for a 4,096-element chunk) and values (2 bits) take their width, not a byte each.

Each row starts on a byte: a row of ``m`` values of ``bits`` bits takes ``row_bytes(m, bits)``
bytes, the last one padded with zero bits, so that a range of rows (the chunks of one range of
a wire object) is one contiguous span of bytes. Bits go least significant first, into the least
significant bit of each byte first (the order numpy's ``packbits(bitorder="little")`` uses).
Vectorised torch operations only, on the device of the values: on a GPU the packing happens
there and only the packed bytes cross to the host.
"""

from __future__ import annotations

import torch

_BYTE_WEIGHTS = 1 << torch.arange(8, dtype=torch.uint8)  # bit i of a byte is worth 2^i


def row_bytes(count: int, bits: int) -> int:
    """Bytes one row of ``count`` values of ``bits`` bits takes (its last byte padded)."""
    return -(-count * bits // 8)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (rows x m non-negative integers, each below ``2**bits``) as rows x
    ``row_bytes(m, bits)`` uint8."""
    rows, count = values.shape
    if bits == 1:  # already one bit each: no expansion
        expanded = values.to(torch.uint8)
    else:
        shifts = torch.arange(bits, device=values.device, dtype=values.dtype)
        expanded = ((values.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).view(rows, count * bits)
    nbytes = row_bytes(count, bits)
    if nbytes * 8 > count * bits:
        expanded = torch.nn.functional.pad(expanded, (0, nbytes * 8 - count * bits))
    weights = _BYTE_WEIGHTS.to(values.device)
    return (expanded.view(rows, nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of each row of ``packed``, as booleans."""
    rows, nbytes = packed.shape
    weights = _BYTE_WEIGHTS.to(packed.device)
    return (packed.unsqueeze(-1) & weights).ne(0).view(rows, nbytes * 8)[:, :count]


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The rows x ``count`` integers (int64) that ``pack`` turned into ``packed``."""
    rows = packed.shape[0]
    expanded = unpack_bits(packed, count * bits)
    if bits == 1:
        return expanded.to(torch.int64)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (expanded.view(rows, count, bits).to(torch.int64) << shifts).sum(-1)
