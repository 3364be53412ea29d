"""Worker processes for benchmarks and tests (bench/tools/processes.py): started from a server that
has imported the package once, with their parent's environment of the moment."""

from __future__ import annotations

import os
import sys

import pytest

from diloco_anywhere.bench.tools.processes import worker_context

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
