"""The SageMaker launcher against moto's server, which serves SageMaker, CloudWatch Logs and S3.

boto3 honours ``AWS_ENDPOINT_URL``, so the real client talks to moto. What moto models of
SageMaker training jobs (5.2): CreateTrainingJob, DescribeTrainingJob, ListTags. It completes
every job at once, keeps AlgorithmSpecification (ContainerEntrypoint included, plus its own
MetricDefinitions) but drops Environment, and does not implement StopTrainingJob (HTTP 500).
So the states seen here are Completed and unknown; the InProgress mapping is checked on
DescribeTrainingJob answers as SageMaker documents them, and Environment on ``describe()``,
whose bodies are what ``launch`` sends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass

import boto3
import pytest
import tomli_w

from diloco_anywhere.backends.base import (
    BackendUnavailableError,
    PartialLaunchError,
    ReplicaHandle,
)
from diloco_anywhere.backends.sagemaker import LOG_GROUP, MAX_JOB_NAME, SageMakerBackend, job_state
from diloco_anywhere.config import ConfigError, load_config
from diloco_anywhere.launching.start.launch import LaunchError, load_handles, plan_launch, start
from support.proxy import Fault, FaultProxy

ECR_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:1"
ROLE = "arn:aws:iam::123456789012:role/diloco/sagemaker"
BASE = {"image": ECR_IMAGE, "role_arn": ROLE}
SETTINGS = {
    **BASE,
    "instance_type": "ml.g5.12xlarge",
    "processes_per_replica": 2,
    "spot": True,
    "max_runtime_hours": 2,
    "max_wait_hours": 3,
    "retries": 5,
    "checkpoint_s3_uri": "s3://diloco/checkpoints",
}
JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # TrainingJobName in the API model


@pytest.fixture
def aws(s3_run, tmp_path, monkeypatch) -> str:
    """moto as the AWS endpoint, with its dummy credentials; nothing read from ~/.aws. Returns
    a fresh s3:// store prefix."""
    store, _ = s3_run
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "missing-credentials"))
    return store


def plan(tmp_path, store: str, settings: dict = SETTINGS, name: str = "t"):
    """A launch of 2 SageMaker replicas of run ``name`` (plan_launch validates the settings)."""
    config = {
        "run": {"name": name, "store": store, "replicas": 2},
        "image": {"ref": "ghcr.io/acme/run:1"},
        "backends": {"sagemaker": settings},
    }
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(config))
    return plan_launch(load_config(path), {"sagemaker": 2}, root=tmp_path)


def sagemaker():
    return boto3.client("sagemaker", region_name="us-east-1")


def bodies(described: list[dict]) -> list[dict]:
    return [item["CreateTrainingJob"] for item in described]


def test_launch_creates_one_job_per_replica_with_the_settings(aws, tmp_path):
    launch = plan(tmp_path, aws)
    start(launch)
    handles = load_handles(launch.config, tmp_path)
    assert [h.replica_id for h in handles] == ["sagemaker-0", "sagemaker-1"]
    for spec, handle in zip(launch.specs, handles, strict=True):
        assert set(handle.job) == {"name", "region", "arn"}
        assert handle.job["region"] == "us-east-1"
        job = sagemaker().describe_training_job(TrainingJobName=handle.job["name"])
        assert job["TrainingJobArn"] == handle.job["arn"]
        assert job["AlgorithmSpecification"]["TrainingImage"] == ECR_IMAGE
        assert job["AlgorithmSpecification"]["ContainerEntrypoint"] == spec.command("python")
        assert job["RoleArn"] == ROLE
        assert job["ResourceConfig"] == {
            "InstanceType": "ml.g5.12xlarge",
            "InstanceCount": 1,
            "VolumeSizeInGB": 100,
        }
        assert job["EnableManagedSpotTraining"] is True
        assert job["StoppingCondition"] == {
            "MaxRuntimeInSeconds": 2 * 3600,
            "MaxWaitTimeInSeconds": 3 * 3600,
        }
        assert job["CheckpointConfig"]["S3Uri"] == "s3://diloco/checkpoints"
        assert job["OutputDataConfig"]["S3OutputPath"] == f"{aws}/t/sagemaker-output"
        assert job.get("Environment", spec.env) == spec.env  # moto drops it
        tags = sagemaker().list_tags(ResourceArn=handle.job["arn"])["Tags"]
        assert {t["Key"]: t["Value"] for t in tags} == {
            "diloco:run": "t",
            "diloco:replica": spec.replica_id,
        }
        # moto completes every job at once
        assert launch.backends["sagemaker"].state(handle) == "exited"


