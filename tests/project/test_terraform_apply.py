"""infra/aws applied for real: terraform, with the AWS provider from a filesystem mirror (no
network), creates every resource on moto's server, whose IAM enforcement is on; the replica
identity it makes can use the run prefix and nothing else; a 2-replica run completes with that
identity's keys; `terraform destroy` leaves nothing.

What moto 5.2 cannot judge, and is checked on the configuration instead (test_infra.py): it
ignores a bucket policy's conditions, so the TLS-only Deny (``aws:SecureTransport`` false)
would deny every request and is removed after the apply; and of an identity policy's
conditions it evaluates ``StringEquals`` only, so the ``s3:prefix`` (``StringLike``) limit on
listing is not enforced here. And it does not implement ListServiceSpecificCredentials, which
the provider calls to destroy a user with ``force_destroy`` (infra/aws sets it so that the
CLI-made key goes with the user): the override turns it off and the test deletes the key.

Terraform reaches moto through a reverse proxy (one connection to moto per request, every
response framed by its length). Under load, moto's development server now and then processed a
request that terraform's Go client sent on a kept-alive connection and the answer never
arrived (moto logged 200, the client saw none): the SDK retried a create that had happened
and the apply failed with EntityAlreadyExists, in 1 of 4 loaded applies straight to moto and
none of the loaded applies through the proxy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.standins import moto_server
from support import ROOT
from support.proxy import FaultProxy
from support.runs import RUN_TOML, diloco, statuses

PROJECT, BUCKET, REGION = "tfrun", "tfrun-store", "us-east-1"
VARIABLES = {
    "project": PROJECT,
    "region": REGION,
    "bucket_name": BUCKET,
    "github_owner": "acme",
    "github_repo": "tfrun",
    "create_replica_user": True,
}
# Provider endpoints: every service infra/aws calls, at moto's server (an override file, so
# the configuration under test is the repository's own, unchanged).
OVERRIDE = """provider "aws" {{
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  s3_use_path_style           = true
  endpoints {{
    s3  = "{endpoint}"
    iam = "{endpoint}"
    sts = "{endpoint}"
    ecr = "{endpoint}"
  }}
}}

resource "aws_iam_user" "replica" {{
  force_destroy = false
}}
"""
ALLOW_ALL = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}
SKIPPED_FOLDERS = {"/proc", "/sys", "/dev", "/run"}


@functools.cache
def provider_mirror() -> Path | None:
    """A Terraform filesystem mirror holding hashicorp/aws: a ``registry.terraform.io`` folder
    within five levels of the root (where a machine image installs one)."""
    pending = [(Path("/"), 0)]
    while pending:
        folder, depth = pending.pop()
        try:
            children = [
                child for child in folder.iterdir() if child.is_dir() and not child.is_symlink()
            ]
        except OSError:
            continue
        for child in children:
            if child.name == "registry.terraform.io" and (child / "hashicorp" / "aws").is_dir():
                return child.parent
            if depth < 4 and str(child) not in SKIPPED_FOLDERS:
                pending.append((child, depth + 1))
    return None


def _missing() -> str | None:
    if shutil.which("terraform") is None:
        return "no terraform on PATH: infra/aws is not applied (https://developer.hashicorp.com/terraform/install)"
    if provider_mirror() is None:
        return (
            "no filesystem mirror of the hashicorp/aws provider (a registry.terraform.io "
            "folder) on this machine: terraform init would need the network"
        )
    return None


pytestmark = [
    pytest.mark.integration,  # every test here starts processes
    pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
]


class Terraform:
    """terraform in a copy of infra/aws with moto's endpoints, offline, as the admin user."""

    def __init__(self, folder: Path, endpoint: str, admin: dict[str, str]) -> None:
        self.folder = folder
        shutil.copytree(ROOT / "infra" / "aws", folder)
        (folder / "moto_override.tf").write_text(OVERRIDE.format(endpoint=endpoint))
        (folder / "run.tfvars.json").write_text(json.dumps(VARIABLES))
        cli_config = folder.parent / "terraform.rc"
        mirror = f'filesystem_mirror {{\n    path = "{provider_mirror()}"\n  }}'
        cli_config.write_text(f"provider_installation {{\n  {mirror}\n}}\n")
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(folder.parent),
            "TF_CLI_CONFIG_FILE": str(cli_config),
            "TF_IN_AUTOMATION": "1",
            "TF_INPUT": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
            **admin,
        }

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["terraform", *args, "-no-color"],
            cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if check:
            assert result.returncode == 0, (
                f"terraform {args[0]}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
            )
        return result


