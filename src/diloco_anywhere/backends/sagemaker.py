"""Amazon SageMaker: one training job per replica, started with boto3's ``CreateTrainingJob``.

Why boto3 and not the SageMaker Python SDK v3 (``ModelTrainer``): we start a prebuilt image with
our own entrypoint, one single-instance job per replica. ModelTrainer's value (uploading source,
recipes, launching distributed training across instances) would go unused, it adds about 1 GB of
dependencies, and it calls IAM ``SimulatePrincipalPolicy``, which moto does not model, so it
could not be tested against a local stand-in. boto3 already comes with the S3 store.

Each replica is a job (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateTrainingJob.html)
whose ``ContainerEntrypoint`` is the replica command, so the image's own ENTRYPOINT and
SageMaker's ``train`` argument convention are bypassed; ``Environment`` carries the DILOCO_*
variables. There are no secrets: the job runs as the execution role (``role_arn``), whose
policies give the replica the bucket through the container's credentials, which boto3 and s3fs
find on their own. SageMaker pulls training images from Amazon ECR only (another registry needs
a VPC, https://docs.aws.amazon.com/sagemaker/latest/dg/docker-containers-adapt-your-own-private-registry.html),
so the image must be an ECR URI.

With ``spot`` (managed spot training) SageMaker restarts an interrupted job itself, and the
replica resumes from the run's global checkpoint in the bucket like any new replica; that is
why ``checkpoint_s3_uri`` (where SageMaker syncs /opt/ml/checkpoints) is optional. ``retries``
becomes the job's ``RetryStrategy``: SageMaker starts a job again, in the same job, after an
internal error or a capacity shortage; without it SageMaker retries nothing. A job ends at
``MaxRuntimeInSeconds`` (its attempts in total, with retries) or, with spot, at
``MaxWaitTimeInSeconds``, stopped with SecondaryStatus MaxRuntimeExceeded or
MaxWaitTimeExceeded (API_StoppingCondition, API_DescribeTrainingJob): ``timed_out``. Status is
``DescribeTrainingJob``, logs are CloudWatch Logs (group /aws/sagemaker/TrainingJobs, one stream
per instance named ``<job>/algo-1-<epoch>``), stop is ``StopTrainingJob``.

Limits (instance types, regions, name and ARN patterns, environment sizes) come from botocore's
model of the SageMaker API, so they follow the installed SDK rather than a list copied here.
Every call honours boto3's own configuration, ``AWS_ENDPOINT_URL`` included (tests point it at
moto's server).
"""

from __future__ import annotations

import difflib
import re
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from secrets import token_hex
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from diloco_anywhere.backends.base import (
    Backend,
    BackendSettings,
    BackendUnavailableError,
    Capabilities,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    SecretHints,
    one_line,
)
from diloco_anywhere.config import RunConfig

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# StoppingCondition.MaxRuntimeInSeconds: "The maximum value is 28 days" (API_StoppingCondition)
MAX_RUNTIME_HOURS = 28 * 24
MAX_JOB_NAME = 63
ENDED: dict[str, JobState] = {
    "Completed": "exited",
    "Failed": "failed",
    "Stopping": "stopped",
    "Stopped": "stopped",
    "Deleting": "stopped",
}
# SecondaryStatus of an InProgress job whose container runs our command; the others (Starting,
# Downloading, Interrupted: a spot job waiting for capacity, Restarting...) are still pending.
RUNNING_PHASES = frozenset({"Training", "Uploading"})
# SecondaryStatus of a job SageMaker stopped at its StoppingCondition: it did not finish.
OUT_OF_TIME = frozenset({"MaxRuntimeExceeded", "MaxWaitTimeExceeded"})
# A FailureReason naming that limit (MaxRuntimeInSeconds, "maximum allowed wait time"...): a job
# that failed as it was being ended for its time counts as ended for its time.
_OUT_OF_TIME_REASON = re.compile(r"max(imum)?[\s_]*(allowed[\s_]*)?(run|wait[\s_]*)time", re.I)
# RetryStrategy.MaximumRetryAttempts: "1 to 30" (API_RetryStrategy); 0 here sends none
MAX_RETRIES = 30
_ECR_HOST = re.compile(
    r"(?P<registry>\d{12})\.dkr[.-]ecr(-fips)?\.(?P<region>[a-z0-9-]+)\.(amazonaws\.com(\.cn)?|on\.aws)"
)
MOVING_TAG = "latest"
# Settings checked against a shape of the API model: field -> (shape, an example)
_SHAPED = {
    "role_arn": ("RoleArn", "arn:aws:iam::123456789012:role/SageMakerExecution"),
    "checkpoint_s3_uri": ("S3Uri", "s3://<bucket>/<prefix>"),
    "output_s3_uri": ("S3Uri", "s3://<bucket>/<prefix>"),
}


