"""``[task] command``: any training script as the replica.

Every backend starts the one replica entrypoint (``replica.py``); with ``[task] command`` set
it runs that command instead of the built-in loop, with the replica's identity in the
environment, so the script's ``diloco_anywhere.join()`` (docs/api.md) knows who it is:
``DILOCO_REPLICA_ID``, ``DILOCO_REPLICA_INDEX``, ``DILOCO_PLATFORM``, and run.toml as
``DILOCO_CONFIG`` (its path, for replicas on this machine) or as the published copy in the
store (``DILOCO_CONFIG_KEY``, elsewhere). The launcher, status, stop, restarts and healing then
work as for the built-in loop: they only ever see the entrypoint.

Every replica's command runs in the same folder (run.toml's, or the image's working directory
on a shared volume), so what a script writes of its own (a Trainer's ``output_dir``, a
``torch.save``) is named per replica with its id: ``DILOCO_REPLICA_ID`` in the environment,
and ``$DILOCO_REPLICA_ID`` (or ``${DILOCO_REPLICA_ID}``; likewise ``DILOCO_REPLICA_INDEX`` and
``DILOCO_PLATFORM``) in the command's arguments is replaced by it, as a shell would, since no
shell runs the command: ``["python", "run_clm.py", "--output_dir", "out/$DILOCO_REPLICA_ID"]``.

The entrypoint watches the script through a file the script's ``join`` writes to
(``DILOCO_JOINED``): a script that has not joined the run within ``task.join_timeout`` seconds
is stopped, and one that exits 0 without having trained the run to its end fails the replica,
each with a message saying so, instead of leaving the other replicas waiting for it. A stop
(SIGTERM) is passed on to the script, which records it (``stopped``) as the built-in loop does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco_anywhere import STARTED_BY_THE_ENTRYPOINT
from diloco_anywhere.config import RunConfig
from diloco_anywhere.contract import (
    ENV_CONFIG,
    ENV_PLATFORM,
    ENV_REPLICA_ID,
    ENV_REPLICA_INDEX,
    NOT_RETRIED,
)

# the file the script's join() reports to; its presence also tells the package it is imported
# in a script this entrypoint started (``diloco_anywhere/__init__.py``)
ENV_JOINED = STARTED_BY_THE_ENTRYPOINT
JOINED, DONE = "joined", "done"
STOP_GRACE = 30.0  # seconds a stopped script has to record its stop and exit
POLL = 0.5
# The replica's identity, replaced in the command's arguments: $NAME or ${NAME}
IDENTITY = (ENV_REPLICA_ID, ENV_REPLICA_INDEX, ENV_PLATFORM)
_NAMES = "|".join(IDENTITY)
# $NAME or ${NAME} (no f-string: a rendered project's sources hold no Jinja-like braces)
IDENTITY_VARIABLE = re.compile(r"\$(?:\{(" + _NAMES + r")\}|(" + _NAMES + r")(?![A-Za-z0-9_]))")


class CommandError(RuntimeError):
    """The script did not take part in the run; the message says how and the fix."""


def report(state: str) -> None:
    """Tell the entrypoint that started this script how far it got (``join`` and the end of
    training call it); nothing when the script was not started by one."""
    path = os.environ.get(ENV_JOINED)
    if path:
        Path(path).write_text(state)


def python_command(command: list[str]) -> list[str]:
    """``python`` (or ``python3``) as the command's program means this replica's own
    interpreter, the one with torch and diloco_anywhere, whatever ``PATH`` holds."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def with_identity(command: list[str], environment: dict[str, str]) -> list[str]:
    """``command`` with ``$DILOCO_REPLICA_ID``, ``$DILOCO_REPLICA_INDEX`` and
    ``$DILOCO_PLATFORM`` (or ``${...}``) in its arguments replaced by this replica's, e.g. a
    per-replica ``--output_dir out/$DILOCO_REPLICA_ID``; any other ``$`` stays as written."""
    return [
        IDENTITY_VARIABLE.sub(lambda match: environment[match.group(1) or match.group(2)], part)
        for part in command
    ]


def run_command(config: RunConfig, replica_id: str, index: int, platform: str) -> int:
    """Run ``[task] command`` as replica ``replica_id``; its exit code, or ``CommandError``.
    Whatever interrupts the entrypoint (its SIGTERM handler's error, Ctrl-C) stops the script
    first, then goes on."""
    with tempfile.TemporaryDirectory(prefix="diloco-command-") as folder:
        joined = Path(folder) / "joined"
        environment = {
            **os.environ,
            ENV_REPLICA_ID: replica_id,
            ENV_REPLICA_INDEX: str(index),
            ENV_PLATFORM: platform,
            ENV_JOINED: str(joined),
        }
        if config.source is not None:
            environment[ENV_CONFIG] = str(config.source)
        process = None
        try:
            process = subprocess.Popen(
                with_identity(python_command(config.task.command), environment),
                env=environment,
                cwd=config.source.parent if config.source is not None else None,
            )
            code = _watch(process, joined, config.task.join_timeout, config.task.command)
        except BaseException:
            if process is not None:
                _stop(process)
            raise
        state = joined.read_text() if joined.exists() else ""
    if code < 0:  # killed by a signal: as shells and platforms report it
        code = 128 - code
    if code in NOT_RETRIED:  # a mistake the script said, in its last error line
        print(f"[task] command {config.task.command} exited {code}: not retried", file=sys.stderr)
    elif code != 0:
        print(f"error: [task] command {config.task.command} exited {code}", file=sys.stderr)
    if code == 0 and state != DONE:
        raise CommandError(
            f"[task] command {config.task.command} exited 0 before the run's outer steps were "
            f"trained (it {'joined' if state else 'never called diloco_anywhere.join()'}); "
            f"train inside `with replica.diloco(...)` until training.done (docs/api.md)"
        )
    return code


def _watch(process: subprocess.Popen, joined: Path, join_timeout: float, command: list[str]) -> int:
    deadline = time.monotonic() + join_timeout
    while (code := process.poll()) is None:
        if not joined.exists() and time.monotonic() > deadline:
            _stop(process)
            raise CommandError(
                f"[task] command {command} did not call diloco_anywhere.join() within "
                f"{join_timeout:.0f} s (task.join_timeout): it was stopped. Join the run "
                f"before training (docs/api.md), or raise task.join_timeout"
            )
        time.sleep(POLL)
    return code


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after ``STOP_GRACE`` seconds. A second stop of the entrypoint
    meanwhile is ignored: it must not leave the script running."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
