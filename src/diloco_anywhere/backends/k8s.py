"""Kubernetes: the replicas a launch starts together are one Indexed Job, submitted with the
official client.

An Indexed Job (https://kubernetes.io/docs/concepts/workloads/controllers/job/#completion-mode)
runs ``completions`` pods from one template and gives each its index in
``JOB_COMPLETION_INDEX``; the replica entrypoint turns that into its id
(``k8s-<DILOCO_REPLICA_ID_BASE + index>``) and shard (``DILOCO_REPLICA_INDEX_BASE`` + index,
``replica.py``). The bases let a Job run any consecutive replicas of a run, so that one replica
(``k8s-1`` alone: one completion, id base 1, its own shard) can be started again. Retries are
per index
(``backoffLimitPerIndex``, #backoff-limit-per-index: on by default since 1.29, GA in 1.33),
so a crashing replica is restarted without touching the others. ``maxFailedIndexes`` is left
unset on purpose: a replica that used up its retries must not take the healthy ones down,
since DiLoCo goes on with ``run.min_replicas``. A pod failure policy (#pod-failure-policy)
spends no retry on a pod the cluster disrupted (preemption, eviction) and none on exit 2, a
run.toml the replica refused, which would only fail again, or exit 3, a replica superseded by
a newer incarnation (``diloco keep`` or ``replace`` started one). Nothing ends a Job for its age
unless ``deadline_hours`` is set: it becomes ``activeDeadlineSeconds``
(#job-termination-and-cleanup), after which the Job controller terminates the Job's pods and
marks it Failed with reason DeadlineExceeded, read here as ``timed_out``.

With ``queue`` set, the Job carries Kueue's ``kueue.x-k8s.io/queue-name`` label; Kueue's webhook
suspends it until admitted, so it is not created suspended here
(https://kueue.sigs.k8s.io/docs/tasks/run/jobs/). Store credentials reach the pods from a
Secret the user created (``envFrom``) or from the pod's service account (IRSA, GKE Workload
Identity); only names are written here. The Job gets a name from the API server
(``generateName``), so ``describe`` shows exactly what ``launch`` submits.

The launcher uses the kubeconfig at ``$KUBECONFIG`` (or ``~/.kube/config``), else the pod's
service account when it runs inside a cluster.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field, model_validator

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
from diloco_anywhere.bucket import hf_buckets
from diloco_anywhere.config import RunConfig
from diloco_anywhere.contract import (
    ENV_REPLICA_ID,
    ENV_REPLICA_ID_BASE,
    ENV_REPLICA_INDEX,
    ENV_REPLICA_INDEX_BASE,
    NOT_RETRIED,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, V1Job, V1Pod

CONTAINER = "replica"
GPU_RESOURCE = "nvidia.com/gpu"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUN_LABEL = "diloco.run"
PLATFORM_LABEL = "diloco.platform"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# An Indexed Job's pods are named and hostnamed "<job>-<index>", a DNS label (63): the Job's
# name stays within 52 so that any index fits; the API server appends 5 characters.
MAX_GENERATE_NAME = 52 - 5
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(rf"{_LABEL.pattern}(\.{_LABEL.pattern})*")
POD_PHASES: dict[str, JobState] = {
    "Pending": "pending",
    "Running": "running",
    "Succeeded": "exited",
    "Failed": "pending",  # its index is not failed yet: the Job controller starts a retry
    "Unknown": "unknown",
}
# The Job controller's reason on the Failed condition of a Job past activeDeadlineSeconds.
DEADLINE_EXCEEDED = "DeadlineExceeded"


def _k8s_name(pattern: re.Pattern[str], limit: int, rule: str) -> AfterValidator:
    def check(value: str) -> str:
        if len(value) > limit or not pattern.fullmatch(value):
            raise ValueError(f"must be {rule}, at most {limit} characters")
        return value

    return AfterValidator(check)


def _quantity(value: str) -> str:
    """The API server's resource quantity syntax, checked by the client's own parser (without
    the client installed, ``check()`` reports that before anything is submitted)."""
    try:
        from kubernetes.utils import parse_quantity
    except ImportError:
        return value
    try:
        parse_quantity(value)
    except ValueError:
        raise ValueError(
            "must be a Kubernetes quantity, e.g. '8' or '500m' (CPU), '32Gi' (memory)"
        ) from None
    return value


_LOWER = "lowercase letters, digits and '-', starting and ending with a letter or digit"
Label = Annotated[str, _k8s_name(_LABEL, 63, f"a DNS-1123 label: {_LOWER}")]
Subdomain = Annotated[
    str, _k8s_name(_SUBDOMAIN, 253, f"a DNS-1123 subdomain: {_LOWER}, dots between")
]
# A LocalQueue name, which the Job carries as a label value: also at most 63 characters.
QueueName = Annotated[str, _k8s_name(_SUBDOMAIN, 63, f"a LocalQueue name: {_LOWER}, dots between")]
Quantity = Annotated[str, AfterValidator(_quantity)]


class Settings(BackendSettings):
    namespace: Label = "default"
    gpus_per_pod: Annotated[int, Field(ge=0)] = 1  # nvidia.com/gpu limit; 0: a CPU pod
    queue: QueueName | None = None  # Kueue LocalQueue in the namespace
    secret: Subdomain | None = None  # Secret with the store's credentials, as env variables
    service_account: Subdomain | None = None  # bucket access by IRSA / Workload Identity
    backoff_limit_per_index: Annotated[int, Field(ge=0)] = 3  # retries of each replica
    # activeDeadlineSeconds: the Job (every replica in it) ends this long after it started
    deadline_hours: Annotated[float, Field(gt=0)] | None = None
    context: str | None = None  # kubeconfig context; default: its current one
    cpu: Quantity | None = None  # requests
    memory: Quantity | None = None

    @model_validator(mode="after")
    def _one_gpu_per_process(self) -> Settings:
        """torchrun starts one process per GPU: more processes than GPUs would share one."""
        if self.gpus_per_pod and self.processes_per_replica > self.gpus_per_pod:
            raise ValueError(
                f"processes_per_replica ({self.processes_per_replica}) must be at most "
                f"gpus_per_pod ({self.gpus_per_pod}): one process per GPU"
            )
        return self

    @model_validator(mode="after")
    def _whole_second_deadline(self) -> Settings:
        """activeDeadlineSeconds is a whole number of seconds, at least 1."""
        if self.deadline_hours is not None and self.deadline_seconds() < 1:
            raise ValueError(
                f"deadline_hours = {self.deadline_hours:g} is under one second; give at least "
                f"1/3600 (one second), or leave it out for no deadline"
            )
        return self

    def deadline_seconds(self) -> int | None:
        """``deadline_hours`` as the Job's activeDeadlineSeconds; None: no deadline."""
        if self.deadline_hours is None:
            return None
        return round(self.deadline_hours * 3600)


