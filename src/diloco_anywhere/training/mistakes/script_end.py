"""A training script's process ends as its replica does, wherever the script's error arises.

A script may build what checks its mistakes before it enters ``with replica:`` (a ``Trainer``
built first: its ``DilocoCallback`` claims the ``output_dir`` as the Trainer is built), after
it left it, or call ``replica.start()`` and never ``finish()``. An error the script does not
catch would then end the process as Python ends it, exit 1, which platforms and the keeper
retry, with the replica's end unrecorded: ``diloco status`` would show it ``exited`` and the
launch only "its job failed". So ``join()`` makes the replica the process's ending: an error
no ``with`` caught is recorded as the replica's end (a ``failed`` event with the message, its
departure final where no restart can help: ``Replica._end``) before Python prints it, and one
of this project's mistakes (``mistakes.mistake_exit_code``) then ends the process with its own
exit code, which no platform retries. The entrypoint's own loop (``replica.py``) ends the same
way through the same ``Replica._end``.

Python calls ``sys.excepthook`` for an error that reaches the top of the main thread (the
``sys`` docs), before the interpreter finalizes; the end at a normal exit of a script that
called ``start()`` is registered with threading's shutdown hook, the one
``concurrent.futures`` itself uses (``atexit`` runs after its pools are shut, and recording
the end writes through them).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from diloco_anywhere.training.mistakes import mistake_exit_code


class Ending(Protocol):
    """What a replica offers its process: ``__exit__``, recording how it ended; it raises
    ``SystemExit`` with the mistake's exit code where no restart can help."""

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


_ending: weakref.ReferenceType[Ending] | None = None  # the replica this process joined last
_python_hook: Callable[..., object] | None = None  # the hook ours replaced


def end_on_mistakes() -> None:
    """From now on, one of this project's mistakes that nothing catches ends this process
    with its exit code (the package's import in a script the entrypoint started)."""
    global _python_hook
    if _python_hook is None:
        _python_hook, sys.excepthook = sys.excepthook, _end_uncaught


def end_with(replica: Ending) -> None:
    """Make ``replica``'s end the end of this process on an error nothing catches (``join``
    calls it). Held weakly: a replica a test drops is not kept alive by its process's hook."""
    global _ending
    _ending = weakref.ref(replica)
    end_on_mistakes()


def end_at_exit(replica: Ending) -> None:
    """Record ``replica``'s end when the main thread ends, if nothing ended it before
    (``Replica.start``, whose script may never call ``finish``)."""
    threading._register_atexit(_end_now, replica, None, None, None)  # type: ignore[attr-defined]


def _end_uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType) -> None:
    replica = _ending() if _ending is not None else None
    code = mistake_exit_code(error)
    if replica is not None:
        try:
            replica.__exit__(kind, error, tb)
        except SystemExit as mistake:
            code = int(mistake.code or 1)
    assert _python_hook is not None
    _python_hook(kind, error, tb)
    if code is not None:
        if replica is None:  # said by the replica's end where there is one
            print(f"error: {error}", file=sys.stderr)
        _leave(code)


def _end_now(replica: Ending, *exc_info: None) -> None:
    try:
        replica.__exit__(*exc_info)
    except SystemExit as mistake:
        _leave(int(mistake.code or 1))


def _leave(code: int) -> None:
    """Exit now with ``code``: Python's own exit after an uncaught error would be 1, and one
    raised at shutdown is printed and dropped."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
