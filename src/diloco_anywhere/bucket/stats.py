"""Counting a store's traffic: requests, retries and bytes moved.

The benchmarks and the round logs subtract two snapshots to get one round's traffic; the
counters are bumped from ``Store``'s worker threads, so they sit behind a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StoreStats:
    """Traffic through one Store. Requests count every attempt; bytes count completed transfers."""

    bytes_up: int = 0
    bytes_down: int = 0
    puts: int = 0
    gets: int = 0
    lists: int = 0
    deletes: int = 0
    retries: int = 0

    def __sub__(self, other: StoreStats) -> StoreStats:
        return StoreStats(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(StoreStats)}

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                self._values[name] += amount

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._values)
