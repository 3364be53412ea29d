"""The replica entrypoint every backend starts: ``python -m diloco_anywhere.replica``.

    python -m diloco_anywhere.replica [--config run.toml] [--replica-id ID] [--replica-index I]

Backends pass who this replica is through the environment (``DILOCO_REPLICA_ID``,
``DILOCO_REPLICA_INDEX``, ``DILOCO_PLATFORM``) and may override the run and store
(``DILOCO_RUN``, ``DILOCO_STORE``), so one image and one command serve every platform. A
Kubernetes Indexed Job gives all its pods one template, so there the id is
``{DILOCO_PLATFORM}-{n}`` with ``n`` = ``DILOCO_REPLICA_ID_BASE`` plus ``JOB_COMPLETION_INDEX``,
and the shard ``DILOCO_REPLICA_INDEX_BASE`` plus that index: a Job that starts replica
``k8s-1`` again alone has one completion, id base 1 and that replica's shard as index base.
Remote replicas read run.toml from the store (``DILOCO_CONFIG_KEY``, published by the launcher:
``published_config.py``); local ones read the file given by ``--config``. The names, exit codes
and identity rules are the launcher's contract (``contract.py``). Store credentials come from
the platform's standard environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_*), read by
the store's SDK, never by us.

Exit codes: 0 when the run's outer steps are done, 2 for a bad run.toml or arguments (nothing
started), 4-6 for a script's mistake no restart can fix (``training/mistakes/__init__.py``; the same
code wherever it is raised: ``training/mistakes/script_end.py``), 1 when training failed (the reason
is printed and recorded in the run's metrics), 143 when stopped by SIGTERM (``diloco stop``, or
the platform preempting or evicting the job; also recorded, as a ``stopped`` event), 3 when
superseded: a newer incarnation of this replica id was started while this process still ran,
so it ended itself (a ``superseded`` event; docs/collective.md, "Membership").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.collective.members.membership import SupersededError
from diloco_anywhere.config import ConfigError, RunConfig
from diloco_anywhere.contract import (
    ENV_CONFIG_KEY,
    ENV_PLATFORM,
    ENV_REPLICA_ID,
    ENV_REPLICA_INDEX,
    EXIT_BAD_CONFIG,
    EXIT_STOPPED,
    EXIT_SUPERSEDED,
    configuration,
    identity,
    replica_index,
)
from diloco_anywhere.training.command import run_command
from diloco_anywhere.training.loop import train
from diloco_anywhere.training.mistakes import mistake_exit_code
from diloco_anywhere.training.ranks.replica_group import leave_rank
from diloco_anywhere.training.replica import Replica, StopRequestedError, raise_stopped

log = logging.getLogger("diloco_anywhere.replica")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m diloco_anywhere.replica",
        description="Train one DiLoCo replica of the run that run.toml describes.",
    )
    parser.add_argument(
        "--config",
        help=f"run.toml (default: the one the launcher published, ${ENV_CONFIG_KEY}, else the "
        f"embedded demo run)",
    )
    parser.add_argument("--replica-id", help=f"or ${ENV_REPLICA_ID}")
    parser.add_argument(
        "--replica-index",
        type=int,
        help=f"data shard, 0..replicas-1 (or ${ENV_REPLICA_INDEX}; default: the id's number)",
    )
    return parser.parse_args(argv)


def run_replica(config: RunConfig, replica_id: str, index: int, platform: str) -> int:
    """Train this replica with the built-in loop; under ``torchrun`` only rank 0 talks to the
    bucket (``replica_group.py``)."""
    with Replica(config, replica_id, index, platform) as replica:
        result = train(replica)
    log.info("replica %s done: %s", replica_id, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    arguments = _arguments(argv)
    environ = dict(os.environ)
    try:
        config = configuration(arguments.config, environ)
        replica_id, given_index = identity(arguments.replica_id, arguments.replica_index, environ)
        index = replica_index(replica_id, given_index, config.run.replicas)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except StoreError as exc:  # reading the published run.toml: may pass, so not exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, raise_stopped)
    platform = os.environ.get(ENV_PLATFORM, "local")
    try:
        if config.task.command:
            return run_command(config, replica_id, index, platform)
        return run_replica(config, replica_id, index, platform)
    except StopRequestedError as exc:
        print(f"replica {replica_id}: {exc}", file=sys.stderr, flush=True)
        # At once: the stop is recorded, and rounds in flight (their threads would hold the
        # interpreter's exit) are abandoned; the bucket's lifecycle rule expires their objects.
        os._exit(EXIT_STOPPED)
    except SystemExit as ended:  # a mistake, recorded and said where the replica ended
        return ended.code if isinstance(ended.code, int) else 1
    except (SupersededError, StoreError, ValueError, RuntimeError) as exc:
        return failure_exit_code(replica_id, exc)


def failure_exit_code(replica_id: str, error: Exception) -> int:
    """Say why training ended and return the exit code that tells the launcher and keeper
    what to do: superseded (a newer incarnation runs: nothing to restart), a mistake no
    restart fixes (its own code), or a failure a restart may fix (1)."""
    if isinstance(error, SupersededError):
        print(f"replica {replica_id}: {error}", file=sys.stderr)
        return EXIT_SUPERSEDED
    if (code := mistake_exit_code(error)) is not None:  # would only fail again
        print(f"error: replica {replica_id}: {error}", file=sys.stderr)
        return code
    print(f"error: replica {replica_id} failed: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    leave_rank(main())