def test_describe_is_what_launch_sends(aws, tmp_path):
    launch = plan(tmp_path, aws)
    backend, specs = launch.backends["sagemaker"], list(launch.specs)
    described = bodies(backend.describe(specs))
    handles = backend.launch(specs, tmp_path)
    for body, spec, handle in zip(described, specs, handles, strict=True):
        job = sagemaker().describe_training_job(TrainingJobName=handle.job["name"])
        job["AlgorithmSpecification"].pop("MetricDefinitions")  # moto adds its own
        sent = {key: value for key, value in body.items() if key != "TrainingJobName"}
        kept = {key: job[key] for key in sent if key in job}
        assert kept == {key: sent[key] for key in kept}
        # moto drops Environment and RetryStrategy, and keeps Tags apart
        assert set(sent) - set(kept) == {"Environment", "RetryStrategy", "Tags"}
        assert body["RetryStrategy"] == {"MaximumRetryAttempts": 5}
        tags = sagemaker().list_tags(ResourceArn=handle.job["arn"])["Tags"]
        assert tags == body["Tags"]
        assert body["Environment"] == spec.env
        assert {"DILOCO_RUN", "DILOCO_STORE", "DILOCO_CONFIG_KEY", "DILOCO_REPLICA_ID"} <= set(
            body["Environment"]
        )
        entrypoint = body["AlgorithmSpecification"]["ContainerEntrypoint"]
        assert entrypoint[:3] == ["python", "-m", "torch.distributed.run"]
        assert "--nproc-per-node=2" in entrypoint
    text = json.dumps(described)
    assert "testing" not in text  # the secret key moto's credentials use
    assert "AWS_" not in text


def test_job_names_fit_the_api_whatever_the_run_name(aws, tmp_path):
    launch = plan(tmp_path, aws, name="my_run.v2=" + "x" * 100)
    backend, specs = launch.backends["sagemaker"], list(launch.specs)
    first, second = bodies(backend.describe(specs)), bodies(backend.describe(specs))
    names = [body["TrainingJobName"] for body in first + second]
    assert all(JOB_NAME.fullmatch(name) and len(name) <= MAX_JOB_NAME for name in names)
    assert names[0].startswith("my-run-v2-xxx")
    assert "-sagemaker-0-" in names[0]
    assert len(set(names)) == 4  # a new suffix per launch: SageMaker never reuses a name


