"""One round of the bucket all-reduce in ``gather`` mode (docs/collective.md, "One round").

Every replica puts its contribution (block-aligned parts, then a manifest), then polls the SEAL
and the manifests of the members it has not seen yet with one ``get_many``. It downloads and
checks each contribution as soon as its manifest appears, so waiting and downloading overlap.
It seals once every member's contribution is in, or once ``min_replicas`` are in and the grace
window has passed. Only contributions it has verified go into a SEAL. Every replica reduces
exactly the sealed set, in SEAL order, so all results are the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from diloco_anywhere import wire
from diloco_anywhere.codec import Codec, Int8Codec
from diloco_anywhere.collective.records import Manifest, PartEntry, Seal
from diloco_anywhere.layout import Participant, RunLayout, parse_contributor
from diloco_anywhere.record import decode_record, encode_record
from diloco_anywhere.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundPolicy:
    """When to seal, when to give up, and how contributions are split and polled."""

    min_replicas: int = 1
    grace: float = 10.0  # seconds after the first contribution is seen
    timeout: float = 600.0
    part_elements: int = 4 << 20  # 16 MiB of float32 per part: parallel, retry-sized reads
    poll_min: float = 0.05
    poll_max: float = 0.2


@dataclass(frozen=True)
class RoundResult:
    mean: torch.Tensor
    seal: Seal
    excluded: dict[str, str] = field(default_factory=dict)  # contributor -> why


class RoundTimeoutError(TimeoutError):
    """No SEAL within the policy's timeout; the message names what was missing."""


class SealedContributionError(RuntimeError):
    """A sealed contribution cannot be read back intact; the message names the key."""


