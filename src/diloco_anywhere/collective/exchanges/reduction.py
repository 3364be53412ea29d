"""The reduction of sealed shards: each shard's parts decoded and averaged on the device the
replica's tensors live on, several shards at a time (docs/collective.md, "Reduce").

Why on the device: on a GPU replica the host was the bottleneck. A 1B-parameter model's int8
round took 26x a raw copy of its bytes on an H200 (issue 41's sync check), because every part
was decoded and added on the CPU, on one thread, while int8 decodes on the GPU at 25-140 GB/s.
Here a part's encoded bytes go from their pooled (pinned) host buffer to the device and are
decoded and added there; only encoded bytes cross the bus, as on the way up.

Why several at a time: a shard's mean is a chain in SEAL order (``mean.py``: the same IEEE
operations in the same order on any device and any thread, so the bits do not depend on
either), but shards are independent. ``reducers`` threads each reduce one shard while the
transfer threads read the next parts, so decode, checks, checksum and accumulate use the
host's cores, and reads of the next parts overlap them.

Memory stays bounded by the window: a slot is taken before a part is fetched and given back
once it has been added (or dropped), so at most ``slots`` parts are held at a time, plus one
accumulator per reducer. Parts are fetched in shard order and a shard's job is queued before
its first part is fetched, so the earliest shard not yet reduced is the first job in the
queue and takes its parts as they come: the window never fills with parts that wait for a
shard that cannot start, even a window of one part.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from diloco_anywhere.bucket.format import framing
from diloco_anywhere.collective.mean import WeightedMean
from diloco_anywhere.collective.parts import Part, one_intra_op_thread, release
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round

# A shard's parts as their fetches are submitted, in SEAL order; None ends them.
Feed = queue.SimpleQueue  # of Future[Part | WireFormatError] | None
# On a GPU the kernels are short and queue on the device: two reducers keep one part's copy
# to the device overlapping another's decode; more add host threads, not speed.
GPU_REDUCERS = 2


@dataclass(frozen=True)
class ShardMean:
    """A shard's reduction: its weighted mean (``mean.result()`` checks it finite) on the
    reduction's device, or the first part that could not be read (contributor, why)."""

    shard: int
    mean: WeightedMean
    failure: tuple[str, framing.WireFormatError] | None


class Slots:
    """A count of parts that may be held at once; ``stop`` wakes and refuses every waiter."""

    def __init__(self, count: int) -> None:
        self._free, self._stopped = count, False
        self._changed = threading.Condition()

    def take(self) -> bool:
        """Wait for a free slot; False once stopped."""
        with self._changed:
            self._changed.wait_for(lambda: self._free > 0 or self._stopped)
            if self._stopped:
                return False
            self._free -= 1
            return True

    def give(self) -> None:
        with self._changed:
            self._free += 1
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped


def reducer_count(device: torch.device, window: int) -> int:
    """Threads that reduce at once: on the CPU one per core this process may use (at most the
    window: each holds a part), on a GPU ``GPU_REDUCERS``."""
    if device.type != "cpu":
        return GPU_REDUCERS
    return max(1, min(window, len(os.sched_getaffinity(0))))


