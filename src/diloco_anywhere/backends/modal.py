"""Modal: one deployed App per run, one Function call per replica.

At launch the launcher builds a Modal App from run.toml: one Function, ``run_replica``, in the
project image (``Image.from_registry``), with the GPUs, timeout and retry policy of
``[backends.modal]`` and the store credentials from Modal Secrets, which Modal puts in the
container's environment (https://modal.com/docs/guide/secrets). It deploys the App
(``App.deploy``) and spawns one call per replica (``Function.spawn``,
https://modal.com/docs/guide/job-queue); each call's id is the replica's handle, so status,
logs and stop work from any shell through ``FunctionCall.from_id``. A call runs the replica
entrypoint as a subprocess (under ``torchrun`` for several GPUs) and raises if it fails, so
Modal's retries start it again, except when the replica refused its run.toml (exit 2), which
would only fail again; a preempted GPU container is restarted on the same input
(https://modal.com/docs/guide/preemption). Modal ends each attempt of a call at the function's
timeout, at most 24 hours (https://modal.com/docs/guide/timeouts), a timeout using up a retry; a
call whose last attempt timed out raises ``FunctionTimeoutError``, read as ``timed_out``. Modal
attaches at most 8 GPUs to a container
(https://modal.com/docs/guide/gpu). The launcher's token is the SDK's own: ``modal token new``,
or ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, field_validator, model_validator

from diloco_anywhere.backends.base import (
    ACTIVE_STATES,
    Backend,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    SecretHints,
)
from diloco_anywhere.bucket import hf_buckets
from diloco_anywhere.bucket.format.layout import parse_count
from diloco_anywhere.config import RunConfig
from diloco_anywhere.contract import NOT_RETRIED

if TYPE_CHECKING:
    import modal

# Modal's GPU names (https://modal.com/docs/guide/gpu). The SDK has no list to take them from:
# its parser (modal._utils.function_utils.parse_gpu_config) accepts any name and Modal's
# servers judge it at deploy time, and the GPUType enum in its protocol is frozen ("no longer
# used by current clients - don't add new types") and lacks B200, H100! and RTX-PRO-6000.
GPU_NAMES = (
    "T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB", "RTX-PRO-6000",
    "H100", "H100!", "H200", "B200", "B200+",
)  # fmt: skip
GPUS_PER_CONTAINER = {"A10": 4, "A10G": 4}  # the others: up to 8
MAX_GPUS = 8
MAX_TIMEOUT_HOURS = 24  # Modal's longest function timeout
RETRY_DELAY = 10.0  # seconds before the first retry; doubled after each
STOP_GRACE = 20.0  # seconds a replica gets to record its stop before it is killed
LOG_ENTRIES = 2000


class ReplicaExitError(RuntimeError):
    """The replica command exited non-zero (and not in ``NOT_RETRIED``): raised so that Modal
    counts the call as failed and retries it."""


def run_replica(env: dict[str, str], command: list[str]) -> int:
    """The body of every replica's Modal call: ``command`` with this container's environment
    (where Modal put the Secrets' store credentials) plus ``env`` (the replica's ``DILOCO_*``
    variables). A subprocess rather than a call into the entrypoint, so that ``torchrun`` can
    start one process per GPU. A cancelled or preempted call is interrupted here by an
    exception; the replica then gets SIGTERM, so it records that it stopped before the
    container goes. Its output goes to the container's, which is the call's log.

    A replica that refused its run.toml (exit 2) would refuse it again, and one superseded by
    a newer incarnation (exit 3) would supersede that one: its code is returned, not raised,
    so that Modal does not retry it; ``state`` reads it as failed."""
    child = subprocess.Popen(command, env={**os.environ, **env})
    try:
        code = child.wait()
    except BaseException:
        _terminate(child)
        raise
    if code not in (0, *NOT_RETRIED):  # the message names the command, never the env
        raise ReplicaExitError(f"`{shlex.join(command)}` exited with code {code}")
    return code


def _terminate(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def parse_gpu(value: str) -> tuple[str, int]:
    """``"NAME"`` or ``"NAME:count"`` as Modal reads it (names are case-insensitive)."""
    name, colon, count = value.partition(":")
    name = name.upper()
    if name not in GPU_NAMES:
        raise ValueError(
            f"Modal has no GPU {name!r}; choose from {', '.join(GPU_NAMES)}, optionally "
            f"followed by ':count' (e.g. 'H100:8')"
        )
    limit = GPUS_PER_CONTAINER.get(name, MAX_GPUS)
    number = parse_count(count, limit) if colon else 1
    if not number:
        raise ValueError(f"the count after {name}: must be a whole number from 1 to {limit}")
    return name, number


def _check_object_name(name: str, what: str) -> None:
    """Refuse a name Modal would refuse for an App or a Secret, by the SDK's own rule (no
    check without the SDK: ``check`` reports that)."""
    try:
        from modal._utils.name_utils import is_valid_object_name
    except ImportError:
        return
    if not is_valid_object_name(name):
        raise ValueError(
            f"{name!r} is not a Modal {what} name: letters, digits, '-', '_' and '.', at most "
            f"64 characters"
        )


class Settings(BackendSettings):
    gpu: str | None = None  # "NAME" or "NAME:count"; None: a CPU-only container
    timeout_hours: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_HOURS)] = MAX_TIMEOUT_HOURS
    retries: Annotated[int, Field(ge=0)] = 2  # a failed call is started again this often
    # Modal Secrets whose keys become the replica's environment: the store's credentials
    secrets: list[str] = Field(default_factory=lambda: ["diloco-store"])
    registry_secret: str | None = None  # a Modal Secret to pull a private image with
    app_name: str | None = None  # default: diloco-{run.name}
    cpu: Annotated[float, Field(gt=0)] | None = None  # cores; default: Modal's
    memory: Annotated[int, Field(gt=0)] | None = None  # MiB; default: Modal's

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, gpu: str | None) -> str | None:
        if gpu is None:
            return None
        name, count = parse_gpu(gpu)
        return name if count == 1 else f"{name}:{count}"

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, names: list[str]) -> list[str]:
        for name in names:
            _check_object_name(name, "Secret")
        return names

    @field_validator("registry_secret")
    @classmethod
    def _registry_secret_name(cls, name: str | None) -> str | None:
        if name is not None:
            _check_object_name(name, "Secret")
        return name

    def timeout_seconds(self) -> int:
        """``timeout_hours`` as the Function's ``timeout`` (whole seconds)."""
        return round(self.timeout_hours * 3600)

    @model_validator(mode="after")
    def _one_process_per_gpu(self) -> Settings:
        gpus = parse_gpu(self.gpu)[1] if self.gpu else None
        if gpus is not None and gpus != self.processes_per_replica:
            raise ValueError(
                f"gpu = {self.gpu!r} gives each replica {gpus} GPUs but processes_per_replica "
                f"is {self.processes_per_replica}: a replica runs one process per GPU, so make "
                f"them equal"
            )
        return self


