"""The records of one round: a contributor's manifest, the round's SEAL, and a shard's failure."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from diloco_anywhere.bucket.codecs.codec import Codec
from diloco_anywhere.bucket.format.framing import Count, Name
from diloco_anywhere.bucket.format.layout import parse_contributor
from diloco_anywhere.bucket.format.record import Record
from diloco_anywhere.bucket.format.wire import max_object_nbytes
from diloco_anywhere.collective.policy import ExchangeMode

# Weights are tokens or samples per sync: 2^64 is beyond any run, and a sum of any number of
# them stays far inside float64 (the mean scales each contribution by its share, mean.py).
MAX_WEIGHT = 2.0**64


def check_weight(weight: float) -> float:
    """``weight`` if it is a number in (0, 2^64]; ``ValueError`` saying so otherwise."""
    if not (isinstance(weight, float | int) and math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ValueError(f"weight {weight!r} is not allowed: a number > 0 and at most 2^64")
    return float(weight)


MAX_PACE_SECONDS = 7 * 86400.0  # a round's training longer than a week is no pace


@dataclass(frozen=True)
class Pace:
    """How a contribution was trained: its inner steps and the seconds they took, the sync's
    waiting left out (0, 0: not measured). Replicas pacing rounds by time plan their next
    ones from the paces a round was sealed with (``training/pacing/pace.py``)."""

    steps: int = 0
    seconds: float = 0.0

    @property
    def step_seconds(self) -> float | None:
        return self.seconds / self.steps if self.steps and self.seconds > 0 else None


NO_PACE = Pace()


class PartEntry(Record):
    """One part of a contribution: its key, exact size and checksum, and its element range."""

    key: str
    size: Count
    crc32c: Annotated[int, Field(ge=0, le=2**32 - 1)]
    start: Count
    stop: Count


class Manifest(Record):
    """Written last by a contributor: the round may count it once this exists."""

    run: Name
    round: Count
    fragment: Count
    replica: Name
    incarnation: Count
    weight: float
    fingerprint: str = Field(max_length=128)
    codec: Codec
    numel: Count
    parts: tuple[PartEntry, ...]
    steps: Count = 0  # the contribution's inner steps (``Pace``)
    seconds: Annotated[float, Field(ge=0, le=MAX_PACE_SECONDS)] = 0.0  # their training time

    @property
    def pace(self) -> Pace:
        return Pace(self.steps, self.seconds)

    @field_validator("weight")
    @classmethod
    def _weight_in_range(cls, weight: float) -> float:
        return check_weight(weight)

    @model_validator(mode="after")
    def _parts_tile_the_tensor(self) -> Manifest:
        edges = (
            [0] + [edge for part in self.parts for edge in (part.start, part.stop)] + [self.numel]
        )
        backwards = any(part.start > part.stop for part in self.parts)
        if (
            backwards
            or not self.parts
            or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2))
        ):
            raise ValueError(f"parts must cover elements [0, {self.numel}) in order, without gaps")
        for part in self.parts:
            most = max_object_nbytes(self.codec, part.stop - part.start)
            if part.size > most:
                raise ValueError(
                    f"part {part.key} claims {part.size} bytes; its {part.stop - part.start} "
                    f"values in {self.codec.name} take at most {most}"
                )
        return self


class Seal(Record):
    """The contributor set of a round and how it is exchanged, decided once by the first writer.

    The mode is part of the SEAL so that every replica exchanges the same way, whatever its own
    configuration or its view of the membership said before the SEAL existed.
    """

    run: Name
    round: Count
    fragment: Count
    contributors: tuple[str, ...]
    mode: ExchangeMode
    sealed_by: str
    # The newest incarnation of each contributor's replica id that the sealer saw claimed when
    # it sealed (``membership.py``, fencing). Empty in SEALs written before fencing.
    claims: dict[Name, Count] = Field(default_factory=dict)

    @field_validator("sealed_by")
    @classmethod
    def _a_contributor_name(cls, name: str) -> str:
        """'<replica>-<incarnation>', as this code writes it: a name read from a bucket is
        checked however it is used."""
        parse_contributor(name)
        return name

    @field_validator("contributors")
    @classmethod
    def _sorted_contributor_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        """Non-empty, strictly sorted (so no one counts twice), each '<replica>-<incarnation>',
        one incarnation per replica (two of one replica would count it twice)."""
        replicas = [parse_contributor(name)[0] for name in names]
        if not names or list(names) != sorted(set(names)):
            raise ValueError("contributors must be a non-empty, sorted list without repeats")
        twice = sorted({replica for replica in replicas if replicas.count(replica) > 1})
        if twice:
            raise ValueError(f"contributors name two incarnations of replica {twice[0]!r}")
        return names

    @model_validator(mode="after")
    def _no_contributor_older_than_its_claims(self) -> Seal:
        """A zombie (an incarnation older than one the sealer saw claimed) never counts."""
        for name in self.contributors:
            replica, incarnation = parse_contributor(name)
            newest = self.claims.get(replica, incarnation)
            if newest > incarnation:
                raise ValueError(
                    f"contributor {name} is older than incarnation {replica}-{newest}, which "
                    f"its sealer saw claimed: only a replica's newest incarnation is a member"
                )
        return self


class ShardFailure(Record):
    """Written instead of a reduced shard when a sealed part of it cannot be read intact.

    It takes the reduced shard's key (create-only, first writer wins), so every replica sees the
    same outcome for that shard and the round fails on all of them alike; nothing is averaged
    without it. Its bytes name no writer: an owner and a stand-in write identical records.
    """

    run: Name
    round: Count
    fragment: Count
    shard: Count
    key: str
    problem: str = Field(max_length=4096)


def same_layout(a: Manifest, b: Manifest) -> bool:
    """Whether two contributions cut the same values into the same parts with one codec."""
    spans = [[(p.start, p.stop) for p in m.parts] for m in (a, b)]
    return a.numel == b.numel and a.codec == b.codec and spans[0] == spans[1]