def _client(service: str, endpoint: str, credentials: dict[str, str]):
    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
    )


def _admin(endpoint: str) -> dict[str, str]:
    """The three requests moto serves before enforcing IAM: an admin user and its key."""
    anyone = {"AWS_ACCESS_KEY_ID": "bootstrap", "AWS_SECRET_ACCESS_KEY": "bootstrap"}
    iam = _client("iam", endpoint, anyone)
    iam.create_user(UserName="admin")
    iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL))
    key = iam.create_access_key(UserName="admin")["AccessKey"]
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


class Applied:
    def __init__(self, endpoint: str, admin: dict[str, str], terraform: Terraform) -> None:
        self.endpoint, self.admin, self.terraform = endpoint, admin, terraform
        self.outputs = {
            k: v["value"] for k, v in json.loads(terraform("output", "-json").stdout).items()
        }
        key = self.client("iam").create_access_key(UserName=self.outputs["replica_user_name"])
        self.replica = {
            "AWS_ACCESS_KEY_ID": key["AccessKey"]["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["AccessKey"]["SecretAccessKey"],
        }
        # The plan right after the apply, which must change nothing; then, as moto ignores a
        # bucket policy's conditions (its TLS-only Deny would refuse every request), the
        # policy is removed before the bucket is used.
        self.plan = terraform("plan", "-detailed-exitcode", "-var-file=run.tfvars.json")
        s3 = self.client("s3")
        self.tls_only_policy = json.loads(s3.get_bucket_policy(Bucket=BUCKET)["Policy"])
        s3.delete_bucket_policy(Bucket=BUCKET)

    def client(self, service: str, credentials: dict[str, str] | None = None):
        return _client(service, self.endpoint, credentials or self.admin)

    def store(self, url: str) -> Store:
        options = {"endpoint_url": self.endpoint, "key": self.replica["AWS_ACCESS_KEY_ID"],
                   "secret": self.replica["AWS_SECRET_ACCESS_KEY"]}  # fmt: skip
        return Store(url, storage_options=options)


@contextlib.contextmanager
def applied_on_moto(folder: Path) -> Iterator[Applied]:
    with (
        moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as endpoint,
        FaultProxy(endpoint) as proxy,
    ):
        admin = _admin(endpoint)
        terraform = Terraform(folder / "aws", proxy.url, admin)
        terraform("init")
        terraform("apply", "-auto-approve", "-var-file=run.tfvars.json")
        yield Applied(endpoint, admin, terraform)


def test_apply_then_a_run_with_the_replica_keys_then_destroy(tmp_path, monkeypatch):
    """One apply, used in order (one test, so that no scheduling of tests across workers can
    destroy before use): every resource exists and a plan right after changes nothing; the
    replica identity reaches the run prefix and nothing else; a 2-replica run completes with
    its keys; `terraform destroy` leaves nothing."""
    with applied_on_moto(tmp_path / "terraform") as applied:
        _every_resource_exists_and_a_plan_then_changes_nothing(applied)
        _the_replica_identity_uses_the_run_prefix_and_nothing_else(applied)
        _a_two_replica_run_completes_with_the_replica_keys(applied, tmp_path / "run", monkeypatch)
        _destroy_leaves_nothing(applied)


def _every_resource_exists_and_a_plan_then_changes_nothing(applied: Applied) -> None:
    assert applied.plan.returncode == 0
    assert applied.outputs["store_url"] == f"s3://{BUCKET}/runs"
    s3 = applied.client("s3")
    assert s3.get_bucket_versioning(Bucket=BUCKET)["Status"] == "Enabled"
    assert len(s3.get_bucket_lifecycle_configuration(Bucket=BUCKET)["Rules"]) == 3
    blocked = s3.get_public_access_block(Bucket=BUCKET)["PublicAccessBlockConfiguration"]
    assert all(blocked.values())
    (repository,) = applied.client("ecr").describe_repositories()["repositories"]
    assert (repository["repositoryName"], repository["imageTagMutability"]) == (
        PROJECT,
        "IMMUTABLE",
    )
    roles = {role["RoleName"] for role in applied.client("iam").list_roles()["Roles"]}
    assert roles == {f"{PROJECT}-sagemaker", f"{PROJECT}-launcher"}
    assert applied.tls_only_policy["Statement"][0]["Effect"] == "Deny"  # applied, then removed


def _the_replica_identity_uses_the_run_prefix_and_nothing_else(applied: Applied) -> None:
    applied.client("s3").create_bucket(Bucket="another-bucket")
    mine = applied.store(applied.outputs["store_url"])
    mine.put("t/probe", b"create-only")
    assert mine.get("t/probe") == b"create-only"
    assert mine.list_prefix("t") == ["t/probe"]
    mine.delete("t/probe")
    assert mine.list_prefix("t") == []
    for url in (f"s3://{BUCKET}/elsewhere", f"s3://{BUCKET}", "s3://another-bucket/runs"):
        other = applied.store(url)
        with pytest.raises(StoreError, match="access denied"):
            other.put("t/probe", b"x")
        with pytest.raises(StoreError, match="access denied"):
            other.get("t/probe")
        with pytest.raises(StoreError, match="access denied"):
            other.delete("t/probe")
    with pytest.raises(StoreError, match="access denied"):
        applied.store("s3://another-bucket/runs").list_prefix("t")
    applied.client("s3").delete_bucket(Bucket="another-bucket")


def _a_two_replica_run_completes_with_the_replica_keys(
    applied: Applied, folder: Path, monkeypatch
) -> None:
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name, value in {**applied.replica, "AWS_ENDPOINT_URL": applied.endpoint,
                        "AWS_DEFAULT_REGION": REGION}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    text = RUN_TOML.format(replicas=2, outer_steps=2)
    (folder / "run.toml").write_text(
        text.replace('store = "store"', f'store = "{applied.outputs["store_url"]}"')
    )
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 2)}


def _destroy_leaves_nothing(applied: Applied) -> None:
    iam, s3 = applied.client("iam"), applied.client("s3")
    user = applied.outputs["replica_user_name"]
    for key in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]:
        iam.delete_access_key(UserName=user, AccessKeyId=key["AccessKeyId"])
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=BUCKET):
        for version in page.get("Versions", []) + page.get("DeleteMarkers", []):
            s3.delete_object(Bucket=BUCKET, Key=version["Key"], VersionId=version["VersionId"])
    applied.terraform("destroy", "-auto-approve", "-var-file=run.tfvars.json")
    assert json.loads(applied.terraform("show", "-json").stdout).get("values") is None
    assert s3.list_buckets()["Buckets"] == []
    assert applied.client("ecr").describe_repositories()["repositories"] == []
    assert [user["UserName"] for user in iam.list_users()["Users"]] == ["admin"]
    assert iam.list_roles()["Roles"] == []
    assert iam.list_groups()["Groups"] == []
    assert iam.list_policies(Scope="Local")["Policies"] == []
    assert iam.list_open_id_connect_providers()["OpenIDConnectProviderList"] == []
