"""What every replica of a run agrees on, as the first to start recorded it.

A run's sharding, its initial model, its data plan and a prepared corpus's settings are each
one record, written create-only by whoever comes first; everyone after reads it back and
compares it with its own (identical writers all succeed: ``Store.put`` is idempotent).
"""

from __future__ import annotations

from typing import TypeVar

from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

R = TypeVar("R", bound=Record)


def first_written(store: Store, key: str, mine: R) -> R:
    """``mine`` if ``key`` was free (it is recorded now), else the record there, checked."""
    try:
        store.put(key, encode_record(mine))
        return mine
    except FileExistsError:
        return decode_record(store.get(key, 0, RECORD_READ_LIMIT), type(mine), key=key)
