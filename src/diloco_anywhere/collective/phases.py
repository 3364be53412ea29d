"""Where a round's time goes: seconds per phase, summed over the threads that spent them.

A round runs on many threads at once (transfers, reducers, the collector), so its phases
overlap: the figures are thread-seconds, and their sum can exceed the round's wall time. Set
beside the wall time they say what bounds a round: transfer seconds near the wall time and
little else is a round at the speed of its link; decode or reduce seconds many times the wall
time is a round spread over the host's cores; one phase alone near the wall time on one
thread is the bottleneck (``diloco bench sync --json``, docs/benchmarks.md "Sync").
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
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
