"""Who is in the run: incarnation claims and leases, kept as create-only objects
(docs/collective.md, "Membership").

Replicas on different platforms share no clock and no server, so membership rests on two rules
that need neither:

- **Fencing.** A replica process starts by claiming the next incarnation number of its replica
  id with a create-only ``claim`` (two processes cannot hold one number). Only the newest
  claimed incarnation of an id is a member: a sealer lists the claims right before it seals
  and never seals a contribution older than a claim it saw, and records what it saw in the
  SEAL, so readers refuse a SEAL that breaks the rule (``records.Seal``). A process that finds
  a newer claim of its own id, or its own claim gone or taken by another process (the run was
  started over), is superseded: it contributes nothing more and ends itself
  (``SupersededError``, within one lease period through its heartbeat).
- **Liveness on the reader's clock.** A member writes a lease every ``period`` seconds of its
  own monotonic clock, each a new key ``lease-{beat}`` with a counter (keys are never
  overwritten, and GCS allows one update per second per object name). A reader judges a member
  live while the counter it sees keeps changing within its own monotonic window
  (``Liveness``); no timestamp one machine wrote is ever compared with another machine's clock.
  Wall-clock times in claims and leases are for people, as is each replica's measured skew
  against the store's clock (``Heartbeat``), which ``diloco status`` shows.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated

from pydantic import Field

from diloco_anywhere.bucket.format.framing import Count, Name, WireFormatError
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.departures import (
    Departure,
    hopeless,
    newest_departures,
    record_departure,
)
from diloco_anywhere.collective.policy import LeasePolicy

log = logging.getLogger(__name__)
Clock = Callable[[], float]
SKEW_SHOWN = 3.0  # seconds; the store's times are whole seconds on S3 and Azure, so less is noise


class Claim(Record):
    replica: Name
    incarnation: Count
    nonce: str  # makes two racing claimants' bytes differ, so exactly one put succeeds
    started_at: float  # the claimant's wall clock: for people, never compared

    @property
    def participant(self) -> Participant:
        return Participant(self.replica, self.incarnation)


class Lease(Record):
    replica: Name
    incarnation: Count
    beat: Count  # counts this incarnation's leases: a reader sees it change while it lives
    every: float = Field(default=LeasePolicy.period, gt=0, le=86400)  # seconds between leases
    written_at: float = 0.0  # the writer's wall clock: for people, never compared
    skew: float | None = None  # seconds the writer's clock is ahead of the store's, last measured
    # fragment -> the newest round this incarnation has finished (for garbage collection);
    # JSON keys are strings, so the fragment is checked as digits here, in the reader
    finished: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Count] = Field(
        default_factory=dict
    )


class SupersededError(RuntimeError):
    """A newer incarnation of this replica id claimed it (a platform restarted it while this
    process still ran), or the run was started over: this process must stop contributing."""


@dataclass(frozen=True)
class MembershipView:
    """One listing of ``members/``: every claimed incarnation and each one's newest lease."""

    claims: dict[str, tuple[int, ...]]  # replica -> claimed incarnations, ascending
    beats: dict[Participant, int]  # incarnation -> its newest lease's beat

    @classmethod
    def read(cls, store: Store, layout: RunLayout) -> MembershipView:
        claims: dict[str, set[int]] = {}
        beats: dict[Participant, int] = {}
        for key in store.list_prefix(layout.members()):
            parsed = layout.parse_member_key(key)
            if parsed is None:
                continue
            replica, incarnation, beat = parsed
            if beat is None:
                claims.setdefault(replica, set()).add(incarnation)
            else:
                member = Participant(replica, incarnation)
                beats[member] = max(beats.get(member, -1), beat)
        return cls({r: tuple(sorted(i)) for r, i in claims.items()}, beats)

    def newest(self) -> dict[str, int]:
        """The newest claimed incarnation of every replica id: the only one that is a member."""
        return {replica: incarnations[-1] for replica, incarnations in self.claims.items()}

    def members(self) -> list[Participant]:
        """The newest incarnation of every replica that has written a lease, by name."""
        return sorted(
            (Participant(replica, incarnation) for replica, incarnation in self.newest().items()
             if Participant(replica, incarnation) in self.beats),
            key=lambda member: member.name,
        )  # fmt: skip

    def superseded(self, claim: Claim) -> str | None:
        """Why ``claim``'s process is no longer its replica's member (None while it is)."""
        newest = self.newest().get(claim.replica)
        if newest is None or claim.incarnation not in self.claims[claim.replica]:
            return f"its claim {claim.participant.name} is gone (the run was deleted or restarted)"
        if newest > claim.incarnation:
            return newer_claim(claim.replica, newest)
        return None


