"""Worker processes for benchmarks and tests, started without paying for imports each time.

A ``spawn``ed worker is a fresh interpreter that imports torch, torchft and this package again:
one to two seconds of CPU per worker, more than many of the rounds it runs. ``fork`` would copy
a parent that runs threads (executors, stand-in servers), which POSIX leaves undefined. The
``forkserver`` method forks each worker from a server process that has imported those modules
once and runs no threads (Python's multiprocessing docs, "Contexts and start methods"); like
``spawn``, targets and arguments are pickled, so code written for one runs under the other.

Not for a benchmark that measures a worker's memory or speed (``bench sync``, ``bench
throughput``): a forked worker's resident set starts without the library pages the server
imported, and faulting them in lands in what it measures; those spawn a fresh interpreter.

One difference is closed here: a forkserver's workers inherit the server's environment, fixed
when it started, where a spawned worker gets its parent's environment of the moment. Each
worker here takes its parent's environment as it was when the worker was created.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from diloco_anywhere.replica_forks import PRELOAD  # what a local replica's fork server holds


class _WorkerProcess(ForkServerProcess):
    """A forkserver process that runs with its parent's environment, as a spawned one does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_environment = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._parent_environment)
        super().run()


class _WorkerContext(ForkServerContext):
    Process = _WorkerProcess


def worker_context() -> ForkServerContext:
    """A multiprocessing context whose workers start from a server holding ``PRELOAD``."""
    context = _WorkerContext()
    context.set_forkserver_preload(list(PRELOAD))
    return context


class WorkerFailedError(RuntimeError):
    """A benchmark's worker process failed: which one, and its error (a store it could not
    reach, a device it does not have), said in one line."""


BROKEN_BARRIER = "BrokenBarrierError"  # a worker that stopped because another one failed
PATIENCE = 3 * 3600.0  # seconds a benchmark's workers may take to report (large sizes)
AFTER_A_FAILURE = 60.0  # seconds the other workers have to report once one has failed


def report(results: Any, key: Any, barrier: Any, measure: Callable[[], Any]) -> None:
    """In a worker: put ``(key, measure())`` on ``results``, or ``(key, its error)`` and
    break ``barrier`` so that the workers waiting there for this one stop and report too.
    Every worker reports once, whatever happens, so its parent never waits for a dead one."""
    try:
        results.put((key, measure()))
    except Exception as exc:
        results.put((key, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def collect(
    workers: list[Any],
    results: Any,
    name: Callable[[Any], str],
    progress: Callable[[str], None],
    patience: float = PATIENCE,
    after_a_failure: float = AFTER_A_FAILURE,
) -> dict[Any, Any]:
    """In the parent: each worker's result by key (``report``). After a failure it waits a
    little for the others' reports, ends the workers either way, and raises
    ``WorkerFailedError`` naming the workers whose own error it was (not those it stopped)."""
    outcomes: dict[Any, Any] = {}
    failures: dict[Any, str] = {}
    try:
        while len(outcomes) + len(failures) < len(workers):
            progress(f"{len(outcomes)} of {len(workers)} done")
            try:
                key, result = results.get(timeout=after_a_failure if failures else patience)
            except queue.Empty:
                if failures:
                    break
                silent = len(workers) - len(outcomes)
                raise WorkerFailedError(
                    f"{silent} worker(s) reported nothing within {patience:g} s"
                ) from None
            if isinstance(result, str):
                failures[key] = result
            else:
                outcomes[key] = result
    finally:
        for worker in workers:
            worker.join(timeout=60 if len(outcomes) == len(workers) else 0)
            if worker.is_alive():
                worker.terminate()
    if failures:
        causes = [k for k, error in failures.items() if not error.startswith(BROKEN_BARRIER)]
        raise WorkerFailedError(
            "; ".join(f"{name(key)} failed: {failures[key]}" for key in causes or failures)
        )
    return outcomes
