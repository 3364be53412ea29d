"""The launcher's contract with a replica: what every platform passes to the one entrypoint.

Backends pass who a replica is through the environment and may override the run, store and
replica count; a Kubernetes Indexed Job gives all its pods one template, so there the id comes
from the completion index (``identity``). Exit codes tell a platform whether a retry can help
(``NOT_RETRIED``). Launching, the backends, the entrypoint (``replica.py``) and the public API
(``training/session.py``) all read the contract here, so none of them imports another for it:
the entrypoint imports no launching code, and launching and the backends neither the
entrypoint nor torchft.
"""

from __future__ import annotations

import re
import signal

from diloco_anywhere.bucket.format.layout import check_name, parse_count
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, RunConfig, load_config, validate_config
from diloco_anywhere.published_config import (
    ENV_CONFIG_KEY,
    PublishedConfigMissingError,
    read_config,
)

ENV_REPLICA_ID = "DILOCO_REPLICA_ID"
ENV_REPLICA_INDEX = "DILOCO_REPLICA_INDEX"
ENV_PLATFORM = "DILOCO_PLATFORM"
ENV_RUN = "DILOCO_RUN"
ENV_STORE = "DILOCO_STORE"
ENV_REPLICAS = "DILOCO_REPLICAS"
ENV_REPLICA_INDEX_BASE = "DILOCO_REPLICA_INDEX_BASE"
ENV_REPLICA_ID_BASE = "DILOCO_REPLICA_ID_BASE"  # the number in the id of completion index 0
ENV_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in an Indexed Job's pods
ENV_CONFIG = "DILOCO_CONFIG"  # run.toml's path, for replicas on this machine
EXIT_STOPPED = 128 + signal.SIGTERM  # as shells and platforms report a SIGTERM exit
EXIT_BAD_CONFIG = 2  # run.toml or arguments refused, nothing started: a retry cannot help
# A newer incarnation of this replica id took its place (membership.py): not a failure of the
# run, and a restart would only supersede the newer one in turn.
EXIT_SUPERSEDED = 3
# A training script's mistake that a restart would meet again (training/mistakes/__init__.py): it
# trains without stepping the optimizer DiLoCo wraps; its model is unlike the run's.
EXIT_NOT_SYNCING = 4
EXIT_MODEL_UNLIKE_RUN = 5
# Too few replicas are left to seal a round, the others stopped for good by their mistakes
# (collective/members/departures.py): a restart would meet the same until they are replaced.
EXIT_RUN_CANNOT_GO_ON = 6
# Ends a platform's retry cannot help: a refused run.toml, a newer incarnation of this id
# running (a retry would supersede it, and be superseded in turn), a script's mistake, a run
# that cannot go on.
NOT_RETRIED = (EXIT_BAD_CONFIG, EXIT_SUPERSEDED, EXIT_NOT_SYNCING, EXIT_MODEL_UNLIKE_RUN,
               EXIT_RUN_CANNOT_GO_ON)  # fmt: skip


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
    launcher's overrides. A file read where the launcher published the run's copy must train
    with the run's settings (``check_same_training``)."""
    path = path or environ.get(ENV_CONFIG)
    if path is None and environ.get(ENV_CONFIG_KEY):
        return with_overrides(_published(environ), environ)
    config = with_overrides(load_config(path), environ)
    if environ.get(ENV_CONFIG_KEY):
        try:
            published = _published(environ)
        except PublishedConfigMissingError:  # started by hand, or by a test: nothing to match
            return config
        check_same_training(config, with_overrides(published, environ), environ[ENV_CONFIG_KEY])
    return config


def _published(environ: dict[str, str]) -> RunConfig:
    if not environ.get(ENV_STORE):
        raise ConfigError(f"${ENV_CONFIG_KEY} is set but ${ENV_STORE} is not")
    with Store(environ[ENV_STORE]) as store:
        return read_config(store, environ[ENV_CONFIG_KEY])


def check_same_training(config: RunConfig, run: RunConfig, key: str) -> None:
    """``config`` (a file this replica read) must train as ``run`` (the launch's published
    run.toml, at ``key``) does: the same DiLoCo settings, replica counts and sharding. A
    replica of another ``sync_every``, outer learning rate or codec would seal rounds the
    others cannot use, or weigh and step them otherwise, found late if at all. The usual
    causes: run.toml edited after the launch, then a local replica restarted from it; a
    script's ``join("run.toml")`` reading an older copy baked into the image."""
    mine, theirs = config.training_settings(), run.training_settings()
    differ = [f"{name} = {mine[name]!r} here, {theirs[name]!r} in the run"
              for name in theirs if mine.get(name) != theirs[name]]  # fmt: skip
    if differ:
        raise ConfigError(
            f"{config.source or 'run.toml'} trains otherwise than the run's run.toml, which "
            f"its launch published ({key}): {'; '.join(differ)}. Every replica of a launch "
            f"trains with the run's settings: undo the edit (or launch again, which publishes "
            f"the new run.toml to every replica), or call join() without a path"
        )


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
