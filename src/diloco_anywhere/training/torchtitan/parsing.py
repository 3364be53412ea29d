"""A torchtitan job's config from torchtitan's own command line (``--module M --config F
[--section.key value]``), as the replica, ``hf_export`` and a project's own tests read it:
torchtitan's modules are imported only after the version check and the CPU changes."""

from __future__ import annotations

from typing import Any

from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.torchtitan.cpu import check_version, prepare_cpu


def parse_job(arguments: list[str]) -> Any:
    """The ``Trainer.Config`` that ``arguments`` name (torchtitan's ``ConfigManager``), on the
    torchtitan version tested (``check_version``) with the CPU changes made first: the job's
    module imports torchtitan's, which bind the device type at import."""
    check_version()
    prepare_cpu()
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(arguments)


def replica_job(arguments: list[str], run: RunConfig) -> Any:
    """The job ``arguments`` name, with what ``run`` decides set on it (``job.for_the_run``):
    the config a replica trains."""
    job = parse_job(arguments)
    from diloco_anywhere.training.torchtitan.job import for_the_run  # imports torchtitan's

    return for_the_run(job, run)
