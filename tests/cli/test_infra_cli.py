"""``diloco infra``: terraform found or said missing in one line, and its outputs (read by a
real terraform from a state file, as after ``terraform apply``) written into run.toml without
losing the file's comments, sensitive values never shown."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.infra import image_in, secrets_to_set
from diloco_anywhere.standins.hf_jobs import hf_jobs_api
from support import ROOT
from support.runs import diloco

RUN_TOML = """# my run: comments stay
[run]
name = "demo"
store = "s3://old-bucket/runs"   # from terraform

[backends.sagemaker]
replicas = 2
instance_type = "ml.g5.xlarge"
spot = true
max_wait_hours = 36

[backends.modal]
replicas = 2
"""
OUTPUTS = {
    "store_url": ("s3://demo-diloco/runs", False),
    "region": ("us-east-1", False),
    "sagemaker_role_arn": ("arn:aws:iam::123456789012:role/demo-sagemaker", False),
    "ecr_repository_url": ("123456789012.dkr.ecr.us-east-1.amazonaws.com/demo", False),
    "replica_user_name": ("demo-replica", False),
    "launcher_role_arn": ("arn:aws:iam::123456789012:role/demo-launcher", False),
    "some_token": ("do-not-print-this", True),
}


@pytest.fixture
def applied(tmp_path, monkeypatch) -> Path:
    """A project whose infra/aws has state, as `terraform apply` leaves it."""
    if shutil.which("terraform") is None:
        pytest.skip("terraform is not installed here: diloco infra output needs it")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", "/dev/null")
    (tmp_path / "infra").mkdir()
    shutil.copytree(ROOT / "infra" / "aws", tmp_path / "infra" / "aws")
    state = {
        "version": 4, "terraform_version": "1.5.0", "serial": 1,
        "lineage": "8d2c5a8e-0000-4000-8000-000000000000", "resources": [],
        "outputs": {name: {"value": value, "type": "string", "sensitive": sensitive}
                    for name, (value, sensitive) in OUTPUTS.items()},
    }  # fmt: skip
    (tmp_path / "infra" / "aws" / "terraform.tfstate").write_text(json.dumps(state))
    (tmp_path / "run.toml").write_text(RUN_TOML)
    return tmp_path


@pytest.mark.integration
def test_outputs_go_into_run_toml_and_the_rest_is_said_as_commands(applied):
    result = diloco("infra", "output", "--write")  # ./run.toml
    assert result.exit_code == 0, result.output
    config = load_config(applied / "run.toml")
    assert config.run.store == "s3://demo-diloco/runs"
    sagemaker = config.backends["sagemaker"]
    assert sagemaker["role_arn"] == "arn:aws:iam::123456789012:role/demo-sagemaker"
    assert sagemaker["image"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com/demo:latest"
    assert "role_arn" not in config.backends["modal"]
    text = (applied / "run.toml").read_text()
    assert text.startswith("# my run: comments stay")
    assert "# from terraform" in text
    assert "aws iam create-access-key --user-name demo-replica" in result.output
    assert "modal secret create demo-store AWS_ACCESS_KEY_ID=..." in result.output
    assert "sagemaker: nothing: the jobs run as role_arn" in result.output
    assert "ECR_REPOSITORY_URL = 123456789012.dkr.ecr.us-east-1.amazonaws.com/demo" in (
        result.output
    )
    assert "AWS_LAUNCHER_ROLE_ARN = arn:aws:iam::123456789012:role/demo-launcher" in result.output
    assert "do-not-print-this" not in result.output  # sensitive
    assert "do-not-print-this" not in text
    again = diloco("infra", "output", "--config", "run.toml", "--write")
    assert "already up to date" in again.output


def test_without_terraform_it_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no terraform here
    (tmp_path / "infra" / "aws").mkdir(parents=True)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    result = diloco("infra", "plan", "--config", "run.toml")
    assert result.exit_code == 1
    assert "terraform is not installed (not on PATH): https://developer.hashicorp.com" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_a_store_outside_the_clouds_with_terraform_needs_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(RUN_TOML.replace("s3://old-bucket", "az://container"))
    result = diloco("infra", "output", "--config", "run.toml")
    assert result.exit_code == 1
    assert "not in a cloud with Terraform here (s3://, gs://) nor a Hugging Face" in result.output


@pytest.mark.parametrize(
    ("current", "written"),
    [
        (None, "ecr/demo:latest"),
        ("ecr/demo:v7", "ecr/demo:v7"),  # its tag kept
        ("ecr/demo@sha256:abc", "ecr/demo@sha256:abc"),  # a pinned digest stays pinned
        ("ghcr.io/acme/demo:v7", "ecr/demo:latest"),  # another repository: Terraform's
        ("localhost:5000/demo", "ecr/demo:latest"),  # a port is not a tag
    ],
)
def test_the_image_keeps_its_tag_or_digest(current, written):
    assert image_in("ecr/demo", current) == written


def test_gcp_guidance_names_gcp_things_and_the_run():
    values = {"workload_identity_provider": "projects/1/locations/global/workloadIdentityPools/p",
              "launcher_service_account": "launcher@p.iam.gserviceaccount.com"}  # fmt: skip
    lines = secrets_to_set("gcp", "demo", values, ["k8s", "modal"])
    assert not [line for line in lines if "AWS" in line]
    assert lines[0].startswith("k8s: GKE: gke_service_accounts")
    assert "GCP_SERVICE_ACCOUNT = launcher@p.iam.gserviceaccount.com" in lines[-1]


def test_outside_aws_without_a_replica_user_says_how_to_get_one():
    lines = secrets_to_set("aws", "demo", {}, ["hf_jobs"])
    assert lines[0] == ("replica key (hf_jobs): set create_replica_user = true, "
                        "`diloco infra up`, then aws iam create-access-key")  # fmt: skip
    assert "STORE_AWS_ACCESS_KEY_ID" in lines[1]


def test_a_hugging_face_bucket_is_made_private_and_removed_with_the_hub_api(tmp_path, monkeypatch):
    """No Terraform for Storage Buckets: `infra up` creates it through huggingface_hub (the
    Hub stand-in here), `output` says which keys each platform needs, `down` removes it."""
    monkeypatch.chdir(tmp_path)
    store = "hf://buckets/alice/demo-diloco/runs"
    (tmp_path / "run.toml").write_text(RUN_TOML.replace("s3://old-bucket/runs", store)
                                       .replace("sagemaker", "hf_jobs"))  # fmt: skip
    with hf_jobs_api() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        planned = diloco("infra", "plan", "--config", "run.toml")
        assert "bucket alice/demo-diloco: would be created, private" in planned.output
        assert diloco("infra", "up", "--config", "run.toml").exit_code == 1  # not confirmed
        assert hub.buckets == {}
        assert diloco("infra", "up", "--config", "run.toml", "--yes").exit_code == 0
        assert hub.buckets["alice/demo-diloco"]["private"] is True
        shown = diloco("infra", "output", "--config", "run.toml", "--write")
        assert shown.exit_code == 0, shown.output
        assert f"store_url = {store}" in shown.output
        assert "Generate S3 credentials" in shown.output
        assert "hf_jobs: export HF_BUCKETS_ACCESS_KEY_ID" in shown.output
        assert diloco("infra", "down", "--config", "run.toml", "--yes").exit_code == 0
        assert hub.buckets == {}