@pytest.mark.parametrize(
    ("settings", "field", "says"),
    [
        ({"instance_type": "ml.h100.8xlarge"}, "instance_type", "ml.p5"),
        ({"instance_type": "p4d.24xlarge"}, "instance_type", "did you mean ml.p4d.24xlarge"),
        ({"spot": True}, "backends.sagemaker", "max_wait_hours"),
        ({"spot": True, "max_runtime_hours": 10, "max_wait_hours": 5}, "sagemaker", "max_wait"),
        ({"max_wait_hours": 5}, "backends.sagemaker", "max_wait_hours applies only with spot"),
        ({"max_runtime_hours": 700}, "max_runtime_hours", "672"),
        ({"retries": 31}, "backends.sagemaker.retries = 31", "less than or equal to 30"),
        ({"retries": -1}, "backends.sagemaker.retries = -1", "greater than or equal to 0"),
        ({"role_arn": "arn:aws:iam::1234:role/x"}, "role_arn", "pattern"),
        ({"role_arn": "arn:aws:iam::123456789012:user/x"}, "role_arn", "pattern"),
        ({"checkpoint_s3_uri": "/tmp/checkpoints"}, "checkpoint_s3_uri", "s3://"),
        ({"region": "us-eats-1"}, "region", "us-east-1"),
        ({"gpu": "h100"}, "backends.sagemaker.gpu", "Extra inputs"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(aws, tmp_path, settings, field, says):
    with pytest.raises(ConfigError) as refused:
        plan(tmp_path, aws, {**BASE, **settings})
    message = str(refused.value)
    assert field in message
    assert says in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("store", "settings", "refused"),
    [
        ("gs://bucket/runs", BASE, r"backends\.sagemaker\.output_s3_uri: required when run"),
        (None, {**BASE, "image": "ghcr.io/acme/run:1"}, r"backends\.sagemaker\.image: .* ECR"),
    ],
)
def test_a_new_job_needs_an_ecr_image_and_an_s3_output(aws, tmp_path, store, settings, refused):
    """describe, check and launch refuse them; the backend itself does not, so that status,
    logs and stop reach the jobs of a launch made before run.toml changed (B6)."""
    earlier = plan(tmp_path, aws)
    [handle, _] = earlier.backends["sagemaker"].launch(list(earlier.specs), tmp_path)
    launch = plan(tmp_path, store or aws, settings)
    backend, specs = launch.backends["sagemaker"], list(launch.specs)
    with pytest.raises(ConfigError, match=refused) as error:
        backend.describe(specs)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=refused):
        backend.check()
    with pytest.raises(ConfigError, match=refused):
        backend.launch(specs, tmp_path)
    assert backend.state(handle) == "exited"
    backend.stop(handle)
    assert "no log events yet" in backend.logs(handle)


def test_an_s3_output_folder_serves_a_store_off_s3(aws, tmp_path):
    settings = {**BASE, "output_s3_uri": "s3://out/x"}
    launch = plan(tmp_path, "gs://bucket/runs", settings)
    [body, _] = bodies(launch.backends["sagemaker"].describe(list(launch.specs)))
    assert body["OutputDataConfig"] == {"S3OutputPath": "s3://out/x"}


def test_describe_and_check_need_the_role(aws, tmp_path):
    launch = plan(tmp_path, aws, {"image": ECR_IMAGE})
    backend = launch.backends["sagemaker"]
    with pytest.raises(ConfigError, match=r"backends\.sagemaker\.role_arn: required"):
        backend.describe(list(launch.specs))
    with pytest.raises(ConfigError, match=r"backends\.sagemaker\.role_arn: required"):
        backend.check()


def test_an_environment_sagemaker_would_refuse_is_refused_before_sending(aws, tmp_path):
    launch = plan(tmp_path, aws)
    spec = launch.specs[0]
    big = dataclasses.replace(spec, env={**spec.env, "DILOCO_BIG": "x" * 513})
    with pytest.raises(ValueError, match=r"Environment\['DILOCO_BIG'\] has 513 characters.*512"):
        launch.backends["sagemaker"].describe([big])


def test_stop_leaves_an_ended_or_unknown_job_alone(aws, tmp_path):
    """moto has no StopTrainingJob (it answers 500): stop must not call it for a job that has
    ended, which SageMaker would refuse anyway. An unknown (deleted) job is fine too."""
    launch = plan(tmp_path, aws)
    backend = launch.backends["sagemaker"]
    [handle, _] = backend.launch(list(launch.specs), tmp_path)
    backend.stop(handle)
    backend.stop(handle)
    assert backend.state(handle) == "exited"
    gone = ReplicaHandle("sagemaker-9", "sagemaker", {**handle.job, "name": "t-deleted-job"})
    backend.stop(gone)
    assert backend.state(gone) == "unknown"


def test_logs_are_the_jobs_cloudwatch_streams(aws, tmp_path):
    launch = plan(tmp_path, aws)
    backend = launch.backends["sagemaker"]
    [handle, other] = backend.launch(list(launch.specs), tmp_path)
    assert "no log events yet" in backend.logs(handle)
    logs = boto3.client("logs", region_name="us-east-1")
    with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
        logs.create_log_group(logGroupName=LOG_GROUP)  # the session's tests share the server
    stream = f"{handle.job['name']}/algo-1-123"
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    now = int(time.time() * 1000)
    events = [{"timestamp": now, "message": "step 1"}, {"timestamp": now + 1, "message": "step 2"}]
    logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=stream, logEvents=events)
    assert backend.logs(handle) == "step 1\nstep 2\n"
    assert "no log events yet" in backend.logs(other)


