"""``sharded`` exchange: a scatter-reduce through the bucket (docs/collective.md, "Reduce").

Shard ``s`` of the sealed layout is owned by ``contributors[s % n]`` (SEAL order). An owner
reads shard ``s`` of every other sealed contribution, reduces it in SEAL order, and puts
``reduced/{s}`` in the round's codec, or int8 for a sparse round (``codec.reduced_codec``:
the mean of sparse contributions is denser than each); every replica then reads the reduced
shards it does not hold (LambdaML's ScatterReduce, SIGMOD'21, section 4.2, with the bucket as
the only medium). Per replica, with contributions of ``P`` bytes and a reduced result of
``R`` (``R = P`` but for sparse): up ``P + R/n``, down ``(P + R)(n - 1)/n``, whatever ``n``.

It streams: an owner accumulates each shard as its parts arrive, where the destination lives
and several shards at a time (``reduction.py``: an accumulator per reducer, a window of parts
in flight), puts each reduced shard in the background while it reduces the next, and
writes every reduced shard into the destination as soon as it is stored or read: no whole
contribution or result is ever held.

A reduced shard is deterministic (the same parts, order and codec) and names no writer, so an
owner and a stand-in write identical bytes and the idempotent put accepts both. Every replica
uses the decoded reduced shards, its own included, so all get the same bytes with a lossy codec
too. An owner that has published nothing new for ``orphan_grace`` seconds (it died or stalls)
has its missing shards reduced by whoever notices; progress, not the round's age, is the
measure, so a large round whose owners are still working is not duplicated.

A sealed part that cannot be read intact is never averaged: the reducer puts a
``ShardFailure`` at the shard's key instead, and every replica fails the round naming the part.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from diloco_anywhere.bucket.codecs.codec import reduced_codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.record import (
    RECORD_MAGIC,
    RECORD_READ_LIMIT,
    decode_record,
    encode_record,
)
from diloco_anywhere.collective.errors import SealedContributionError
from diloco_anywhere.collective.exchanges.reduction import ShardMean, Slots, reduce_shards
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.records import Seal, ShardFailure
from diloco_anywhere.collective.round import Round
from diloco_anywhere.collective.transfers import Held

log = logging.getLogger(__name__)
# The wire header's replica field of a reduced shard: the round's reduction, by whoever.
REDUCER = "_reduced"


def shard_owners(seal: Seal, shards: int) -> list[str]:
    return [seal.contributors[shard % len(seal.contributors)] for shard in range(shards)]


def sharded_mean(round_: Round, seal: Seal, destination: FlatTensors) -> None:
    _ShardedExchange(round_, seal, destination).run()


class _ShardedExchange:
    def __init__(self, round_: Round, seal: Seal, destination: FlatTensors) -> None:
        self.round, self.seal, self.destination = round_, seal, destination
        manifests = round_.sealed_manifests(seal)
        self.reference = manifests[0]
        self.reduced_codec = reduced_codec(self.reference.codec)
        self.owners = shard_owners(seal, len(self.reference.parts))
        self.transfers = round_.parts.transfers
        self._mine_done_at: float | None = None  # monotonic time our own shards were reduced
        self._abandon = threading.Event()  # our reduction failed: stop collecting

    def _key(self, shard: int) -> str:
        return self.round.layout.reduced(self.round.round, self.round.fragment, shard)

    def _where(self, shard: int) -> str:
        return f"round {self.round.round} fragment {self.round.fragment} shard {shard}"

    # -- reducing ----------------------------------------------------------------------------

    def _reduce(self, shards: list[int]) -> None:
        """Reduce ``shards`` from the sealed parts where the destination lives, several at a
        time (``reduction.py``), and publish each in the background, at most ``window``
        publishing at once (``_publish``)."""
        publishing: list[Future[None]] = []
        slots = Slots(self.transfers.window)

        def publish(reduced: ShardMean) -> None:
            slots.take()
            held = Held(self.transfers.pool)
            try:
                data = self._reduced_object(reduced, held)
                future = self.transfers.executor.submit(self._publish, reduced.shard, data, held)
            except BaseException:
                held.release()
                slots.give()
                raise
            future.add_done_callback(lambda _: slots.give())
            publishing.append(future)  # list.append is atomic: reducers call this at once

        try:
            reduce_shards(
                self.round, self.seal, shards, self.destination.device, publish,
                slots=self._downloads(),
            )  # fmt: skip
        finally:
            wait(publishing)  # nothing writes into the destination after the round returns
        for future in publishing:
            future.result()

    def _downloads(self) -> int:
        """Parts to have in flight so that ``window`` of them are downloads: our own parts
        in the sequence are encoded again here, and move no bytes."""
        n, window = len(self.seal.contributors), self.transfers.window
        if self.round.me.name not in self.seal.contributors or n == 1:
            return window
        return -(-window * n // (n - 1))

    def _reduced_object(self, reduced: ShardMean, held: Held) -> bytes | memoryview:
        """The reduced shard as a wire object, or a ``ShardFailure`` record if a part is bad."""
        if reduced.failure is not None:
            _, failure = reduced.failure
            return encode_record(
                ShardFailure(
                    run=self.round.layout.run,
                    round=self.round.round,
                    fragment=self.round.fragment,
                    shard=reduced.shard,
                    key=failure.key,
                    problem=failure.problem,
                )
            )
        meta = wire.ObjectMeta(
            run=self.round.layout.run,
            round=self.round.round,
            replica=REDUCER,
            incarnation=0,
            shard=reduced.shard,
        )
        result = reduced.mean.result()
        codec = self.reduced_codec
        nbytes = wire.max_object_nbytes(codec, result.numel())
        with self.round.times.measure("encode"):
            return wire.encode(result, codec, meta, into=held.allocate(nbytes))

    def _publish(self, shard: int, data: bytes | memoryview, held: Held) -> None:
        """Put the reduced shard, then write what the bucket holds for it into the
        destination: ours, or the bytes of a reducer that stored other bytes first."""
        try:
            try:
                with self.round.times.measure("transfer"):
                    self.round.store.put(self._key(shard), data)
            except FileExistsError:
                held.release()
                if not self._fetch(shard):
                    raise
                return
            self._apply(shard, data, trusted=True)
        finally:
            held.release()

    # -- collecting --------------------------------------------------------------------------

    def _apply(self, shard: int, data: bytes | memoryview, trusted: bool = False) -> None:
        """Write a reduced shard, checked against the sealed layout, into the destination; a
        ``ShardFailure`` or a bad object fails the round (a create-only key cannot be written
        again)."""
        key, entry = self._key(shard), self.reference.parts[shard]
        try:
            if bytes(data[: len(RECORD_MAGIC)]) == RECORD_MAGIC:
                failure = decode_record(data, ShardFailure, key=key)
                raise SealedContributionError(
                    f"{self._where(shard)}: sealed part {failure.key} is unreadable: "
                    f"{failure.problem}"
                )
            reader = wire.WireReader(data, key)
            header = reader.header
            if (header.run, header.round, header.replica, header.shard) != (
                self.round.layout.run,
                self.round.round,
                REDUCER,
                shard,
            ) or (header.numel, header.codec) != (entry.stop - entry.start, self.reduced_codec):
                raise framing.WireFormatError(key, "reduced shard header does not match the SEAL")
            checks, times = not trusted, self.round.times
            for start, values in reader.chunks(
                self.destination.device,
                check_values=checks,
                check_checksum=checks,
                on_time=times.add,
            ):
                self.destination.write(entry.start + start, values)
        except framing.WireFormatError as exc:
            raise SealedContributionError(f"{self._where(shard)}: {exc}") from None

    def _largest(self, shard: int) -> int:
        """The most bytes a reduced shard's object can hold: its wire object in the round's
        codec, or a ``ShardFailure`` record; a read stops one byte past it."""
        entry = self.reference.parts[shard]
        numel = entry.stop - entry.start
        return max(wire.max_object_nbytes(self.reduced_codec, numel), RECORD_READ_LIMIT - 1)

    def _fetch(self, shard: int) -> bool:
        """Read reduced shard ``shard`` into the destination; False while it does not exist."""
        held = Held(self.transfers.pool)
        try:
            with self.round.times.measure("transfer"):
                data = self.round.store.get_into(
                    self._key(shard), held.allocate, limit=self._largest(shard) + 1
                )
        except FileNotFoundError:
            return False
        else:
            self._apply(shard, data)
            return True
        finally:
            held.release()

    def _next_fetches(
        self,
        queued: dict[str, list[int]],
        busy: Counter[str],
        streaming: set[str],
        due: dict[str, float],
    ) -> list[int]:
        """Shards to start reading now, taken off their owners' queues. Owners whose shards
        are arriving (``streaming``) share ``window`` reads in flight; any other owner is
        probed at one shard at a time, once its next poll is ``due``, window or not: a GET per
        poll while it is late, and its first shard is seen while another owner's stream fills
        the window."""
        now, window = time.monotonic(), self.transfers.window
        share = -(-window // max(1, len(streaming)))
        room = window - sum(busy.values())
        chosen: list[int] = []
        for owner, queue in queued.items():
            if owner in streaming:
                take = max(0, min(share - busy[owner], room, len(queue)))
                room -= take
            else:
                take = 1 if queue and due[owner] <= now and not busy[owner] else 0
            chosen += queue[:take]
            del queue[:take]
        return chosen

    def _collect(self, shards: list[int]) -> None:
        """Read the others' reduced shards as they appear, a window of reads kept in flight,
        standing in for late owners once our own shards are reduced (``_mine_done_at``);
        stops early when ``_abandon`` is set. Each owner's shards wait in a queue of their
        own, so choosing the next reads costs per owner, not per shard."""
        policy, started = self.round.policy, time.monotonic()
        queued: dict[str, list[int]] = {}
        for shard in shards:
            queued.setdefault(self.owners[shard], []).append(shard)
        progress = dict.fromkeys(queued, started)  # an owner's last shard seen
        due = dict.fromkeys(queued, started)  # an owner's next probe
        delays = {owner: policy.poll_delays() for owner in queued}
        in_flight: dict[Future[bool], int] = {}
        busy: Counter[str] = Counter()  # reads in flight per owner
        streaming: set[str] = set()  # owners whose last read shard was there
        try:
            while (in_flight or any(queued.values())) and not self._abandon.is_set():
                for shard in self._next_fetches(queued, busy, streaming, due):
                    busy[self.owners[shard]] += 1
                    in_flight[self.transfers.executor.submit(self._fetch, shard)] = shard
                if late := self._late(queued, busy, progress):
                    self._take_over(late)
                    continue
                waiting = [o for o, q in queued.items() if q and o not in streaming and not busy[o]]
                probe_at = min((due[owner] for owner in waiting), default=None)
                timeout = None if probe_at is None else max(0.0, probe_at - time.monotonic())
                if not in_flight:
                    with self.round.times.measure("waiting"):
                        self._abandon.wait(timeout)
                    continue
                done, _ = wait(in_flight, timeout, return_when=FIRST_COMPLETED)
                for future in done:
                    shard = in_flight.pop(future)
                    owner = self.owners[shard]
                    busy[owner] -= 1
                    if future.result():
                        progress[owner] = time.monotonic()
                        streaming.add(owner)
                        delays[owner] = policy.poll_delays()
                    else:
                        bisect.insort(queued[owner], shard)
                        streaming.discard(owner)
                        due[owner] = time.monotonic() + next(delays[owner])
        finally:
            wait(in_flight)  # nothing writes into the destination after the round returns

    def _take_over(self, late: list[int]) -> None:
        log.warning(
            "round %d fragment %d: reducing shards %s myself; owners %s are late",
            self.round.round, self.round.fragment, late, sorted({self.owners[s] for s in late}),
        )  # fmt: skip
        self._reduce(late)

    def _late(
        self, queued: dict[str, list[int]], busy: Counter[str], progress: dict[str, float]
    ) -> list[int]:
        """The queued shards of owners with no read in flight that have shown no progress for
        ``orphan_grace`` seconds, taken off their queues. Counted from when our own reduction
        ended at the earliest: before that we are busy, not waiting, and the owners started
        when we did."""
        if self._mine_done_at is None:
            return []
        now, late = time.monotonic(), []
        for owner, queue in queued.items():
            quiet = now - max(progress[owner], self._mine_done_at)
            if queue and not busy[owner] and quiet >= self.round.policy.orphan_grace:
                late += queue
                queue.clear()
        return sorted(late)

    def run(self) -> None:
        """Reduce our shards while collecting the others' on a thread of its own: their
        owners publish while we reduce, and reading them meanwhile keeps the link busy
        through the end of our reduction (docs/collective.md, "Reduce")."""
        me = self.round.me.name
        shards = range(len(self.owners))
        mine = [shard for shard in shards if self.owners[shard] == me]
        others = [shard for shard in shards if self.owners[shard] != me]
        with ThreadPoolExecutor(1, thread_name_prefix="collect") as collecting:
            collected = collecting.submit(self._collect, others)
            try:
                if mine:
                    self._reduce(mine)
            except BaseException:
                self._abandon.set()
                raise
            finally:
                self._mine_done_at = time.monotonic()
            collected.result()
