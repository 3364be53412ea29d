"""Who is in the run: incarnation claims and leases, kept as create-only objects.

- A replica process starts by claiming the next incarnation number of its replica id with a
  create-only ``claim`` object. Two processes cannot hold the same number, and a restarted
  replica always gets a newer one. Only a replica's newest incarnation is a member, so an
  older one that is still running (a zombie) is never polled and cannot contribute.
- A member is live while its lease for the current or the previous lease period exists. Every
  lease is a new key (``lease-{period}``) rather than an update of one key: keys are never
  overwritten, and GCS allows one update per second per object name. A replica deletes its own
  leases once they are two periods old, so listings stay short.

Periods come from wall clocks (``floor(time / period)``), so clocks must agree to well within a
period. NTP-synced cloud machines agree to milliseconds; the default period is 10 s.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from diloco_anywhere.bucket.layout import Participant, RunLayout
from diloco_anywhere.bucket.record import RECORD_READ_LIMIT, Record, decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.bucket.wire import Count, Name, WireFormatError

log = logging.getLogger(__name__)
Clock = Callable[[], float]


class Claim(Record):
    replica: Name
    incarnation: Count
    nonce: str  # makes two racing claimants' bytes differ, so exactly one put succeeds
    started_at: float


class Lease(Record):
    replica: Name
    incarnation: Count
    period: Count
    # fragment -> the newest round this incarnation has finished (for garbage collection);
    # JSON keys are strings, so the fragment is checked as digits here, in the reader
    finished: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Count] = Field(
        default_factory=dict
    )


@dataclass(frozen=True)
class LeasePolicy:
    period: float = 10.0  # seconds; a member is dead after one to two periods without a lease

    def current(self, now: float) -> int:
        return math.floor(now / self.period)


def claim_incarnation(
    store: Store, layout: RunLayout, replica: str, clock: Clock = time.time
) -> int:
    """Claim and return the next unused incarnation number of ``replica``."""
    claimed = [
        parsed[1]
        for key in store.list_prefix(layout.incarnations(replica))
        if (parsed := layout.parse_member_key(key)) and parsed[2] is None
    ]
    incarnation = max(claimed, default=-1) + 1
    nonce = uuid.uuid4().hex
    while True:
        claim = Claim(replica=replica, incarnation=incarnation, nonce=nonce, started_at=clock())
        try:
            store.put(layout.claim(replica, incarnation), encode_record(claim))
            return incarnation
        except FileExistsError:
            incarnation += 1  # another process of this replica claimed it first


def live_members(
    store: Store, layout: RunLayout, policy: LeasePolicy, now: float
) -> list[Participant]:
    """The newest incarnation of every replica whose lease for this or the last period exists."""
    newest: dict[str, int] = {}
    leases: set[tuple[str, int, int]] = set()
    for key in store.list_prefix(layout.members()):
        parsed = layout.parse_member_key(key)
        if parsed is None:
            continue
        replica, incarnation, period = parsed
        if period is None:
            newest[replica] = max(newest.get(replica, -1), incarnation)
        else:
            leases.add(parsed)
    current = policy.current(now)
    return sorted(
        (Participant(replica, incarnation) for replica, incarnation in newest.items()
         if {(replica, incarnation, current), (replica, incarnation, current - 1)} & leases),
        key=lambda member: member.name,
    )  # fmt: skip


def member_progress(
    store: Store, layout: RunLayout, members: list[Participant], policy: LeasePolicy, now: float
) -> dict[str, dict[int, int]]:
    """Each member's newest finished round per fragment, from its newest lease (up to a period
    old, so it errs toward rounds still needed). A member without a readable lease reports
    nothing, which keeps every round."""
    current = policy.current(now)
    keys = {
        member.name: [
            layout.lease(member.replica, member.incarnation, period)
            for period in (current, current - 1)
            if period >= 0
        ]
        for member in members
    }
    objects = store.get_many(
        (key for member_keys in keys.values() for key in member_keys), limit=RECORD_READ_LIMIT
    )
    progress: dict[str, dict[int, int]] = {}
    for name, member_keys in keys.items():
        data = next((objects[key] for key in member_keys if objects[key] is not None), None)
        try:
            lease = decode_record(data, Lease, key=member_keys[0]) if data else None
        except WireFormatError as exc:
            log.warning("unreadable lease: %s", exc)
            lease = None
        progress[name] = {int(f): r for f, r in lease.finished.items()} if lease else {}
    return progress


class Heartbeat:
    """Writes ``me``'s lease once per period on a background thread, until stopped."""

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        me: Participant,
        policy: LeasePolicy,
        clock: Clock = time.time,
        progress: Callable[[], dict[int, int]] = dict,
    ) -> None:
        """``progress()``: the newest finished round per fragment, reported in each lease."""
        self.store, self.layout, self.me, self.policy, self.clock = store, layout, me, policy, clock
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def beat(self) -> int:
        """Write this period's lease (idempotent) and delete our leases two periods old."""
        period = self.policy.current(self.clock())
        finished = {str(fragment): round_ for fragment, round_ in self.progress().items()}
        lease = Lease(
            replica=self.me.replica, incarnation=self.me.incarnation, period=period,
            finished=finished,
        )  # fmt: skip
        self.store.put(self._key(period), encode_record(lease))
        if period >= 2:
            self.store.delete(self._key(period - 2))
        return period

    def _key(self, period: int) -> str:
        return self.layout.lease(self.me.replica, self.me.incarnation, period)

    def _run(self) -> None:
        """Beat at the start of every period (``start`` beat the first one)."""
        while not self._stop.wait(self._until_next_period()):
            try:
                self.beat()
            except Exception:  # a store outage must not kill the replica; peers see it as dead
                log.exception("heartbeat of %s failed; next try next period", self.me.name)

    def _until_next_period(self) -> float:
        now = self.clock()
        return max(0.0, (self.policy.current(now) + 1) * self.policy.period - now)

    def start(self) -> Heartbeat:
        self.beat()  # live before anyone polls for us
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
