"""Runs the checks in order, each in a fresh process (``one.py``) under its own time limit and
within the whole run's budget, and writes what they found: ``gpu-check.json`` (the device,
the environment, every check's outcome and numbers) and each check's log, into ``out`` (the
device tool's ``$OUT``, so they come back with the call).

A check that outlives its limit is killed with every process it started, replicas and
``torchrun`` included (they run in sessions of their own, so they are found by a marker in
their environment): the next check gets the device to itself. A check that would start with
less than ``MIN_SECONDS`` of the budget left is skipped, saying so: a rerun can take it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_anywhere.backends.local import zombie
from diloco_anywhere.bench.gpu.outcome import Outcome, skipped
from diloco_anywhere.bench.gpu.plan import CHECKS, LIMIT_SCALE, Check

MARKER = "DILOCO_GPU_CHECK"  # in the environment of every process a check starts
MIN_SECONDS = 30.0
LOG_TAIL = 3000  # characters of a failed check's log in its reason


@dataclass
class Ran:
    """A check's row in the summary."""

    name: str
    title: str
    limit: float
    seconds: float
    outcome: Outcome

    def as_dict(self) -> dict[str, Any]:
        row = {"name": self.name, "title": self.title, "limit": self.limit}
        return {**row, "seconds": self.seconds, **self.outcome.as_dict()}


def kill_marked(marker: str, wait: float = 30.0) -> None:
    """SIGKILL every process whose environment holds ``MARKER=marker`` (Linux's /proc), and
    wait up to ``wait`` s until each has ended: a killed process holds its GPU memory until
    it is gone, and the next check needs the device to itself."""
    wanted, killed = f"{MARKER}={marker}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    deadline = time.monotonic() + wait
    while any(map(running, killed)) and time.monotonic() < deadline:
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and has not ended (a zombie has: it waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not zombie(pid)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL:] if path.exists() else ""


def run_one(check: Check, device: str, work: Path, limit: float, out: Path) -> Ran:
    """``check`` in a process of its own, killed with all it started after ``limit`` s."""
    work.mkdir(parents=True)
    result, log_path = work / "result.json", out / f"gpu-check-{check.name}.log"
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "diloco_anywhere.bench.gpu.one", check.target, device,
               str(work / "files"), str(result)]  # fmt: skip
    environment = {**os.environ, MARKER: marker, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=environment, start_new_session=True,
        )  # fmt: skip
        try:
            process.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_marked(marker)
            process.wait()
    if timed_out:
        outcome = Outcome("FAIL", reason=f"timed out after {limit:.0f} s; its log ends:\n"
                                         f"{_tail(log_path)}")  # fmt: skip
    elif result.exists():
        outcome = Outcome(**json.loads(result.read_text()))
    else:
        outcome = Outcome("FAIL", reason=f"exited {process.returncode} with no outcome; its "
                                         f"log ends:\n{_tail(log_path)}")  # fmt: skip
    return Ran(check.name, check.title, limit, time.monotonic() - started, outcome)


def run_checks(
    device: str,
    names: list[str],
    budget: float,
    out: Path,
    environment: dict[str, Any],
    report: Callable[[Ran], None],
    starting: Callable[[Check, float], None] = lambda *_: None,
) -> dict[str, Any]:
    """The named checks in order; ``starting(check, limit)`` before each and ``report(ran)``
    after; the summary (also written), with ``environment`` (``environment.describe``)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-gpu-check-") as scratch:
        for check in (check for check in CHECKS if check.name in names):
            left = budget - (time.monotonic() - started)
            if left < MIN_SECONDS:
                ran = Ran(check.name, check.title, 0.0, 0.0, skipped(
                    f"{left:.0f} s of the {budget:.0f} s budget left: rerun with --only "
                    f"{check.name}"))  # fmt: skip
            else:
                limit = min(check.seconds * LIMIT_SCALE[device], left)
                starting(check, limit)
                ran = run_one(check, device, Path(scratch, check.name), limit, out)
            rows.append(ran)
            report(ran)
    summary = {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget": budget, "seconds": time.monotonic() - started,
        "environment": environment, "checks": [row.as_dict() for row in rows],
    }  # fmt: skip
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
