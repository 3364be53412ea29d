"""A round's parts: uploading a contribution from the caller's tensors, reading parts back.

Every part passes through a pooled buffer (``transfers.py``), at most a window of them at a
time. A part read from the bucket is checked against the manifest that names it (size and
checksum, then header), and its values are checked as they stream (``wire.WireReader``).

A replica's own parts are kept after upload only where a gather round has room for them
(``Round.contribute``). Any other that a reduction needs is encoded again from the caller's
tensors, which the caller leaves untouched until the round ends
(``BucketCollective.allreduce``). Encoding is deterministic, so the bytes equal the uploaded
ones; their checksum is compared with the manifest's all the same, and on a mismatch (the
tensors changed during the round) the part is read from the bucket, so what is averaged is
always what was sealed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from diloco_anywhere.bucket.codecs.codec import Codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.phases import PhaseTimes
from diloco_anywhere.collective.records import Manifest, PartEntry
from diloco_anywhere.collective.transfers import AdaptiveWindow, BufferPool, Held

log = logging.getLogger(__name__)


class MissingPartError(framing.WireFormatError):
    """A part a manifest names does not exist (any more)."""


def one_intra_op_thread() -> None:
    """Round and transfer threads do memory-bound work (copies, CRC32C, sums). Left at the
    default, each thread that runs torch ops gets its own OpenMP team, whose spinning threads
    take the cores from training (docs/benchmarks.md, "Inner-loop throughput"). The setting
    is per thread."""
    torch.set_num_threads(1)


@dataclass(frozen=True)
class Transfers:
    """What a round moves parts with: threads, reused buffers, and how many parts may be in
    flight at once (``window``: the bound on memory and on concurrent requests, adapted
    between rounds by ``control``)."""

    executor: Executor
    pool: BufferPool
    control: AdaptiveWindow

    @property
    def window(self) -> int:
        """Parts in flight for a phase starting now (read once per phase)."""
        return self.control.size

    @classmethod
    def create(cls, window: int, rounds: int = 1, most: int | None = None) -> Transfers:
        """For ``rounds`` rounds in flight at a time, each with ``window`` parts, widened up
        to ``most`` where the link pays for it (``AdaptiveWindow``); threads start as needed."""
        control = AdaptiveWindow(window, most)
        threads = control.most * rounds
        executor = ThreadPoolExecutor(
            threads, thread_name_prefix="transfer", initializer=one_intra_op_thread
        )
        return cls(executor, BufferPool(keep=threads + 2 * rounds), control)


@dataclass
class Part:
    """Part ``shard`` of ``name``'s contribution in a pooled buffer. ``trusted``: bytes this
    process encoded, or checked in full already; others are checked as they are read."""

    name: str
    shard: int
    manifest: Manifest
    held: Held
    trusted: bool = False

    @property
    def entry(self) -> PartEntry:
        return self.manifest.parts[self.shard]

    def chunks(
        self,
        device: torch.device = wire.CPU,
        on_time: Callable[[str, float], None] | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The part's float32 values in chunks; ``WireFormatError`` naming the part's key if
        it is not the one its manifest describes (provisional until the iteration ends).
        ``on_time``: as ``WireReader.chunks``'s."""
        data, entry = self.held.view, self.entry
        if not self.trusted:
            checksum = framing.stored_checksum(data)
            if len(data) != entry.size or checksum != entry.crc32c:
                raise framing.WireFormatError(
                    entry.key,
                    f"{len(data)} bytes with checksum {checksum:#010x}; the manifest says "
                    f"{entry.size} bytes, {entry.crc32c:#010x}",
                )
        reader = wire.WireReader(data, entry.key)
        header, manifest = reader.header, self.manifest
        if (header.run, header.replica, header.incarnation, header.round, header.shard) != (
            manifest.run,
            manifest.replica,
            manifest.incarnation,
            manifest.round,
            self.shard,
        ) or header.numel != entry.stop - entry.start:
            raise framing.WireFormatError(entry.key, "part header does not match the manifest")
        checks = not self.trusted
        yield from reader.chunks(
            device, check_values=checks, check_checksum=checks, on_time=on_time
        )

    def verify(self) -> None:
        """Read the part through once, checking everything; then it is ``trusted``."""
        for _ in self.chunks():
            pass
        self.trusted = True

    def release(self) -> None:
        self.held.release()


