"""Worker processes for benchmarks and tests (bench/tools/processes.py): started from a server that
has imported the package once, with their parent's environment of the moment."""

from __future__ import annotations

import os
import queue
import sys
import threading
from functools import partial

import pytest

from diloco_anywhere.bench.tools.processes import (
    WorkerFailedError,
    collect,
    report,
    worker_context,
)

pytestmark = pytest.mark.integration  # every test here starts processes

VARIABLE = "DILOCO_TEST_WORKER_VARIABLE"


def _report(results) -> None:
    results.put((os.environ.get(VARIABLE), "diloco_anywhere.replica" in sys.modules))


def _worker_sees(context) -> tuple[str | None, bool]:
    results = context.Queue()
    process = context.Process(target=_report, args=(results,))
    process.start()
    found = results.get(timeout=120)
    process.join(timeout=30)
    assert process.exitcode == 0
    return found


def test_a_worker_has_the_package_imported_and_its_parents_environment_of_the_moment(
    monkeypatch,
):
    monkeypatch.delenv(VARIABLE, raising=False)
    context = worker_context()
    assert _worker_sees(context) == (None, True)  # this module imports no replica: preloaded
    monkeypatch.setenv(VARIABLE, "set after the server started")
    assert _worker_sees(context) == ("set after the server started", True)


def _at_the_barrier(result: list[int]):
    """A worker's measure: meet the others, then give ``result``."""

    def measure(barrier: threading.Barrier) -> list[int]:
        barrier.wait()
        return result

    return measure


def _workers(*measures) -> tuple[list[threading.Thread], queue.Queue]:
    """Threads reporting as a benchmark's worker processes do, each measure given the one
    barrier they meet at."""
    results: queue.Queue = queue.Queue()
    barrier = threading.Barrier(len(measures))
    workers = [
        threading.Thread(target=report, args=(results, key, barrier, partial(measure, barrier)))
        for key, measure in enumerate(measures)
    ]
    for worker in workers:
        worker.start()
    return workers, results


def test_workers_that_report_give_their_results_by_key():
    workers, results = _workers(_at_the_barrier([1]), _at_the_barrier([2]))
    assert collect(workers, results, str, lambda _: None) == {0: [1], 1: [2]}


def test_a_failed_worker_is_named_with_its_error_not_the_ones_it_stopped():
    """One worker fails before the barrier; the other, waiting there, is stopped (its error
    is the broken barrier): the parent names the one that failed, with its own error."""

    def failing(barrier):
        raise ValueError("Protocol not known: nosuchproto")

    workers, results = _workers(_at_the_barrier([1]), failing)
    with pytest.raises(WorkerFailedError) as failed:
        collect(workers, results, lambda key: f"replica r{key}", lambda _: None)
    assert str(failed.value) == "replica r1 failed: ValueError: Protocol not known: nosuchproto"
    assert not any(worker.is_alive() for worker in workers)


class _Stuck(threading.Thread):
    """A worker that never reports until it is ended, as a process hung in a store call."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        super().__init__(target=self.ended.wait)

    def terminate(self) -> None:
        self.ended.set()


def test_a_worker_that_never_reports_is_ended_and_not_waited_for():
    stuck = _Stuck()
    stuck.start()
    silent: queue.Queue = queue.Queue()
    with pytest.raises(WorkerFailedError, match=r"1 worker\(s\) reported nothing within 0.2 s"):
        collect([stuck], silent, str, lambda _: None, patience=0.2)
    assert stuck.ended.is_set()
    # after another worker failed, the stuck one is given a little time, then ended
    stuck = _Stuck()
    stuck.start()
    failed: queue.Queue = queue.Queue()
    failed.put((1, "OSError: disk full"))
    with pytest.raises(WorkerFailedError, match=r"^r1 failed: OSError: disk full$"):
        collect([stuck, stuck], failed, lambda k: f"r{k}", lambda _: None, after_a_failure=0.2)
    assert stuck.ended.is_set()
