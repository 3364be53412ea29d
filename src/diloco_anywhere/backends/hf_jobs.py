"""Hugging Face Jobs: one job per replica, started with ``huggingface_hub``'s Jobs API.

Each replica is ``HfApi.run_job`` with the project image, the replica command, the chosen
flavor and a timeout from run.toml: the hub's default of 30 minutes would kill a training run
(huggingface_hub issue #3665). Store credentials travel as HF Jobs *secrets*, which the hub
keeps encrypted and does not show on the job page; run.toml names them
(``[backends.hf_jobs] secrets``) and their values are read from the launcher's environment at
launch, never written anywhere by us. Status is ``inspect_job``, logs ``fetch_job_logs``, stop
``cancel_job`` (https://huggingface.co/docs/huggingface_hub/guides/jobs).

The hub stops a job at its ``timeout`` (the guide above). huggingface_hub's ``JobStage`` has no
stage for that (COMPLETED, CANCELED, ERROR, DELETED, SCHEDULING, RUNNING) and the hub documents
no wording for it, so a job that ended in ERROR or CANCELED reads ``timed_out`` when its status
message speaks of a timeout, or when it ran for the whole timeout it was started with (kept in
its handle).

The hub is reached at ``$HF_ENDPOINT`` when set (read at each call, so a test's local
stand-in applies), else huggingface.co; the token is huggingface_hub's own (``HF_TOKEN`` or
``hf auth login``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator

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

STATES: dict[str, JobState] = {
    "SCHEDULING": "pending",
    "RUNNING": "running",
    "COMPLETED": "exited",
    "ERROR": "failed",
    "CANCELED": "stopped",
    "DELETED": "stopped",
}
_TIMEOUT = re.compile(r"\d+(\.\d+)?[smhd]?")
# huggingface_hub's units for a timeout given as text (``_create_job_spec``)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A status message saying the job timed out ("timeout", "timed out", "time-out"...)
_TIMED_OUT = re.compile(r"\btime[sd]?[ -]?out\b", re.IGNORECASE)
# Stages a job its timeout ended may show: it did not complete, and was not running any more
_UNFINISHED = ("ERROR", "CANCELED")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Settings(BackendSettings):
    flavor: str = "a10g-small"  # the hub's hardware names (JobHardware); there is no h100
    timeout: str = "24h"  # seconds, or a number with s, m, h or d
    attempts: Annotated[int, Field(ge=1, le=10)] = 3  # the hub restarts a failed job
    namespace: str | None = None  # user or organization; default: the token's user
    # The job's secrets (store credentials), each read from the launcher's environment:
    # "NAME" (from NAME), or "NAME=SOURCE" (from SOURCE: a launcher whose own AWS_* are an
    # OIDC session passes the replicas' long-lived key under other names)
    secrets: list[str] = Field(default_factory=list)

    @field_validator("flavor")
    @classmethod
    def _known_flavor(cls, flavor: str) -> str:
        allowed = flavors()
        if allowed and flavor not in allowed:
            raise ValueError(f"HF Jobs has no flavor {flavor!r}; choose from {', '.join(allowed)}")
        return flavor

    @field_validator("timeout")
    @classmethod
    def _duration(cls, timeout: str) -> str:
        if not _TIMEOUT.fullmatch(timeout):
            raise ValueError("give seconds, or a number followed by s, m, h or d (e.g. '24h')")
        return timeout

    @field_validator("secrets")
    @classmethod
    def _variable_names(cls, names: list[str]) -> list[str]:
        bad = [entry for entry in names
               if not all(_ENV_NAME.fullmatch(part) for part in entry.split("=", 1))]  # fmt: skip
        if bad:
            raise ValueError(f"{bad}: give NAME or NAME=SOURCE, environment variable names")
        return names

    def timeout_seconds(self) -> int:
        """``timeout`` in seconds, converted as huggingface_hub sends it (``timeoutSeconds``)."""
        unit = self.timeout[-1]
        if unit in _UNIT_SECONDS:
            return int(float(self.timeout[:-1]) * _UNIT_SECONDS[unit])
        return int(float(self.timeout))

    def secret_sources(self) -> dict[str, str]:
        """The job's secret name -> the launcher's variable it is read from."""
        pairs = (entry.partition("=")[::2] for entry in self.secrets)
        return {name: source or name for name, source in pairs}


def flavors() -> list[str]:
    """The hub's flavors as this huggingface_hub knows them ([] without the SDK: ``check``
    reports that)."""
    try:
        from huggingface_hub import JobHardware
    except ImportError:
        return []
    return [hardware.value for hardware in JobHardware]


def hub_api() -> Any:
    """huggingface_hub's client at ``$HF_ENDPOINT`` when set, read now (a stand-in set after
    huggingface_hub was imported applies), else huggingface.co."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)