def part_ranges(numel: int, codec: Codec, part_elements: int) -> list[tuple[int, int]]:
    """Element ranges of the parts, aligned to the codec's block so no block straddles two."""
    align = codec.block if isinstance(codec, Int8Codec) else 1
    size = max(align, part_elements // align * align)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)] or [(0, 0)]


def weighted_mean(contributions: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """sum(w_i * g_i) / sum(w_i) in the given order, each step one IEEE float32 operation
    (a multiply, then an add; no fused multiply-add), so any machine gets the same bits."""
    total = sum(weight for _, weight in contributions)
    accumulator = torch.zeros_like(contributions[0][0])
    scaled = torch.empty_like(accumulator)
    for tensor, weight in contributions:
        torch.mul(tensor, weight, out=scaled)
        accumulator.add_(scaled)
    return accumulator.div_(total)


class GatherRound:
    """Round ``round_`` of fragment ``fragment`` among ``members``, as seen by ``me``."""

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        round_: int,
        fragment: int,
        me: Participant,
        members: list[Participant],
        policy: RoundPolicy,
    ) -> None:
        self.store, self.layout, self.policy = store, layout, policy
        self.round, self.fragment, self.me = round_, fragment, me
        self.members = {member.name: member for member in members}
        self.seal_key = layout.seal(round_, fragment)
        self._verified: dict[str, tuple[Manifest, torch.Tensor]] = {}
        self._excluded: dict[str, str] = {}

    # -- contributing ------------------------------------------------------------------------

    def contribute(
        self, flat: torch.Tensor, weight: float, codec: Codec, fingerprint: str = ""
    ) -> Manifest:
        """Put the parts, then the manifest; keep our own decoded copy (no download)."""
        entries, decoded = [], []
        for shard, (start, stop) in enumerate(
            part_ranges(flat.numel(), codec, self.policy.part_elements)
        ):
            meta = wire.ObjectMeta(
                run=self.layout.run,
                round=self.round,
                replica=self.me.replica,
                incarnation=self.me.incarnation,
                shard=shard,
            )
            encoded = wire.encode(flat[start:stop], codec, meta)
            key = self.layout.part(
                self.round, self.fragment, self.me.replica, self.me.incarnation, shard
            )
            self.store.put(key, encoded)
            entries.append(
                PartEntry(
                    key=key,
                    size=len(encoded),
                    crc32c=wire.stored_checksum(encoded),
                    start=start,
                    stop=stop,
                )
            )
            decoded.append(wire.decode(encoded, key=key).tensor)
        manifest = Manifest(
            run=self.layout.run,
            round=self.round,
            fragment=self.fragment,
            replica=self.me.replica,
            incarnation=self.me.incarnation,
            weight=float(weight),
            fingerprint=fingerprint,
            codec=codec,
            numel=flat.numel(),
            parts=tuple(entries),
        )
        key = self.layout.manifest(self.round, self.fragment, self.me.replica, self.me.incarnation)
        self.store.put(key, encode_record(manifest))
        self._verified[self.me.name] = (manifest, torch.cat(decoded))
        return manifest

    # -- reading contributions ---------------------------------------------------------------

    def _manifest_key(self, name: str) -> str:
        replica, incarnation = parse_contributor(name)
        return self.layout.manifest(self.round, self.fragment, replica, incarnation)

    def _check_manifest(self, name: str, manifest: Manifest, key: str) -> None:
        expected = (self.layout.run, self.round, self.fragment, *parse_contributor(name))
        found = (
            manifest.run,
            manifest.round,
            manifest.fragment,
            manifest.replica,
            manifest.incarnation,
        )
        if found != expected:
            raise wire.WireFormatError(key, f"manifest is for {found}, expected {expected}")

    def _fetch(self, name: str, manifest: Manifest) -> torch.Tensor:
        """Every part present, of the manifest's size and checksum and header; else an error."""
        keys = [part.key for part in manifest.parts]
        objects = self.store.get_many(keys)
        tensors = []
        for shard, part in enumerate(manifest.parts):
            data = objects[part.key]
            if data is None:
                raise wire.WireFormatError(part.key, "part named in the manifest is missing")
            checksum = wire.stored_checksum(data)
            if len(data) != part.size or checksum != part.crc32c:
                raise wire.WireFormatError(
                    part.key,
                    f"{len(data)} bytes with checksum {checksum:#010x}; the manifest says "
                    f"{part.size} bytes, {part.crc32c:#010x}",
                )
            decoded = wire.decode(data, key=part.key)
            header = decoded.header
            if (header.replica, header.incarnation, header.round, header.shard) != (
                manifest.replica,
                manifest.incarnation,
                manifest.round,
                shard,
            ) or decoded.tensor.numel() != part.stop - part.start:
                raise wire.WireFormatError(part.key, "part header does not match the manifest")
            tensors.append(decoded.tensor.reshape(-1))
        return torch.cat(tensors)

    def _take(self, name: str, data: bytes) -> None:
        key = self._manifest_key(name)
        try:
            manifest = decode_record(data, Manifest, key=key)
            self._check_manifest(name, manifest, key)
            own = self._verified[self.me.name][0] if self.me.name in self._verified else None
            if own is not None and manifest.numel != own.numel:
                raise wire.WireFormatError(key, f"{manifest.numel} elements; ours has {own.numel}")
            self._verified[name] = (manifest, self._fetch(name, manifest))
        except wire.WireFormatError as exc:
            self._excluded[name] = str(exc)
            log.warning(
                "round %d fragment %d: excluding %s: %s", self.round, self.fragment, name, exc
            )

    # -- sealing and reducing ----------------------------------------------------------------

    def _sealable(self) -> list[str]:
        """Verified contributions of members: a non-member (a zombie, or a replica missing
        from the member list) never counts, not even its own contribution."""
        return sorted(self._verified.keys() & self.members.keys())

    def _ready_to_seal(self, first_seen: float | None) -> bool:
        count = len(self._sealable())
        if count == len(self.members.keys() - self._excluded.keys()) and count:
            return count >= self.policy.min_replicas
        grace_over = first_seen is not None and time.monotonic() - first_seen >= self.policy.grace
        return count >= self.policy.min_replicas and grace_over

    def _try_seal(self) -> None:
        seal = Seal(
            run=self.layout.run,
            round=self.round,
            fragment=self.fragment,
            contributors=tuple(self._sealable()),
            sealed_by=self.me.name,
        )
        with contextlib.suppress(FileExistsError):  # sealed first by another; next poll reads it
            self.store.put(self.seal_key, encode_record(seal))

    def _wait_for_seal(self) -> Seal:
        deadline = time.monotonic() + self.policy.timeout
        first_seen = time.monotonic() if self._verified else None
        while True:
            pending = [
                n for n in self.members if n not in self._verified and n not in self._excluded
            ]
            objects = self.store.get_many([self.seal_key, *map(self._manifest_key, pending)])
            if objects[self.seal_key] is not None:
                return decode_record(objects[self.seal_key], Seal, key=self.seal_key)
            for name in pending:
                if (data := objects[self._manifest_key(name)]) is not None:
                    self._take(name, data)
                    first_seen = first_seen or time.monotonic()
            if self._ready_to_seal(first_seen):
                self._try_seal()
                continue
            if time.monotonic() > deadline:
                missing = sorted(self.members.keys() - self._verified.keys())
                raise RoundTimeoutError(
                    f"round {self.round} fragment {self.fragment}: no SEAL after "
                    f"{self.policy.timeout:g}s; have {sorted(self._verified)}, missing {missing} "
                    f"(min_replicas={self.policy.min_replicas}) in store {self.store.url}"
                )
            time.sleep(random.uniform(self.policy.poll_min, self.policy.poll_max))

    def result(self) -> RoundResult:
        """Wait for the SEAL, then the weighted mean of exactly the sealed contributions."""
        seal = self._wait_for_seal()
        contributions = []
        for name in seal.contributors:
            if name not in self._verified:  # sealed by someone who saw it before we did
                key = self._manifest_key(name)
                self._take(name, self.store.get(key))
                if name not in self._verified:
                    raise SealedContributionError(
                        f"round {self.round} fragment {self.fragment}: sealed contribution "
                        f"{name} is unreadable: {self._excluded[name]}"
                    )
            manifest, tensor = self._verified[name]
            contributions.append((tensor, manifest.weight))
        return RoundResult(weighted_mean(contributions), seal, dict(self._excluded))