class Settings(BackendSettings):
    # The IAM role the jobs run as: trusted by sagemaker.amazonaws.com, allowed to pull the
    # image from ECR, write CloudWatch logs and read and write the run's bucket.
    role_arn: str | None = None
    instance_type: str = "ml.g5.xlarge"  # botocore's TrainingInstanceType names
    region: str | None = None  # default: boto3's (AWS_DEFAULT_REGION, ~/.aws/config)
    spot: bool = False  # managed spot training: cheaper, interruptible, restarted by SageMaker
    max_runtime_hours: Annotated[float, Field(gt=0, le=MAX_RUNTIME_HOURS)] = 24
    # RetryStrategy.MaximumRetryAttempts: SageMaker starts the job again after an internal
    # error or a capacity shortage (within max_runtime_hours in total); 0: no RetryStrategy
    retries: Annotated[int, Field(ge=0, le=MAX_RETRIES)] = 2
    max_wait_hours: Annotated[float, Field(gt=0)] | None = None  # spot: waiting + running
    checkpoint_s3_uri: str | None = None  # optional: replicas resume from the bucket anyway
    output_s3_uri: str | None = None  # default: <run.store>/<run>/sagemaker-output (s3 store)
    volume_size_gb: Annotated[int, Field(ge=1)] = 100

    @field_validator("instance_type")
    @classmethod
    def _known_instance_type(cls, instance_type: str) -> str:
        allowed = instance_types()
        if allowed and instance_type not in allowed:
            raise ValueError(_unknown_instance_type(instance_type, allowed))
        return instance_type

    @field_validator("region")
    @classmethod
    def _known_region(cls, region: str | None) -> str | None:
        allowed = regions()
        if region is not None and allowed and region not in allowed:
            raise ValueError(
                f"SageMaker has no region {region!r}; choose from {', '.join(allowed)}"
            )
        return region

    @field_validator(*_SHAPED)
    @classmethod
    def _api_shape(cls, value: str | None, info: ValidationInfo) -> str | None:
        shape, example = _SHAPED[str(info.field_name)]
        refused = [] if value is None else refusals(value, shape, "it")
        if refused:
            raise ValueError(f"{'; '.join(refused)} (e.g. {example})")
        return value

    @model_validator(mode="after")
    def _spot_wait(self) -> Settings:
        """A spot job's MaxWaitTimeInSeconds (waiting for capacity plus running) must be at
        least its MaxRuntimeInSeconds; it means nothing without spot."""
        if not self.spot and self.max_wait_hours is not None:
            raise ValueError("max_wait_hours applies only with spot = true")
        if self.spot and (self.max_wait_hours or 0) < self.max_runtime_hours:
            raise ValueError(
                f"spot = true needs max_wait_hours (got {self.max_wait_hours}) at least "
                f"max_runtime_hours ({self.max_runtime_hours:g}): the time a job may wait for "
                f"spot capacity plus the time it runs"
            )
        return self


@cache
def _botocore() -> Any | None:
    """botocore's session (None without botocore: ``check`` says how to install it)."""
    try:
        import botocore.session
    except ImportError:
        return None
    return botocore.session.get_session()


@cache
def _api() -> Any | None:
    """botocore's model of the SageMaker API."""
    session = _botocore()
    return None if session is None else session.get_service_model("sagemaker")


def instance_types() -> list[str]:
    """The training instance types this botocore knows ([] without botocore)."""
    api = _api()
    return [] if api is None else list(api.shape_for("TrainingInstanceType").enum)


