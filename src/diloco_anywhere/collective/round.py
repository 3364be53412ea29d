"""One round of the bucket all-reduce, up to its SEAL (docs/collective.md, "One round").

Every replica puts its contribution (block-aligned parts, then a manifest), then polls the SEAL
and the manifests of the members it has not seen yet with one ``get_many``. It checks each
manifest as it appears; when it expects a ``gather`` exchange it also downloads and checks the
contribution at once, so waiting and downloading overlap. It seals once every member's
contribution is in, or once ``min_replicas`` are in and the grace window has passed. The SEAL
fixes the contributor set and the exchange mode; ``gather.py`` and ``sharded.py`` then reduce
exactly the sealed set, so every replica gets the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from diloco_anywhere import wire
from diloco_anywhere.codec import Codec, Int8Codec
from diloco_anywhere.collective.records import ExchangeMode, Manifest, PartEntry, Seal
from diloco_anywhere.layout import Participant, RunLayout, parse_contributor
from diloco_anywhere.record import decode_record, encode_record
from diloco_anywhere.store import Store

log = logging.getLogger(__name__)
PartId = tuple[str, int]  # (contributor, shard)


@dataclass(frozen=True)
class RoundPolicy:
    """When to seal, how to exchange, when to give up, and how contributions are split."""

    min_replicas: int = 1
    grace: float = 10.0  # seconds after the first contribution is seen
    timeout: float = 600.0
    # "auto" picks per round from the sealed count and the payload size (``exchange_mode``).
    mode: Literal["auto", "gather", "sharded"] = "auto"
    # The run's replica count: contributions split into a multiple of this many parts, so that
    # in sharded mode every owner reduces an equal share.
    expected_replicas: int = 1
    # auto: shard once that saves at least this many download bytes per replica (see below).
    sharded_min_saving: int = 64 << 20
    # sharded: a shard whose reduction is still missing this long after the SEAL was seen is
    # reduced by whoever notices (its owner died or stalls).
    orphan_grace: float = 30.0
    part_elements: int = 4 << 20  # at most 16 MiB of float32 per part: parallel, retry-sized
    poll_min: float = 0.05
    poll_max: float = 0.2

    def poll_delays(self) -> Iterator[float]:
        """Seconds between polls: jittered exponential backoff. The upper bound doubles from
        ``poll_min`` to ``poll_max``; each delay is uniform between ``poll_min`` and it, so
        replicas polling the same keys spread out. Restart it when a poll finds something."""
        upper = self.poll_min
        while True:
            yield random.uniform(self.poll_min, upper)
            upper = min(self.poll_max, 2 * upper)

    def exchange_mode(self, contributors: int, payload_bytes: int) -> ExchangeMode:
        """``gather`` downloads ``(n - 1) P`` per replica, ``sharded`` ``2 P (n - 1) / n`` but
        adds a put and a get in sequence (the reduced shards). Shard when the bytes saved,
        ``P (n - 1)(n - 2) / n``, are worth two more store round trips: at ~50 ms each and
        ~1 GB/s per replica, that is ~100 MB; the default threshold is 64 MiB."""
        if self.mode != "auto":
            return self.mode
        n = contributors
        saving = payload_bytes * (n - 1) * (n - 2) / n if n else 0
        return "sharded" if saving >= self.sharded_min_saving else "gather"


class RoundTimeoutError(TimeoutError):
    """No SEAL within the policy's timeout; the message names what is missing and the fix."""


class SealedContributionError(RuntimeError):
    """A sealed contribution cannot be read back intact; the message names the key."""


class RoundDataMissingError(SealedContributionError):
    """A sealed contribution's manifest or part is gone: garbage collection took the round."""


class MissingPartError(wire.WireFormatError):
    """A part a manifest names does not exist (any more)."""


class DivergedError(SealedContributionError):
    """This replica's global state differs from the sealed contributors': it must heal."""


