"""The Kubernetes backend: rendered Indexed Jobs checked against the API's schemas, and launches
through the real ``kubernetes`` client against a stand-in API server that runs the pods here
(``diloco_anywhere.standins.kubernetes``)."""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from diloco_anywhere.backends.base import BackendUnavailableError, ReplicaHandle
from diloco_anywhere.backends.k8s import (
    KubernetesBackend,
    api_client,
    generate_name,
    label_value,
    parse_indexes,
    pod_failure_policy,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, load_config
from diloco_anywhere.contract import identity
from diloco_anywhere.launching.start.launch import plan_launch, run_metrics, start
from diloco_anywhere.published_config import publish_config
from diloco_anywhere.standins import StandIn, moto_s3

kubernetes = pytest.importorskip("kubernetes", reason="the k8s extra is not installed")
from diloco_anywhere.standins.kubernetes import K8sStandIn, k8s_api  # noqa: E402
from support.runs import RUN_TOML  # noqa: E402

K8S = """
[image]
ref = "ghcr.io/acme/run:1"
[backends.k8s]
{backend}
"""
SECRET_VALUE = "do-not-leak-this"
STORE_SECRET = "store-creds"


def write_config(folder: Path, backend: str, name: str = "t", replicas: int = 2, outer=2):
    """test_launch's small run, with this run name, every replica needed, an S3 store."""
    path = folder / f"{name}.toml"
    run = RUN_TOML.format(replicas=replicas, outer_steps=outer)
    run = run.replace('name = "t"', f'name = "{name}"').replace('"store"', '"s3://diloco"')
    run = run.replace("min_replicas = 2", f"min_replicas = {replicas}")
    path.write_text(run + K8S.format(backend=backend))
    return load_config(path)


def wait_for(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return value


def test_the_rendered_job_is_a_valid_indexed_job_with_gpus_torchrun_and_kueue(
    tmp_path, monkeypatch
):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_VALUE)  # the launcher's own: stays here
    settings = f"""gpus_per_pod = 2
processes_per_replica = 2
queue = "team-a"
secret = "{STORE_SECRET}"
service_account = "trainer"
backoff_limit_per_index = 5
cpu = "8"
memory = "32Gi"
"""
    config = write_config(tmp_path, settings, name="My_Run.v2", replicas=3)
    plan = plan_launch(config, {"k8s": 3}, root=tmp_path)
    [job] = plan.backends["k8s"].describe(list(plan.specs))

    for version in ("1.33.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(job, version, strict=True)
    assert job["metadata"]["generateName"] == "diloco-my-run-v2-"
    assert job["metadata"]["labels"] == {
        "diloco.run": "My_Run.v2",
        "diloco.platform": "k8s",
        "kueue.x-k8s.io/queue-name": "team-a",
    }
    assert "suspend" not in job["spec"]  # Kueue's webhook suspends it until admitted
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimitPerIndex"] == 5
    assert "maxFailedIndexes" not in spec  # one replica out of retries leaves the others be
    assert "activeDeadlineSeconds" not in spec  # no deadline unless asked for
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "trainer"
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/acme/run:1"
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": "2"},
        "requests": {"cpu": "8", "memory": "32Gi"},
    }
    assert container["command"][:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in container["command"]
    assert container["command"][-2:] == ["-m", "diloco_anywhere.replica"]
    assert container["envFrom"] == [{"secretRef": {"name": STORE_SECRET}}]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["DILOCO_REPLICA_ID_BASE"] == env["DILOCO_REPLICA_INDEX_BASE"] == "0"
    assert env["DILOCO_PLATFORM"] == "k8s"
    assert env["DILOCO_REPLICAS"] == "3"
    assert "DILOCO_REPLICA_ID" not in env
    assert "DILOCO_REPLICA_INDEX" not in env  # each pod derives both from its index
    assert SECRET_VALUE not in json.dumps(job)
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(job)


def test_a_cpu_job_without_extras_has_no_resources_or_secret(tmp_path):
    config = write_config(tmp_path, "gpus_per_pod = 0")
    plan = plan_launch(config, {"k8s": 2}, root=tmp_path)
    [job] = plan.backends["k8s"].describe(list(plan.specs))
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "diloco_anywhere.replica"]
    assert not {"resources", "envFrom", "volumeMounts"} & container.keys()
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ("gpus_per_pod = -1", "backends.k8s.gpus_per_pod = -1: Input should be greater"),
        ("gpu = 1", "backends.k8s.gpu = 1: Extra inputs are not permitted"),
        ('namespace = "Team_A"', "backends.k8s.namespace = 'Team_A': must be a DNS-1123 label"),
        ('secret = "Store Creds"', "backends.k8s.secret = 'Store Creds': must be a DNS-1123"),
        ('memory = "lots"', "backends.k8s.memory = 'lots': must be a Kubernetes quantity"),
        ("backoff_limit_per_index = -2", "backends.k8s.backoff_limit_per_index = -2"),
        ("deadline_hours = 0", "backends.k8s.deadline_hours = 0: Input should be greater than 0"),
        ("deadline_hours = 0.0001", "backends.k8s: deadline_hours = 0.0001 is under one second"),
        (
            "gpus_per_pod = 2\nprocesses_per_replica = 4",
            "processes_per_replica (4) must be at most gpus_per_pod (2)",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(tmp_path, settings, expected):
    with pytest.raises(ConfigError, match="k8s") as refused:
        KubernetesBackend(write_config(tmp_path, settings))
    assert expected in str(refused.value)


def template_env(job: dict) -> dict[str, str]:
    [container] = job["spec"]["template"]["spec"]["containers"]
    return {item["name"]: item["value"] for item in container["env"]}


def test_a_job_can_start_any_consecutive_replicas_again_with_their_ids_and_shards(tmp_path):
    """Replica k8s-1 alone (as `diloco keep` restarts it): a Job of one completion whose pod
    derives id k8s-1 and that replica's shard, whatever platforms come before k8s."""
    config = write_config(tmp_path, "", replicas=4)
    plan = plan_launch(config, {"local": 1, "k8s": 3}, root=tmp_path)
    backend, specs = plan.backends["k8s"], plan.specs_on("k8s")
    assert [(spec.replica_id, spec.index) for spec in specs] == [
        ("k8s-0", 1), ("k8s-1", 2), ("k8s-2", 3),
    ]  # fmt: skip

    for subset, first, base in ([specs[1]], 1, 2), (specs[1:], 1, 2), (specs, 0, 1):
        [job] = backend.describe(subset)
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == len(subset)
        env = template_env(job)
        assert env["DILOCO_REPLICA_ID_BASE"] == str(first)
        assert env["DILOCO_REPLICA_INDEX_BASE"] == str(base)
        pods = [identity(None, None, {**env, "JOB_COMPLETION_INDEX": str(k)})
                for k in range(len(subset))]  # fmt: skip
        assert pods == [(spec.replica_id, spec.index) for spec in subset]


def test_one_job_needs_consecutive_replicas_with_consecutive_indexes(tmp_path):
    plan = plan_launch(write_config(tmp_path, "", replicas=3), {"k8s": 3}, root=tmp_path)
    specs = plan.specs_on("k8s")
    with pytest.raises(ValueError, match=r"expected consecutive ids k8s-0\.\.k8s-1 .* got"):
        plan.backends["k8s"].describe([specs[0], specs[2]])
    odd = dataclasses.replace(specs[0], replica_id="k8s-one")
    with pytest.raises(ValueError, match=r"replica id 'k8s-one' is not k8s-<number>"):
        plan.backends["k8s"].describe([odd])


def test_a_deadline_is_the_jobs_active_deadline_and_its_attempt_limit(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    backend = KubernetesBackend(write_config(tmp_path, "deadline_hours = 2"))
    plan = plan_launch(backend.config, {"k8s": 2}, root=tmp_path)
    [job] = plan.backends["k8s"].describe(plan.specs)
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    assert job["spec"]["activeDeadlineSeconds"] == 2 * 3600
    assert (backend.attempt_limit(), backend.hardware()) == (2 * 3600, "")
    no_deadline = KubernetesBackend(write_config(tmp_path, ""))
    assert (no_deadline.attempt_limit(), no_deadline.hardware()) == (None, "")


@pytest.mark.parametrize(
    ("run", "expected"),
    [("t", "diloco-t-"), ("_Ab.c_d=e", "diloco-ab-c-d-e-"), ("x" * 128, f"diloco-{'x' * 39}-")],
)
def test_job_names_are_dns_labels_that_leave_room_for_the_pod_index(run, expected):
    name = generate_name(run) + "b2c4d"  # the API server's suffix
    assert generate_name(run) == expected
    assert len(name) <= 52
    assert label_value(run) == run.replace("=", "-")[:63].strip("_")


def test_index_ranges_of_a_job_status_are_read():
    assert parse_indexes("0-2,4,7-8") == {0, 1, 2, 4, 7, 8}
    assert parse_indexes(None) == parse_indexes("") == set()


def test_check_without_a_kubeconfig_or_a_cluster_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    backend = KubernetesBackend(write_config(tmp_path, ""))
    with pytest.raises(BackendUnavailableError) as unavailable:
        backend.check()
    message = str(unavailable.value)
    assert "\n" not in message
    assert str(tmp_path / "missing") in message
    assert "not a pod in a cluster" in message
    assert "$KUBECONFIG" in message


def test_check_without_the_client_says_how_to_install_it(tmp_path, monkeypatch):
    backend = KubernetesBackend(write_config(tmp_path, ""))
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    with pytest.raises(BackendUnavailableError, match=r"pip install 'diloco-anywhere\[k8s\]'"):
        backend.check()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[StandIn, K8sStandIn]]:
    """A bucket and a Kubernetes API whose pods run here, shared by this module's tests."""
    with moto_s3() as s3, k8s_api() as api:
        yield s3, api


@pytest.fixture
def kube(cluster, monkeypatch) -> K8sStandIn:
    """The stand-in as the current cluster, its bucket's credentials in a Secret for the pods
    and in this process's environment for the launcher (which publishes run.toml) and the
    test (which reads the metrics)."""
    s3, api = cluster
    store_env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": s3.storage_options["endpoint_url"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    if ("default", STORE_SECRET) not in api.secrets:
        client = api_client(None)  # the backend's, from the stand-in's kubeconfig
        data = {
            name: base64.b64encode(value.encode()).decode() for name, value in store_env.items()
        }
        kubernetes.client.CoreV1Api(client).create_namespaced_secret(
            "default", {"metadata": {"name": STORE_SECRET}, "data": data}
        )
    return api


def states_of(backend: KubernetesBackend, handles: list[ReplicaHandle], seen: set[str]):
    states = [backend.state(handle) for handle in handles]
    seen.update(states)
    return states


def ended(states: list[str]) -> bool:
    return all(state in ("exited", "failed", "timed_out", "stopped") for state in states)


@pytest.mark.integration
def test_a_server_side_dry_run_creates_nothing(tmp_path, kube):
    config = write_config(tmp_path, f'secret = "{STORE_SECRET}"')
    plan = plan_launch(config, {"k8s": 2}, root=tmp_path)
    backend = plan.backends["k8s"]
    [manifest] = backend.describe(list(plan.specs))
    jobs_before = len(kube.jobs)

    answer = backend.submit(manifest, dry_run=True)

    assert answer["metadata"]["name"].startswith("diloco-t-")
    method, path, body = kube.requests[-1]
    assert method == "POST"
    assert parse_qs(urlsplit(path).query)["dryRun"] == ["All"]
    assert body == manifest  # what describe shows is what is sent
    assert len(kube.jobs) == jobs_before
    assert kube.running() == 0
    job = {"namespace": "default", "name": answer["metadata"]["name"], "index": 0}
    handle = ReplicaHandle("k8s-0", "k8s", job)
    assert backend.state(handle) == "stopped"  # no such Job


@pytest.mark.integration
def test_api_errors_reach_the_user_as_one_short_line(tmp_path, kube, monkeypatch):
    """An ApiException's text holds the response's headers and body over many lines: the
    user gets its status, reason and the API server's message."""
    plan = plan_launch(write_config(tmp_path, ""), {"k8s": 2}, root=tmp_path)
    backend = plan.backends["k8s"]
    [manifest] = backend.describe(list(plan.specs))
    manifest["spec"]["completionMode"] = "NonIndexed"
    with pytest.raises(RuntimeError) as refused:
        backend.submit(manifest, dry_run=False)
    assert str(refused.value) == "422 Unprocessable Entity: the stand-in runs Indexed Jobs only"
    assert isinstance(refused.value.__cause__, kubernetes.client.ApiException)

    kubeconfig = json.loads(kube.kubeconfig.read_text())
    kubeconfig["users"][0]["user"]["token"] = "revoked"
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    handle = ReplicaHandle("k8s-0", "k8s", {"namespace": "default", "name": "gone", "index": 0})
    for call in (KubernetesBackend(plan.config).stop, KubernetesBackend(plan.config).state):
        with pytest.raises(RuntimeError) as unauthorized:
            call(handle)
        assert str(unauthorized.value) == "401 Unauthorized: no bearer token"


@pytest.mark.integration
def test_a_two_replica_run_on_the_cluster_finishes(tmp_path, kube):
    settings = f'secret = "{STORE_SECRET}"\ngpus_per_pod = 0\ncontext = "standin"'
    config = write_config(tmp_path, settings)
    plan = plan_launch(config, {"k8s": 2}, root=tmp_path)

    backend, handles = start(plan)["k8s"]

    assert [h.job["index"] for h in handles] == [0, 1]
    assert {h.job["context"] for h in handles} == {"standin"}
    assert len({h.job["name"] for h in handles}) == 1  # one Indexed Job
    seen: set[str] = set()
    states = wait_for(lambda: states_of(backend, handles, seen), ended, timeout=80)
    assert "running" in seen
    logs = backend.logs(handles[0])
    assert states == ["exited", "exited"], logs
    metrics = run_metrics(config).read()
    assert {replica: m.state() for replica, m in metrics.items()} == {
        "k8s-0": "done",
        "k8s-1": "done",
    }
    assert {m.platform for m in metrics.values()} == {"k8s"}
    assert "replica k8s-0 done" in logs
    assert "\n" in logs  # text, not the repr of bytes
    assert "replica k8s-1 done" in backend.logs(handles[1])
    jobs_sent = [body for method, path, body in kube.requests if "/jobs" in path]
    assert jobs_sent
    assert "testing" not in json.dumps([jobs_sent, [h.job for h in handles]])  # the Secret's

    deletes = sum(method == "DELETE" for method, _, _ in kube.requests)
    for handle in handles:
        backend.stop(handle)  # the Job has ended: left as it is
    assert sum(method == "DELETE" for method, _, _ in kube.requests) == deletes
    assert [backend.state(h) for h in handles] == ["exited", "exited"]


@pytest.mark.integration
def test_a_replica_that_refuses_its_config_fails_without_retries(tmp_path, kube):
    """Launched without publishing run.toml, replicas cannot read it and exit 2, which the
    pod failure policy does not retry."""
    settings = f'secret = "{STORE_SECRET}"\nbackoff_limit_per_index = 3'
    plan = plan_launch(write_config(tmp_path, settings, name="broken"), {"k8s": 2}, tmp_path)
    backend = plan.backends["k8s"]
    handles = backend.launch(list(plan.specs), tmp_path)

    states = wait_for(lambda: states_of(backend, handles, set()), ended, timeout=40)

    assert states == ["failed", "failed"]
    status = kube.jobs[("default", handles[0].job["name"])].manifest["status"]
    assert status["failedIndexes"] == "0-1"
    assert status["failed"] == 2  # one pod per index
    assert "broken/configs/" in backend.logs(handles[1])  # its error: not found


def test_no_retry_is_spent_on_an_end_a_retry_cannot_help():
    """Exit 2 (a refused run.toml, as the stand-in test above shows), exit 3 (superseded:
    `diloco keep` or `replace` started a newer incarnation, which a retry would supersede) and
    exits 4 and 5 (a script's mistake: it steps another optimizer, its model is unlike the
    run's) and exit 6 (too few replicas left for a round) fail the index at once; a disruption
    spends no retry."""
    rules = pod_failure_policy()["rules"]
    assert rules[0] == {
        "action": "FailIndex",
        "onExitCodes": {"containerName": "replica", "operator": "In", "values": [2, 3, 4, 5, 6]},
    }
    assert rules[1]["action"] == "Ignore"


@pytest.mark.integration
def test_a_crashing_replica_is_retried_alone_then_failed(tmp_path, kube):
    """Index 0 crashes (exit 1) every time, index 1 succeeds: index 0 gets its own retries
    and fails; index 1 is not disturbed."""
    config = write_config(tmp_path, "backoff_limit_per_index = 1")
    plan = plan_launch(config, {"k8s": 2}, root=tmp_path)
    backend = plan.backends["k8s"]
    [manifest] = backend.describe(list(plan.specs))
    crash = "import os, sys; sys.exit(os.environ['JOB_COMPLETION_INDEX'] == '0')"
    manifest["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "-c", crash]
    name = backend.submit(manifest, dry_run=False)["metadata"]["name"]
    handles = [
        ReplicaHandle(f"k8s-{k}", "k8s", {"namespace": "default", "name": name, "index": k})
        for k in (0, 1)
    ]

    states = wait_for(lambda: states_of(backend, handles, set()), ended, timeout=20)

    assert states == ["failed", "exited"]
    status = kube.jobs[("default", name)].manifest["status"]
    assert (status["failedIndexes"], status["completedIndexes"]) == ("0", "1")
    assert status["failed"] == 2  # the first pod of index 0 and its one retry
    assert status["conditions"][0]["type"] == "Failed"


@pytest.mark.integration
def test_stop_deletes_a_running_job_and_its_pods(tmp_path, kube):
    config = write_config(tmp_path, f'secret = "{STORE_SECRET}"', name="long", outer=500)
    backend, handles = start(plan_launch(config, {"k8s": 2}, root=tmp_path))["k8s"]
    assert wait_for(lambda: backend.state(handles[0]), lambda s: s == "running", 30) == "running"

    backend.stop(handles[0])
    backend.stop(handles[1])  # the Job is gone already: nothing to do

    assert [backend.state(h) for h in handles] == ["stopped", "stopped"]
    name = handles[0].job["name"]
    [(_, path, _)] = [r for r in kube.requests if r[0] == "DELETE" and name in r[1]]
    assert parse_qs(urlsplit(path).query)["propagationPolicy"] == ["Background"]
    assert wait_for(kube.running, lambda running: running == 0, 20) == 0


@pytest.mark.integration
def test_a_job_past_its_deadline_times_out_every_index_not_completed(tmp_path, kube):
    """As the Job controller does at activeDeadlineSeconds: the running pods are terminated
    and the Job fails with reason DeadlineExceeded; an index that had completed stays so."""
    config = write_config(tmp_path, f"deadline_hours = {10 / 3600}")
    plan = plan_launch(config, {"k8s": 2}, root=tmp_path)
    backend = plan.backends["k8s"]
    [manifest] = backend.describe(list(plan.specs))
    assert manifest["spec"]["activeDeadlineSeconds"] == 10
    index_1_ends = "import os, time; os.environ['JOB_COMPLETION_INDEX'] == '1' or time.sleep(300)"
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    container["command"] = ["python", "-c", index_1_ends]
    name = backend.submit(manifest, dry_run=False)["metadata"]["name"]
    handles = [
        ReplicaHandle(f"k8s-{k}", "k8s", {"namespace": "default", "name": name, "index": k})
        for k in (0, 1)
    ]

    states = wait_for(lambda: states_of(backend, handles, set()), ended, timeout=90)

    assert states == ["timed_out", "exited"]
    job = kube.jobs[("default", name)]
    [condition] = job.manifest["status"]["conditions"]
    assert (condition["type"], condition["reason"]) == ("Failed", "DeadlineExceeded")
    assert all(pod.container.exit_code() is not None for pod in kube.pods_of(job))
    assert len(kube.pods_of(job)) == 2  # the terminated pod was not retried
    deletes = sum(method == "DELETE" for method, _, _ in kube.requests)
    backend.stop(handles[0])  # the Job has ended
    assert sum(method == "DELETE" for method, _, _ in kube.requests) == deletes


@pytest.mark.integration
def test_replicas_started_again_one_job_each_run_with_their_ids_and_shards(tmp_path, kube):
    """A 3-replica run whose k8s replicas each come in a Job of their own, k8s-1 first (as the
    keeper restarts one), next to a local replica: every one trains as itself, on its shard."""
    settings = f'secret = "{STORE_SECRET}"\ngpus_per_pod = 0'
    config = write_config(tmp_path, settings, name="again", replicas=3)
    plan = plan_launch(config, {"local": 1, "k8s": 2}, root=tmp_path)
    with Store(config.store_url()) as bucket:
        publish_config(bucket, config)
    backend, [k8s_0, k8s_1] = plan.backends["k8s"], plan.specs_on("k8s")
    local = plan.backends["local"].launch(plan.specs_on("local"), plan.run_dir)
    handles = [*backend.launch([k8s_1], tmp_path), *backend.launch([k8s_0], tmp_path)]

    assert [(h.replica_id, h.job["index"]) for h in handles] == [("k8s-1", 0), ("k8s-0", 0)]
    assert handles[0].job["name"] != handles[1].job["name"]  # one Job each
    states = wait_for(lambda: states_of(backend, handles, set()), ended, timeout=240)
    assert states == ["exited", "exited"], backend.logs(handles[0])
    metrics = run_metrics(config).read()
    assert {replica: m.state() for replica, m in metrics.items()} == {
        "local-0": "done", "k8s-0": "done", "k8s-1": "done",
    }  # fmt: skip
    started = {replica: [e.detail for e in m.events if e.event == "started"]
               for replica, m in metrics.items()}  # fmt: skip
    assert started["k8s-0"][0].startswith("shard 1 of 3")
    assert started["k8s-1"][0].startswith("shard 2 of 3")
    assert plan.backends["local"].state(local[0]) == "exited"
