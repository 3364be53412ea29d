"""``diloco infra``: the run's cloud resources (infra/aws, infra/gcp) through terraform, and its
outputs into run.toml.

terraform is run as a program (``-chdir``, ``-input=false``, ``-json`` where it has it), not
through python-terraform: that wrapper has had no release since 2020 and adds nothing over
four subcommands, while terraform's own CLI and its ``output -json`` are the stable,
documented interface (https://developer.hashicorp.com/terraform/cli/commands/output).

Which output goes where in run.toml is one table (``RUN_TOML_FIELDS``); a value Terraform marks
sensitive is never printed or written. What cannot come from Terraform (a key for replicas
outside the cloud: Terraform makes none, so its state holds none) is said as the commands that
make and store it, per platform, in each backend's own words (``Backend.secret_hints``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from diloco_anywhere.backends import BACKENDS, backend_class
from diloco_anywhere.backends.base import one_line
from diloco_anywhere.bucket import hf_buckets

TERRAFORM_INSTALL = "https://developer.hashicorp.com/terraform/install"
CLOUDS = {"s3": "aws", "gs": "gcp", "gcs": "gcp"}
# terraform output -> (run.toml table, key)
RUN_TOML_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "store_url": (("run",), "store"),
    "sagemaker_role_arn": (("backends", "sagemaker"), "role_arn"),
    "ecr_repository_url": (("backends", "sagemaker"), "image"),
}


class InfraError(RuntimeError):
    """terraform is missing or failed; one line saying which and what to do."""


@dataclass(frozen=True)
class Terraform:
    """terraform in one configuration folder (``infra/aws`` or ``infra/gcp``)."""

    folder: Path
    var_file: Path | None = None

    @property
    def cloud(self) -> str:
        return self.folder.name

    @property
    def where(self) -> str:
        return str(self.folder)

    def _run(self, *args: str, capture: bool = False) -> str:
        program = shutil.which("terraform")
        if program is None:
            raise InfraError(f"terraform is not installed (not on PATH): {TERRAFORM_INSTALL}")
        if not self.folder.is_dir():
            raise InfraError(f"{self.folder}: no such Terraform folder (infra/aws or infra/gcp)")
        command = [program, f"-chdir={self.folder}", *args]
        result = subprocess.run(command, capture_output=capture, text=True, check=False)
        if result.returncode != 0:
            detail = " ".join((result.stderr or "").split())[-400:] if capture else "see above"
            raise InfraError(f"`terraform {args[0]}` in {self.folder} failed: {detail}")
        return result.stdout or ""

    def _variables(self) -> list[str]:
        return [f"-var-file={self.var_file.resolve()}"] if self.var_file else []

    def init(self) -> None:
        self._run("init", "-input=false")

    def plan(self) -> None:
        self._run("plan", "-input=false", *self._variables())

    def apply(self, approve: bool) -> None:
        self._run("apply", *self._variables(), *_unattended(approve))

    def destroy(self, approve: bool) -> None:
        self._run("destroy", *self._variables(), *_unattended(approve))

    def outputs(self) -> dict[str, dict]:
        """``terraform output -json``: name -> {value, type, sensitive}."""
        return json.loads(self._run("output", "-json", capture=True) or "{}")


@dataclass(frozen=True)
class HubBucket:
    """A Hugging Face Storage Bucket (``run.store = "hf://buckets/..."``), made and removed
    with huggingface_hub, since no Terraform provider covers it; the steps of ``Terraform``.
    It is created private. ``confirm`` asks the user where Terraform would have asked."""

    url: hf_buckets.BucketUrl
    store: str
    confirm: Callable[[str], bool]
    cloud = "hf"

    @property
    def bucket_id(self) -> str:
        return f"{self.url.namespace}/{self.url.bucket}"

    @property
    def where(self) -> str:
        return f"hf://buckets/{self.bucket_id}"

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``HfApi().<method>`` at ``$HF_ENDPOINT`` when set (read now, not at import), with
        the token of ``HF_TOKEN`` or ``hf auth login``. A bucket the Hub does not know is
        ``FileNotFoundError``; any other failure is one ``InfraError``."""
        try:
            import huggingface_hub

            from diloco_anywhere.backends.hf_jobs import hub_api
        except ImportError:
            raise InfraError(
                "huggingface_hub is not installed: pip install huggingface_hub"
            ) from None
        api = hub_api()
        try:
            return getattr(api, method)(*args, **kwargs)
        except huggingface_hub.errors.HfHubHTTPError as exc:
            if exc.response is not None and exc.response.status_code == 404:
                raise FileNotFoundError(self.bucket_id) from None
            raise InfraError(f"bucket {self.bucket_id}: {one_line(exc)}") from None
        except Exception as exc:  # the Hub unreachable, no token, ...
            raise InfraError(f"bucket {self.bucket_id}: {one_line(exc)}") from None

    def _files(self) -> int | None:
        """Files in the bucket, or None when it does not exist."""
        try:
            return self._call("bucket_info", self.bucket_id).total_files
        except FileNotFoundError:
            return None

    def init(self) -> None:
        """Nothing to set up: huggingface_hub is checked at the first call."""

    def plan(self) -> None:
        files = self._files()
        print(f"bucket {self.bucket_id}: " + (
            f"exists ({files} files); nothing to change" if files is not None
            else "would be created, private"
        ))  # fmt: skip

    def apply(self, approve: bool) -> None:
        if self._files() is not None:
            print(f"bucket {self.bucket_id} exists; nothing to change")
            return
        if not (approve or self.confirm(f"create the private bucket {self.bucket_id}?")):
            raise InfraError("nothing created")
        self._call("create_bucket", self.bucket_id, private=True, exist_ok=True)

    def destroy(self, approve: bool) -> None:
        files = self._files()
        if files:
            raise InfraError(
                f"bucket {self.bucket_id} holds {files} files: delete the runs first "
                f"(diloco launch --fresh deletes a run's objects), then run down again"
            )
        if files is not None and (approve or self.confirm(f"delete the bucket {self.bucket_id}?")):
            self._call("delete_bucket", self.bucket_id, missing_ok=True)

    def outputs(self) -> dict[str, dict]:
        if self._files() is None:
            return {}
        return {"store_url": {"value": self.store, "sensitive": False}}