class _DeviceStreams:
    """On CUDA, a stream per reducer thread, so one thread's copy to the device does not wait
    for another's kernels; nothing elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._local = device, threading.local()

    def stream(self) -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        if not hasattr(self._local, "stream"):
            self._local.stream = torch.cuda.Stream(self.device)
        return self._local.stream


def reduce_shards(
    round_: Round,
    seal: Seal,
    shards: Sequence[int],
    device: torch.device,
    finish: Callable[[ShardMean], None],
    *,
    slots: int | None = None,
) -> None:
    """Reduce ``shards`` of the sealed round on ``device`` and call ``finish`` with each, on
    the reducer thread, while the accumulator is still the shard's. ``slots``: parts held at
    once (the transfers' window by default); shards reduced at once: the policy's
    ``reducers`` (``reducer_count`` when unset). The first error (a ``finish`` that raised, a
    store that failed) stops the rest and is raised here once every thread has let go of its
    parts."""
    if not shards:
        return
    window = round_.parts.transfers.window
    reducers = round_.policy.reducers or reducer_count(device, window)
    reduction = _Reduction(round_, seal, shards, device, finish, Slots(slots or window), reducers)
    reduction.run(shards)


class _Reduction:
    def __init__(
        self,
        round_: Round,
        seal: Seal,
        shards: Iterable[int],
        device: torch.device,
        finish: Callable[[ShardMean], None],
        slots: Slots,
        reducers: int,
    ) -> None:
        manifests = round_.sealed_manifests(seal)
        self.round, self.contributors, self.finish = round_, seal.contributors, finish
        self.entries = manifests[0].parts
        self.weights = [manifest.weight for manifest in manifests]
        self.total = sum(self.weights)
        self.device, self.slots, self.reducers = device, slots, reducers
        self.streams = _DeviceStreams(device)
        longest = max(self.entries[s].stop - self.entries[s].start for s in shards)
        self.buffers: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor]] = queue.SimpleQueue()
        for _ in range(reducers):  # at most ``reducers`` shards are reduced at a time
            self.buffers.put(
                (torch.empty(longest, device=device), torch.empty(longest, device=device))
            )

    def run(self, shards: Iterable[int]) -> None:
        """A shard's job is queued before its parts are fetched, and takes each part as it
        comes (``Feed``): with a window smaller than the contributors, the slots a shard's
        first parts hold come back before its last parts need them."""
        fetch, transfers = self.round.part_fetcher(), self.round.parts.transfers
        jobs: list[Future[None]] = []
        pool = ThreadPoolExecutor(
            self.reducers, thread_name_prefix="reduce", initializer=one_intra_op_thread
        )
        try:
            for shard in shards:
                feed: Feed = queue.SimpleQueue()
                jobs.append(pool.submit(self._reduce_one, shard, feed))
                try:
                    for name in self.contributors:
                        if not self.slots.take():
                            break
                        feed.put(transfers.executor.submit(fetch, (name, shard)))
                finally:
                    feed.put(None)  # the shard's parts end here
                if self.slots.stopped:
                    break
        except BaseException:
            self.slots.stop()
            raise
        finally:
            pool.shutdown(wait=True)
        for job in jobs:
            job.result()  # the first error, in shard order

    def _reduce_one(self, shard: int, feed: Feed) -> None:
        """Accumulate the shard's parts in SEAL order as they are fed and ``finish`` it; every
        part is released and its slot given back, whatever happens."""
        accumulator, scratch = self.buffers.get()
        pending = iter(feed.get, None)
        try:
            with torch.cuda.stream(self.streams.stream()):
                entry = self.entries[shard]
                mean = WeightedMean(accumulator[: entry.stop - entry.start], self.total, scratch)
                failure, added = None, 0
                for name, weight in zip(self.contributors, self.weights, strict=True):
                    future = next(pending, None)
                    if future is None:  # the reduction stopped before this part was fetched
                        break
                    failure, added = self._add(mean, name, weight, future, failure), added + 1
                if added == len(self.contributors) and not self.slots.stopped:
                    self.finish(ShardMean(shard, mean, failure))
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # done before the buffers move on
        except BaseException:
            self.slots.stop()
            raise
        finally:
            for future in pending:  # left by an error: dropped
                self._add(None, "", 0.0, future, None)
            self.buffers.put((accumulator, scratch))

    def _add(
        self,
        mean: WeightedMean | None,
        name: str,
        weight: float,
        future: Future[Part | framing.WireFormatError],
        failure: tuple[str, framing.WireFormatError] | None,
    ) -> tuple[str, framing.WireFormatError] | None:
        """Add one part to ``mean`` (None: drop it) unless the shard has failed or the
        reduction stopped; then release it and give its slot back. Returns the shard's first
        unreadable part."""
        part: Part | framing.WireFormatError | None = None
        try:
            part = future.result()
            if isinstance(part, framing.WireFormatError):
                raise part
            if mean is not None and failure is None and not self.slots.stopped:
                times = self.round.times
                for start, values in part.chunks(self.device, on_time=times.add):
                    with times.measure("reduce"):
                        mean.add(start, values, weight)
        except framing.WireFormatError as exc:
            return failure or (name, exc)
        except Exception:
            if mean is not None:
                raise
        finally:
            if part is not None:
                release(part)
            self.slots.give()
        return failure
