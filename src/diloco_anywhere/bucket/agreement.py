"""What a run's replicas must all start with (its initial model, its sharding, its data plan),
decided by their votes, not by whoever happened to start first.

Each replica writes its own record as a vote (``{key}-votes/{index:06d}-{replica}``, its
newest incarnation's overwriting an older one's), then waits, as a first round does, for:

- a strict majority of the run's ``replicas`` holding one record: no later vote can change it;
- else every replica's vote: the record most hold, a tie going to the lowest shard index;
- else ``min_replicas`` votes, ``grace`` seconds, and a strict majority of the votes in
  holding one record (a lone replica of a run whose ``min_replicas`` is 1 trains alone);
- else the round's ``timeout``, whoever is in: the record most of them hold, a tie going to
  the lowest index.

A replica that comes before ``min_replicas`` others therefore waits for them, as its first
round would (no round can seal without them), instead of deciding alone: a replica of another
platform that starts minutes later still has its vote. Votes split evenly wait for more. The
waits count from the replica's first vote, once for all its records, and the replica's log
says what it waits for.

The first to decide writes the record at ``key`` (create-only); everyone else, and every later
replica, takes it from there. So three replicas of which one has a wider model stop the wider
one, whichever started first and however late the others start. Only when the wrong replicas
are a majority of those in at ``timeout``, or when ``min_replicas`` wrong ones came first, can
the run's record be the wrong one: the message of a replica unlike it names the replicas
holding the run's record, for that case.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)
INDEX_DIGITS = 6
SAY_EVERY = 30.0  # seconds between log lines of a replica waiting for votes


@dataclass(frozen=True)
class Electorate:
    """This replica and the run it votes in: as the first round would wait for them."""

    index: int  # this replica's shard index
    replica: str  # its id, named to the others
    replicas: int  # run.replicas
    least: int  # run.min_replicas
    grace: float  # [sync] grace
    timeout: float  # [sync] timeout
    poll: float = 0.5
    # raises when the run cannot go on (its replicas that stopped for good leave too few, as
    # a round waiting on them finds: ``collective/members/departures.py``), every ``check_every`` s
    check: Callable[[], None] = field(default=lambda: None, compare=False)
    check_every: float = 5.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    since: float = field(default_factory=time.monotonic, compare=False)  # its first vote's wait


@dataclass(frozen=True)
class Agreed(Generic[R]):
    """The run's record, and the replicas whose vote it is (empty where no vote is left to
    read: the bucket's lifecycle rule expired them)."""

    record: R
    holders: tuple[str, ...]

    def named(self) -> str:
        """For a message: who holds the run's record."""
        return f"held by {', '.join(self.holders)}" if self.holders else "decided before"


@dataclass(frozen=True)
class Vote:
    index: int
    replica: str
    data: bytes
    alike: Hashable  # what must match for two votes to be one (``agree``'s ``alike``)


def same_record(record: Record) -> Hashable:
    """Two records are one when they are equal in every field."""
    return record.model_dump_json()


def votes_prefix(key: str) -> str:
    """Where the votes on ``key`` are: a folder of their own beside it."""
    return f"{key}-votes"


def agree(
    store: Store,
    key: str,
    mine: R,
    electorate: Electorate,
    alike: Callable[[R], Hashable] = same_record,
) -> Agreed[R]:
    """The run's record at ``key``: ``mine`` is this replica's vote for it. ``alike`` says
    what of a record must match for two votes to count as one (by default, every field)."""
    model = type(mine)
    decided = _exists(store, key)
    vote = f"{votes_prefix(key)}/{electorate.index:0{INDEX_DIGITS}d}-{electorate.replica}"
    store.overwrite(vote, encode_record(mine))  # after the decision too: it names the holders
    if not decided:
        _decide(store, key, model, electorate, alike)
    record = decode_record(store.get(key, 0, RECORD_READ_LIMIT), model, key=key)
    votes = read_votes(store, key, model, alike)
    return Agreed(record, tuple(v.replica for v in votes if v.alike == alike(record)))


def _decide(
    store: Store, key: str, model: type[R], electorate: Electorate, alike: Callable[[R], Hashable]
) -> None:
    """Wait for the votes to decide, then record the decision unless someone did first
    (``electorate.check`` raising meanwhile when the run cannot go on)."""
    said = checked = electorate.clock()
    while True:
        votes = read_votes(store, key, model, alike)
        waited = electorate.clock() - electorate.since
        choice = decision(votes, electorate, waited)
        if choice is not None:
            # another replica may have decided first (the same, unless votes came in between)
            with contextlib.suppress(FileExistsError):
                store.put(key, choice)
            return
        if _exists(store, key):
            return
        if electorate.clock() - checked >= electorate.check_every:
            electorate.check()
            checked = electorate.clock()
        if electorate.clock() - said >= SAY_EVERY:
            log.info("%s: %s", key, waiting_for(votes, electorate, waited))
            said = electorate.clock()
        electorate.sleep(electorate.poll)


def waiting_for(votes: list[Vote], electorate: Electorate, waited: float) -> str:
    """What a replica waiting on the votes waits for, said in its log."""
    kinds = len({vote.alike for vote in votes})
    split = f", split {kinds} ways" if kinds > 1 else ""
    return (
        f"{len(votes)} of the run's {electorate.replicas} replicas voted{split} "
        f"(min_replicas = {electorate.least}); waiting for more, "
        f"{max(0.0, electorate.timeout - waited):.0f} s at most ([sync] timeout)"
    )


def decision(votes: list[Vote], electorate: Electorate, waited: float) -> bytes | None:
    """The record the votes decide, None while they may still change it."""
    if not votes:
        return None
    groups: dict[Hashable, list[Vote]] = {}
    for vote in votes:
        groups.setdefault(vote.alike, []).append(vote)
    most = max(groups.values(), key=lambda group: (len(group), -min(v.index for v in group)))
    majority = 2 * len(most) > electorate.replicas
    everyone = len(votes) >= electorate.replicas
    clear = 2 * len(most) > len(votes)  # those in are not split evenly
    enough = len(votes) >= electorate.least and waited >= electorate.grace and clear
    late = waited >= electorate.timeout
    if majority or everyone or enough or late:
        return min(most, key=lambda vote: vote.index).data
    return None


def read_votes(
    store: Store, key: str, model: type[R], alike: Callable[[R], Hashable] = same_record
) -> list[Vote]:
    """Every replica's newest vote, checked; one that does not decode is left out, said."""
    votes: dict[int, Vote] = {}
    for name in sorted(store.list_prefix(votes_prefix(key))):
        index, _, replica = name.rsplit("/", 1)[-1].partition("-")
        if not (index.isdigit() and replica):
            continue
        data = store.get(name, 0, RECORD_READ_LIMIT)
        try:
            record = decode_record(data, model, key=name)
        except WireFormatError as error:
            log.warning("a vote left out: %s", error)
            continue
        votes[int(index)] = Vote(int(index), replica, data, alike(record))
    return list(votes.values())


def _exists(store: Store, key: str) -> bool:
    try:
        store.get(key, 0, 1)
    except FileNotFoundError:
        return False
    return True