def part_ranges(numel: int, codec: Codec, part_elements: int, multiple: int = 1) -> list[range]:
    """Element ranges of a contribution's parts: a multiple of ``multiple`` parts of at most
    ``part_elements`` each (fewer when there are fewer codec blocks than that), whole codec
    blocks each, sizes within one block of each other. Every replica computes the same ranges
    from the same numel, codec and policy, which sharded mode relies on."""
    align = codec.block if isinstance(codec, Int8Codec) else 1
    blocks = math.ceil(numel / align)
    wanted = math.ceil(math.ceil(numel / max(part_elements, 1)) / multiple) * multiple
    parts = max(1, min(wanted, blocks))
    edges = [min(numel, (i * blocks // parts) * align) for i in range(parts + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(parts)]


def _same_layout(a: Manifest, b: Manifest) -> bool:
    spans = [[(p.start, p.stop) for p in m.parts] for m in (a, b)]
    return a.numel == b.numel and a.codec == b.codec and spans[0] == spans[1]


class Round:
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
        refresh_members: Callable[[], list[Participant]] | None = None,
        refresh_every: float = 10.0,
    ) -> None:
        """``refresh_members`` (called every ``refresh_every`` seconds while the round waits
        for its SEAL) lets a replica that starts mid-round count in it."""
        self.store, self.layout, self.policy = store, layout, policy
        self.round, self.fragment, self.me = round_, fragment, me
        self.members = {member.name: member for member in members}
        self._refresh_members, self._refresh_every = refresh_members, refresh_every
        self.seal_key = layout.seal(round_, fragment)
        self.manifests: dict[str, Manifest] = {}  # checked manifests
        self._foreign: dict[str, str] = {}  # contributor -> a fingerprint unlike ours
        self.excluded: dict[str, str] = {}  # contributor -> why
        self._parts: dict[str, list[torch.Tensor]] = {}  # decoded, checked contributions

    # -- contributing ------------------------------------------------------------------------

    def contribute(
        self, flat: torch.Tensor, weight: float, codec: Codec, fingerprint: str = ""
    ) -> Manifest:
        """Put the parts concurrently, then the manifest; keep our own decoded copy."""
        ranges = part_ranges(
            flat.numel(), codec, self.policy.part_elements, self.policy.expected_replicas
        )
        me = self.me
        keys = [
            self.layout.part(self.round, self.fragment, me.replica, me.incarnation, shard)
            for shard in range(len(ranges))
        ]
        encoded = [
            wire.encode(flat[elements.start : elements.stop], codec, self._meta(shard))
            for shard, elements in enumerate(ranges)
        ]
        self.store.put_many(dict(zip(keys, encoded, strict=True)))
        manifest = Manifest(
            run=self.layout.run,
            round=self.round,
            fragment=self.fragment,
            replica=me.replica,
            incarnation=me.incarnation,
            weight=float(weight),
            fingerprint=fingerprint,
            codec=codec,
            numel=flat.numel(),
            parts=tuple(
                PartEntry(
                    key=key,
                    size=len(data),
                    crc32c=wire.stored_checksum(data),
                    start=elements.start,
                    stop=elements.stop,
                )
                for key, data, elements in zip(keys, encoded, ranges, strict=True)
            ),
        )
        key = self.layout.manifest(self.round, self.fragment, me.replica, me.incarnation)
        self.store.put(key, encode_record(manifest))
        self.manifests[me.name] = manifest
        self._parts[me.name] = [
            wire.sent_values(data, codec, len(elements))
            for data, elements in zip(encoded, ranges, strict=True)
        ]
        return manifest

    def _meta(self, shard: int) -> wire.ObjectMeta:
        return wire.ObjectMeta(
            run=self.layout.run,
            round=self.round,
            replica=self.me.replica,
            incarnation=self.me.incarnation,
            shard=shard,
        )

    # -- reading contributions ---------------------------------------------------------------

    def manifest_key(self, name: str) -> str:
        replica, incarnation = parse_contributor(name)
        return self.layout.manifest(self.round, self.fragment, replica, incarnation)

    def _check_manifest(self, name: str, data: bytes, reference: Manifest | None) -> Manifest:
        """A manifest of this round by ``name``, laid out as ``reference`` (when given);
        else ``WireFormatError`` naming its key."""
        key = self.manifest_key(name)
        manifest = decode_record(data, Manifest, key=key)
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
        replica, incarnation = parse_contributor(name)
        part_keys = [p.key for p in manifest.parts]
        if part_keys != [
            self.layout.part(self.round, self.fragment, replica, incarnation, shard)
            for shard in range(len(part_keys))
        ]:
            raise wire.WireFormatError(key, "manifest names parts outside its own folder")
        if reference is not None and manifest.fingerprint != reference.fingerprint:
            self._foreign[name] = manifest.fingerprint
            raise wire.WireFormatError(
                key,
                f"fingerprint {manifest.fingerprint!r} differs from this replica's "
                f"{reference.fingerprint!r}: their global weights differ",
            )
        if reference is not None and not _same_layout(manifest, reference):
            raise wire.WireFormatError(
                key,
                f"{manifest.numel} elements in {len(manifest.parts)} parts with codec "
                f"{manifest.codec!r}; this round has {reference.numel} in "
                f"{len(reference.parts)} with {reference.codec!r} (replicas must share the "
                f"model, codec and round policy)",
            )
        return manifest

    def _check_part(self, manifest: Manifest, shard: int, data: bytes | None) -> torch.Tensor:
        """The part present, of the manifest's size and checksum and header; else an error."""
        part = manifest.parts[shard]
        if data is None:
            raise MissingPartError(part.key, "part named in the manifest is missing")
        checksum = wire.stored_checksum(data)
        if len(data) != part.size or checksum != part.crc32c:
            raise wire.WireFormatError(
                part.key,
                f"{len(data)} bytes with checksum {checksum:#010x}; the manifest says "
                f"{part.size} bytes, {part.crc32c:#010x}",
            )
        decoded = wire.decode(data, key=part.key)
        header = decoded.header
        if (header.run, header.replica, header.incarnation, header.round, header.shard) != (
            manifest.run,
            manifest.replica,
            manifest.incarnation,
            manifest.round,
            shard,
        ) or decoded.tensor.numel() != part.stop - part.start:
            raise wire.WireFormatError(part.key, "part header does not match the manifest")
        return decoded.tensor.reshape(-1)

    def read_parts(
        self, wanted: Iterable[PartId]
    ) -> dict[PartId, torch.Tensor | wire.WireFormatError]:
        """Checked parts of checked manifests, each a tensor or the ``WireFormatError`` that
        names its key. Parts already held (our own, or prefetched) are not downloaded again;
        the rest come with one ``get_many``."""
        wanted = list(wanted)
        missing = [(n, s) for n, s in wanted if n not in self._parts]
        objects = self.store.get_many(self.manifests[n].parts[s].key for n, s in missing)
        found: dict[PartId, torch.Tensor | wire.WireFormatError] = {}
        for name, shard in wanted:
            if name in self._parts:
                found[name, shard] = self._parts[name][shard]
                continue
            manifest = self.manifests[name]
            try:
                data = objects[manifest.parts[shard].key]
                found[name, shard] = self._check_part(manifest, shard, data)
            except wire.WireFormatError as exc:
                found[name, shard] = exc
        return found

    def _exclude(self, name: str, problem: Exception) -> None:
        self.excluded[name] = str(problem)
        self.manifests.pop(name, None)
        log.warning(
            "round %d fragment %d: excluding %s: %s", self.round, self.fragment, name, problem
        )

    def _fetch_contribution(self, name: str) -> None:
        """Download and check every part of ``name``'s contribution, or exclude it."""
        manifest = self.manifests[name]
        parts = self.read_parts((name, shard) for shard in range(len(manifest.parts)))
        if bad := next((p for p in parts.values() if isinstance(p, wire.WireFormatError)), None):
            self._exclude(name, bad)
        else:
            self._parts[name] = list(parts.values())  # type: ignore[arg-type]

    def _take(self, name: str, data: bytes, prefetch: bool) -> None:
        try:
            self.manifests[name] = self._check_manifest(
                name, data, self.manifests.get(self.me.name)
            )
        except wire.WireFormatError as exc:
            self._exclude(name, exc)
            return
        if prefetch:
            self._fetch_contribution(name)

    # -- sealing -----------------------------------------------------------------------------

    def _payload_bytes(self) -> int:
        own = self.manifests.get(self.me.name)
        return sum(part.size for part in own.parts) if own else 0

    def _mode_for(self, contributors: int) -> ExchangeMode:
        return self.policy.exchange_mode(contributors, self._payload_bytes())

    def _sealable(self) -> list[str]:
        """Checked contributions of members: a non-member (a zombie, or a replica missing
        from the member list) never counts, not even its own contribution."""
        return sorted(self.manifests.keys() & self.members.keys())

    def _ready_to_seal(self, first_seen: float | None) -> bool:
        count = len(self._sealable())
        if count == len(self.members.keys() - self.excluded.keys()) and count:
            return count >= self.policy.min_replicas
        grace_over = first_seen is not None and time.monotonic() - first_seen >= self.policy.grace
        return count >= self.policy.min_replicas and grace_over

    def _verify_for_gather(self) -> bool:
        """A gather SEAL lists only contributions checked in full: fetch any not yet checked.
        True when all were intact (otherwise readiness must be judged again)."""
        unchecked = [name for name in self._sealable() if name not in self._parts]
        for name in unchecked:
            self._fetch_contribution(name)
        return all(name in self._parts for name in unchecked)

    def _in_minority(self) -> bool:
        """More members hold weights unlike ours than like ours: let one of them seal (a
        replica that missed a commit is the odd one out; the others go on without it)."""
        groups = Counter(self._foreign[name] for name in self._foreign if name in self.members)
        return bool(groups) and max(groups.values()) > len(self._sealable())

    def _try_seal(self) -> bool:
        """Put the SEAL; False when this replica declines to (it is in a minority)."""
        if self._in_minority():
            return False
        contributors = tuple(self._sealable())
        mode = self._mode_for(len(contributors))
        if mode == "gather" and not self._verify_for_gather():
            return True  # some were left out: judge readiness again at once
        seal = Seal(
            run=self.layout.run,
            round=self.round,
            fragment=self.fragment,
            contributors=contributors,
            mode=mode,
            sealed_by=self.me.name,
        )
        with contextlib.suppress(FileExistsError):  # sealed first by another; next poll reads it
            self.store.put(self.seal_key, encode_record(seal))
        return True

    def wait_for_seal(self) -> Seal:
        """Poll until the round's SEAL exists (writing it when ready); every sealed
        contributor's manifest is checked before this returns."""
        deadline = time.monotonic() + self.policy.timeout
        first_seen = time.monotonic() if self.manifests else None
        prefetch = self._mode_for(len(self.members)) == "gather"
        delays = self.policy.poll_delays()
        refreshed = time.monotonic()
        while True:
            if self._refresh_members and time.monotonic() - refreshed >= self._refresh_every:
                self.members = {member.name: member for member in self._refresh_members()}
                refreshed = time.monotonic()
            seen = self.manifests.keys() | self.excluded.keys()
            pending = [name for name in self.members if name not in seen]
            objects = self.store.get_many([self.seal_key, *map(self.manifest_key, pending)])
            if objects[self.seal_key] is not None:
                return self._load_seal(objects[self.seal_key])
            for name in pending:
                if (data := objects[self.manifest_key(name)]) is not None:
                    self._take(name, data, prefetch)
                    first_seen = first_seen or time.monotonic()
                    delays = self.policy.poll_delays()
            if self._ready_to_seal(first_seen) and self._try_seal():
                continue
            if time.monotonic() > deadline:
                missing = sorted(self.members.keys() - self.manifests.keys())
                raise RoundTimeoutError(
                    f"round {self.round} fragment {self.fragment}: no SEAL after "
                    f"{self.policy.timeout:g}s; have {sorted(self.manifests)}, missing "
                    f"{missing} (min_replicas={self.policy.min_replicas}) in store "
                    f"{self.store.url}; start the missing replicas (see `diloco status`), "
                    f"lower run.min_replicas, or raise sync.timeout"
                )
            time.sleep(next(delays))

    def read_seal(self) -> Seal | None:
        """The round's SEAL if it exists (``_load_seal``), without contributing or sealing."""
        try:
            data = self.store.get(self.seal_key)
        except FileNotFoundError:
            return None
        return self._load_seal(data)

    def _load_seal(self, data: bytes) -> Seal:
        """The SEAL, with every sealed contributor's manifest at hand and checked. The sealer's
        judgement stands: a contribution we excluded (say, laid out unlike our own) is read
        again, and ``sealed_manifests`` checks that the sealed set agrees with itself."""
        seal = decode_record(data, Seal, key=self.seal_key)
        if (seal.run, seal.round, seal.fragment) != (self.layout.run, self.round, self.fragment):
            raise SealedContributionError(
                f"{self.seal_key}: the SEAL is for run {seal.run} round {seal.round} "
                f"fragment {seal.fragment}"
            )
        for name in seal.contributors:
            if name in self.manifests:
                continue
            try:
                data = self.store.get(self.manifest_key(name))
                self.manifests[name] = self._check_manifest(name, data, reference=None)
            except (wire.WireFormatError, FileNotFoundError) as exc:
                raise self.unreadable(name, exc) from None
        return seal

    def unreadable(self, name: str, problem: Exception) -> SealedContributionError:
        """The error for a sealed contribution that cannot be read back intact, or that is gone
        (``RoundDataMissingError``: garbage collection took the round)."""
        gone = isinstance(problem, (FileNotFoundError, MissingPartError))
        return (RoundDataMissingError if gone else SealedContributionError)(
            f"round {self.round} fragment {self.fragment}: sealed contribution {name} is "
            f"unreadable: {problem}"
        )

    def sealed_manifests(self, seal: Seal) -> list[Manifest]:
        """The sealed contributors' manifests in SEAL order, all of the same layout."""
        manifests = [self.manifests[name] for name in seal.contributors]
        for name, manifest in zip(seal.contributors, manifests, strict=True):
            if not _same_layout(manifest, manifests[0]):
                raise SealedContributionError(
                    f"round {self.round} fragment {self.fragment}: sealed contributions "
                    f"{seal.contributors[0]} and {name} are laid out differently; replicas "
                    f"must share the model, codec and round policy"
                )
        return manifests

    def check_own_contribution(self, seal: Seal) -> None:
        """The sealed result fits this replica only if it holds the same global weights and
        sent a tensor of the same layout; else fail loudly rather than apply it."""
        own = self.manifests.get(self.me.name)
        if own is None:
            return
        sealed = self.sealed_manifests(seal)[0]
        where = f"round {self.round} fragment {self.fragment}"
        if not _same_layout(own, sealed):
            raise SealedContributionError(
                f"{where}: this replica sent {own.numel} values in {len(own.parts)} parts; the "
                f"sealed contributions have {sealed.numel} in {len(sealed.parts)}; replicas "
                f"must share the model, codec and round policy"
            )
        if own.fingerprint != sealed.fingerprint:
            raise DivergedError(
                f"{where}: this replica's global state ({own.fingerprint}) differs from the "
                f"sealed contributors' ({sealed.fingerprint}): it missed or made a commit the "
                f"others did not, or computed differently; it heals from the bucket"
            )
