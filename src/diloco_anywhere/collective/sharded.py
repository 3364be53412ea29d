"""``sharded`` exchange: a scatter-reduce through the bucket (docs/collective.md, "Reduce").

Shard ``s`` of the sealed layout is owned by ``contributors[s % n]`` (SEAL order). An owner
reads shard ``s`` of every other sealed contribution, reduces it in SEAL order, and puts
``reduced/{s}`` in the round's codec; every replica then reads the reduced shards it does not
hold (LambdaML's ScatterReduce, SIGMOD'21, section 4.2, with the bucket as the only medium).
Per replica: up ``P (1 + 1/n)``, down ``2 P (n - 1) / n``, whatever ``n``.

A reduced shard is deterministic (the same parts, order and codec) and names no writer, so an
owner and a stand-in write identical bytes and the idempotent put accepts both. Every replica
uses the decoded reduced shards, its own included, so all get the same bytes with a lossy codec
too. A shard still missing ``orphan_grace`` seconds after this replica saw the SEAL (its owner
died or stalls) is reduced by this replica itself.

A sealed part that cannot be read intact is never averaged: the reducer puts a
``ShardFailure`` at the shard's key instead, and every replica fails the round naming the part.
"""

from __future__ import annotations

import logging
import time

import torch

from diloco_anywhere import wire
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.records import Seal, ShardFailure
from diloco_anywhere.collective.round import (
    PartId,
    Round,
    SealedContributionError,
)
from diloco_anywhere.record import RECORD_MAGIC, decode_record, encode_record

log = logging.getLogger(__name__)
# The wire header's replica field of a reduced shard: the round's reduction, by whoever.
REDUCER = "_reduced"


def shard_owners(seal: Seal, shards: int) -> list[str]:
    return [seal.contributors[shard % len(seal.contributors)] for shard in range(shards)]


def sharded_mean(round_: Round, seal: Seal) -> torch.Tensor:
    return _ShardedExchange(round_, seal).run()


class _ShardedExchange:
    def __init__(self, round_: Round, seal: Seal) -> None:
        self.round, self.seal = round_, seal
        manifests = round_.sealed_manifests(seal)
        self.reference = manifests[0]
        self.weights = [manifest.weight for manifest in manifests]
        self.owners = shard_owners(seal, len(self.reference.parts))

    def _key(self, shard: int) -> str:
        return self.round.layout.reduced(self.round.round, self.round.fragment, shard)

    def _where(self, shard: int) -> str:
        return f"round {self.round.round} fragment {self.round.fragment} shard {shard}"

    # -- reducing ----------------------------------------------------------------------------

    def _reduced_object(
        self, shard: int, parts: dict[PartId, torch.Tensor | wire.WireFormatError]
    ) -> bytes | bytearray:
        """The reduced shard as a wire object, or a ``ShardFailure`` record if a part is bad."""
        tensors = [parts[name, shard] for name in self.seal.contributors]
        bad = next((t for t in tensors if isinstance(t, wire.WireFormatError)), None)
        if bad is not None:
            failure = ShardFailure(
                run=self.round.layout.run,
                round=self.round.round,
                fragment=self.round.fragment,
                shard=shard,
                key=bad.key,
                problem=bad.problem,
            )
            return encode_record(failure)
        mean = weighted_mean(list(zip(tensors, self.weights, strict=True)))  # type: ignore[arg-type]
        meta = wire.ObjectMeta(
            run=self.round.layout.run,
            round=self.round.round,
            replica=REDUCER,
            incarnation=0,
            shard=shard,
        )
        return wire.encode(mean, self.reference.codec, meta)

    def reduce(self, shards: list[int]) -> dict[int, torch.Tensor]:
        """Reduce ``shards`` from the sealed parts, put them, and return them decoded."""
        wanted = [(name, shard) for shard in shards for name in self.seal.contributors]
        parts = self.round.read_parts(wanted)
        objects = {shard: self._reduced_object(shard, parts) for shard in shards}
        try:
            self.round.store.put_many({self._key(s): data for s, data in objects.items()})
        except FileExistsError:  # a reducer stored other bytes first: its outcome stands
            stored = self.round.store.get_many(self._key(s) for s in shards)
            return {shard: self._decode(shard, stored[self._key(shard)]) for shard in shards}
        return {shard: self._decode_own(shard, data) for shard, data in objects.items()}

    def _decode_own(self, shard: int, data: bytes | bytearray) -> torch.Tensor:
        if data[: len(RECORD_MAGIC)] == RECORD_MAGIC:  # a ShardFailure: fail the round
            return self._decode(shard, data)
        part = self.reference.parts[shard]
        return wire.sent_values(data, self.reference.codec, part.stop - part.start)

    # -- collecting --------------------------------------------------------------------------

    def _decode(self, shard: int, data: bytes) -> torch.Tensor:
        """A reduced shard checked against the sealed layout; a ``ShardFailure`` or a bad
        object fails the round (a create-only key cannot be written again)."""
        key = self._key(shard)
        try:
            if data[: len(RECORD_MAGIC)] == RECORD_MAGIC:
                failure = decode_record(data, ShardFailure, key=key)
                raise SealedContributionError(
                    f"{self._where(shard)}: sealed part {failure.key} is unreadable: "
                    f"{failure.problem}"
                )
            decoded = wire.decode(data, key=key)
            header, part = decoded.header, self.reference.parts[shard]
            if (header.run, header.round, header.replica, header.shard) != (
                self.round.layout.run,
                self.round.round,
                REDUCER,
                shard,
            ) or decoded.tensor.numel() != part.stop - part.start:
                raise wire.WireFormatError(key, "reduced shard header does not match the SEAL")
        except wire.WireFormatError as exc:
            raise SealedContributionError(f"{self._where(shard)}: {exc}") from None
        return decoded.tensor.reshape(-1)

    def run(self) -> torch.Tensor:
        """Reduce our shards, then collect the others', standing in for late owners."""
        shards = range(len(self.owners))
        held = self.reduce([s for s in shards if self.owners[s] == self.round.me.name])
        policy, seal_seen = self.round.policy, time.monotonic()
        delays = policy.poll_delays()
        while missing := [s for s in shards if s not in held]:
            objects = self.round.store.get_many(map(self._key, missing))
            for shard in missing:
                if (data := objects[self._key(shard)]) is not None:
                    held[shard] = self._decode(shard, data)
                    delays = policy.poll_delays()
            missing = [s for s in missing if s not in held]
            waited = time.monotonic() - seal_seen
            if missing and waited >= policy.orphan_grace:
                log.warning(
                    "round %d fragment %d: reducing shards %s myself; owners %s are late",
                    self.round.round, self.round.fragment, missing,
                    sorted({self.owners[s] for s in missing}),
                )  # fmt: skip
                held.update(self.reduce(missing))
            elif missing:
                time.sleep(next(delays))
        return torch.cat([held[shard] for shard in shards])