def _unattended(approve: bool) -> list[str]:
    """Without approval given, terraform shows the plan and asks (it needs its input for
    that); with it, nothing is asked."""
    return ["-input=false", "-auto-approve"] if approve else []


def public_values(outputs: dict[str, dict]) -> dict[str, object]:
    """The outputs that are set and not sensitive (those are never printed or written)."""
    return {
        name: output["value"]
        for name, output in outputs.items()
        if not output["sensitive"] and output["value"] is not None
    }


def write_run_toml(path: Path, values: dict[str, object]) -> list[str]:
    """Set the run.toml fields the outputs give, keeping the file's comments and layout
    (tomlkit); a SageMaker field only where run.toml has a ``[backends.sagemaker]``. The
    fields changed, as ``table.key = value`` lines."""
    document = tomlkit.parse(path.read_text())
    changed = []
    for output, (table_path, key) in RUN_TOML_FIELDS.items():
        if output not in values:
            continue
        table = _table(document, table_path)
        if table is None:
            continue
        value = str(values[output])
        if key == "image":
            value = image_in(value, table.get(key))
        if table.get(key) != value:
            table[key] = value
            changed.append(f"{'.'.join(table_path)}.{key} = {value!r}")
    path.write_text(tomlkit.dumps(document))
    return changed


def image_in(repository: str, current: object) -> str:
    """The image ``repository`` with the tag or digest run.toml already gives it (a pinned
    digest stays pinned), else ``:latest``."""
    current = str(current or "")
    name, digest = current.partition("@")[::2]
    if digest:
        return current if name == repository else f"{repository}@{digest}"
    head, _, tag = current.rpartition(":")
    return (
        f"{repository}:{tag}" if head == repository and "/" not in tag else f"{repository}:latest"
    )


def _table(document: tomlkit.TOMLDocument, names: tuple[str, ...]) -> dict | None:
    table = document
    for name in names:
        if name not in table:
            return None
        table = table[name]
    return table


def secrets_to_set(
    cloud: str, run: str, values: dict[str, object], platforms: list[str]
) -> list[str]:
    """What the user must still provide per platform: commands with placeholders, never a
    value (Terraform makes no key; docs/infra.md says why). Each platform's words are its
    backend's ``secret_hints``; a name that is no platform is passed over."""
    hints = {p: backend_class(p).secret_hints for p in platforms if p in BACKENDS}
    lines = _key_lines(cloud, values, sorted(p for p, hint in hints.items() if hint.aws_key))
    if cloud == "hf":
        lines.append(f"bucket keys: {hf_buckets.CREDENTIALS_HELP}")
    said = {p: hint.for_cloud(cloud, run) for p, hint in hints.items()}
    lines += [f"{p}: {line}" for p, line in said.items() if line is not None]
    return lines + _github_lines(values)


def _key_lines(cloud: str, values: dict[str, object], outside: list[str]) -> list[str]:
    """The replicas' key for platforms outside AWS: who makes it, or how to get a user."""
    if cloud != "aws" or not outside:
        return []
    user = values.get("replica_user_name")
    if user:
        return [f"replica key ({', '.join(outside)}): aws iam create-access-key --user-name {user}"]
    return [f"replica key ({', '.join(outside)}): set create_replica_user = true, "
            f"`diloco infra up`, then aws iam create-access-key"]  # fmt: skip


def _github_lines(values: dict[str, object]) -> list[str]:
    """The repository variables the workflows read."""
    names = {
        "launcher_role_arn": "AWS_LAUNCHER_ROLE_ARN",
        "ecr_repository_url": "ECR_REPOSITORY_URL",
        "workload_identity_provider": "GCP_WORKLOAD_IDENTITY_PROVIDER",
        "launcher_service_account": "GCP_SERVICE_ACCOUNT",
    }
    return [f"GitHub: repository variable {variable} = {values[output]}"
            for output, variable in names.items() if values.get(output)]  # fmt: skip
