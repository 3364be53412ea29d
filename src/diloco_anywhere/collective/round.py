"""One round of the bucket all-reduce, up to its SEAL (docs/collective.md, "One round").

Every replica puts its contribution (block-aligned parts, then a manifest), then polls the SEAL
and the manifests of the members it has not seen yet with one ``get_many``. It checks each
manifest as it appears; when it expects a ``gather`` exchange it also downloads and checks the
contribution at once, so waiting and downloading overlap. It seals once every member's
contribution is in, or once ``min_replicas`` are in and the grace window has passed. The SEAL
fixes the contributor set and the exchange mode; ``exchanges/`` then reduces
exactly the sealed set, so every replica gets the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch

from diloco_anywhere.bucket.codecs.codec import Codec, reduced_codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.layout import Participant, RunLayout, parse_contributor
from diloco_anywhere.bucket.format.record import RECORD_READ_LIMIT, decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.errors import (
    DivergedError,
    RoundDataMissingError,
    RoundHopelessError,
    RoundTimeoutError,
    SealedContributionError,
)
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.kept_parts import KeptParts, PartId
from diloco_anywhere.collective.members.departures import Departure, hopeless
from diloco_anywhere.collective.members.membership import (
    MembershipView,
    SupersededError,
    newer_claim,
)
from diloco_anywhere.collective.parts import (
    MissingPartError,
    Part,
    PartIO,
    Transfers,
    default_transfers,
    part_ranges,
    release,
)
from diloco_anywhere.collective.phases import PhaseTimes
from diloco_anywhere.collective.policy import ExchangeMode, RoundPolicy
from diloco_anywhere.collective.records import NO_PACE, Manifest, Pace, PartEntry, Seal, same_layout
from diloco_anywhere.collective.transfers import windowed

log = logging.getLogger(__name__)


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
        transfers: Transfers | None = None,
        departures: Callable[[], dict[str, Departure]] | None = None,
    ) -> None:
        """``refresh_members`` (called every ``refresh_every`` seconds while the round waits
        for its SEAL) lets a replica that starts mid-round count in it; ``departures`` (called
        as often: how the replicas that left left) end the wait at once when those that left
        for good leave too few for any round (``RoundHopelessError``), and say who left in a
        timeout's message.
        ``transfers``: the collective's threads and buffers (by default, ones shared by this
        process's rounds)."""
        self.store, self.layout, self.policy = store, layout, policy
        self.round, self.fragment, self.me = round_, fragment, me
        self.claims: dict[str, int] = {}  # replica -> newest claimed incarnation, at sealing
        self._set_members(members)
        self._refresh_members, self._refresh_every = refresh_members, refresh_every
        self._departures = departures
        self.departed: dict[str, Departure] = {}  # as of the newest refresh
        self.seal_key = layout.seal(round_, fragment)
        self.manifests: dict[str, Manifest] = {}  # checked manifests
        self._foreign: dict[str, str] = {}  # contributor -> a fingerprint unlike ours
        self.excluded: dict[str, str] = {}  # contributor -> why
        self.times = PhaseTimes()  # where the round's time goes (``phases.py``)
        self.parts = PartIO(store, transfers or default_transfers(policy.window), self.times)
        self.source: FlatTensors | None = None  # our contribution: the caller's tensors
        self._verified: set[str] = set()  # contributions checked in full (gather)
        # parts kept for a gather exchange: others' checked ones, our own as uploaded
        self.kept = KeptParts(policy.gather_memory, me.name, not store.on_this_machine)

    # -- contributing ------------------------------------------------------------------------

    def contribute(
        self,
        source: FlatTensors | torch.Tensor,
        weight: float,
        codec: Codec,
        fingerprint: str = "",
        pace: Pace = NO_PACE,
    ) -> Manifest:
        """Encode and put the parts, ``window`` at a time, straight from ``source`` (which must
        not change until the round is done), then the manifest (with how it was trained).
        Where a gather exchange is expected, uploaded parts stay in memory while they fit
        (``kept_parts.py``), so that it need not encode them again."""
        if isinstance(source, torch.Tensor):
            source = FlatTensors([source.reshape(-1)])
        self.source = source
        ranges = part_ranges(
            source.numel, codec, self.policy.part_elements, self.policy.expected_replicas
        )
        me = self.me
        payload = codec.payload_nbytes(source.numel)
        keeping = self._mode_of(len(self.members), codec, source.numel, payload) == "gather"

        def upload(shard: int) -> PartEntry:
            key = self.layout.part(self.round, self.fragment, me.replica, me.incarnation, shard)
            keep = partial(self.kept.offer, (me.name, shard)) if keeping else None
            return self.parts.upload(source, ranges[shard], codec, self.part_meta(shard), key, keep)

        transfers, started = self.parts.transfers, time.perf_counter()
        window = transfers.window
        entries = tuple(windowed(transfers.executor, upload, range(len(ranges)), window))
        transfers.control.observe(window, len(ranges), source.numel, self.policy.part_elements,
                                  time.perf_counter() - started)  # fmt: skip
        manifest = Manifest(
            run=self.layout.run, round=self.round, fragment=self.fragment, replica=me.replica,
            incarnation=me.incarnation, weight=float(weight), fingerprint=fingerprint,
            codec=codec, numel=source.numel, parts=entries, steps=pace.steps,
            seconds=pace.seconds,
        )  # fmt: skip
        key = self.layout.manifest(self.round, self.fragment, me.replica, me.incarnation)
        self.store.put(key, encode_record(manifest))
        self.manifests[me.name] = manifest
        self._verified.add(me.name)
        return manifest

    def part_meta(self, shard: int) -> wire.ObjectMeta:
        """The header fields of our own part ``shard``."""
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
            raise framing.WireFormatError(key, f"manifest is for {found}, expected {expected}")
        replica, incarnation = parse_contributor(name)
        part_keys = [p.key for p in manifest.parts]
        if part_keys != [
            self.layout.part(self.round, self.fragment, replica, incarnation, shard)
            for shard in range(len(part_keys))
        ]:
            raise framing.WireFormatError(key, "manifest names parts outside its own folder")
        if reference is not None and manifest.fingerprint != reference.fingerprint:
            self._foreign[name] = manifest.fingerprint
            raise framing.WireFormatError(
                key,
                f"fingerprint {manifest.fingerprint!r} differs from this replica's "
                f"{reference.fingerprint!r}: their global weights differ",
            )
        if reference is not None and not same_layout(manifest, reference):
            raise framing.WireFormatError(
                key,
                f"{manifest.numel} elements in {len(manifest.parts)} parts with codec "
                f"{manifest.codec!r}; this round has {reference.numel} in "
                f"{len(reference.parts)} with {reference.codec!r} (replicas must share the "
                f"model, codec and round policy)",
            )
        return manifest

    def part_fetcher(self) -> Callable[[PartId], Part | framing.WireFormatError]:
        """Fetches a part into a pooled buffer: kept from a gather prefetch, encoded again
        from our tensors if it is ours, else downloaded; or the error naming its key. The
        manifests are taken as now: exclusions meanwhile change nothing for it."""
        manifests = dict(self.manifests)

        def fetch(part: PartId) -> Part | framing.WireFormatError:
            name, shard = part
            if (kept := self.kept.take(part)) is not None:
                return Part(name, shard, manifests[name], kept, trusted=True)
            own = None
            if name == self.me.name and self.source is not None:
                own = (self.source, self.part_meta(shard))
            return self.parts.fetch(name, manifests[name], shard, own)

        return fetch

    def parts_in_order(self, wanted: Iterable[PartId]) -> Iterator[Part | framing.WireFormatError]:
        """Each of ``wanted`` (``part_fetcher``), a window in flight, in order; the consumer
        releases each part."""
        executor, window = self.parts.transfers.executor, self.parts.transfers.window
        return windowed(executor, self.part_fetcher(), wanted, window, release=release)

    def _exclude(self, name: str, problem: Exception) -> None:
        self.excluded[name] = str(problem)
        self.manifests.pop(name, None)
        log.warning(
            "round %d fragment %d: excluding %s: %s", self.round, self.fragment, name, problem
        )

    def _fetch_contribution(self, name: str) -> None:
        """Download and check every part of ``name``'s contribution, or exclude it. Checked
        parts are kept for the exchange while they fit ``policy.gather_memory``; the others
        are read again after the SEAL."""
        shards = range(len(self.manifests[name].parts))
        for part in self.parts_in_order((name, shard) for shard in shards):
            if name in self.excluded:
                release(part)
                continue
            try:
                if isinstance(part, framing.WireFormatError):
                    raise part
                part.verify()
            except framing.WireFormatError as exc:
                release(part)
                self._exclude(name, exc)
                continue
            if not self.kept.offer((name, part.shard), part.held):
                part.release()
        if name not in self.excluded:
            self._verified.add(name)

    def release(self) -> None:
        """Give back the buffers of parts still kept (the round is over)."""
        self.kept.release()

    def _take(self, name: str, data: bytes, prefetch: bool) -> None:
        try:
            self.manifests[name] = self._check_manifest(
                name, data, self.manifests.get(self.me.name)
            )
        except framing.WireFormatError as exc:
            self._exclude(name, exc)
            return
        if prefetch:
            self._fetch_contribution(name)

    # -- sealing -----------------------------------------------------------------------------

    def _mode_for(self, contributors: int) -> ExchangeMode:
        """The exchange for ``contributors`` like our own contribution: its bytes, and those
        of the reduced shards a ``sharded`` exchange would write (``reduced_codec``)."""
        own = self.manifests.get(self.me.name)
        if own is None:
            return self.policy.exchange_mode(contributors, 0)
        return self._mode_of(contributors, own.codec, own.numel, sum(p.size for p in own.parts))

    def _mode_of(self, contributors: int, codec: Codec, numel: int, payload: int) -> ExchangeMode:
        """The exchange for ``contributors`` contributions of ``payload`` bytes each."""
        reduced = reduced_codec(codec).payload_nbytes(numel)
        return self.policy.exchange_mode(contributors, payload, reduced)

    def _sealable(self) -> list[str]:
        """Checked contributions of members, each the newest incarnation of its replica that
        this replica has seen (claimed, or contributing): a non-member, or a zombie (an older
        incarnation still running), never counts, not even its own contribution."""
        names = self.manifests.keys() & self.members.keys()
        newest = dict(self.claims)
        for name in names:
            member = self.members[name]
            newest[member.replica] = max(newest.get(member.replica, -1), member.incarnation)
        return sorted(
            name for name in names
            if self.members[name].incarnation == newest[self.members[name].replica]
        )  # fmt: skip

    def _set_members(self, members: list[Participant]) -> None:
        """Take the member list; ``SupersededError`` if it holds a newer incarnation of ours."""
        self.members = {member.name: member for member in members}
        newer = [m.incarnation for m in members if m.replica == self.me.replica]
        self._fence({**self.claims, self.me.replica: max([self.me.incarnation, *newer])})

    def _fence(self, claims: dict[str, int]) -> None:
        """Take ``claims`` (the newest claimed incarnation of every replica id, listed now);
        ``SupersededError`` if this replica's own id has a newer one."""
        self.claims = claims
        newest = claims.get(self.me.replica, self.me.incarnation)
        if newest > self.me.incarnation:
            raise SupersededError(
                f"round {self.round} fragment {self.fragment}: "
                f"{newer_claim(self.me.replica, newest)}; {self.me.name} stops contributing"
            )

    def _ready_to_seal(self, first_seen: float | None) -> bool:
        count = len(self._sealable())
        if count == len(self.members.keys() - self.excluded.keys()) and count:
            return count >= self.policy.min_replicas
        grace_over = first_seen is not None and time.monotonic() - first_seen >= self.policy.grace
        return count >= self.policy.min_replicas and grace_over

    def _verify_for_gather(self) -> bool:
        """A gather SEAL lists only contributions checked in full: fetch any not yet checked.
        True when all were intact (otherwise readiness must be judged again)."""
        unchecked = [name for name in self._sealable() if name not in self._verified]
        for name in unchecked:
            self._fetch_contribution(name)
        return all(name in self._verified for name in unchecked)

    def _in_minority(self) -> bool:
        """More members hold weights unlike ours than like ours: let one of them seal (a
        replica that missed a commit is the odd one out; the others go on without it)."""
        groups = Counter(self._foreign[name] for name in self._foreign if name in self.members)
        return bool(groups) and max(groups.values()) > len(self._sealable())

    def _try_seal(self, first_seen: float | None) -> bool:
        """Put the SEAL; False when this replica declines to (it is in a minority, or the
        claims listed right before sealing leave too few contributions)."""
        if self._in_minority():
            return False
        self._fence(MembershipView.read(self.store, self.layout).newest())
        if not self._ready_to_seal(first_seen):
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
            claims={
                replica: self.claims[replica]
                for replica, _ in map(parse_contributor, contributors)
                if replica in self.claims
            },
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
            if time.monotonic() - refreshed >= self._refresh_every:
                self._refresh()
                refreshed = time.monotonic()
            seen = self.manifests.keys() | self.excluded.keys()
            pending = [name for name in self.members if name not in seen]
            objects = self.store.get_many(
                [self.seal_key, *map(self.manifest_key, pending)], limit=RECORD_READ_LIMIT
            )
            if objects[self.seal_key] is not None:
                return self._load_seal(objects[self.seal_key])
            for name in pending:
                if (data := objects[self.manifest_key(name)]) is not None:
                    self._take(name, data, prefetch)
                    first_seen = first_seen or time.monotonic()
                    delays = self.policy.poll_delays()
            if self._ready_to_seal(first_seen) and self._try_seal(first_seen):
                continue
            if time.monotonic() > deadline:
                raise RoundTimeoutError(
                    f"round {self.round} fragment {self.fragment}: no SEAL after "
                    f"{self.policy.timeout:g}s; have {sorted(self.manifests)}, missing "
                    f"{self._missing()} (min_replicas={self.policy.min_replicas}) in store "
                    f"{self.store.url}; start the missing replicas (see `diloco status`), "
                    f"lower run.min_replicas, or raise sync.timeout"
                )
            with self.times.measure("waiting"):
                time.sleep(next(delays))

    def _missing(self) -> str:
        """Who a round that timed out waited for: the members that sent nothing, how the
        replicas that left left, and how many of the run's replicas never joined (no lease:
        not started yet, or failed before they could, as an image without the project)."""
        said = [f"{name} (joined, sent nothing)"
                for name in sorted(self.members.keys() - self.manifests.keys())]  # fmt: skip
        said += [f"{replica} (left: {d.reason})" for replica, d in sorted(self.departed.items())]
        seen = {m.replica for m in self.members.values()} | self.departed.keys()
        seen |= {name.rsplit("-", 1)[0] for name in self.manifests}
        if (never := self.policy.expected_replicas - len(seen)) > 0:
            said.append(f"{never} of the run's {self.policy.expected_replicas} replicas never "
                        f"joined (not started yet, or failed at their start: `diloco status`, "
                        f"`diloco logs REPLICA`)")  # fmt: skip
        return "; ".join(said) or "nobody"

    def _refresh(self) -> None:
        """Take in replicas that joined meanwhile; give up at once when no round can seal."""
        if self._refresh_members:
            self._set_members(self._refresh_members())
        self.departed = self._departures() if self._departures else {}
        why = hopeless(self.departed, self.policy.expected_replicas, self.policy.min_replicas)
        if why is not None:
            raise RoundHopelessError(
                f"round {self.round} fragment {self.fragment} cannot seal: {why}"
            )

    def read_seal(self) -> Seal | None:
        """The round's SEAL if it exists (``_load_seal``), without contributing or sealing."""
        try:
            data = self.store.get(self.seal_key, 0, RECORD_READ_LIMIT)
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
        if self.me.replica in seal.claims:
            self._fence({**self.claims, self.me.replica: seal.claims[self.me.replica]})
        for name in seal.contributors:
            if name in self.manifests:
                continue
            try:
                data = self.store.get(self.manifest_key(name), 0, RECORD_READ_LIMIT)
                self.manifests[name] = self._check_manifest(name, data, reference=None)
            except (framing.WireFormatError, FileNotFoundError) as exc:
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
            if not same_layout(manifest, manifests[0]):
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
        if not same_layout(own, sealed):
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
