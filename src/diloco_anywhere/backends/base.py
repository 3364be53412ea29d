"""What every launcher does: check it can start, describe, start, report on, show logs of and
stop replicas.

A ``ReplicaSpec`` is platform-neutral: the replica's id and data shard, the environment that
tells the replica entrypoint who it is and where the run lives, and the arguments of the one
command every platform runs, ``python -m diloco_anywhere.replica``. A backend turns specs into
its platform's jobs and returns ``ReplicaHandle``s, small JSON-able records saved in the run
folder, so that ``diloco status``, ``logs`` and ``stop`` work from another shell later.

Secrets never go into a spec, a handle, a ``describe`` output or a log: replicas take store
credentials from their platform's own mechanism (Modal secrets, HF Jobs secrets, an IAM role,
a Kubernetes secret), and launchers take theirs from the platform SDK's usual places.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_anywhere.config import ConfigError, RunConfig, problems

# pending: accepted by the platform, not yet running (queued, scheduling, pulling the image);
# timed_out: ended by the platform's limit on one attempt (Modal's function timeout, HF Jobs'
# timeout, SageMaker's max runtime or spot wait, a Kubernetes deadline), not by a failure or a
# stop: the keeper starts the next attempt (docs/backends.md, "Unattended runs").
JobState = Literal["pending", "running", "exited", "failed", "timed_out", "stopped", "unknown"]
# The job may still be running (or its platform could not say): not to be replaced or forgotten.
ACTIVE_STATES = ("pending", "running", "unknown")
MAX_MESSAGE = 400


class BackendUnavailableError(RuntimeError):
    """A launcher cannot start here: its SDK or credentials are missing. One line: what is
    missing and how to provide it."""


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str  # "{platform}-{k}": unique in the run
    index: int  # data shard, 0 .. replicas - 1 across all platforms
    platform: str
    env: dict[str, str]  # DILOCO_* variables; no secrets
    args: tuple[str, ...]  # after ``python -m diloco_anywhere.replica``
    processes: int = 1  # > 1: one per GPU under torchrun, DDP inside the replica

    def command(self, python: str = "python") -> list[str]:
        """The replica's command: the entrypoint, under ``torchrun`` (``torch.distributed.run``,
        one node, a free port) when the replica has several processes."""
        entrypoint = ["-m", "diloco_anywhere.replica", *self.args]
        if self.processes == 1:
            return [python, *entrypoint]
        torchrun = ["-m", "torch.distributed.run", "--standalone"]
        return [python, *torchrun, f"--nproc-per-node={self.processes}", *entrypoint]


@dataclass(frozen=True)
class ReplicaHandle:
    replica_id: str
    platform: str
    job: dict[str, Any] = field(default_factory=dict)  # the platform's job reference


class BackendSettings(BaseModel):
    """``[backends.<platform>]`` in run.toml: what every platform has. Each backend extends it
    with its own fields; an unknown field is an error, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: Annotated[int, Field(ge=1)] | None = None  # `--backend name` without a count
    processes_per_replica: Annotated[int, Field(ge=1)] = 1  # > 1: torchrun, one per GPU
    image: str | None = None  # remote platforms: overrides [image] ref


SettingsT = TypeVar("SettingsT", bound=BackendSettings)


def backend_settings(config: RunConfig, platform: str, model: type[SettingsT]) -> SettingsT:
    """``[backends.<platform>]`` validated by ``model``; errors name ``backends.<platform>.*``."""
    where = str(config.source or "run.toml")
    try:
        return model.model_validate(config.backends.get(platform, {}))
    except ValidationError as exc:
        raise ConfigError(problems(exc, where, prefix=f"backends.{platform}")) from None


def settings_error(config: RunConfig, platform: str, field: str, message: str) -> ConfigError:
    """A ``[backends.<platform>]`` field that cannot launch, named as the loader names fields."""
    return ConfigError(f"{config.source or 'run.toml'}: backends.{platform}.{field}: {message}")


def import_sdk(module: str, platform: str) -> ModuleType:
    """The platform's SDK, or ``BackendUnavailableError`` saying which extra installs it."""
    try:
        return import_module(module)
    except ImportError:
        raise BackendUnavailableError(
            f"backend {platform} needs the {module.split('.')[0]} package: "
            f"pip install 'diloco-anywhere[{platform}]'"
        ) from None