class HfJobsBackend(Backend):
    name = "hf_jobs"
    capabilities = Capabilities(remote=True, stops_one_replica=True, time_limit="always")
    secret_hints = SecretHints(
        aws="export STORE_AWS_ACCESS_KEY_ID and STORE_AWS_SECRET_ACCESS_KEY (as "
        "[backends.hf_jobs] secrets reads them) before `diloco launch`; in GitHub, "
        "repository secrets of those names",
        gcp="as for modal (docs/infra.md, 'GCS outside Google Cloud')",
        hf=f"export {hf_buckets.ENV_ACCESS_KEY} and {hf_buckets.ENV_SECRET_KEY} "
        "(as [backends.hf_jobs] secrets reads them) before `diloco launch`",
        aws_key=True,
    )
    settings_model = Settings
    settings: Settings

    def _api(self) -> Any:
        return hub_api()

    def check(self) -> None:
        if self.import_sdk("huggingface_hub").get_token() is None:
            raise BackendUnavailableError(
                "backend hf_jobs: no Hugging Face token; run `hf auth login` or set HF_TOKEN "
                "(a token allowed to start Jobs)"
            )
        sources = self.settings.secret_sources().values()
        missing = [source for source in sources if source not in os.environ]
        if missing:
            raise BackendUnavailableError(
                f"backend hf_jobs: backends.hf_jobs.secrets reads {', '.join(missing)}, not set "
                f"here; export them before launching (their values become the jobs' secrets)"
            )

    def attempt_limit(self) -> float | None:
        """The jobs' ``timeout``, after which the hub ends one."""
        return self.settings.timeout_seconds()

    def hardware(self) -> str:
        """The flavor, as the hub prices it."""
        return self.settings.flavor

    def _job(self, spec: ReplicaSpec, secrets: dict[str, str]) -> dict[str, Any]:
        """``run_job``'s arguments for one replica."""
        return {
            "image": self.image(),
            "command": spec.command("python"),
            "env": spec.env,
            "secrets": secrets,
            "flavor": self.settings.flavor,
            "timeout": self.settings.timeout,
            "attempts": self.settings.attempts,
            "labels": {"diloco-run": self.config.run.name, "diloco-replica": spec.replica_id},
            "namespace": self.settings.namespace,
        }

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        masked = dict.fromkeys(self.settings.secret_sources(), "***")
        return [{"run_job": self._job(spec, masked)} for spec in specs]

    def starter(
        self, specs: list[ReplicaSpec], run_dir: Path
    ) -> Callable[[ReplicaSpec], ReplicaHandle]:
        """The jobs' namespace and secrets, read once; then one ``run_job`` per replica."""
        api = self._api()
        namespace = self.settings.namespace or api.whoami()["name"]
        sources = self.settings.secret_sources()
        secrets = {name: os.environ[source] for name, source in sources.items()}

        def start_one(spec: ReplicaSpec) -> ReplicaHandle:
            job = api.run_job(**{**self._job(spec, secrets), "namespace": namespace})
            reference = {"id": job.id, "namespace": namespace, "url": job.url,
                         "timeout_s": self.settings.timeout_seconds()}  # fmt: skip
            return ReplicaHandle(spec.replica_id, self.name, reference)

        return start_one

    def state(self, handle: ReplicaHandle) -> JobState:
        """The job's stage, ``timed_out`` for one its timeout ended; a job the hub no longer
        knows is stopped, and one it could not tell about (an HTTP error) unknown. Other
        errors (the hub unreachable) are raised."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            job = self._api().inspect_job(**_reference(handle))
        except HfHubHTTPError as exc:
            return "stopped" if _not_found(exc) else "unknown"
        if _timed_out(job, handle.job.get("timeout_s")):
            return "timed_out"
        return STATES.get(str(job.status.stage), "unknown")

    def logs(self, handle: ReplicaHandle) -> str:
        return "\n".join(self._api().fetch_job_logs(**_reference(handle), follow=False))

    def stop(self, handle: ReplicaHandle) -> None:
        """Cancel the job unless it has ended; an unknown state may hide a running job."""
        from huggingface_hub.errors import HfHubHTTPError

        if self.state(handle) in ACTIVE_STATES:
            try:
                self._api().cancel_job(**_reference(handle))
            except HfHubHTTPError as exc:
                if not _not_found(exc):  # gone meanwhile
                    raise


def _timed_out(job: Any, timeout: float | None) -> bool:
    """Whether the hub ended ``job`` (a JobInfo) at its timeout: it ended unfinished, and its
    status message says so or it ran for the whole ``timeout`` (seconds; None for a handle
    that does not record it)."""
    if str(job.status.stage) not in _UNFINISHED:
        return False
    if _TIMED_OUT.search(job.status.message or ""):
        return True
    ran = job.durations.running_secs if job.durations else None
    return ran is not None and timeout is not None and ran >= timeout


def _reference(handle: ReplicaHandle) -> dict[str, str]:
    return {"job_id": handle.job["id"], "namespace": handle.job["namespace"]}


def _not_found(exc: Any) -> bool:
    return exc.response is not None and exc.response.status_code == 404
