"""The CRC32C of two byte strings put together, from their own CRCs and the second's length.

A checkpoint's file is checked against its COMMIT's CRC32C as its tensors are read into the
replica, in whatever order the state takes them, not in a read of its own
(``training/checkpoints/reader.PartCheck``): each tensor's bytes get a CRC of their own, and
these are put together in file order here. This is zlib's ``crc32_combine`` (Mark Adler's
GF(2) matrix method, zlib 1.2.x ``crc32.c``) for the Castagnoli polynomial: the CRC register
advanced over ``length`` zero bytes by squaring a 32x32 bit matrix, O(log length) work. The
``crc32c`` package computes CRCs but has no combine.
"""

from __future__ import annotations

CASTAGNOLI = 0x82F63B78  # CRC32C's polynomial, bit-reversed as the register shifts right


def _times(matrix: list[int], vector: int) -> int:
    """``matrix`` (32 columns, each a 32-bit word) times ``vector`` over GF(2)."""
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _squared(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def crc32c_combine(first: int, second: int, length: int) -> int:
    """The CRC32C of ``a + b`` from ``first`` = CRC32C(a), ``second`` = CRC32C(b) and
    ``length`` = len(b)."""
    if length <= 0:
        return first
    zeros = _squared(_squared([CASTAGNOLI] + [1 << bit for bit in range(31)]))  # 4 zero bits
    while length:  # len(b) zero bytes applied to the first CRC, a power of two at a time
        zeros = _squared(zeros)  # one zero byte, then two, four, ...
        if length & 1:
            first = _times(zeros, first)
        length >>= 1
    return first ^ second
