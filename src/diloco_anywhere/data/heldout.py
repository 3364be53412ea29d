"""Which documents are held out: chosen by a hash of each document's text, so the choice of a
document never depends on what else is in the corpus (adding files moves nothing between the
splits, as taking the last few percent of the documents in file order would)."""

from __future__ import annotations

import hashlib

_SCALE = 2**64


def held_out(text: str, fraction: float) -> bool:
    """Whether the document that starts with ``text`` is held out: BLAKE2b of its text (a
    .txt document's first piece) below ``fraction`` of the hash range."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * _SCALE
