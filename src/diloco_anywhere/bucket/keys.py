"""What a store key may be: one rule that every supported store can hold as is.

Keys come from the run's layout and, on reading, from listings anyone could have written to.
One rule, the strictest of the stores', keeps a key meaning the same object on every backend,
rules out '.', '..' and the local store's hidden temp names, and lets a listing tell a key this
tool wrote from anything else in the bucket.
"""

from __future__ import annotations

import re

_KEY_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,254}")
MAX_KEY_LENGTH = 1024  # S3's limit, the strictest of the supported stores


def check_key(key: str) -> str:
    """A key is '/'-separated segments of 1-255 of ``A-Z a-z 0-9 _ . = -``, each starting with a
    letter, digit or '_' (so no '.', '..' or hidden temp names), at most 1024 characters in all."""
    segments = key.split("/")
    bad = next((s for s in segments if not _KEY_SEGMENT.fullmatch(s)), None)
    if bad is not None or len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"store key {key!r} is not allowed: use '/'-separated segments of 1-255 letters, "
            f"digits, '_', '.', '=', '-', each starting with a letter, digit or '_'; "
            f"at most {MAX_KEY_LENGTH} characters in all"
        )
    return key
