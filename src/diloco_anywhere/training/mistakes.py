"""A training script's mistakes that no restart can fix, each ending its replica at once with
its own exit code and a message that names the fix (``diloco status`` and ``diloco logs`` show
it), instead of leaving the replica, and the run, waiting on rounds that cannot seal.
"""

from __future__ import annotations

from diloco_anywhere import contract


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
    good (``collective/departures.py``): not this script's mistake, but no restart of it
    can help until they are fixed and replaced."""

    exit_code = contract.EXIT_RUN_CANNOT_GO_ON
