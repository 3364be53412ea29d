"""What every launcher does: check it can start, describe, start, report on, show logs of and
stop replicas; and what each platform declares about itself.

A platform is one subclass of ``Backend`` in its own module of this package, named as the
module (``backends/modal.py``: ``ModalBackend``, ``name = "modal"``). The abstract methods are
what each platform must do; the rest is shared here: reading ``[backends.<name>]``, the image,
importing the SDK, and starting one job per replica with a rollback if one fails (``launch``).
What a platform can do beyond that is data on its class (``Capabilities``), read by the
launcher, the keeper and the limit plan, and so is what its user must set up for its replicas
to reach the store (``SecretHints``, said by ``diloco infra output``).

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

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, ClassVar, Literal

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

    def command(self, python: str = "python", torchrun: bool = False) -> list[str]:
        """The replica's command: the entrypoint, under ``torchrun`` (``torch.distributed.run``,
        one node, a free port) when the replica has several processes, or when asked (a
        sharded replica of one process needs its process group for FSDP2's device mesh)."""
        entrypoint = ["-m", "diloco_anywhere.replica", *self.args]
        if self.processes == 1 and not torchrun:
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


def one_line(exc: BaseException) -> str:
    """An SDK's error as one short line: some (kubernetes' ApiException) carry HTTP headers
    and bodies over many lines."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


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


@dataclass(frozen=True)
class Capabilities:
    """What a platform can do beyond the methods every one has, declared on its class: the
    launcher, the keeper and the limit plan read these, never probe for methods."""

    # True: the replica runs the project image elsewhere and reads run.toml from the store
    # (the launcher publishes it there, and refuses a store those replicas cannot reach);
    # False: a process here, reading the local file.
    remote: bool
    # Whether ``stop`` ends one replica alone (False on Kubernetes, where one launch's replicas
    # are one Job): a keeper replacing a hung replica stops its job first only where it can,
    # and elsewhere leaves the new incarnation's claim to fence the old process off.
    stops_one_replica: bool
    # What ends an attempt for its age (``attempt_limit()`` says after how long): "none",
    # nothing; "always", a limit the settings may change but not remove (Modal's timeout, HF
    # Jobs' timeout, SageMaker's max runtime); "optional", only one the settings set (a
    # Kubernetes deadline).
    time_limit: Literal["none", "always", "optional"]
    # ``spot_wait_limit()``: with spot capacity, an attempt also ends after waiting for it
    # (SageMaker's MaxWaitTimeInSeconds); the limit plan states it.
    spot_wait: bool = False
    # ``server_dry_run(specs)``: the platform's own dry run of what ``launch`` would submit
    # (Kubernetes: the API server admits the Job, stores nothing): ``--server-dry-run``.
    server_dry_run: bool = False
    # ``exit_code(handle)``: the replica's exit code where the platform keeps it (local
    # processes), which tells the keeper a refused run.toml (2) or a superseded replica (3).
    exit_codes: bool = False


@dataclass(frozen=True)
class SecretHints:
    """What the user must still provide for a platform's replicas to reach the run's store,
    by the store's cloud, as ``diloco infra output`` says it: a command with placeholders, or
    a sentence, never a value (Terraform makes no key: docs/infra.md). ``{run}`` stands for
    the run's name. None: nothing to say (the replicas have the store as they are)."""

    aws: str | None = None  # the store on S3 (infra/aws)
    gcp: str | None = None  # on GCS (infra/gcp; also said for another Terraform folder)
    hf: str | None = None  # a Hugging Face Storage Bucket
    # On S3, the replicas run outside AWS and need an IAM user's access key: `diloco infra
    # output` says how to make one (the ``replica_user_name`` output).
    aws_key: bool = False

    def for_cloud(self, cloud: str, run: str) -> str | None:
        """The hint for a store on ``cloud`` (``aws``, ``hf``; any other: ``gcp``'s)."""
        hint = {"aws": self.aws, "hf": self.hf}.get(cloud, self.gcp)
        return None if hint is None else hint.format(run=run)


class Backend(abc.ABC):
    """One platform's launcher. A subclass that sets ``name`` is a platform: it declares its
    ``capabilities`` and ``secret_hints`` too (checked when the class is made), and is
    registered under that name (``Backend.registry``; ``backends.get_backend`` builds one).
    A subclass that does not set ``name`` is a variant of its parent's platform."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    secret_hints: ClassVar[SecretHints]
    # The model of ``[backends.<name>]`` in run.toml; a platform extends BackendSettings.
    settings_model: ClassVar[type[BackendSettings]] = BackendSettings
    # Every platform by name, filled as their modules are imported.
    registry: ClassVar[dict[str, type[Backend]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        undeclared = [a for a in ("capabilities", "secret_hints") if a not in cls.__dict__]
        if undeclared:
            raise TypeError(f"backend {cls.name!r} ({cls.__qualname__}) must declare "
                            f"{' and '.join(undeclared)}")  # fmt: skip
        known = Backend.registry.get(cls.name)
        where = (cls.__module__, cls.__qualname__)
        if known is not None and (known.__module__, known.__qualname__) != where:
            raise TypeError(f"backend {cls.name!r} is {known.__qualname__} already")
        Backend.registry[cls.name] = cls

    def __init__(self, config: RunConfig | None = None) -> None:
        """``[backends.<name>]`` validated by ``settings_model``; errors name
        ``backends.<name>.*``. Settings only: ``diloco status``, ``logs`` and ``stop`` build
        a backend from the current run.toml to reach jobs already started."""
        self.config = config or RunConfig()
        where = str(self.config.source or "run.toml")
        try:
            self.settings = self.settings_model.model_validate(
                self.config.backends.get(self.name, {})
            )
        except ValidationError as exc:
            raise ConfigError(problems(exc, where, prefix=f"backends.{self.name}")) from None

    # -- what every platform does ----------------------------------------------------------

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``BackendUnavailableError`` (one line) if the SDK or credentials are missing.
        Called for every platform of a launch before any replica starts."""

    @abc.abstractmethod
    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """What ``launch`` would submit, as the platform sees it, secret values masked."""

    def launch(self, specs: list[ReplicaSpec], run_dir: Path) -> list[ReplicaHandle]:
        """Start ``specs``, one job each (``starter``); if one fails, or the user presses
        Ctrl-C, the jobs this call started are stopped before the error goes on
        (``launch_each``), so a platform failing half-way leaves no paid job behind. A
        platform that starts its replicas together (Kubernetes: one Job) overrides this."""
        return launch_each(specs, self.starter(specs, run_dir), self.stop)

    def starter(
        self, specs: list[ReplicaSpec], run_dir: Path
    ) -> Callable[[ReplicaSpec], ReplicaHandle]:
        """For ``launch``: does what the launch's jobs share (deploys an app, reads the
        secrets, makes a client) and returns what starts one spec's job and returns its
        handle. Every platform defines this or ``launch``."""
        raise NotImplementedError(f"backend {self.name} defines launch, not starter")

    @abc.abstractmethod
    def state(self, handle: ReplicaHandle) -> JobState:
        """The replica's job state, as the platform reports it."""

    @abc.abstractmethod
    def logs(self, handle: ReplicaHandle) -> str:
        """The replica's output as the platform keeps it."""

    @abc.abstractmethod
    def stop(self, handle: ReplicaHandle) -> None:
        """Stop the replica's job; a job that has already ended is left as it is."""

    @abc.abstractmethod
    def attempt_limit(self) -> float | None:
        """Seconds after which the platform ends one attempt of a replica, as configured
        (Modal's function timeout, HF Jobs' timeout, SageMaker's max runtime, a Kubernetes
        deadline); None where nothing ends it. Plans when the keeper must start the next."""

    @abc.abstractmethod
    def hardware(self) -> str:
        """What one replica runs on, as the price table names it (``launching/cost/prices.py``):
        e.g. ``A100-80GB:2`` on Modal, ``a10g-large`` on HF Jobs, ``ml.p4d.24xlarge`` on
        SageMaker; ``""`` where no list price applies (local processes, your own cluster)."""

    # -- what some platforms do: see ``capabilities`` ----------------------------------------

    def server_dry_run(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """With ``capabilities.server_dry_run``: the platform's own verdict on what ``launch``
        would submit; nothing is stored or started."""
        raise NotImplementedError(f"backend {self.name} has no server-side dry run")

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """With ``capabilities.exit_codes``: the replica's exit code, None while it runs or
        where the platform does not say."""
        return None

    def spot_wait_limit(self) -> float | None:
        """With ``capabilities.spot_wait``: seconds an attempt may wait for spot capacity and
        run, in all; None when it does not run on spot capacity."""
        return None

    # -- shared by the platforms ------------------------------------------------------------

    def image(self) -> str:
        """The image a remote platform starts: ``[backends.<name>] image`` or ``[image]
        ref``."""
        image = self.settings.image or self.config.image.ref
        if not image:
            raise ConfigError(
                f"{self.config.source or 'run.toml'}: backend {self.name} needs an image: set "
                f"[image] ref (the project image built from images/Dockerfile, e.g. "
                f"ghcr.io/<owner>/<project>)"
            )
        return image

    def import_sdk(self, module: str) -> ModuleType:
        """The platform's SDK, or ``BackendUnavailableError`` saying which extra installs it."""
        extra = self.name.replace("_", "-")  # extras are named normalized (PEP 685)
        try:
            return import_module(module)
        except ImportError:
            raise BackendUnavailableError(
                f"backend {self.name} needs the {module.split('.')[0]} package: "
                f"pip install 'diloco-anywhere[{extra}]'"
            ) from None

    def settings_error(self, field: str, message: str) -> ConfigError:
        """A ``[backends.<name>]`` field that cannot launch, named as the loader names
        fields."""
        return ConfigError(
            f"{self.config.source or 'run.toml'}: backends.{self.name}.{field}: {message}"
        )
