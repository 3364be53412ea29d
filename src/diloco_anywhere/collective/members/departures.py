"""How replicas left the run, so that the others know who will not come back and why.

A replica that leaves writes one small record (its newest incarnation's overwrites an older
one's): why it ended, and whether it is ``final``, an end no restart can help (a mistake of
its script or configuration, refused at once: ``training/mistakes/__init__.py``). A replica that
could not write one (it never joined: an image without the project, a script that fails before
``join``; or it was killed) has one written for it when nothing will start it again: by the
keeper that gave up on it, or by the launch that follows it and found the run cannot go on
(``membership.depart_for``), naming its newest claimed incarnation, or none. A round waiting for
its SEAL reads them: when the replicas that stopped for good leave fewer than
``min_replicas`` of the run's, no round can seal again, and it fails at once saying who
stopped and why, instead of waiting out its timeout five times (``round.py``).
"""

from __future__ import annotations

import logging

from pydantic import Field

from diloco_anywhere.bucket.format.framing import Count, Name, WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)


class Departure(Record):
    replica: Name
    # its incarnation that left; None: it never joined (no incarnation was ever claimed)
    incarnation: Count | None
    reason: str = Field(max_length=2000)
    final: bool  # no restart can help: it stays out until it is fixed and replaced


def record_departure(
    store: Store,
    layout: RunLayout,
    replica: str,
    incarnation: int | None,
    reason: str,
    final: bool,
) -> None:
    """Say why ``replica`` (its ``incarnation``) left; a store that fails here only leaves the
    others less informed."""
    record = Departure(replica=replica, incarnation=incarnation, reason=reason[:2000],
                       final=final)  # fmt: skip
    try:
        store.overwrite(layout.departure(replica), encode_record(record))
    except OSError as exc:
        log.warning("could not record how %s left: %s", replica, exc)


def newest_departures(
    store: Store, layout: RunLayout, newest: dict[str, int]
) -> dict[str, Departure]:
    """How each replica whose newest claimed incarnation (``newest``: replica -> incarnation)
    has left left, and each that never joined and was said to have left for good (a record of
    no incarnation, while it has claimed none); a record that does not decode is left out,
    said."""
    found = {}
    for key in store.list_prefix(f"{layout.exchange}/departures"):
        try:
            record = decode_record(store.get(key, 0, RECORD_READ_LIMIT), Departure, key=key)
        except (WireFormatError, FileNotFoundError) as exc:
            log.warning("a departure record left out: %s", exc)
            continue
        if newest.get(record.replica) == record.incarnation:
            found[record.replica] = record
    return found


def hopeless(departed: dict[str, Departure], replicas: int, least: int) -> str | None:
    """Why no round of a run of ``replicas`` can reach ``least`` contributions again (None
    while one can): those that left for good leave too few."""
    gone = {replica: d for replica, d in sorted(departed.items()) if d.final}
    if not gone or replicas - len(gone) >= least:
        return None
    named = "; ".join(f"{replica}: {d.reason}" for replica, d in gone.items())
    return (
        f"min_replicas = {least}, and {len(gone)} of the run's {replicas} replicas stopped for "
        f"good ({named}); fix each, then `diloco replace` it, or lower run.min_replicas"
    )