def departed(store: Store, layout: RunLayout) -> dict[str, Departure]:
    """How the replicas that left the run left (``departures.newest_departures``), as the
    membership stands now."""
    return newest_departures(store, layout, MembershipView.read(store, layout).newest())


def run_hopeless(store: Store, layout: RunLayout, replicas: int, least: int) -> str | None:
    """Why no round of the run can seal again (``departures.hopeless``), None while one can:
    what a replica that waits before its first round (for the others' votes) checks, as a
    round waiting for its SEAL does."""
    return hopeless(departed(store, layout), replicas, least)


def depart_for(
    store: Store, layout: RunLayout, replica: str, reason: str, final: bool = True
) -> None:
    """Say for ``replica`` that it left (``departures.py``; for good unless not ``final``),
    where it could not: the keeper gave up on it, or the launch following it found the run
    cannot go on. Its newest claimed incarnation, or none where it never joined; a later
    incarnation (``diloco replace``) is not concerned."""
    newest = MembershipView.read(store, layout).newest().get(replica)
    record_departure(store, layout, replica, newest, reason, final=final)


def newer_claim(replica: str, newest: int) -> str:
    """Why an older incarnation of ``replica`` is superseded, said alike wherever it is seen."""
    return f"incarnation {replica}-{newest} claimed replica {replica} since"


@dataclass
class _Sighting:
    beat: int
    since: float  # the reader's monotonic time when it first saw this beat
    changes: int = 0  # how often this reader saw the beat change


@dataclass
class Liveness:
    """Which members are live, judged on this reader's own monotonic clock only.

    A member is live while the beat of its newest lease has changed within the last
    ``policy.expiry`` seconds of this reader's clock, counted from when this reader first saw
    that beat. A member seen for the first time counts as live until then: a reader that has
    just started cannot tell a fresh lease from one left by a process that died (at most one
    expiry of waiting for a dead member; a round seals without it after its grace anyway).
    """

    policy: LeasePolicy
    clock: Clock = time.monotonic
    _seen: dict[Participant, _Sighting] = field(default_factory=dict)

    def observe(self, view: MembershipView) -> None:
        now = self.clock()
        for member, beat in view.beats.items():
            seen = self._seen.get(member)
            if seen is None:
                self._seen[member] = _Sighting(beat, now)
            elif seen.beat != beat:
                self._seen[member] = _Sighting(beat, now, seen.changes + 1)

    def live(self, view: MembershipView) -> list[Participant]:
        """Observe ``view``, then the members in it that are live."""
        self.observe(view)
        now = self.clock()
        return [m for m in view.members() if now - self._seen[m].since < self.policy.expiry]

    def advanced(self, member: Participant) -> bool:
        """Whether this reader has seen ``member``'s beat change: a process writes its leases."""
        seen = self._seen.get(member)
        return seen is not None and seen.changes > 0


def watch_live(
    store: Store,
    layout: RunLayout,
    policy: LeasePolicy,
    clock: Clock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Participant]:
    """The run's members whose leases advance, watched from this process alone (a launcher,
    which has no earlier observation): returns as soon as every member's lease has advanced,
    or once an expiry has passed, with those that did. The expiry is ``policy``'s, or longer
    where a member's lease says it beats less often. Members that left cleanly have no lease
    and cost no waiting; one that was killed costs the full expiry."""
    view = MembershipView.read(store, layout)
    waiting = set(view.members())
    periods = [lease.every for lease in newest_leases(store, layout, view, [*waiting]).values()
               if lease is not None]  # fmt: skip
    policy = replace(policy, period=max([policy.period, *periods]))
    liveness = Liveness(policy, clock)
    liveness.observe(view)
    deadline = clock() + policy.expiry
    while waiting and clock() < deadline:
        sleep(min(policy.period / 2, max(0.0, deadline - clock())))
        liveness.observe(MembershipView.read(store, layout))
        waiting = {m for m in waiting if not liveness.advanced(m)}
    return sorted(set(view.members()) - waiting, key=lambda member: member.name)


def claim_incarnation(
    store: Store, layout: RunLayout, replica: str, wall_clock: Clock = time.time
) -> Claim:
    """Claim the next unused incarnation number of ``replica``."""
    claimed = MembershipView.read(store, layout).claims.get(replica, ())
    incarnation = max(claimed, default=-1) + 1
    nonce = uuid.uuid4().hex
    while True:
        claim = Claim(
            replica=replica, incarnation=incarnation, nonce=nonce, started_at=wall_clock()
        )
        try:
            store.put(layout.claim(replica, incarnation), encode_record(claim))
            return claim
        except FileExistsError:
            incarnation += 1  # another process of this replica claimed it first


