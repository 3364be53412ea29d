"""A training script's mistakes that no restart can fix, each ending its replica at once with
its own exit code and a message that names the fix (``diloco status`` and ``diloco logs`` show
it), instead of leaving the replica, and the run, waiting on rounds that cannot seal.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco_anywhere import contract
from diloco_anywhere.config import ConfigError


class ScriptMistakeError(RuntimeError):
    """The script cannot take part in the run as written; ``exit_code`` is the replica's."""

    exit_code = 1


class NotSyncingError(ScriptMistakeError):
    """Batches go by but the optimizer given to ``replica.diloco`` takes no step: DiLoCo syncs
    inside that optimizer's ``step()``, so the replica would never sync."""

    exit_code = contract.EXIT_NOT_SYNCING


class TrainingOutsideDilocoError(ScriptMistakeError):
    """The script joined the run and steps an optimizer, but never entered ``replica.diloco``
    (``outside_diloco.py``): a Trainer without ``DilocoCallback``, a loop not wrapped."""

    exit_code = contract.EXIT_NOT_SYNCING


class ModelUnlikeRunError(ScriptMistakeError):
    """The model's initial weights or structure differ from the run's: the replicas' global
    states would never agree."""

    exit_code = contract.EXIT_MODEL_UNLIKE_RUN


class RunCannotGoOnError(ScriptMistakeError):
    """Too few of the run's replicas are left to seal a round, the others having stopped for
    good (``collective/members/departures.py``): not this script's mistake, but no restart of it
    can help until they are fixed and replaced."""

    exit_code = contract.EXIT_RUN_CANNOT_GO_ON


def stop_if_hopeless(why: Callable[[], str | None], waiting: str) -> Callable[[], None]:
    """A check for a replica that waits before its first round (``waiting``: on what): raises
    ``RunCannotGoOnError`` once ``why()`` says no round can seal again, as a round would."""

    def check() -> None:
        if (reason := why()) is not None:
            raise RunCannotGoOnError(f"while {waiting}: {reason}")

    return check


class SharedOutputDirError(ScriptMistakeError):
    """The folder the script writes its own outputs to (a Trainer's ``output_dir``) is another
    replica's of the same run (``output_claims.py``): the two would overwrite each other's
    checkpoints, and a restart resume from the other's. A restart meets it again (exit 2, as a
    refused run.toml: never retried)."""

    exit_code = contract.EXIT_BAD_CONFIG


def mistake_exit_code(error: BaseException) -> int | None:
    """The exit code ``error`` ends a replica's process with, where it is one of this
    project's mistakes that no restart can fix (a script's, or a run.toml or arguments the
    run refuses: exit 2); ``None`` for any other error, which a restart may get past."""
    if isinstance(error, ScriptMistakeError):
        return error.exit_code
    if isinstance(error, ConfigError):
        return contract.EXIT_BAD_CONFIG
    return None