def test_check_without_credentials_says_how_to_provide_them(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "missing-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # a runner on EC2 has credentials
    backend = plan(tmp_path, "s3://diloco", BASE)
    with pytest.raises(BackendUnavailableError) as missing:
        backend.backends["sagemaker"].check()
    message = str(missing.value)
    assert "\n" not in message
    assert "aws configure" in message
    assert "AWS_PROFILE" in message


@dataclass
class NthPost(Fault):
    """Answers the ``post``-th POST with an error in SageMaker's JSON. SageMaker's calls are
    all POST /, so within one ``launch`` the second is the second CreateTrainingJob."""

    post: int = 1
    seen: int = 0

    def matches(self, method: str, path: str) -> bool:
        self.seen += method == "POST"
        return self.times > 0 and self.seen == self.post

    def body(self) -> bytes:
        return json.dumps({"__type": self.code, "message": self.message}).encode()


def test_a_launch_refused_part_way_stops_the_jobs_it_created(aws, tmp_path, monkeypatch):
    launch = plan(tmp_path, aws)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    with FaultProxy(endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        quota = "account-level service limit 'ml.g5.12xlarge for spot training job usage' is 1"
        refusal = NthPost("POST", status=400, code="ResourceLimitExceeded", message=quota, post=2)
        proxy.inject(refusal)
        with pytest.raises(PartialLaunchError) as refused:
            launch.backends["sagemaker"].launch(list(launch.specs), tmp_path)
    message = str(refused.value)
    assert "ResourceLimitExceeded" in message
    assert quota in message
    assert "stopped 1 replicas (sagemaker-0)" in message
    assert "STILL RUNNING" not in message
    assert [handle.replica_id for handle in refused.value.started] == ["sagemaker-0"]


@pytest.mark.parametrize("stop_fails", [False, True])
def test_a_create_that_failed_after_sagemaker_took_it_stops_that_job(
    aws, tmp_path, monkeypatch, stop_fails
):
    """The first CreateTrainingJob reaches SageMaker, which creates the job, but the client
    gets an error: as when botocore retries a call whose answer was lost and SageMaker
    refuses the retry (ResourceInUse: the name is taken, by that very job). The job has no
    handle, but its name is known: it is stopped by name."""
    launch = plan(tmp_path, aws)
    backend = launch.backends["sagemaker"]
    stopped: list[str] = []

    def stop(handle: ReplicaHandle) -> None:
        stopped.append(handle.job["name"])
        if stop_fails:
            raise RuntimeError("AccessDeniedException: not allowed to StopTrainingJob")
        SageMakerBackend.stop(backend, handle)

    monkeypatch.setattr(backend, "stop", stop)
    taken = "Training job names must be unique within an AWS account and region"
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxy.inject(NthPost("POST", status=400, code="ResourceInUse", message=taken, mode="after"))
        with pytest.raises(PartialLaunchError) as refused:
            backend.launch(list(launch.specs), tmp_path)
        [name] = stopped  # the job of sagemaker-0, the only one tried
        assert "-sagemaker-0-" in name
        assert sagemaker().describe_training_job(TrainingJobName=name)["TrainingJobName"] == name
    message = str(refused.value)
    assert "ResourceInUse" in message
    assert "none to stop" in message  # no earlier job of this launch
    assert refused.value.started == []
    if stop_fails:
        assert f"SageMaker job {name} (region us-east-1) may exist and could not be" in message
        assert "not allowed to StopTrainingJob" in message
        assert "stop it by hand" in message
    else:
        assert "stop it by hand" not in message


@pytest.mark.parametrize(
    ("status", "secondary", "state"),
    [
        ("InProgress", "Starting", "pending"),
        ("InProgress", "Downloading", "pending"),
        ("InProgress", "Interrupted", "pending"),  # spot capacity taken back; waits, restarts
        ("InProgress", "Training", "running"),
        ("InProgress", "Uploading", "running"),
        ("Completed", "Completed", "exited"),
        ("Failed", "Failed", "failed"),
        ("Stopping", "Stopping", "stopped"),
        ("Stopped", "Stopped", "stopped"),
        ("Stopped", "MaxRuntimeExceeded", "timed_out"),  # ended at MaxRuntimeInSeconds
        ("Stopping", "MaxRuntimeExceeded", "timed_out"),
        ("Stopped", "MaxWaitTimeExceeded", "timed_out"),  # spot: waited and ran too long
    ],
)
def test_job_states(status, secondary, state):
    """The mapping of DescribeTrainingJob answers moto cannot produce (it completes at once)."""
    assert job_state({"TrainingJobStatus": status, "SecondaryStatus": secondary}) == state


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        ("ClientError: the job exceeded MaxRuntimeInSeconds while stopping", "timed_out"),
        ("Training job exceeded the maximum allowed wait time", "timed_out"),
        ("AlgorithmError: ExecuteUserScriptError: exit code 1", "failed"),
        ("CapacityError: Unable to provision requested ML compute capacity", "failed"),
    ],
)
def test_a_failed_job_whose_reason_names_its_time_limit_timed_out(reason, state):
    job = {"TrainingJobStatus": "Failed", "SecondaryStatus": "Failed", "FailureReason": reason}
    assert job_state(job) == state