def read_lease(store: Store, layout: RunLayout, member: Participant, beat: int) -> Lease | None:
    """``member``'s lease ``beat``; None when it is gone (its writer deleted it meanwhile) or
    unreadable (logged): a lease is advice, never a reason to fail."""
    key = layout.lease(member.replica, member.incarnation, beat)
    try:
        return decode_record(store.get(key, 0, RECORD_READ_LIMIT), Lease, key=key)
    except FileNotFoundError:
        return None
    except WireFormatError as exc:
        log.warning("unreadable lease: %s", exc)
        return None


def newest_leases(
    store: Store, layout: RunLayout, view: MembershipView, members: list[Participant]
) -> dict[str, Lease | None]:
    """Each member's newest lease in ``view`` (None when it has none readable), read at once."""
    keys = {
        member.name: layout.lease(member.replica, member.incarnation, view.beats[member])
        for member in members
        if member in view.beats
    }
    objects = store.get_many(keys.values(), limit=RECORD_READ_LIMIT)
    leases: dict[str, Lease | None] = {member.name: None for member in members}
    for name, key in keys.items():
        try:
            leases[name] = decode_record(objects[key], Lease, key=key) if objects[key] else None
        except WireFormatError as exc:
            log.warning("unreadable lease: %s", exc)
    return leases


def member_progress(
    store: Store, layout: RunLayout, view: MembershipView, members: list[Participant]
) -> dict[str, dict[int, int]]:
    """Each member's newest finished round per fragment, from its newest lease (up to a period
    old, so it errs toward rounds still needed). A member without a readable lease reports
    nothing, which keeps every round."""
    leases = newest_leases(store, layout, view, members)
    return {
        name: {int(f): r for f, r in lease.finished.items()} if lease else {}
        for name, lease in leases.items()
    }


