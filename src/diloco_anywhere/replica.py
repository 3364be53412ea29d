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
``published_config.py``); local ones read the file given by ``--config``. Store
credentials come from the platform's standard environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
AZURE_*), read by the store's SDK, never by us.

Exit codes: 0 when the run's outer steps are done, 2 for a bad run.toml or arguments (nothing
started), 1 when training failed (the reason is printed and recorded in the run's metrics), 143
when stopped by SIGTERM (``diloco stop``, or the platform preempting or evicting the job; also
recorded, as a ``stopped`` event), 3 when superseded: a newer incarnation of this replica id was
started while this process still ran, so it ended itself (a ``superseded`` event;
docs/collective.md, "Membership").
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys

from diloco_anywhere.bucket.layout import check_name, parse_count
from diloco_anywhere.bucket.store import Store, StoreError
from diloco_anywhere.collective.membership import SupersededError
from diloco_anywhere.config import ConfigError, RunConfig, load_config, validate_config
from diloco_anywhere.launching.published_config import ENV_CONFIG_KEY, read_config
from diloco_anywhere.training.command import ENV_CONFIG, run_command
from diloco_anywhere.training.loop import train
from diloco_anywhere.training.session import (
    EXIT_SUPERSEDED,
    Replica,
    StopRequestedError,
    raise_stopped,
)

log = logging.getLogger("diloco_anywhere.replica")
ENV_REPLICA_ID = "DILOCO_REPLICA_ID"
ENV_REPLICA_INDEX = "DILOCO_REPLICA_INDEX"
ENV_PLATFORM = "DILOCO_PLATFORM"
ENV_RUN = "DILOCO_RUN"
ENV_STORE = "DILOCO_STORE"
ENV_REPLICAS = "DILOCO_REPLICAS"
ENV_REPLICA_INDEX_BASE = "DILOCO_REPLICA_INDEX_BASE"
ENV_REPLICA_ID_BASE = "DILOCO_REPLICA_ID_BASE"  # the number in the id of completion index 0
ENV_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in an Indexed Job's pods
EXIT_STOPPED = 128 + signal.SIGTERM  # as shells and platforms report a SIGTERM exit
EXIT_BAD_CONFIG = 2  # run.toml or arguments refused, nothing started: a retry cannot help
# Ends a platform's retry cannot help: a refused run.toml, or a newer incarnation of this id
# running (a retry would supersede it, and be superseded in turn).
NOT_RETRIED = (EXIT_BAD_CONFIG, EXIT_SUPERSEDED)


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


def identity(
    replica_id: str | None, index: int | None, environ: dict[str, str]
) -> tuple[str, int | None]:
    """The replica id and, if given, its data shard: from the arguments, else the launcher's
    variables, else an Indexed Job's completion index counted from the id number and the
    shard of the Job's first replica (``DILOCO_REPLICA_ID_BASE``, ``DILOCO_REPLICA_INDEX_BASE``)."""
    replica_id = replica_id or environ.get(ENV_REPLICA_ID)
    if index is None and environ.get(ENV_REPLICA_INDEX):
        index = _whole_number(environ[ENV_REPLICA_INDEX], ENV_REPLICA_INDEX)
    completion = environ.get(ENV_COMPLETION_INDEX)
    if replica_id is None and completion is not None:
        offset = _whole_number(completion, ENV_COMPLETION_INDEX)
        first = _whole_number(environ.get(ENV_REPLICA_ID_BASE, "0"), ENV_REPLICA_ID_BASE)
        replica_id = f"{environ.get(ENV_PLATFORM, 'k8s')}-{first + offset}"
        base = _whole_number(environ.get(ENV_REPLICA_INDEX_BASE, "0"), ENV_REPLICA_INDEX_BASE)
        index = base + offset if index is None else index
    return check_name(replica_id or "", f"replica id (--replica-id or ${ENV_REPLICA_ID})"), index


def _whole_number(value: str, name: str) -> int:
    number = parse_count(value)
    if number is None:
        raise ValueError(f"${name} = {value!r}: expected a whole number >= 0")
    return number


def configuration(path: str | None, environ: dict[str, str]) -> RunConfig:
    """run.toml: the file given, else the one the entrypoint gave a ``[task] command``
    (``$DILOCO_CONFIG``), else the launcher's published copy, else the embedded run; then the
    launcher's overrides."""
    path = path or environ.get(ENV_CONFIG)
    if path is None and environ.get(ENV_CONFIG_KEY):
        if not environ.get(ENV_STORE):
            raise ConfigError(f"${ENV_CONFIG_KEY} is set but ${ENV_STORE} is not")
        with Store(environ[ENV_STORE]) as store:
            config = read_config(store, environ[ENV_CONFIG_KEY])
    else:
        config = load_config(path)
    return with_overrides(config, environ)


def replica_index(replica_id: str, given: int | None, replicas: int) -> int:
    """The data shard: given, else the trailing number of the id (``modal-3`` -> 3)."""
    if given is None:
        match = re.search(r"(\d+)$", replica_id)
        if match is None:
            raise ValueError(
                f"replica {replica_id!r} has no trailing number: give --replica-index "
                f"or ${ENV_REPLICA_INDEX}"
            )
        given = int(match.group(1))
    if not 0 <= given < replicas:
        raise ValueError(f"replica index {given} is not in 0..{replicas - 1} (run.replicas)")
    return given


OVERRIDES = {"name": ENV_RUN, "store": ENV_STORE, "replicas": ENV_REPLICAS}


def with_overrides(config: RunConfig, environ: dict[str, str]) -> RunConfig:
    """``DILOCO_RUN`` / ``DILOCO_STORE`` / ``DILOCO_REPLICAS`` replace run.name / run.store /
    run.replicas (launchers set them), validated like the file itself."""
    changes = {key: environ[env] for key, env in OVERRIDES.items() if environ.get(env)}
    if not changes:
        return config
    where = f"{config.source or 'run.toml'} with ${' $'.join(OVERRIDES[k] for k in changes)}"
    data = config.model_dump()
    data["run"].update(changes)
    return validate_config(data, where, config.source)


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
    except SupersededError as exc:  # a newer incarnation runs: nothing to restart
        print(f"replica {replica_id}: {exc}", file=sys.stderr)
        return EXIT_SUPERSEDED
    except ConfigError as exc:  # e.g. a sharding unlike the run's: would only fail again
        print(f"error: replica {replica_id}: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (StoreError, ValueError, RuntimeError) as exc:
        print(f"error: replica {replica_id} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
