"""Which replica trains which part of the run's data: claims on units of the stream, in the bucket.

The data stream (``order.py``) is cut into units of ``unit_sequences`` consecutive positions:
``batches_per_unit x sequences per batch``, one process's steps of a round at the reference pace
(a part of them when rounds are paced by time, ``training/pacing/pace.py``). At the start of each
round a replica claims the units its processes train with create-only writes of
``data/claims/{unit}-{attempt}`` naming the round and itself (``Replica-incarnation``), taking
the lowest unit that is free: one nobody claimed yet, or one given back. No server decides:
two replicas racing for a unit both try the same key, and the store lets one create it.

A claim stands or falls with its round (the SEAL, ``collective/round.py``):

- the round is sealed with the claimer's contribution, by at least ``min_replicas``: the unit
  is trained, for good;
- the round is sealed without it (the replica died, was late, diverged, or was superseded):
  the unit is given back, and the next claim on it is its next attempt;
- the round is not sealed yet: the unit is taken.

An attempt is only ever written by a replica that saw every earlier attempt given back, and a
sealed round never changes, so a unit is trained by at most one sealed contribution, and none
is skipped: whatever the replicas do (restart, heal, leave, join late, change in number between
launches), every sequence of an epoch is trained once. Claims and SEALs never change once
written, so each replica reads each of them once (``Claims`` keeps what it read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from diloco_anywhere.bucket.agreement import Electorate, agree
from diloco_anywhere.bucket.format.framing import Count, WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout, parse_contributor
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import ConfigError

log = logging.getLogger(__name__)


class DataPlan(Record):
    """How the run's data stream is cut: the same for every replica of a run."""

    corpus: str = Field(min_length=1, max_length=4096)  # where it was read first (for errors)
    manifest_crc32c: int = Field(ge=0, lt=2**32)  # which corpus it is, wherever it is read
    seq_len: Count
    unit_sequences: Count
    epoch_sequences: Count = Field(ge=1)
    chunk_sequences: Count
    window_chunks: Count
    seed: int


class DataPlanError(ConfigError):
    """This replica would cut the run's data otherwise than the run does."""


class UnitClaim(Record):
    unit: Count
    attempt: Count
    contributor: str = Field(min_length=1, max_length=256)  # '<replica>-<incarnation>'
    round: Count
    rank: Count  # its place in the round's claim: process r of n trains places r, r + n, ...


def share(round_: int, replicas: int, index: int, count: int) -> range:
    """The ``count`` units replica ``index`` trains in ``round_`` of a run whose ``replicas``
    all train every round: one per process, ``(round x replicas + index) x count`` on."""
    first = (round_ * replicas + index) * count
    return range(first, first + count)


def agree_on_plan(store: Store, layout: RunLayout, plan: DataPlan, electorate: Electorate) -> None:
    """Vote for this replica's data plan as the run's (``bucket/agreement.py``), and refuse
    it if the run's is another, naming each field."""
    agreed = agree(store, layout.data_plan(), plan, electorate, alike=_cut)
    theirs = agreed.record
    fields = [name for name in DataPlan.model_fields if name != "corpus"]
    differ = [name for name in fields if getattr(theirs, name) != getattr(plan, name)]
    if differ:  # as _cut
        shown = ", ".join(f"{n} {getattr(theirs, n)} (here {getattr(plan, n)})" for n in differ)
        raise DataPlanError(
            f"the run's data stream was cut with {shown}, the corpus first read at "
            f"{theirs.corpus} ({agreed.named()}): a run's data never changes under it, or "
            f"sequences would be trained twice or never; go back to those settings, or start a "
            f"new run (another run.name)"
        )


def _cut(plan: DataPlan) -> str:
    """What must match between replicas: everything but where each reads the corpus from."""
    return plan.model_copy(update={"corpus": ""}).model_dump_json()


Outcome = Literal["trained", "given back", "taken"]
TRAINED, GIVEN_BACK, TAKEN = "trained", "given back", "taken"


@dataclass(frozen=True)
class ClaimState:
    """A unit as the claims and SEALs say."""

    unit: int
    attempts: int  # claims written on it
    trained: bool  # its last claim's round sealed with the claim's contribution
    taken: bool  # its last claim's round not sealed yet

    @property
    def free(self) -> bool:
        return not (self.trained or self.taken)


