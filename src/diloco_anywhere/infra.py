"""``diloco infra``: the run's cloud resources (infra/aws, infra/gcp) through terraform, and its
outputs into run.toml.

terraform is run as a program (``-chdir``, ``-input=false``, ``-json`` where it has it), not
through python-terraform: that wrapper has had no release since 2020 and adds nothing over
four subcommands, while terraform's own CLI and its ``output -json`` are the stable,
documented interface (https://developer.hashicorp.com/terraform/cli/commands/output).

Which output goes where in run.toml is one table (``RUN_TOML_FIELDS``); a value Terraform marks
sensitive is never printed or written. What cannot come from Terraform (a key for replicas
outside the cloud: Terraform makes none, so its state holds none) is said as the commands that
make and store it, per platform.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import tomlkit

TERRAFORM_INSTALL = "https://developer.hashicorp.com/terraform/install"
CLOUDS = {"s3": "aws", "gs": "gcp", "gcs": "gcp"}
# terraform output -> (run.toml table, key, how the value is written)
RUN_TOML_FIELDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "store_url": (("run",), "store", "{}"),
    "sagemaker_role_arn": (("backends", "sagemaker"), "role_arn", "{}"),
    "ecr_repository_url": (("backends", "sagemaker"), "image", "{}:latest"),
}


class InfraError(RuntimeError):
    """terraform is missing or failed; one line saying which and what to do."""


@dataclass(frozen=True)
class Terraform:
    """terraform in one configuration folder (``infra/aws`` or ``infra/gcp``)."""

    folder: Path
    var_file: Path | None = None

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


def _unattended(approve: bool) -> list[str]:
    """Without approval given, terraform shows the plan and asks (it needs its input for
    that); with it, nothing is asked."""
    return ["-input=false", "-auto-approve"] if approve else []


def public_values(outputs: dict[str, dict]) -> dict[str, object]:
    """The outputs that are not sensitive (those are never printed or written)."""
    return {name: output["value"] for name, output in outputs.items() if not output["sensitive"]}


def write_run_toml(path: Path, values: dict[str, object]) -> list[str]:
    """Set the run.toml fields the outputs give, keeping the file's comments and layout
    (tomlkit); a SageMaker field only where run.toml has a ``[backends.sagemaker]``. The
    fields changed, as ``table.key = value`` lines."""
    document = tomlkit.parse(path.read_text())
    changed = []
    for output, (table_path, key, shape) in RUN_TOML_FIELDS.items():
        if output not in values:
            continue
        table = _table(document, table_path)
        if table is None:
            continue
        value = shape.format(values[output])
        if table.get(key) != value:
            table[key] = value
            changed.append(f"{'.'.join(table_path)}.{key} = {value!r}")
    path.write_text(tomlkit.dumps(document))
    return changed


def _table(document: tomlkit.TOMLDocument, names: tuple[str, ...]) -> dict | None:
    table = document
    for name in names:
        if name not in table:
            return None
        table = table[name]
    return table


def secrets_to_set(cloud: str, values: dict[str, object], platforms: list[str]) -> list[str]:
    """What the user must still provide per platform: commands with placeholders, never a
    value (Terraform makes no key; docs/infra.md says why)."""
    lines = []
    user = values.get("replica_user_name")
    if cloud == "aws" and user and {"modal", "hf_jobs", "k8s"} & set(platforms):
        lines.append(f"replica key (outside AWS): aws iam create-access-key --user-name {user}")
    per_platform = {
        "modal": "modal secret create <project>-store AWS_ACCESS_KEY_ID=... "
        "AWS_SECRET_ACCESS_KEY=... (the names in [backends.modal] secrets)",
        "hf_jobs": "export the variables named in [backends.hf_jobs] secrets before "
        "`diloco launch` (sent as the jobs' encrypted secrets)",
        "k8s": "kubectl create secret generic <project>-store --from-literal=NAME=... (named in "
        "[backends.k8s] secret), or a service account with the replica policy/role",
        "sagemaker": "nothing: the jobs run as role_arn, which has the bucket",
    }
    lines += [f"{platform}: {per_platform[platform]}" for platform in platforms
              if platform in per_platform]  # fmt: skip
    if values.get("launcher_role_arn"):
        lines.append(f"GitHub: repository variable AWS_LAUNCHER_ROLE_ARN = "
                     f"{values['launcher_role_arn']}")  # fmt: skip
    if values.get("workload_identity_provider"):
        lines.append(f"GitHub: repository variables GCP_WORKLOAD_IDENTITY_PROVIDER = "
                     f"{values['workload_identity_provider']}, GCP_SERVICE_ACCOUNT = "
                     f"{values.get('launcher_service_account')}")  # fmt: skip
    return lines
