"""Why a round fails, as the replica acts on it: a timeout (wait, or give up), a sealed
contribution that cannot be read (skip the round), a global state unlike the others' (heal),
a model of another size (stop: nothing can fix it by retrying)."""

from __future__ import annotations


class RoundTimeoutError(TimeoutError):
    """No SEAL within the policy's timeout; the message names what is missing and the fix."""


class RoundHopelessError(RuntimeError):
    """No round can seal again: too few of the run's replicas are left (``departures.py``);
    the message names who stopped for good, why, and the fix."""


class SealedContributionError(RuntimeError):
    """A sealed contribution cannot be read back intact; the message names the key."""


class RoundDataMissingError(SealedContributionError):
    """A sealed contribution's manifest or part is gone: garbage collection took the round."""


class DivergedError(SealedContributionError):
    """This replica's global state differs from the sealed contributors': it must heal."""


class ModelMismatchError(RuntimeError):
    """A sealed round is intact but of another size than this replica's model: applying it
    would be wrong on every replica that holds this model, so nothing is skipped or healed."""