class PartIO:
    """Uploads and reads of parts through ``store`` with ``transfers``; the seconds they take
    go to ``times`` (``phases.py``)."""

    def __init__(self, store: Store, transfers: Transfers, times: PhaseTimes | None = None) -> None:
        self.store, self.transfers = store, transfers
        self.times = times or PhaseTimes()

    def encode(
        self,
        source: FlatTensors,
        elements: range,
        codec: Codec,
        meta: wire.ObjectMeta,
        held: Held,
    ) -> memoryview:
        """Elements ``elements`` of ``source`` as a wire object in ``held``'s buffer."""
        nbytes = wire.max_object_nbytes(codec, len(elements))
        with self.times.measure("encode"):
            return wire.encode_values(
                lambda start, stop: source.read(elements.start + start, elements.start + stop),
                len(elements),
                codec,
                meta,
                device=source.device,
                into=held.allocate(nbytes),
            )

    def upload(
        self,
        source: FlatTensors,
        elements: range,
        codec: Codec,
        meta: wire.ObjectMeta,
        key: str,
        keep: Callable[[Held], bool] | None = None,
    ) -> PartEntry:
        """Encode and put one part. ``keep`` is offered the uploaded bytes (``Held.view``);
        unless it takes them (True: it releases them later), the buffer is free again when
        this returns."""
        held, kept = Held(self.transfers.pool), False
        try:
            data = self.encode(source, elements, codec, meta, held)
            with self.times.measure("transfer"):
                self.store.put(key, data)
            entry = PartEntry(
                key=key,
                size=len(data),
                crc32c=framing.stored_checksum(data),
                start=elements.start,
                stop=elements.stop,
            )
            kept = keep is not None and keep(held.keep(data))
            return entry
        finally:
            if not kept:
                held.release()

    def download(self, name: str, manifest: Manifest, shard: int) -> Part:
        """Part ``shard`` of ``manifest`` from the bucket (``MissingPartError`` if absent)."""
        held = Held(self.transfers.pool)
        key = manifest.parts[shard].key
        try:
            # one byte past the manifest's size: a larger object is refused, not downloaded
            limit = manifest.parts[shard].size + 1
            with self.times.measure("transfer"):
                held.keep(self.store.get_into(key, held.allocate, limit=limit))
        except FileNotFoundError:
            held.release()
            raise MissingPartError(key, "part named in the manifest is missing") from None
        except BaseException:
            held.release()
            raise
        return Part(name, shard, manifest, held)

    def own(
        self, source: FlatTensors, name: str, manifest: Manifest, shard: int, meta: wire.ObjectMeta
    ) -> Part:
        """Our own part ``shard``, encoded again from ``source`` (see the module docstring)."""
        entry = manifest.parts[shard]
        held = Held(self.transfers.pool)
        try:
            data = self.encode(source, range(entry.start, entry.stop), manifest.codec, meta, held)
        except BaseException:
            held.release()
            raise
        if len(data) == entry.size and framing.stored_checksum(data) == entry.crc32c:
            return Part(name, shard, manifest, held.keep(data), trusted=True)
        held.release()
        log.warning(
            "%s: this replica's tensors changed while its round was in flight; reading its own "
            "part from the bucket (the caller must not touch allreduce's tensors until it is done)",
            entry.key,
        )
        return self.download(name, manifest, shard)

    def fetch(
        self,
        name: str,
        manifest: Manifest,
        shard: int,
        own: tuple[FlatTensors, wire.ObjectMeta] | None = None,
    ) -> Part | framing.WireFormatError:
        """A part from wherever it is (``own``: re-encode it), or the error naming its key."""
        try:
            if own is not None:
                return self.own(own[0], name, manifest, shard, own[1])
            return self.download(name, manifest, shard)
        except framing.WireFormatError as exc:
            return exc


def release(part: Part | Exception) -> None:
    """Give a fetched part's buffer back (an error holds none)."""
    if isinstance(part, Part):
        part.release()


_DEFAULT_TRANSFERS: dict[int, Transfers] = {}
_DEFAULT_LOCK = threading.Lock()


def default_transfers(window: int) -> Transfers:
    """Threads and buffers shared by the rounds of this process that bring none of their own
    (a ``BucketCollective`` brings its own)."""
    with _DEFAULT_LOCK:
        if window not in _DEFAULT_TRANSFERS:
            _DEFAULT_TRANSFERS[window] = Transfers.create(window, rounds=4)
        return _DEFAULT_TRANSFERS[window]


def part_ranges(numel: int, codec: Codec, part_elements: int, multiple: int = 1) -> list[range]:
    """Element ranges of a contribution's parts: a multiple of ``multiple`` parts of at most
    ``part_elements`` each (fewer when there are fewer codec blocks than that), whole codec
    blocks each, sizes within one block of each other. Every replica computes the same ranges
    from the same numel, codec and policy, which sharded mode relies on."""
    align = codec.align
    blocks = math.ceil(numel / align)
    wanted = math.ceil(math.ceil(numel / max(part_elements, 1)) / multiple) * multiple
    parts = max(1, min(wanted, blocks))
    edges = [min(numel, (i * blocks // parts) * align) for i in range(parts + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(parts)]
