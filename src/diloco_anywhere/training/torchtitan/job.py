"""A torchtitan job's config, set to train as a replica of the run (``for_the_run``).

A torchtitan 0.3.0 job is a function returning a ``Trainer.Config``, picked with ``--module``
and ``--config`` and overridden from the command line (``config/manager.py``
``ConfigManager.parse_args``); that stays the user's. What the run decides is then set on it,
each with a line in the log where it replaces what the job asked for:

- ``training.steps``: the run's inner steps (``outer_steps x sync_every``), which the
  learning-rate schedule spans (its ``total_steps`` defaults to it);
- ``dataloader``: with run.toml's ``[task] data``, the run's loader (``run_data.py``), so
  that the job's own dataset is never opened;
- ``checkpoint.enable = False``: the run's global checkpoints and the replica's own state
  hold the model, the outer optimizer and the data position, and a heal restores them; a
  second checkpointer of its own would resume the trainer elsewhere than the run;
- ``debug.seed``: 0 where the job gives none, since with none torchtitan seeds from the
  clock, and every replica of a DiLoCo run starts from the same weights
  (``state/initial_state.py`` checks it);
- on a CPU, its attention computed the CPU's way (``cpu.cpu_attention``).

Only torchtitan's core ``Trainer`` is trained so: a job built for another trainer (its
``experiments/torchft`` fault tolerance, whose manager needs a Lighthouse) is refused, saying
to use the model's own config, as the run takes the place of that fault tolerance; so is
pipeline parallelism, whose model parts a replica cannot sync as one model.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.trainer import Trainer

from diloco_anywhere import contract
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.mistakes import ScriptMistakeError
from diloco_anywhere.training.torchtitan.cpu import cpu_attention
from diloco_anywhere.training.torchtitan.run_data import RunDataLoader

log = logging.getLogger(__name__)
DEFAULT_SEED = 0


class TorchtitanJobError(ScriptMistakeError):
    """The job cannot train as a replica (the message says why and what to change): refused
    before anything starts, with an exit code no platform retries."""

    exit_code = contract.EXIT_BAD_CONFIG


def for_the_run(config: Any, run: RunConfig) -> Any:
    """``config`` (the job's ``Trainer.Config``) with what the run decides set on it."""
    owner = type(config)._owner
    if owner is not Trainer:
        raise TorchtitanJobError(
            f"the job's config builds {owner.__module__}.{owner.__name__}; a replica trains "
            f"torchtitan's core Trainer (torchtitan.trainer.Trainer), the run taking the place "
            f"of fault tolerance: use the model's own config (e.g. --module llama3 --config "
            f"llama3_debugmodel), not an experiment's"
        )
    if config.parallelism.pipeline_parallel_degree > 1:
        raise TorchtitanJobError(
            f"parallelism.pipeline_parallel_degree = "
            f"{config.parallelism.pipeline_parallel_degree}: pipeline parallelism splits the "
            f"model into parts, and a replica syncs one model; run the replica without it "
            f"(FSDP, tensor and context parallelism are fine)"
        )
    _set(config.training, "steps", run.diloco.total_steps, "the run's inner steps")
    if run.task.data:
        _set(config, "dataloader", RunDataLoader.Config(), "run.toml's [task] data is the data")
    _set(config.checkpoint, "enable", False, "the run's global checkpoints hold the state")
    if config.debug.seed is None:
        _set(config.debug, "seed", DEFAULT_SEED, "every replica starts from the same weights")
    return cpu_attention(config)


def _set(section: Any, name: str, value: Any, why: str) -> None:
    job = getattr(section, name)
    if job != value:
        log.info("%s.%s = %r replaced by %r: %s", type(section).__name__, name, job, value, why)
    setattr(section, name, value)
