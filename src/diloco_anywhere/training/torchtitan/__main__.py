"""A torchtitan job as this replica, started with torchtitan's own arguments (those of
``python -m torchtitan.train``) as run.toml's ``[task] command`` (docs/api.md, "torchtitan as a
replica"), under ``torchrun`` for a replica of several processes::

    python -m diloco_anywhere.training.torchtitan --module M --config F [--section.key value]

It does what ``torchtitan.train.main`` does, with the run's say over the job
(``job.for_the_run``) and the trainer joined to the run (``trainer.DilocoTrainer``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from diloco_anywhere import contract
from diloco_anywhere.training.mistakes import ScriptMistakeError
from diloco_anywhere.training.torchtitan.parsing import replica_job


def one_process_group() -> None:
    """torchtitan sets up its processes' group from ``torchrun``'s variables; a replica of one
    process started without ``torchrun`` gets them as ``torchrun --nproc-per-node 1`` sets
    them, its rendezvous on a port the system picks (``MASTER_PORT=0``: one process has no
    other to tell the port to)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
        )  # fmt: skip


def main(arguments: list[str]) -> None:
    """``train_the_job``; a job refused before it joined the run says why, and exits with a code no
    platform retries (a refusal after it joined is the replica's end, ``Replica._end``)."""
    try:
        train_the_job(arguments)
    except ScriptMistakeError as refused:
        print(f"error: {refused}", file=sys.stderr, flush=True)
        sys.exit(refused.exit_code)


def train_the_job(arguments: list[str]) -> None:
    run_config = contract.configuration(None, dict(os.environ))
    config = replica_job(arguments, run_config)  # the version checked, the CPU changes made
    from torchtitan.tools.logging import init_logger

    from diloco_anywhere.training.replica import join
    from diloco_anywhere.training.torchtitan.trainer import DilocoTrainer

    init_logger()
    one_process_group()
    trainer = DilocoTrainer(config)
    try:
        with join(run_config) as replica:
            trainer.train_replica(replica)
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