class Claims:
    """This replica incarnation's claims on the run's data stream."""

    def __init__(
        self, store: Store, layout: RunLayout, contributor: str, min_replicas: int,
        index: int = 0, replicas: int = 1, share_units: int | None = None,
    ) -> None:  # fmt: skip
        """``index`` of ``replicas``: the replica's own share of each round, tried first once
        nothing is behind (``_candidates``); ``share_units`` units each (by default, as many
        as a round's claim asks for: replicas paced by time ask for more or fewer)."""
        parse_contributor(contributor)
        self.store, self.layout, self.contributor = store, layout, contributor
        self.min_replicas, self.index, self.replicas = min_replicas, index, replicas
        self.share_units = share_units
        self._claims: dict[str, UnitClaim] = {}  # every claim read, by key
        # every sealed round read: the contributors it applied (none for a round sealed by
        # fewer than min_replicas, or whose SEAL no replica can read: no replica applied it)
        self._applied: dict[int, frozenset[str]] = {}
        self._mine: dict[int, list[int]] = {}  # round -> units this incarnation claimed

    def units(self, round_: int, count: int) -> list[int]:
        """``count`` units to train in round ``round_`` (as many per process of the replica):
        those this incarnation claimed for it already (a heal reopens a round's data), else
        new ones."""
        if round_ not in self._mine:
            self._mine[round_] = self._claim(round_, count)
        return self._mine[round_]

    def _claim(self, round_: int, count: int) -> list[int]:
        taken: list[int] = []
        for unit, attempt in self._candidates(round_, count):
            claim = UnitClaim(
                unit=unit, attempt=attempt, contributor=self.contributor, round=round_,
                rank=len(taken),
            )  # fmt: skip
            key = self.layout.data_claim(unit, attempt)
            try:
                self.store.put(key, encode_record(claim))
            except FileExistsError:  # another replica took it first: on to the next
                continue
            self._claims[key] = claim
            taken.append(unit)
            if len(taken) == count:
                return taken
        raise AssertionError("the candidates never end")  # pragma: no cover

    def _candidates(self, round_: int, count: int) -> Iterator[tuple[int, int]]:
        """(unit, attempt) to try: first the free units before the round's shares (given back,
        or skipped by an absent replica, from the store's first round on), lowest first; then
        this replica's own share of the round (``share``: ``round x replicas + index``, times
        the share's size),
        so that a run whose replicas all train every round trains the same units in the same
        replicas each time it is run; then every other free unit, lowest first, and the never
        claimed."""
        states = self.states()
        claimed = {state.unit: state for state in states}
        size = self.share_units or count
        first = round_ * self.replicas * size
        # the run's data in this store begins with the shares of its first round claimed: a
        # run resumed into a new store from a mirror's checkpoint goes on where the checkpoint
        # is, not from unit 0
        lowest = min((claim.round for claim in self._claims.values()), default=round_)
        floor = lowest * self.replicas * size
        frontier = states[-1].unit + 1 if states else first
        free = [
            (unit, claimed[unit].attempts if unit in claimed else 0)
            for unit in range(floor, max(frontier, first))
            if unit not in claimed or claimed[unit].free
        ]
        own = share(round_, self.replicas, self.index, size)
        yield from ((unit, attempt) for unit, attempt in free if unit < first)
        yield from ((unit, 0) for unit in own if unit >= frontier or unit not in claimed)
        yield from ((unit, attempt) for unit, attempt in free if unit >= first)
        unit = frontier
        while True:
            yield unit, 0
            unit += 1

    def states(self) -> list[ClaimState]:
        """Every claimed unit's state, by unit: from its newest claim alone (every earlier
        one was given back)."""
        newest: dict[int, tuple[int, str]] = {}
        for key, (unit, attempt) in self._listed():
            if attempt >= newest.get(unit, (-1, ""))[0]:
                newest[unit] = (attempt, key)
        claims = self._read([key for _, key in newest.values()])
        states = []
        for unit, (attempt, key) in sorted(newest.items()):
            outcome = self.outcome(claims[key])
            states.append(ClaimState(unit, attempt + 1, outcome == TRAINED, outcome == TAKEN))
        return states

    def every_claim(self) -> list[tuple[UnitClaim, Outcome]]:
        """Every claim written in the run, each with what came of it (``coverage.py``)."""
        claims = self._read([key for key, _ in self._listed()])
        return [(claim, self.outcome(claim)) for claim in claims.values()]

    def outcome(self, claim: UnitClaim) -> Outcome:
        """What the claim's round made of it: trained, given back, or taken (not sealed)."""
        applied = self._applied.get(claim.round)
        if applied is None:
            return TAKEN
        return TRAINED if claim.contributor in applied else GIVEN_BACK

    def _listed(self) -> list[tuple[str, tuple[int, int]]]:
        keys = self.store.list_prefix(self.layout.data_claims())
        parsed = ((key, self.layout.parse_data_claim(key)) for key in keys)
        return [(key, numbers) for key, numbers in parsed if numbers is not None]

    def _read(self, keys: list[str]) -> dict[str, UnitClaim]:
        """The claims at ``keys``, and the SEALs of their rounds, read once each."""
        self._read_claims(keys)
        self._read_seals({self._claims[key].round for key in keys})
        return {key: self._claims[key] for key in keys}

    def _read_claims(self, keys: list[str]) -> None:
        unread = [key for key in keys if key not in self._claims]
        for key, data in self.store.get_many(unread, limit=RECORD_READ_LIMIT).items():
            if data is None:
                raise FileNotFoundError(f"{self.store.url}/{key} was listed, then was gone")
            claim = decode_record(data, UnitClaim, key=key)
            if self.layout.data_claim(claim.unit, claim.attempt) != key:
                raise ValueError(f"{key} holds the claim of unit {claim.unit} {claim.attempt}")
            self._claims[key] = claim

    def _read_seals(self, rounds: set[int]) -> None:
        unread = {self.layout.seal(round_, 0): round_ for round_ in rounds - self._applied.keys()}
        for key, data in self.store.get_many(unread, limit=RECORD_READ_LIMIT).items():
            if data is not None:
                self._applied[unread[key]] = self._contributors_applied(key, data)

    def _contributors_applied(self, key: str, data: bytes) -> frozenset[str]:
        """Whose contributions the sealed round applied. A SEAL that cannot be read fails the
        round on every replica alike (``collective/round.py``): its units are given back."""
        try:
            seal = decode_record(data, Seal, key=key)
        except WireFormatError as exc:
            log.warning("%s: its units are given back (the round failed everywhere)", exc)
            return frozenset()
        if len(seal.contributors) < self.min_replicas:
            return frozenset()
        return frozenset(seal.contributors)