@contextmanager
def api_errors() -> Iterator[None]:
    """On the methods that call the API server: an ``ApiException``, whose text carries the
    response's headers and body over many lines, becomes one short line, its status, reason
    and the API server's message (its Status object's)."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as exc:
        try:
            message = f": {json.loads(exc.body)['message']}"
        except (TypeError, ValueError, KeyError):  # no body, not JSON, not a Status
            message = ""
        raise RuntimeError(f"{exc.status} {exc.reason}{message}") from exc


class KubernetesBackend(Backend):
    name = "k8s"
    capabilities = Capabilities(
        remote=True,
        stops_one_replica=False,  # deleting the Job ends every replica of its launch
        time_limit="optional",  # deadline_hours
        server_dry_run=True,
    )
    secret_hints = SecretHints(
        aws="kubectl create secret generic {run}-store --from-literal=AWS_ACCESS_KEY_ID"
        "=... --from-literal=AWS_SECRET_ACCESS_KEY=... (EKS: a service account with "
        "replica_policy_arn instead)",
        gcp="GKE: gke_service_accounts in the tfvars and [backends.k8s] service_account",
        hf="kubectl create secret generic {run}-store "  # {run}: filled in by for_cloud
        f"--from-literal={hf_buckets.ENV_ACCESS_KEY}=... "
        f"--from-literal={hf_buckets.ENV_SECRET_KEY}=...",
        aws_key=True,
    )
    settings_model = Settings
    settings: Settings

    def __init__(self, config: RunConfig | None = None) -> None:
        super().__init__(config)
        self._clients: dict[str | None, ApiClient] = {}  # by kubeconfig context

    def check(self) -> None:
        self.import_sdk("kubernetes")
        self._client(self.settings.context)

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        return [self.manifest(specs)]

    def attempt_limit(self) -> float | None:
        """The Job's activeDeadlineSeconds; None without ``deadline_hours`` (nothing ends a Job
        for its age)."""
        return self.settings.deadline_seconds()

    def hardware(self) -> str:
        """Your own cluster: no list price."""
        return ""

    def manifest(self, specs: list[ReplicaSpec]) -> dict[str, Any]:
        """The Indexed Job that runs ``specs`` (consecutive replicas of the run), one index per
        replica, as a plain dict."""
        env = self._template_env(specs)
        run = self.config.run.name
        labels = {RUN_LABEL: label_value(run), PLATFORM_LABEL: self.name}
        queue = {QUEUE_LABEL: self.settings.queue} if self.settings.queue else {}
        seconds = self.settings.deadline_seconds()
        deadline = {"activeDeadlineSeconds": seconds} if seconds is not None else {}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "generateName": generate_name(run),
                "namespace": self.settings.namespace,
                "labels": {**labels, **queue},
                "annotations": {RUN_LABEL: run},  # exact, where the label had to be mapped
            },
            "spec": {
                "completionMode": "Indexed",
                "completions": len(specs),
                "parallelism": len(specs),
                "backoffLimitPerIndex": self.settings.backoff_limit_per_index,
                **deadline,
                "podFailurePolicy": pod_failure_policy(),
                "template": {
                    "metadata": {"labels": labels},
                    "spec": self._pod_spec(specs[0], env),
                },
            },
        }

    def _template_env(self, specs: list[ReplicaSpec]) -> dict[str, str]:
        """The environment all pods share: the specs' own minus the id and index, which each
        pod derives from its completion index and the Job's first id number and shard. Refuses
        specs one template cannot serve."""
        if not specs:
            raise ValueError("k8s: no replicas to launch")
        first, base = self._id_number(specs[0]), specs[0].index
        expected = [(f"{self.name}-{first + k}", base + k) for k in range(len(specs))]
        if [(spec.replica_id, spec.index) for spec in specs] != expected:
            raise ValueError(
                f"k8s starts replicas together as one Indexed Job, whose pods are named by "
                f"their completion index: expected consecutive ids {self.name}-{first}.."
                f"{self.name}-{first + len(specs) - 1} with consecutive indexes from {base}, "
                f"got {[(spec.replica_id, spec.index) for spec in specs]}"
            )
        shared = {(_common(spec.env), spec.args, spec.processes) for spec in specs}
        if len(shared) > 1:
            raise ValueError(
                "k8s: the replicas of one launch differ beyond their id and index (environment, "
                "arguments or processes), which one pod template cannot express"
            )
        bases = {ENV_REPLICA_ID_BASE: str(first), ENV_REPLICA_INDEX_BASE: str(base)}
        return {**dict(_common(specs[0].env)), **bases}

    def _id_number(self, spec: ReplicaSpec) -> int:
        """The ``n`` of a replica id ``k8s-<n>``, which a pod rebuilds from its index."""
        found = re.fullmatch(rf"{re.escape(self.name)}-(\d+)", spec.replica_id)
        if found is None:
            raise ValueError(
                f"k8s: replica id {spec.replica_id!r} is not {self.name}-<number>, which a "
                f"pod of an Indexed Job derives from its completion index"
            )
        return int(found[1])

    def _pod_spec(self, spec: ReplicaSpec, env: dict[str, str]) -> dict[str, Any]:
        settings = self.settings
        limits = {GPU_RESOURCE: str(settings.gpus_per_pod)} if settings.gpus_per_pod else None
        requests = _without_none({"cpu": settings.cpu, "memory": settings.memory}) or None
        shm = spec.processes > 1  # torchrun's processes share tensors through /dev/shm
        container = {
            "name": CONTAINER,
            "image": self.image(),
            "command": spec.command("python"),
            "env": [{"name": name, "value": value} for name, value in env.items()],
            "envFrom": [{"secretRef": {"name": settings.secret}}] if settings.secret else None,
            "resources": _without_none({"limits": limits, "requests": requests}) or None,
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}] if shm else None,
        }
        return _without_none(
            {
                "restartPolicy": "Never",
                "serviceAccountName": settings.service_account,
                "containers": [_without_none(container)],
                # containers get 64 MiB of /dev/shm by default, too little for NCCL and DDP
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}] if shm else None,
            }
        )

    def launch(self, specs: list[ReplicaSpec], run_dir: Path) -> list[ReplicaHandle]:
        """One Job for all ``specs``, any consecutive replicas of the run (one alone, to start
        it again); each handle names the Job and its replica's completion index in it."""
        manifest = self.manifest(specs)
        created = self.submit(manifest, dry_run=False)
        job = {"namespace": self.settings.namespace, "name": created["metadata"]["name"]}
        context = {"context": self.settings.context} if self.settings.context else {}
        return [
            ReplicaHandle(spec.replica_id, self.name, {**job, "index": k, **context})
            for k, spec in enumerate(specs)
        ]

    def server_dry_run(self, specs: list[ReplicaSpec]) -> list[dict[str, Any]]:
        """The Job as the API server would create it (``dryRun=All``)."""
        return [self.submit(self.manifest(specs), dry_run=True)]

    @api_errors()
    def submit(self, manifest: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        """Create the Job; ``dry_run``: the API server validates and admits it (webhooks,
        quotas, the generated name) but stores and starts nothing. The Job as the server
        returned it."""
        from kubernetes.client import BatchV1Api

        client = self._client(self.settings.context)
        created = BatchV1Api(client).create_namespaced_job(
            manifest["metadata"]["namespace"], manifest, dry_run="All" if dry_run else None
        )
        return client.sanitize_for_serialization(created)

    @api_errors()
    def state(self, handle: ReplicaHandle) -> JobState:
        job = self._job(handle)
        if job is None or job.metadata.deletion_timestamp is not None:
            return "stopped"
        return index_state(job, self._pods(handle), handle.job["index"])

    @api_errors()
    def logs(self, handle: ReplicaHandle) -> str:
        """The output of the index's newest pod (an earlier attempt's is gone with its pod
        once retried); empty before its container has started."""
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        pods = self._pods(handle)
        if not pods:
            return ""
        core = CoreV1Api(self._client(handle.job.get("context")))
        try:  # raw: kubernetes 36.0 returns str(bytes), "b'...'", for a text body
            response = core.read_namespaced_pod_log(
                pods[0].metadata.name,
                handle.job["namespace"],
                container=CONTAINER,
                _preload_content=False,
            )
            return response.data.decode(errors="replace")
        except ApiException as exc:
            if exc.status in (400, 404):  # container not started yet, or pod just deleted
                return ""
            raise

    @api_errors()
    def stop(self, handle: ReplicaHandle) -> None:
        """Delete the Job unless it has ended. That ends every replica in the Job: Kubernetes
        cannot stop one index alone, and ``diloco stop`` stops them all anyway.
        Pods are removed in the background after their grace period, so replicas record the
        stop."""
        from kubernetes.client import BatchV1Api
        from kubernetes.client.exceptions import ApiException

        job = self._job(handle)
        if job is None or _ended(job):
            return
        batch = BatchV1Api(self._client(handle.job.get("context")))
        try:
            batch.delete_namespaced_job(
                handle.job["name"], handle.job["namespace"], propagation_policy="Background"
            )
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile
                raise

    def _job(self, handle: ReplicaHandle) -> V1Job | None:
        from kubernetes.client import BatchV1Api
        from kubernetes.client.exceptions import ApiException

        batch = BatchV1Api(self._client(handle.job.get("context")))
        try:
            return batch.read_namespaced_job(handle.job["name"], handle.job["namespace"])
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _pods(self, handle: ReplicaHandle) -> list[V1Pod]:
        """The pods of the handle's index, newest first."""
        from kubernetes.client import CoreV1Api

        core = CoreV1Api(self._client(handle.job.get("context")))
        selector = f"{JOB_NAME_LABEL}={handle.job['name']},{INDEX_LABEL}={handle.job['index']}"
        pods = core.list_namespaced_pod(handle.job["namespace"], label_selector=selector).items
        return sorted(pods, key=lambda pod: pod.metadata.creation_timestamp, reverse=True)

    def _client(self, context: str | None) -> ApiClient:
        if context not in self._clients:
            self._clients[context] = api_client(context)
        return self._clients[context]


def pod_failure_policy() -> dict[str, Any]:
    """No retry for a refused run.toml (exit 2: it would fail again) or a superseded replica
    (exit 3: a newer incarnation runs, which a retry would supersede), and none spent on a pod
    the cluster disrupted (preemption, eviction, node drain), which is simply started again."""
    not_retried = {"containerName": CONTAINER, "operator": "In", "values": list(NOT_RETRIED)}
    disrupted = [{"type": "DisruptionTarget", "status": "True"}]
    return {
        "rules": [
            {"action": "FailIndex", "onExitCodes": not_retried},
            {"action": "Ignore", "onPodConditions": disrupted},
        ]
    }


def api_client(context: str | None) -> ApiClient:
    """A client from the kubeconfig ($KUBECONFIG, read now, not at import; else
    ~/.kube/config), else the service account of the pod this runs in."""
    from kubernetes import client, config

    path = os.environ.get("KUBECONFIG") or "~/.kube/config"
    configuration = client.Configuration()
    try:
        config.load_kube_config(path, context, client_configuration=configuration)
    except config.ConfigException as exc:
        kubeconfig_problem = one_line(exc)
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            raise BackendUnavailableError(
                f"k8s: no cluster credentials: kubeconfig {path}: {kubeconfig_problem}, and this "
                f"is not a pod in a cluster; get a kubeconfig (aws eks update-kubeconfig, gcloud "
                f"container clusters get-credentials, az aks get-credentials) or set $KUBECONFIG"
            ) from None
    return client.ApiClient(configuration)


def index_state(job: V1Job, pods: list[V1Pod], index: int) -> JobState:
    """One replica's state from its Job's status and its index's newest pod. A Job past its
    deadline ends every index it has not completed (the controller terminates their pods,
    which may then count as failed): all of them read ``timed_out``."""
    status = job.status
    if index in parse_indexes(status.completed_indexes if status else None):
        return "exited"
    if _condition(job, "Failed", DEADLINE_EXCEEDED):
        return "timed_out"
    if index in parse_indexes(status.failed_indexes if status else None):
        return "failed"
    if _ended(job):
        return "failed"  # the Job ended (a deadline, a policy) before this index completed
    if job.spec.suspend or not pods:
        return "pending"  # waiting for Kueue's admission, or for the controller
    return POD_PHASES.get(pods[0].status.phase if pods[0].status else "", "unknown")


def _ended(job: V1Job) -> bool:
    """Whether the Job has completed or failed as a whole."""
    return _condition(job, "Complete") or _condition(job, "Failed")


def _condition(job: V1Job, kind: str, reason: str | None = None) -> bool:
    """Whether the Job's status holds condition ``kind`` (with ``reason``, if given) as True.
    The Job controller adds Complete or Failed once the Job's pods have terminated (before,
    it may hold SuccessCriteriaMet or FailureTarget)."""
    conditions = (job.status.conditions if job.status else None) or []
    return any(
        c.type == kind and c.status == "True" and reason in (None, c.reason) for c in conditions
    )


def parse_indexes(ranges: str | None) -> set[int]:
    """``"0-2,4"`` (a Job's completedIndexes / failedIndexes) -> ``{0, 1, 2, 4}``."""
    indexes: set[int] = set()
    for part in (ranges or "").split(","):
        if part:
            first, _, last = part.partition("-")
            indexes.update(range(int(first), int(last or first) + 1))
    return indexes


def generate_name(run: str) -> str:
    """``diloco-<run>-``: the run name mapped to a DNS-1123 label (lowercase; '_', '.', '='
    become '-'), short enough for the pods' hostnames; the API server appends a suffix."""
    part = re.sub(r"[^a-z0-9]+", "-", run.lower()).strip("-")
    return "-".join(filter(None, ["diloco", part]))[: MAX_GENERATE_NAME - 1].rstrip("-") + "-"


def label_value(run: str) -> str:
    """The run name as a label value: at most 63 of letters, digits, '-', '_', '.', starting
    and ending with a letter or digit."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run)[:63].strip("-_.")


def _common(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in env.items() if k not in (ENV_REPLICA_ID, ENV_REPLICA_INDEX))


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}