class Heartbeat:
    """Writes ``claim``'s lease every period on a background thread, until stopped; watches the
    membership as it goes (``on_view``) and measures this machine's clock against the store's.
    """

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        claim: Claim,
        policy: LeasePolicy,
        wall_clock: Clock = time.time,
        progress: Callable[[], dict[int, int]] = dict,
        on_view: Callable[[MembershipView], None] = lambda _: None,
    ) -> None:
        """``progress()``: the newest finished round per fragment, reported in each lease.
        ``on_view(view)``: called with the membership listed at each beat, before its lease
        is written (it raises ``SupersededError`` to end the heartbeat)."""
        self.store, self.layout, self.claim, self.policy = store, layout, claim, policy
        self.wall_clock, self.progress, self.on_view = wall_clock, progress, on_view
        self.me = claim.participant
        self.beats = 0  # leases written
        self.skew: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def beat(self) -> MembershipView:
        """List the membership (``on_view`` may end the heartbeat, raising
        ``SupersededError``), then write the next lease and delete ours two beats old."""
        view = MembershipView.read(self.store, self.layout)
        self.on_view(view)
        beat = self.beats
        lease = Lease(
            replica=self.me.replica, incarnation=self.me.incarnation, beat=beat,
            every=self.policy.period, written_at=self.wall_clock(), skew=self.skew,
            finished={str(fragment): round_ for fragment, round_ in self.progress().items()},
        )  # fmt: skip
        before = self.wall_clock()
        self.store.put(self._key(beat), encode_record(lease))
        if beat % self.policy.skew_every == 0:
            self._measure_skew(self._key(beat), before)
        self.beats += 1
        if beat >= 2:
            self.store.delete(self._key(beat - 2))
        return view

    def _measure_skew(self, key: str, before: float) -> None:
        """This machine's clock minus the time the store recorded for the lease just written
        (the midpoint of the put, to within its round trip and the store's whole seconds)."""
        after = self.wall_clock()
        try:
            self.skew = round((before + after) / 2 - self.store.modified(key), 3)
        except (OSError, ValueError) as exc:  # advice only: a store without times says nothing
            log.info("clock skew not measured: %s", exc)
            return
        if abs(self.skew) >= SKEW_SHOWN:
            log.warning(
                "this machine's clock is %+.1f s off the store's (%s); the run does not depend "
                "on it, but times in its metrics and logs are off by as much: enable NTP",
                self.skew, self.store.url,
            )  # fmt: skip

    def _key(self, beat: int) -> str:
        return self.layout.lease(self.me.replica, self.me.incarnation, beat)

    def _run(self) -> None:
        """Beat every period (``start`` beat the first one)."""
        while not self._stop.wait(self.policy.period):
            try:
                self.beat()
            except SupersededError:  # said by ``on_view``; our keys may be another's now
                return
            except Exception:  # a store outage must not kill the replica; peers see it as dead
                log.exception("heartbeat of %s failed; next try next period", self.me.name)

    def start(self) -> Heartbeat:
        self.beat()  # live before anyone polls for us
        self._thread.start()
        return self

    def stop(self, leave: bool = True) -> None:
        """Stop beating; with ``leave``, delete our leases too, so that nobody waits for us (a
        launcher checking the run is not live, peers counting members)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if leave:
            for beat in range(max(0, self.beats - 2), self.beats):
                try:
                    self.store.delete(self._key(beat))
                except OSError as exc:  # leaving anyway: the lease just stops advancing
                    log.warning("could not delete the lease of %s: %s", self.me.name, exc)


class Membership:
    """This process's place in the run: its claim, its heartbeat, and its view of the others,
    kept on this process's clocks. A background heartbeat lists the membership every period:
    when this process is superseded, ``on_superseded`` is called once, on that thread, and
    every later call here raises the ``SupersededError``."""

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        replica: str,
        policy: LeasePolicy,
        *,
        wall_clock: Clock = time.time,
        progress: Callable[[], dict[int, int]] = dict,
        on_superseded: Callable[[SupersededError], None] = lambda _: None,
    ) -> None:
        self.store, self.layout, self.policy = store, layout, policy
        self.claim = claim_incarnation(store, layout, replica, wall_clock)
        self.me = self.claim.participant
        self.on_superseded = on_superseded
        self.superseded: SupersededError | None = None
        self.last_view: MembershipView | None = None  # the newest ``view``'s listing
        self._liveness = Liveness(policy)
        self._lock = threading.Lock()
        self.heartbeat = Heartbeat(
            store, layout, self.claim, policy, wall_clock, progress, self._on_beat
        ).start()

    def check(self) -> None:
        """Raise ``SupersededError`` if this process has been superseded."""
        if self.superseded is not None:
            raise self.superseded

    def view(self) -> MembershipView:
        """The membership listed now; ``SupersededError`` if this process is superseded."""
        self.check()
        view = MembershipView.read(self.store, self.layout)
        self._judge(view.superseded(self.claim))
        self.last_view = view
        return view

    def members(self) -> list[Participant]:
        """The live members, this process among them (it knows it lives, whatever its lease)."""
        view = self.view()
        with self._lock:
            members = self._liveness.live(view)
        return sorted({*members, self.me}, key=lambda member: member.name)

    def _on_beat(self, view: MembershipView) -> None:
        """Each beat also reads our own claim back: a run started over (``--fresh``) may have
        given our number to a new process, whose claim then holds another nonce."""
        with self._lock:
            self._liveness.observe(view)
        self._judge(view.superseded(self.claim) or self._claim_taken())

    def _claim_taken(self) -> str | None:
        key = self.layout.claim(self.me.replica, self.me.incarnation)
        try:
            claim = decode_record(self.store.get(key, 0, RECORD_READ_LIMIT), Claim, key=key)
        except FileNotFoundError:
            return f"its claim {self.me.name} is gone (the run was deleted or restarted)"
        except WireFormatError as exc:
            return f"its claim is unreadable: {exc}"
        return None if claim.nonce == self.claim.nonce else f"another process claimed {key}"

    def _judge(self, reason: str | None) -> None:
        """Supersede this process for ``reason`` (nothing when None); tell ``on_superseded``
        the first time, and raise."""
        if reason is None:
            return
        with self._lock:
            first = self.superseded is None
            if first:
                self.superseded = SupersededError(
                    f"replica {self.me.replica} incarnation {self.me.incarnation} is superseded: "
                    f"{reason}; this process stops contributing and ends (only the newest "
                    f"claimed incarnation of a replica is a member)"
                )
        if first:
            log.error("%s", self.superseded)
            self.on_superseded(self.superseded)
        raise self.superseded  # type: ignore[misc]

    def progress(self, members: list[Participant]) -> dict[str, dict[int, int]]:
        """Each of ``members``' newest finished round per fragment (``member_progress``)."""
        return member_progress(self.store, self.layout, self.view(), members)

    def leave(self, reason: str = "", final: bool = False) -> None:
        """Stop the heartbeat; say why we left (``departures.py``: ``final``, no restart can
        help) and delete our leases, unless superseded (then they may be another process's: a
        run started over reuses incarnation numbers)."""
        if self.superseded is None and reason:
            me = self.me
            record_departure(self.store, self.layout, me.replica, me.incarnation, reason, final)
        self.heartbeat.stop(leave=self.superseded is None)
