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
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_anywhere.config import ConfigError, RunConfig, problems

# pending: accepted by the platform, not yet running (queued, scheduling, pulling the image)
JobState = Literal["pending", "running", "exited", "failed", "stopped", "unknown"]


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


def image_of(config: RunConfig, settings: BackendSettings, platform: str) -> str:
    """The image a remote platform starts: ``[backends.<platform>] image`` or ``[image] ref``."""
    image = settings.image or config.image.ref
    if not image:
        raise ConfigError(
            f"{config.source or 'run.toml'}: backend {platform} needs an image: set [image] ref "
            f"(the project image built from images/Dockerfile, e.g. ghcr.io/<owner>/<project>)"
        )
    return image


def stop_all(handles: list[ReplicaHandle], stop: Callable[[ReplicaHandle], None]) -> str:
    """Stop every job of a launch that failed part-way; what became of them, in words. A job
    whose stop fails is named with its platform reference: the user must stop it by hand."""
    stopped, left = [], []
    for handle in handles:
        try:
            stop(handle)
            stopped.append(handle.replica_id)
        except Exception as exc:  # every job must be reported, whatever its platform said
            left.append(f"{handle.replica_id} ({handle.platform} job {handle.job}: {exc})")
    said = f"stopped the {len(stopped)} replicas already started" if stopped else "none started"
    return said + (f"; STILL RUNNING, stop by hand: {'; '.join(left)}" if left else "")


def launch_each(
    specs: list[ReplicaSpec],
    start_one: Callable[[ReplicaSpec], ReplicaHandle],
    stop: Callable[[ReplicaHandle], None],
) -> list[ReplicaHandle]:
    """Start one job per spec; if one fails (a quota, most often), stop those this call
    started before raising, so a platform that fails half-way leaves no paid job behind."""
    handles: list[ReplicaHandle] = []
    try:
        for spec in specs:
            handles.append(start_one(spec))
    except Exception as exc:
        raise RuntimeError(f"{exc}; {stop_all(handles, stop)}") from exc
    return handles


class Backend(Protocol):
    name: str
    # True: the replica runs the project image elsewhere and reads run.toml from the store
    # (the launcher publishes it there); False: a process here, reading the local file.
    remote: bool

    def check(self) -> None:
        """Raise ``BackendUnavailableError`` (one line) if the SDK or credentials are missing.
        Called for every platform of a launch before any replica starts."""

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """What ``launch`` would submit, as the platform sees it, secret values masked."""

    def launch(self, specs: list[ReplicaSpec], run_dir: Path) -> list[ReplicaHandle]: ...

    def state(self, handle: ReplicaHandle) -> JobState: ...

    def logs(self, handle: ReplicaHandle) -> str: ...

    def stop(self, handle: ReplicaHandle) -> None:
        """Stop the replica's job; a job that has already ended is left as it is."""