def regions() -> list[str]:
    """Every region, in every partition, where this botocore knows SageMaker."""
    session = _botocore()
    if session is None:
        return []
    partitions = session.get_available_partitions()
    return sorted({r for p in partitions for r in session.get_available_regions("sagemaker", p)})


def _unknown_instance_type(instance_type: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(instance_type, allowed, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    families = sorted({name.rsplit(".", 1)[0] for name in allowed})
    return (
        f"SageMaker training has no instance type {instance_type!r}; {hint}the {len(allowed)} "
        f"botocore knows are ml.<family>.<size> with families {', '.join(families)}"
    )


def refusals(value: Any, shape: str, what: str) -> list[str]:
    """What the API model's ``shape`` refuses in ``value``: sizes and patterns, which botocore
    does not check before sending and SageMaker answers with a bare ValidationException."""
    api = _api()
    return [] if api is None else _refusals(value, api.shape_for(shape), what)


def _refusals(value: Any, shape: Any, what: str) -> list[str]:
    kind = shape.type_name
    found = _size(len(value), shape.metadata, what, "entries" if kind in ("list", "map") else "")
    if kind == "map":
        for key, item in value.items():
            found += _refusals(key, shape.key, f"{what} name {key!r:.40}")
            found += _refusals(item, shape.value, f"{what}[{key!r:.40}]")
    elif kind == "list":
        for position, item in enumerate(value):
            found += _refusals(item, shape.member, f"{what}[{position}]")
    elif "pattern" in shape.metadata and not re.fullmatch(shape.metadata["pattern"], value):
        found.append(f"{what} does not match SageMaker's pattern {shape.metadata['pattern']}")
    return found


def _size(size: int, limits: dict[str, Any], what: str, unit: str) -> list[str]:
    low, high = limits.get("min", 0), limits.get("max")
    if size >= low and (high is None or size <= high):
        return []
    allowed = f"{low} to {high}" if high is not None else f"at least {low}"
    return [f"{what} has {size} {unit or 'characters'}; SageMaker allows {allowed}"]


def job_name(run: str, replica_id: str, suffix: str) -> str:
    """A TrainingJobName: unique in the account and region for good (SageMaker keeps ended
    jobs' names), so every launch and restart takes a new ``suffix``; letters, digits and
    hyphens, at most 63 characters. Other characters become hyphens; the run name is cut."""
    tail = _hyphenated(f"{replica_id}-{suffix}")
    head = _hyphenated(run)[: MAX_JOB_NAME - len(tail) - 1].strip("-")
    return f"{head}-{tail}" if head else tail


def _hyphenated(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-")


def launch_suffix() -> str:
    """UTC time to the second and 4 random hex digits: job names sort by launch, never clash."""
    return f"{time.strftime('%y%m%d-%H%M%S', time.gmtime())}-{token_hex(2)}"


def _newest_digest(ecr: Any, where: dict[str, str]) -> str:
    """The digest ``latest`` names in the repository, else the newest pushed image's."""
    try:
        tagged = ecr.describe_images(**where, imageIds=[{"imageTag": MOVING_TAG}])
        return tagged["imageDetails"][0]["imageDigest"]
    except ecr.exceptions.ImageNotFoundException:
        pass
    pages = ecr.get_paginator("describe_images").paginate(**where, filter={"tagStatus": "TAGGED"})
    images = [image for page in pages for image in page["imageDetails"]]
    if not images:
        raise BackendUnavailableError(
            f"backend sagemaker: ECR repository {where['repositoryName']} holds no tagged image "
            f"yet: run the image workflow (or docker push a sha-<commit> tag) first"
        )
    return max(images, key=lambda image: image["imagePushedAt"])["imageDigest"]


def job_state(job: dict[str, Any]) -> JobState:
    """A DescribeTrainingJob answer as a JobState: ``timed_out`` for a job SageMaker ended at
    its StoppingCondition."""
    status, phase = job["TrainingJobStatus"], job.get("SecondaryStatus")
    if status == "InProgress":
        return "running" if phase in RUNNING_PHASES else "pending"
    if status in ("Stopping", "Stopped") and phase in OUT_OF_TIME:
        return "timed_out"
    if status == "Failed" and _OUT_OF_TIME_REASON.search(job.get("FailureReason", "")):
        return "timed_out"
    return ENDED.get(status, "unknown")


class SageMakerBackend(Backend):
    name = "sagemaker"
    capabilities = Capabilities(
        remote=True, stops_one_replica=True, time_limit="always", spot_wait=True
    )
    secret_hints = SecretHints(aws="nothing: the jobs run as role_arn, which has the bucket")
    settings_model = Settings
    settings: Settings

    def __init__(self, config: RunConfig | None = None) -> None:
        """Settings only: ``diloco status``, ``logs`` and ``stop`` build the backend from the
        current run.toml to reach jobs already started, whatever its image or store now are;
        what a new job needs is resolved where its request is made, and by ``check``."""
        super().__init__(config)
        self._clients: dict[tuple[str, str], Any] = {}

    def check(self) -> None:
        """boto3, credentials, role, image, output, region: in the order a user provides
        them. Resolves credentials the way boto3 does; starts nothing."""
        boto3 = self.import_sdk("boto3")
        from botocore.exceptions import BotoCoreError

        try:
            credentials = boto3.Session().get_credentials()
        except BotoCoreError as exc:  # e.g. AWS_PROFILE names a profile that does not exist
            raise BackendUnavailableError(f"backend sagemaker: AWS credentials: {exc}") from None
        if credentials is None:
            raise BackendUnavailableError(
                "backend sagemaker: no AWS credentials; run `aws configure` (or `aws sso login`)"
                ", set AWS_PROFILE, or in GitHub Actions assume the OIDC role "
                "(aws-actions/configure-aws-credentials)"
            )
        self._job_settings()
        self._region()

    def _job_settings(self) -> dict[str, str]:
        """What every job of a launch shares and run.toml must allow: role, image, output."""
        return {
            "role": self._role(),
            "image": self._ecr_image(),
            "output": self.settings.output_s3_uri or self._default_output(),
        }

    def _ecr_image(self) -> str:
        """The image, which SageMaker pulls from Amazon ECR only."""
        image = self.image()
        if not _ECR_HOST.fullmatch(image.split("/", 1)[0]):
            raise self.settings_error("image", (
                f"{image!r} is not in Amazon ECR, the only registry SageMaker training pulls "
                f"from; push the image to <account>.dkr.ecr.<region>.amazonaws.com/"
                f"<repository>:<tag> and set [backends.sagemaker] image to it"
            ))  # fmt: skip
        return image

    def _default_output(self) -> str:
        """Where SageMaker writes each job's output (required by the API): next to the
        run's objects when the store is on S3."""
        store = self.config.store_url().rstrip("/")
        if not store.startswith("s3://"):
            raise self.settings_error("output_s3_uri", (
                f"required when run.store is not on S3 ({store.partition(':')[0]}): SageMaker "
                f"writes each job's output to an s3:// folder, e.g. s3://<bucket>/"
                f"sagemaker-output"
            ))  # fmt: skip
        return f"{store}/{self.config.run.name}/sagemaker-output"

    def _role(self) -> str:
        if self.settings.role_arn is None:
            raise self.settings_error("role_arn", (
                "required: the IAM role the jobs run as (trusted by sagemaker.amazonaws.com, "
                "allowed to pull the image, write logs and use the run's bucket), e.g. "
                f"{_SHAPED['role_arn'][1]}"
            ))  # fmt: skip
        return self.settings.role_arn

    def _region(self) -> str:
        import boto3

        region = self.settings.region or boto3.Session().region_name
        if not region:
            raise BackendUnavailableError(
                "backend sagemaker: no AWS region; set [backends.sagemaker] region (e.g. "
                "us-east-1), AWS_DEFAULT_REGION, or `aws configure set region`"
            )
        return region

    def _client(self, service: str, region: str) -> Any:
        """One client per service and region for this backend's life (a supervisor asks for
        states every few seconds)."""
        if (service, region) not in self._clients:
            import boto3

            self._clients[service, region] = boto3.Session().client(service, region_name=region)
        return self._clients[service, region]

    def attempt_limit(self) -> float | None:
        """MaxRuntimeInSeconds: the running time SageMaker gives a job, its retries included
        (a spot job may also wait for capacity, up to MaxWaitTimeInSeconds in all)."""
        return self._stopping_condition()["MaxRuntimeInSeconds"]

    def spot_wait_limit(self) -> float | None:
        """``max_wait_hours`` in seconds with ``spot``: MaxWaitTimeInSeconds, the time a job
        may wait for spot capacity and run, in all."""
        wait = self.settings.max_wait_hours
        return wait * 3600 if self.settings.spot and wait is not None else None

    def hardware(self) -> str:
        """The instance type (one instance per job), as SageMaker prices it."""
        return self.settings.instance_type

    def _stopping_condition(self) -> dict[str, int]:
        condition = {"MaxRuntimeInSeconds": round(self.settings.max_runtime_hours * 3600)}
        if self.settings.spot:
            condition["MaxWaitTimeInSeconds"] = round((self.settings.max_wait_hours or 0) * 3600)
        return condition

    def _request(
        self, spec: ReplicaSpec, suffix: str, role: str, image: str, output: str
    ) -> dict[str, Any]:
        """CreateTrainingJob's body for one replica: one instance running our command."""
        entrypoint = spec.command("python")
        refused = refusals(entrypoint, "TrainingContainerEntrypoint", "ContainerEntrypoint")
        refused += refusals(spec.env, "TrainingEnvironmentMap", "Environment")
        if refused:
            raise ValueError(
                f"SageMaker would refuse {spec.replica_id}'s job: {'; '.join(refused)}"
            )
        settings = self.settings
        request = {
            "TrainingJobName": job_name(self.config.run.name, spec.replica_id, suffix),
            "RoleArn": role,
            "AlgorithmSpecification": {
                "TrainingImage": image,
                "TrainingInputMode": "File",
                "ContainerEntrypoint": entrypoint,
            },
            "Environment": dict(spec.env),
            "OutputDataConfig": {"S3OutputPath": output},
            "ResourceConfig": {
                "InstanceType": settings.instance_type,
                "InstanceCount": 1,
                "VolumeSizeInGB": settings.volume_size_gb,
            },
            "StoppingCondition": self._stopping_condition(),
            "EnableManagedSpotTraining": settings.spot,
            "Tags": [
                {"Key": "diloco:run", "Value": self.config.run.name},
                {"Key": "diloco:replica", "Value": spec.replica_id},
            ],
        }
        if settings.retries:
            request["RetryStrategy"] = {"MaximumRetryAttempts": settings.retries}
        if settings.checkpoint_s3_uri:
            request["CheckpointConfig"] = {"S3Uri": settings.checkpoint_s3_uri}
        return request

    def _requests(self, specs: list[ReplicaSpec], pin: bool = False) -> list[dict[str, Any]]:
        shared, suffix = self._job_settings(), launch_suffix()
        if pin:
            shared["image"] = self._pinned(shared["image"])
        return [self._request(spec, suffix, **shared) for spec in specs]

    def _pinned(self, image: str) -> str:
        """``<repository>:latest`` as one digest for the whole launch, so every replica runs the
        same bytes: DiLoCo's replicas must share their code, and SageMaker pulls the image
        again whenever it restarts a job (spot), hours later. The digest is that of the
        ``latest`` tag where the repository has one, else of the newest image pushed
        (infra/aws keeps every tag immutable, so its image workflow pushes ``sha-<commit>``
        tags only). Any other tag, or a digest, is used as given."""
        tagged = ":" in image.rsplit("/", 1)[-1]
        repository, tag = image.rsplit(":", 1) if tagged else (image, MOVING_TAG)
        host, _, name = repository.partition("/")
        found = _ECR_HOST.fullmatch(host)  # _ecr_image checked it is in ECR
        if "@" in image or tag != MOVING_TAG or found is None:
            return image
        ecr = self._client("ecr", found["region"])
        where = {"registryId": found["registry"], "repositoryName": name}
        try:
            return f"{repository}@{_newest_digest(ecr, where)}"
        except ecr.exceptions.ClientError as exc:
            raise BackendUnavailableError(
                f"backend sagemaker: cannot find the image {image} in ECR to pin it for this "
                f"launch ({one_line(exc)}); the launcher needs ecr:DescribeImages on the "
                f"repository (infra/aws grants it), or name a tag or digest in [backends."
                f"sagemaker] image"
            ) from None

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """The CreateTrainingJob bodies (there is no secret to mask); job names get a new
        time and random suffix at each call, as at each launch."""
        return [{"CreateTrainingJob": request} for request in self._requests(specs)]

    def starter(
        self, specs: list[ReplicaSpec], run_dir: Path
    ) -> Callable[[ReplicaSpec], ReplicaHandle]:
        """Every request made (the image pinned once for all), then one CreateTrainingJob
        per replica."""
        requests = dict(
            zip((s.replica_id for s in specs), self._requests(specs, pin=True), strict=True)
        )
        region = self._region()
        client = self._client("sagemaker", region)

        def start_one(spec: ReplicaSpec) -> ReplicaHandle:
            request = requests[spec.replica_id]
            job = {"name": request["TrainingJobName"], "region": region}
            try:
                arn = client.create_training_job(**request)["TrainingJobArn"]
            except BaseException as exc:  # Ctrl-C too: the job may be created all the same
                self._stop_unacknowledged(ReplicaHandle(spec.replica_id, self.name, job), exc)
                raise
            return ReplicaHandle(spec.replica_id, self.name, {**job, "arn": arn})

        return start_one

    def _stop_unacknowledged(self, handle: ReplicaHandle, exc: BaseException) -> None:
        """A CreateTrainingJob that raised may still have created the job: the connection
        dropped or timed out after SageMaker took it, or botocore's retry was refused
        (ResourceInUse) because its first attempt had succeeded. Its name is known, so it is
        stopped like any other (a job SageMaker does not know is nothing to stop); if that
        fails too, the error says so."""
        try:
            self.stop(handle)
        except Exception as stop_exc:
            raise RuntimeError(
                f"SageMaker job {handle.job['name']} (region {handle.job['region']}) may "
                f"exist and could not be stopped ({one_line(stop_exc)}): stop it by hand if "
                f"it does; creating it failed: {one_line(exc)}"
            ) from exc

    def _describe(self, handle: ReplicaHandle) -> dict[str, Any] | None:
        """DescribeTrainingJob, or None for a job SageMaker does not know (deleted)."""
        client = self._client("sagemaker", handle.job["region"])
        try:
            return client.describe_training_job(TrainingJobName=handle.job["name"])
        except client.exceptions.ClientError as exc:
            if _not_found(exc):
                return None
            raise

    def state(self, handle: ReplicaHandle) -> JobState:
        job = self._describe(handle)
        return "unknown" if job is None else job_state(job)

    def logs(self, handle: ReplicaHandle) -> str:
        """The latest page (up to 1 MB) of each of the job's streams, one per instance start."""
        name, client = handle.job["name"], self._client("logs", handle.job["region"])
        try:
            streams = client.describe_log_streams(
                logGroupName=LOG_GROUP, logStreamNamePrefix=f"{name}/"
            )["logStreams"]
        except client.exceptions.ResourceNotFoundException:  # no job has logged yet
            streams = []
        messages = [
            event["message"]
            for stream in streams
            for event in client.get_log_events(
                logGroupName=LOG_GROUP, logStreamName=stream["logStreamName"], startFromHead=False
            )["events"]
        ]
        if not messages:
            return f"(no log events yet in CloudWatch Logs {LOG_GROUP} for {name}/*)\n"
        return "\n".join(messages) + "\n"

    def stop(self, handle: ReplicaHandle) -> None:
        """StopTrainingJob if the job is in progress; SageMaker refuses it for any other job
        (ValidationException), which we take as done, the job having ended meanwhile."""
        job = self._describe(handle)
        if job is None or job["TrainingJobStatus"] != "InProgress":
            return
        client = self._client("sagemaker", handle.job["region"])
        try:
            client.stop_training_job(TrainingJobName=handle.job["name"])
        except client.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] != "ValidationException":
                raise


def _not_found(exc: Any) -> bool:
    """The API models ResourceNotFound; SageMaker (and moto) answer a ValidationException
    saying the job is not found."""
    error = exc.response["Error"]
    message = str(error.get("Message", "")).lower()
    return error["Code"] == "ResourceNotFound" or (
        error["Code"] == "ValidationException" and ("not found" in message or "find" in message)
    )