def test_retries_and_runtime_up_to_28_days_are_sent_and_the_limit_is_the_runtime(aws, tmp_path):
    settings = {**BASE, "instance_type": "ml.p4d.24xlarge", "max_runtime_hours": 28 * 24}
    for retries, strategy in ((0, None), (30, {"MaximumRetryAttempts": 30})):
        launch = plan(tmp_path, aws, {**settings, "retries": retries})
        backend = launch.backends["sagemaker"]
        [body, _] = bodies(backend.describe(launch.specs))
        assert body.get("RetryStrategy") == strategy
        assert body["StoppingCondition"] == {"MaxRuntimeInSeconds": 2419200}  # SageMaker's most
        assert (backend.attempt_limit(), backend.hardware()) == (2419200, "ml.p4d.24xlarge")
    default = plan(tmp_path, aws, BASE).backends["sagemaker"]
    assert default.settings.retries == 2
    assert (default.attempt_limit(), default.hardware()) == (24 * 3600, "ml.g5.xlarge")


def test_a_replica_started_again_is_a_new_job_of_its_own_name(aws, tmp_path):
    """What `diloco keep` does: the one spec of replica sagemaker-1, launched again, is a new
    training job (SageMaker never reuses a name) for that replica, id and shard."""
    launch = plan(tmp_path, aws)
    backend, spec = launch.backends["sagemaker"], launch.specs[1]
    [body] = bodies(backend.describe([spec]))
    assert body["Environment"]["DILOCO_REPLICA_ID"] == "sagemaker-1"
    assert body["Environment"]["DILOCO_REPLICA_INDEX"] == "1"

    handles = [backend.launch([spec], tmp_path)[0] for _ in range(2)]

    assert [handle.replica_id for handle in handles] == ["sagemaker-1", "sagemaker-1"]
    names = [handle.job["name"] for handle in handles]
    assert names[0] != names[1]
    assert all("-sagemaker-1-" in name for name in names)
    for handle in handles:
        job = sagemaker().describe_training_job(TrainingJobName=handle.job["name"])
        assert job["AlgorithmSpecification"]["ContainerEntrypoint"] == spec.command("python")
        tags = sagemaker().list_tags(ResourceArn=handle.job["arn"])["Tags"]
        assert {"Key": "diloco:replica", "Value": "sagemaker-1"} in tags


def test_check_without_boto3_says_how_to_install_it(aws, tmp_path, monkeypatch):
    backend = plan(tmp_path, aws).backends["sagemaker"]
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(BackendUnavailableError) as error:
        backend.check()
    assert str(error.value) == (
        "backend sagemaker needs the boto3 package: pip install 'diloco-anywhere[sagemaker]'"
    )


def _push(repository: str, tag: str, layer: str) -> str:
    """An image manifest pushed to moto's ECR under ``tag``; its digest."""
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1,
                   "digest": f"sha256:{layer * 64}"},
        "layers": [],
    })  # fmt: skip
    ecr = boto3.client("ecr", region_name="us-east-1")
    pushed = ecr.put_image(repositoryName=repository, imageManifest=manifest, imageTag=tag)
    return pushed["image"]["imageId"]["imageDigest"]


@pytest.mark.parametrize("latest_tag", [False, True])
def test_latest_is_pinned_to_one_digest_for_every_replica_of_a_launch(aws, tmp_path, latest_tag):
    """infra/aws keeps every ECR tag immutable (no `latest` tag there): `:latest` means the
    newest image pushed. A repository that has a `latest` tag pins that tag's digest."""
    repository = f"pin-{os.urandom(4).hex()}"
    mutability = "MUTABLE" if latest_tag else "IMMUTABLE"
    boto3.client("ecr", region_name="us-east-1").create_repository(
        repositoryName=repository, imageTagMutability=mutability
    )
    digest = _push(repository, "sha-0a1b2c3", "a")
    if latest_tag:
        digest = _push(repository, "latest", "b")
    image = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/{repository}:latest"
    launch = plan(tmp_path, aws, {**SETTINGS, "image": image})
    [described, _] = bodies(launch.backends["sagemaker"].describe(launch.specs))
    assert described["AlgorithmSpecification"]["TrainingImage"] == image  # a dry run asks nothing
    start(launch)
    for handle in load_handles(launch.config, tmp_path):
        job = sagemaker().describe_training_job(TrainingJobName=handle.job["name"])
        assert job["AlgorithmSpecification"]["TrainingImage"] == image.replace(
            ":latest", f"@{digest}"
        )


def test_latest_of_an_empty_repository_says_to_build_first(aws, tmp_path):
    repository = f"pin-{os.urandom(4).hex()}"
    boto3.client("ecr", region_name="us-east-1").create_repository(repositoryName=repository)
    image = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/{repository}"  # no tag: latest
    launch = plan(tmp_path, aws, {**SETTINGS, "image": image})
    with pytest.raises(LaunchError, match=f"{repository} holds no tagged image yet: run the image"):
        start(launch)
