"""``crc32c_combine``: the CRC32C of two byte strings put together, from their own."""

from __future__ import annotations

import os

import crc32c
import pytest

from diloco_anywhere.bucket.format.crc_combine import crc32c_combine


@pytest.mark.parametrize("first", [0, 1, 3, 8, 1000, 65537])
@pytest.mark.parametrize("second", [0, 1, 2, 7, 4096, 100003])
def test_the_combined_crc_is_the_crc_of_the_bytes_put_together(first, second):
    a, b = os.urandom(first), os.urandom(second)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_pieces_combined_in_order_give_the_whole_file_s_crc():
    pieces = [os.urandom(size) for size in (8, 123, 0, 4096, 77)]
    combined = 0
    for piece in pieces:
        combined = crc32c_combine(combined, crc32c.crc32c(piece), len(piece))
    assert combined == crc32c.crc32c(b"".join(pieces))