def one_line(exc: BaseException) -> str:
    """An SDK's error as one short line: some (kubernetes' ApiException) carry HTTP headers
    and bodies over many lines."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def image_of(config: RunConfig, settings: BackendSettings, platform: str) -> str:
    """The image a remote platform starts: ``[backends.<platform>] image`` or ``[image] ref``."""
    image = settings.image or config.image.ref
    if not image:
        raise ConfigError(
            f"{config.source or 'run.toml'}: backend {platform} needs an image: set [image] ref "
            f"(the project image built from images/Dockerfile, e.g. ghcr.io/<owner>/<project>)"
        )
    return image


@dataclass(frozen=True)
class StopReport:
    """What became of the jobs a stop was sent to: a job whose stop failed is named with its
    platform reference, for the user to stop by hand."""

    stopped: list[str]
    left: list[str]

    def __str__(self) -> str:
        said = f"stopped {len(self.stopped)} replicas ({', '.join(self.stopped)})"
        said = said if self.stopped else "none to stop"
        return said + (
            f"; STILL RUNNING, stop by hand: {'; '.join(self.left)}" if self.left else ""
        )


def stop_all(handles: list[ReplicaHandle], stop: Callable[[ReplicaHandle], None]) -> StopReport:
    """Send a stop to every job, carrying on past any that fails."""
    stopped, left = [], []
    for handle in handles:
        try:
            stop(handle)
            stopped.append(handle.replica_id)
        except Exception as exc:  # every job must be reported, whatever its platform said
            left.append(
                f"{handle.replica_id} ({handle.platform} job {handle.job}: {one_line(exc)})"
            )
    return StopReport(stopped, left)


class PartialLaunchError(RuntimeError):
    """A platform failed part-way; ``started`` are the jobs it had started (already told to
    stop; kept so the launch record still names any whose stop failed)."""

    def __init__(self, message: str, started: list[ReplicaHandle]) -> None:
        super().__init__(message)
        self.started = started


def launch_each(
    specs: list[ReplicaSpec],
    start_one: Callable[[ReplicaSpec], ReplicaHandle],
    stop: Callable[[ReplicaHandle], None],
) -> list[ReplicaHandle]:
    """Start one job per spec; if one fails (a quota, most often) or the user presses Ctrl-C,
    stop those this call started before raising, so a platform that fails half-way leaves no
    paid job behind."""
    handles: list[ReplicaHandle] = []
    try:
        for spec in specs:
            handles.append(start_one(spec))
    except Exception as exc:
        raise PartialLaunchError(f"{one_line(exc)}; {stop_all(handles, stop)}", handles) from exc
    except BaseException:
        stop_all(handles, stop)
        raise
    return handles


class Backend(Protocol):
    name: str
    # True: the replica runs the project image elsewhere and reads run.toml from the store
    # (the launcher publishes it there); False: a process here, reading the local file.
    remote: bool
    # Whether ``stop`` ends one replica alone (False on Kubernetes, where one launch's replicas
    # are one Job): a keeper replacing a hung replica stops its job first only where it can,
    # and elsewhere leaves the new incarnation's claim to fence the old process off.
    stops_one_replica: bool

    def check(self) -> None:
        """Raise ``BackendUnavailableError`` (one line) if the SDK or credentials are missing.
        Called for every platform of a launch before any replica starts."""

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """What ``launch`` would submit, as the platform sees it, secret values masked."""

    def launch(self, specs: list[ReplicaSpec], run_dir: Path) -> list[ReplicaHandle]: ...

    # Optional: ``server_dry_run(specs) -> list[dict]``, the platform's own dry run of what
    # ``launch`` would submit (Kubernetes: the API server admits the Job, stores nothing).

    def state(self, handle: ReplicaHandle) -> JobState: ...

    def logs(self, handle: ReplicaHandle) -> str: ...

    def stop(self, handle: ReplicaHandle) -> None:
        """Stop the replica's job; a job that has already ended is left as it is."""

    def attempt_limit(self) -> float | None:
        """Seconds after which the platform ends one attempt of a replica, as configured
        (Modal's function timeout, HF Jobs' timeout, SageMaker's max runtime, a Kubernetes
        deadline); None where nothing ends it. Plans when the keeper must start the next."""

    def hardware(self) -> str:
        """What one replica runs on, as the price table names it (``launching/cost.py``):
        e.g. ``A100-80GB:2`` on Modal, ``a10g-large`` on HF Jobs, ``ml.p4d.24xlarge`` on
        SageMaker; ``""`` where no list price applies (local processes, your own cluster)."""
