"""Resident memory of this process, and its peak over a stretch of work, sampled by a thread.

``diloco bench sync`` reports what one sync adds to a replica's host memory: the peak resident
set during the round minus the resident set before the first round. Sampling (every 5 ms) can
miss a spike shorter than a period; the buffers a round holds live far longer than that. Linux
only (``/proc/self/statm``); elsewhere the figures are absent.
"""

from __future__ import annotations

import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set size, or None where /proc is not there."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:
        return None


class PeakMemory:
    """``with PeakMemory() as peak: ...``; then ``peak.bytes`` is the largest resident set
    seen (None where it cannot be read)."""

    def __init__(self, period: float = 0.005) -> None:
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
        self.bytes = resident_bytes()

    def _sample(self) -> None:
        while not self._stop.wait(self._period):
            self._note()

    def _note(self) -> None:
        now = resident_bytes()
        if now is not None and self.bytes is not None:
            self.bytes = max(self.bytes, now)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._note()
