"""diloco-anywhere: DiLoCo across platforms that share nothing but an object store.

The public API (docs/api.md), imported on first use so that ``import diloco_anywhere`` (and
the ``diloco`` CLI) stays quick:

- ``join``: this process's replica of a run (``Replica``), whose ``diloco(model, optimizer)``
  trains any PyTorch loop under torchft's DiLoCo through the bucket (``Training``);
- ``Collective``: the all-reduce alone, from a store URL and this process's name;
- ``BucketManager``: the drop-in for ``torchft.Manager``, for a script that builds torchft's
  ``DiLoCo`` itself (``BucketManager.over(collective)``);
- ``StopRequestedError``: what SIGTERM (``diloco stop``, a preemption) raises in a replica;
- ``DilocoCallback``: a Hugging Face ``transformers.Trainer`` as a replica (it needs
  ``transformers`` and ``accelerate``, loaded only when it is used).
"""

import os
from importlib import import_module
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from diloco_anywhere.collective.plain import Collective
    from diloco_anywhere.training.hf_trainer import DilocoCallback
    from diloco_anywhere.training.managers.bucket import BucketManager
    from diloco_anywhere.training.replica import Replica, StopRequestedError, join
    from diloco_anywhere.training.training import Training


def _installed_version(distribution: str = "diloco-anywhere") -> str:
    """The version of the distribution that installed this package: ``distribution``, or a
    project rendered from the template, which ships this runtime under its own name."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        names = packages_distributions().get(__name__, [distribution])
        return version(names[0])


__version__ = _installed_version()

# In a script the replica entrypoint started (``[task] command``: ``training/command.py``'s
# ``ENV_JOINED`` is set for it), one of this project's mistakes ends the process with its own
# exit code wherever it is raised, from the first import of this package on
# (``training/mistakes/script_end.py``); elsewhere nothing is installed, and the import stays quick.
STARTED_BY_THE_ENTRYPOINT = "DILOCO_JOINED"
if STARTED_BY_THE_ENTRYPOINT in os.environ:
    import_module("diloco_anywhere.training.mistakes.script_end").end_on_mistakes()
__all__ = [
    "BucketManager",
    "Collective",
    "DilocoCallback",
    "Replica",
    "StopRequestedError",
    "Training",
    "__version__",
    "join",
]
_EXPORTS = {
    "BucketManager": "diloco_anywhere.training.managers.bucket",
    "Collective": "diloco_anywhere.collective.plain",
    "DilocoCallback": "diloco_anywhere.training.hf_trainer",
    "Replica": "diloco_anywhere.training.replica",
    "StopRequestedError": "diloco_anywhere.training.replica",
    "Training": "diloco_anywhere.training.training",
    "join": "diloco_anywhere.training.replica",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco_anywhere' has no attribute {name!r}")
