"""What every ``diloco`` command shares: consoles, one-line errors, a progress spinner, sizes."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from diloco_anywhere.backends.base import BackendUnavailableError
from diloco_anywhere.bench.tools.processes import WorkerFailedError
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.config import ConfigError
from diloco_anywhere.launching.start.infra import InfraError
from diloco_anywhere.launching.start.launch import LaunchError
from diloco_anywhere.launching.start.launches import LaunchTakenError
from diloco_anywhere.launching.watch.status import finite_or_null
from diloco_anywhere.launching.watch.tracking import TrackerUnavailableError
from diloco_anywhere.standins import StandInUnavailableError

CONFIG_OPTION = typer.Option(
    "--config", help="run.toml of the run. Default: the embedded demo run (4 local replicas)."
)
JSON_OPTION = typer.Option("--json", help="Print JSON instead of a table (for scripts).")
ConfigPath = Annotated[Path | None, CONFIG_OPTION]
JsonFlag = Annotated[bool, JSON_OPTION]
DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

stdout = Console()
stderr = Console(stderr=True)

SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
}  # fmt: skip
MIN_BENCH_SIZE = 1024
USER_ERRORS = (
    StoreError, StandInUnavailableError, ConfigError, ValueError, FileNotFoundError,
    BackendUnavailableError, LaunchError, LaunchTakenError, InfraError, TrackerUnavailableError,
    WorkerFailedError,
)  # fmt: skip


def print_json(value: object) -> None:
    """Print ``value`` as standard JSON for scripts: a NaN loss or an infinite ratio is
    ``null`` (``json.dumps`` would print ``NaN``/``-Infinity``, which JSON parsers reject)."""
    print(json.dumps(finite_or_null(value), indent=2, allow_nan=False))


def parse_duration(text: str, option: str, minimum: float = 0.0) -> float:
    """``600``, ``90s``, ``10m``, ``1.5h`` or ``2d`` -> seconds (at least ``minimum``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2)] if match else 0.0
    if seconds < max(minimum, 1e-9):
        raise typer.BadParameter(
            f"{option} {text!r}: give a duration of at least {minimum:g} s, as a number "
            f"followed by s, m, h or d (e.g. 10m)"
        )
    return seconds


def parse_size(text: str) -> int:
    """``67108864``, ``64MiB``, ``64M`` (binary) or ``64MB`` (decimal) -> bytes (>= 1 KiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    size = int(float(match.group(1)) * SIZE_UNITS[unit]) if unit in SIZE_UNITS else 0
    if size < MIN_BENCH_SIZE:
        raise typer.BadParameter(
            f"{text!r}: give at least {MIN_BENCH_SIZE} bytes, as a number optionally followed "
            f"by KiB, MiB, GiB, KB, MB or GB"
        )
    return size


@contextmanager
def progress_display() -> Iterator[Callable[[str], None]]:
    """A spinner on stderr showing the current step (stdout stays clean for --json)."""
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=stderr, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task("starting")
        yield lambda step: progress.update(task, description=step)


@contextmanager
def user_errors() -> Iterator[None]:
    """Errors a user can fix print as one line, not a traceback."""
    try:
        yield
    except USER_ERRORS as exc:
        # escaped: messages quote run.toml sections ("[image] ref"), which rich reads as markup
        stderr.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@contextmanager
def interrupted_by_sigterm() -> Iterator[None]:
    """Within it, SIGTERM (a CI runner cancelling, ``kill``) interrupts as Ctrl-C does, so a
    command following a launch stops what it started instead of dying with it running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
