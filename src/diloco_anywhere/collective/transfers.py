"""Transfers of one round: a bounded window of parts in flight, in reused host buffers.

Host memory is what bounds a sync at real model sizes (a 7B model's fp32 pseudo-gradient is
28 GiB), so a round never holds a whole contribution or a whole result: at most ``window``
parts are being encoded, uploaded, downloaded or waiting to be reduced at a time, each in a
buffer from the collective's ``BufferPool``. That bound (``window`` x the part size, per round
in flight) is also the number of concurrent requests, which is what a round's bandwidth over
a WAN comes from: each connection to an object store runs at tens of MB/s, so throughput
comes from requests in parallel (``diloco bench sync --standin``; docs/benchmarks.md).

How many requests a link is worth is not known ahead (a connection's rate, the link's, the
host's cores for the codec), so the window adapts between rounds (``AdaptiveWindow``): it
widens while a wider one moves a round's parts faster, and stays within the sync's memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

import torch

from diloco_anywhere.bucket.format.framing import MAX_HEADER_BYTES, PREFIX
from diloco_anywhere.collective.policy import FLOAT32_BYTES

log = logging.getLogger(__name__)
# Buffers are within 64 KiB of their part: with 1 MiB classes an int8 part (1 MiB and its
# scales) took a 2 MiB buffer, twice its bytes, in every part a gather round keeps.
SIZE_CLASS = 64 << 10
HEADROOM = PREFIX.size + MAX_HEADER_BYTES  # an encode reserves room for the largest header
T = TypeVar("T")
R = TypeVar("R")


class BufferPool:
    """Host buffers reused across parts and rounds.

    A fresh 16 MiB buffer per part costs more in page faults than the copy into it (measured
    in docs/benchmarks.md, "Sync"); a reused one is touched once. Buffers grow to the largest
    object they held. Pinned (page-locked) when CUDA is present, so copies between a GPU and
    the encoded bytes run by DMA without a staging copy. At most ``keep`` idle buffers are kept.
    """

    def __init__(self, keep: int, pinned: bool | None = None) -> None:
        self._keep = keep
        self._pinned = torch.cuda.is_available() if pinned is None else pinned
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def _new(self, nbytes: int) -> torch.Tensor:
        """Sized up to the next ``SIZE_CLASS`` past ``nbytes`` plus a header's room, so that a
        buffer that held a downloaded part (its exact size) also fits an encode of one (which
        asks for the largest header), and one size class serves a round."""
        capacity = -(-(nbytes + HEADROOM) // SIZE_CLASS) * SIZE_CLASS
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pinned)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (a uint8 host tensor), to ``give`` back."""
        with self._lock:
            fits = [i for i, buffer in enumerate(self._idle) if buffer.numel() >= nbytes]
            buffer = self._idle.pop(fits[-1]) if fits else None
        return self._new(nbytes) if buffer is None else buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buffer)


class Held:
    """A pooled buffer lent out, with a view of its first bytes; ``release`` gives it back."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._buffer: torch.Tensor | None = None
        self.view = memoryview(b"")

    def allocate(self, nbytes: int) -> memoryview:
        """For ``Store.get_into``: a view of at least ``nbytes`` bytes of a pooled buffer."""
        self.release()
        self._buffer = self._pool.take(nbytes)
        self.view = memoryview(self._buffer.numpy())
        return self.view

    def keep(self, view: memoryview) -> Held:
        self.view = view
        return self

    def release(self) -> None:
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer, self.view = None, memoryview(b"")


def windowed(
    executor: Executor,
    work: Callable[[T], R],
    items: Iterable[T],
    window: int,
    release: Callable[[R], None] = lambda _: None,
) -> Iterator[R]:
    """``work(item)`` for every item on ``executor``, at most ``window`` submitted and not yet
    consumed at a time; results in the order of ``items``. If the consumer stops early (an
    error, or ``close``), the work in flight is waited for and its results ``release``d, so no
    buffer is left out of its pool."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            if len(pending) >= window:
                yield pending.popleft().result()
            pending.append(executor.submit(work, item))
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            with contextlib.suppress(Exception):
                release(future.result())


# A wider window is kept only if it moves a round's parts this much faster: less is noise, or
# a link (or a host) already full, where more requests only cost more (stores bill them).
WIDER_GAIN = 1.1
# Rounds at a settled window before a wider one is tried again: the link may have changed.
SETTLED_ROUNDS = 20
# A round's window of parts, at most this share of its payload's float32 bytes: with the
# others' reduced shards read meanwhile (as many again) and a gather's kept parts (at most
# a quarter of a payload of 1 GiB), a sync stays within half its payload (docs/collective.md).
MEMORY_SHARE = 0.125


class AdaptiveWindow:
    """A round's parts in flight, adapted between rounds to what the link and the host allow:
    from ``least`` (run.toml's ``[sync] window``), doubled while the wider window uploads a
    round's contribution at least ``WIDER_GAIN`` times faster, back to the narrower one when
    it does not, tried again after ``SETTLED_ROUNDS`` rounds; never past ``most``, nor past
    ``MEMORY_SHARE`` of a round's payload in parts in flight (the sync's host memory bound;
    rounds in flight together are fragments', each of its own payload). A probe of TCP's
    kind (grow while it pays), measured where a round's phase has at least twice the
    window's parts, so that it ran full; thread-safe (rounds of several fragments report)."""

    def __init__(self, least: int, most: int | None = None) -> None:
        self.least, self.most = least, max(least, most or least)
        self.size = least
        self._narrower: tuple[int, float] | None = None  # (size, rate) before a probe
        self._settled = SETTLED_ROUNDS  # rounds since the last probe: the first round probes
        self._lock = threading.Lock()

    def observe(
        self, window: int, parts: int, numel: int, part_elements: int, seconds: float
    ) -> None:
        """One round's upload of its contribution at ``window``: ``parts`` parts of at most
        ``part_elements`` float32 values each, ``numel`` in all, in ``seconds``."""
        if seconds <= 0 or parts < 2 * window:
            return  # too few parts to fill the window: says nothing of a wider one
        rate = numel * FLOAT32_BYTES / seconds  # bytes/s of the float32 payload
        fits = int(MEMORY_SHARE * numel // part_elements)
        with self._lock:
            if window == self.size:  # not a round that started before another changed it
                self._next(rate, max(self.least, min(self.most, fits)))

    def _next(self, rate: float, most: int) -> None:
        if self._narrower is not None:  # this round tried a wider window
            size, narrower_rate = self._narrower
            if rate >= narrower_rate * WIDER_GAIN:
                self._widen(rate, most)
                return
            log.info("window %d moved parts at %.0f MB/s, %d at %.0f MB/s: back to %d",
                     self.size, rate / 1e6, size, narrower_rate / 1e6, size)  # fmt: skip
            self.size, self._narrower, self._settled = size, None, 0
            return
        self._settled += 1
        if self._settled >= SETTLED_ROUNDS:
            self._widen(rate, most)

    def _widen(self, rate: float, most: int) -> None:
        """Try twice the window next round, where memory allows; else settle here."""
        wider = min(most, 2 * self.size)
        if wider <= self.size:
            self._narrower, self._settled = None, 0
            return
        log.info("window %d moved parts at %.0f MB/s: trying %d", self.size, rate / 1e6, wider)
        self._narrower, self.size = (self.size, rate), wider