class ModalBackend(Backend):
    name = "modal"
    capabilities = Capabilities(remote=True, stops_one_replica=True, time_limit="always")
    secret_hints = SecretHints(
        aws="modal secret create {run}-store AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...",
        gcp="a key of replica_service_account for GOOGLE_APPLICATION_CREDENTIALS "
        "(docs/infra.md, 'GCS outside Google Cloud')",
        hf="modal secret create {run}-store "  # {run}: filled in by for_cloud
        f"{hf_buckets.ENV_ACCESS_KEY}=... {hf_buckets.ENV_SECRET_KEY}=...",
        aws_key=True,
    )
    settings_model = Settings
    settings: Settings

    def __init__(self, config: RunConfig | None = None) -> None:
        super().__init__(config)
        self.app_name = self.settings.app_name or f"diloco-{self.config.run.name}"
        try:
            _check_object_name(self.app_name, "App")
        except ValueError as exc:
            made = "" if self.settings.app_name else " (made from run.name): set one"
            raise self.settings_error("app_name", f"{exc}{made}") from None

    def check(self) -> None:
        config = self.import_sdk("modal.config").config
        if not (config.get("token_id") and config.get("token_secret")):
            raise BackendUnavailableError(
                "backend modal: no Modal token; run `modal token new`, or set MODAL_TOKEN_ID "
                "and MODAL_TOKEN_SECRET (in GitHub Actions, from the repository's secrets)"
            )

    def attempt_limit(self) -> float | None:
        """The function's timeout, which Modal applies to each attempt of a call."""
        return self.settings.timeout_seconds()

    def hardware(self) -> str:
        """The GPU spec as Modal prices it (``A100-80GB:2``), or ``cpu``."""
        return self.settings.gpu or "cpu"

    def function_options(self) -> dict[str, Any]:
        """The Function's settings, JSON-able: what ``describe`` shows and ``build_app``
        gives Modal. Secrets by name: their values stay with Modal."""
        settings = self.settings
        return {
            "image": self.image(),
            "registry_secret": settings.registry_secret,
            "gpu": settings.gpu,
            "secrets": list(settings.secrets),
            "timeout": settings.timeout_seconds(),
            "retries": {
                "max_retries": settings.retries,
                "initial_delay": RETRY_DELAY,
                "backoff_coefficient": 2.0,
            },
            "cpu": settings.cpu,
            "memory": settings.memory,
        }

    def build_app(self) -> tuple[modal.App, modal.Function]:
        """The App and its one Function, defined here and not deployed: nothing is sent.

        ``serialized=True``: the App is made from run.toml at launch, not when a module is
        imported, so a container importing this module would not find it; Modal therefore
        ships the function itself (pickled by reference to this module, which the image has).
        ``include_source=False``: the container runs the package installed in the image, not
        a copy of the launcher's checkout. ``add_python=None``: the image has its own Python.
        """
        import modal

        options = self.function_options()
        registry = options["registry_secret"]
        app = modal.App(self.app_name)
        function = app.function(
            image=modal.Image.from_registry(
                options["image"],
                secret=modal.Secret.from_name(registry) if registry else None,
                add_python=None,
            ),
            gpu=options["gpu"],
            secrets=[modal.Secret.from_name(name) for name in options["secrets"]],
            timeout=options["timeout"],
            retries=modal.Retries(**options["retries"]),
            cpu=options["cpu"],
            memory=options["memory"],
            serialized=True,
            include_source=False,
        )(run_replica)
        return app, function

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """The deployment, then one spawn per replica, as ``launch`` makes them."""
        deploy = {"app": self.app_name, "function": run_replica.__name__, **self.function_options()}
        return [
            {"deploy": deploy},
            *({"spawn": {"replica": spec.replica_id, "env": spec.env,
                         "command": spec.command("python")}} for spec in specs),
        ]  # fmt: skip

    def starter(
        self, specs: list[ReplicaSpec], run_dir: Path
    ) -> Callable[[ReplicaSpec], ReplicaHandle]:
        """Deploy the App (again: a relaunch updates it); then one call spawned per replica."""
        app, function = self.build_app()
        app.deploy()

        def spawn(spec: ReplicaSpec) -> ReplicaHandle:
            call = function.spawn(spec.env, spec.command("python"))
            job = {"app": self.app_name, "call_id": call.object_id}
            return ReplicaHandle(spec.replica_id, self.name, job)

        return spawn

    def state(self, handle: ReplicaHandle) -> JobState:
        """From the call's result, polled without waiting. Modal's public API does not tell a
        queued call from a running one: both are "running" here. A call ended by the function's
        timeout (``modal._utils.function_utils._process_result`` raises FunctionTimeoutError for
        a result with status TIMEOUT) is "timed_out"; only the call's own end is "failed";
        Modal failing to answer (credentials, an outage, an expired result) is "unknown"."""
        import modal
        from grpclib import GRPCError
        from grpclib.exceptions import StreamTerminatedError
        from modal.exception import Error, FunctionTimeoutError, InternalFailure, RemoteError

        try:
            result = modal.FunctionCall.from_id(handle.job["call_id"]).get(timeout=0)
        except TimeoutError:  # the builtin, not modal.exception's: no result yet
            return "running"
        except RemoteError as exc:
            # A cancelled call's result has status TERMINATED and no exception (the container
            # sends it so: modal/_runtime/container_io_manager.py), which the SDK raises as an
            # empty RemoteError; a failure that has no exception object carries its message.
            return "failed" if str(exc) else "stopped"
        except FunctionTimeoutError:  # its last attempt ran out of time
            return "timed_out"
        except InternalFailure:  # the call's result: Modal lost it (preemptions are retried)
            return "failed"
        except (Error, GRPCError, StreamTerminatedError):  # Modal could not say
            return "unknown"
        except Exception:  # what the call raised: ReplicaExitError, a crash
            return "failed"
        return "failed" if isinstance(result, int) and result != 0 else "exited"

    def logs(self, handle: ReplicaHandle) -> str:
        """The call's latest log entries; where Modal cannot give them, how to see them."""
        import modal
        from modal.exception import Error

        try:
            call = modal.FunctionCall.from_id(handle.job["call_id"])
            return "".join(entry.message for entry in call.logs.tail(entries=LOG_ENTRIES))
        except Error as exc:
            return (
                f"(Modal gave no logs: {exc}; see them with `modal app logs {handle.job['app']}`)\n"
            )

    def stop(self, handle: ReplicaHandle) -> None:
        """Cancel the call and end its container; a call that has ended is left as it is."""
        import modal

        if self.state(handle) in ACTIVE_STATES:  # unknown: it may be running
            modal.FunctionCall.from_id(handle.job["call_id"]).cancel(terminate_containers=True)
