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
