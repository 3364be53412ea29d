"""Where a round's time goes: seconds per phase, summed over the threads that spent them.

The work of the host (checksum, decode, reduce, encode) is counted in CPU seconds of the
thread that did it (``time.thread_time``), so a round whose threads outnumber the cores is
not charged for the time they waited for one; a transfer, and waiting, in wall seconds of the
thread: what a request or the others cost, whatever the CPU did meanwhile. A round runs on
many threads at once (transfers, reducers, the collector), so the figures overlap and their
sum can exceed the round's wall time. Set beside it they say what bounds a round: transfer
seconds near the wall time and little else, the link; CPU seconds near the wall time times
the cores, the host; one phase alone near the wall time, that phase on one thread (``diloco
bench sync --json``, docs/benchmarks.md "Sync").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

# transfer: store requests (put, get); checksum: CRC32C of bytes read; decode: codec bytes to
# float32 values and their checks; reduce: the weighted mean's multiply-adds; encode: values to
# codec bytes; waiting: for the SEAL, and for others' reduced shards with none in flight.
PHASES = ("transfer", "checksum", "decode", "reduce", "encode", "waiting")
WALL_PHASES = ("transfer", "waiting")  # the others are CPU seconds of their thread


class PhaseTimes:
    """Thread-safe seconds per phase (``PHASES``)."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        clock = time.perf_counter if phase in WALL_PHASES else time.thread_time
        started = clock()
        try:
            yield
        finally:
            self.add(phase, clock() - started)

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
