"""A stand-in for the Kubernetes API server and Job controller, for the real ``kubernetes``
client.

It serves what the k8s backend and its tests use: batch/v1 Jobs (create, honouring
``?dryRun=All`` and ``generateName``; read; delete), core/v1 Secrets (create), Pods (list by
equality label selector) and a pod's log. Each index of an Indexed Job is run as a local
process (``containers.ContainerProcess``) with the container's ``env``, its ``envFrom``
Secrets (decoded from base64) and ``JOB_COMPLETION_INDEX``; a failed index is retried up to
``backoffLimitPerIndex`` times, each attempt a new pod, unless the pod failure policy fails
the index on that exit code (``FailIndex``, ``onExitCodes`` with ``In``); the Job's
``completedIndexes`` / ``failedIndexes`` and conditions follow. ``activeDeadlineSeconds`` after
its start, a Job that has not ended is failed as the Job controller does it: a FailureTarget
condition with reason DeadlineExceeded, its running pods terminated (SIGTERM) and not retried,
then, once they have ended, the Failed condition with that reason. Deleting a Job removes it at
once and terminates its pods' processes (SIGTERM), as background propagation does. Every
request is kept in ``.requests`` as (method, path with query, JSON body as sent).

Not modelled: images (this Python runs every pod, or with ``DILOCO_STANDIN_ENGINE`` the pod's
image: ``containers``), scheduling, resources and GPUs, queues
(Kueue), service accounts, the rest of the pod failure policy (there are no disruptions here),
other completion modes (refused), set-based label selectors, watches, missing Secrets,
authentication beyond requiring a bearer token.
"""

from __future__ import annotations

import base64
import json
import random
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from diloco_anywhere.standins.containers import ContainerProcess, RecordingServer

TOKEN = "standin-token"
JOBS = re.compile(r"/apis/batch/v1/namespaces/(?P<ns>[^/]+)/jobs(/(?P<name>[^/]+))?")
SECRETS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/secrets")
PODS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(/(?P<name>[^/]+)/log)?")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _suffix() -> str:
    """As the API server completes a generateName: 5 of its consonants and digits."""
    return "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))


def _ranges(indexes: set[int]) -> str | None:
    """``{0, 1, 2, 4}`` -> ``"0-2,4"``, the Job status's interval format."""
    parts: list[list[int]] = []
    for index in sorted(indexes):
        if parts and parts[-1][1] == index - 1:
            parts[-1][1] = index
        else:
            parts.append([index, index])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in parts) or None


# The Job controller's reason and message for a Job past its activeDeadlineSeconds
DEADLINE = {
    "reason": "DeadlineExceeded",
    "message": "Job was active longer than specified deadline",
}


def _condition(kind: str, **reason: str) -> dict[str, str]:
    return {"type": kind, "status": "True", "lastTransitionTime": _now(), **reason}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Job:
    """A created Indexed Job: its manifest, with a status kept as its pods end."""

    def __init__(self, api: K8sStandIn, manifest: dict[str, Any]) -> None:
        self.api, self.manifest = api, manifest
        self.deleted = False
        self.past_deadline = False
        spec = manifest["spec"]
        self.completed: set[int] = set()
        self.failed: set[int] = set()
        self.active = set(range(spec["completions"]))  # indexes whose pods are still coming
        self.pod_failures = 0
        manifest["status"] = {"startTime": _now()}
        for index in range(spec["completions"]):  # the Job controller, one thread per index
            threading.Thread(target=self._run_index, args=(index,), daemon=True).start()
        if spec.get("activeDeadlineSeconds") is not None:
            deadline = threading.Timer(spec["activeDeadlineSeconds"], self._deadline_exceeded)
            deadline.daemon = True
            deadline.start()

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def _run_index(self, index: int) -> None:
        """Pods one after another until one succeeds, the index's retries are spent, the pod
        failure policy fails the index, or the Job is deleted."""
        retries = self.manifest["spec"].get("backoffLimitPerIndex", 0)
        while True:
            pod = self.api.start_pod(self, index)
            code = pod.container.process.wait()
            self.api.end_pod(pod, code)
            with self.api.lock:
                if self.deleted:
                    return
                self.pod_failures += code != 0
                ended = code == 0 or retries == 0 or code in self._fail_index_codes()
                if ended:
                    (self.completed if code == 0 else self.failed).add(index)
                if ended or self.past_deadline:  # past it: terminated, never retried
                    self.active.discard(index)
                self.update_status()
                if index not in self.active:
                    return
            retries -= 1

    def _deadline_exceeded(self) -> None:
        """activeDeadlineSeconds have passed: unless the Job has ended, mark it failing and
        terminate its running pods; ``update_status`` fails it once they have ended."""
        with self.api.lock:
            if self.deleted or not self.active:
                return
            self.past_deadline = True
            self.manifest["status"]["conditions"] = [_condition("FailureTarget", **DEADLINE)]
            for pod in self.api.pods_of(self):
                pod.container.terminate()

    def _fail_index_codes(self) -> set[int]:
        """Exit codes the pod failure policy fails an index on at once (operator In)."""
        rules = self.manifest["spec"].get("podFailurePolicy", {}).get("rules", [])
        return {
            code
            for rule in rules
            if rule["action"] == "FailIndex" and rule.get("onExitCodes", {}).get("operator") == "In"
            for code in rule["onExitCodes"]["values"]
        }

    def update_status(self) -> None:
        """Counts, index ranges, and the terminal condition once no index runs: Failed for a
        deadline passed, or for an index out of retries; else Complete."""
        status = self.manifest["status"]
        status.update(
            active=len(self.active),
            succeeded=len(self.completed),
            failed=self.pod_failures,
            completedIndexes=_ranges(self.completed),
            failedIndexes=_ranges(self.failed),
        )
        if self.active:
            return
        if self.past_deadline:
            status["conditions"] = [_condition("Failed", **DEADLINE)]
        elif self.failed:
            status["conditions"] = [_condition("Failed")]
        else:
            status["conditions"] = [_condition("Complete")]
            status["completionTime"] = _now()


class _Pod:
    def __init__(self, job: _Job, index: int, env: dict[str, str], folder: Path) -> None:
        template = job.manifest["spec"]["template"]
        container = template["spec"]["containers"][0]
        self.name = f"{job.name}-{index}-{_suffix()}"
        labels = {
            **template.get("metadata", {}).get("labels", {}),
            "job-name": job.name,
            "batch.kubernetes.io/job-name": job.name,
            "batch.kubernetes.io/job-completion-index": str(index),
        }
        self.record = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": job.manifest["metadata"]["namespace"],
                "labels": labels,
                "creationTimestamp": _now(),
            },
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        }
        log, image = folder / f"{self.name}.log", container.get("image")
        self.container = ContainerProcess(
            container["command"], env, log, image=image, replaces_entrypoint=True
        )
        self.record["status"]["phase"] = "Running"


class K8sStandIn(RecordingServer):
    """The API server's state: Jobs, Secrets and Pods by (namespace, name)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(_Handler)
        self.folder = folder
        self.kubeconfig = folder / "kubeconfig"
        self.lock = threading.RLock()
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], _Pod] = {}

    def write_kubeconfig(self) -> None:
        cluster = {"name": "standin", "cluster": {"server": self.url}}
        user = {"name": "standin", "user": {"token": TOKEN}}
        context = {"name": "standin", "context": {"cluster": "standin", "user": "standin"}}
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [user],
            "contexts": [context],
            "current-context": "standin",
        }
        self.kubeconfig.write_text(json.dumps(kubeconfig))  # JSON is YAML

    def container_env(self, job: _Job, index: int) -> dict[str, str]:
        container = job.manifest["spec"]["template"]["spec"]["containers"][0]
        namespace = job.manifest["metadata"]["namespace"]
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            secret = self.secrets[(namespace, source["secretRef"]["name"])]
            env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
        env.update({item["name"]: item["value"] for item in container.get("env", [])})
        return {**env, "JOB_COMPLETION_INDEX": str(index)}

    def start_pod(self, job: _Job, index: int) -> _Pod:
        with self.lock:
            pod = _Pod(job, index, self.container_env(job, index), self.folder)
            self.pods[(job.manifest["metadata"]["namespace"], pod.name)] = pod
            if job.deleted:
                pod.container.cancel()
            elif job.past_deadline:  # a retry that began as the deadline passed
                pod.container.terminate()
            return pod

    def end_pod(self, pod: _Pod, code: int) -> None:
        with self.lock:
            pod.record["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            if self.jobs.get(self.job_of(pod)) is None:  # its Job was deleted: the pod goes too
                self.pods.pop((pod.record["metadata"]["namespace"], pod.name), None)

    def pods_of(self, job: _Job) -> list[_Pod]:
        key = (job.manifest["metadata"]["namespace"], job.name)
        return [pod for pod in self.pods.values() if self.job_of(pod) == key]

    @staticmethod
    def job_of(pod: _Pod) -> tuple[str, str]:
        metadata = pod.record["metadata"]
        return metadata["namespace"], metadata["labels"]["job-name"]

    def running(self) -> int:
        """Pod processes still alive."""
        with self.lock:
            return sum(pod.container.exit_code() is None for pod in self.pods.values())

    def close(self) -> None:
        with self.lock:
            pods = list(self.pods.values())
        for pod in pods:
            pod.container.kill()


class _Handler(BaseHTTPRequestHandler):
    server: K8sStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _reply(self, code: int, body: object) -> None:
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"null"
        self.server.requests.append((method, self.path, json.loads(raw)))  # as sent
        body = json.loads(raw)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._reply(401, _status(401, "Unauthorized", "no bearer token"))
            return
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        for pattern, route in ((JOBS, self._jobs), (SECRETS, self._secrets), (PODS, self._pods)):
            match = pattern.fullmatch(parts.path)
            if match:
                with self.server.lock:
                    self._reply(*route(method, match, query, body))
                return
        self._reply(404, _status(404, "NotFound", f"no route {method} {parts.path}"))

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _jobs(self, method: str, match: re.Match, query: dict, body: Any) -> tuple[int, Any]:
        namespace, name = match["ns"], match["name"]
        if method == "POST" and name is None:
            return self._create_job(namespace, body, dry_run=query.get("dryRun") == "All")
        job = self.server.jobs.get((namespace, name or ""))
        if job is None:
            return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
        if method == "GET":
            return 200, job.manifest
        if method == "DELETE":
            del self.server.jobs[(namespace, name)]
            job.deleted = True
            for pod in self.server.pods_of(job):
                pod.container.cancel()
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 405, _status(405, "MethodNotAllowed", method)

    def _create_job(self, namespace: str, body: dict, dry_run: bool) -> tuple[int, Any]:
        metadata = body.setdefault("metadata", {})
        if body.get("spec", {}).get("completionMode") != "Indexed":
            return 422, _status(422, "Invalid", "the stand-in runs Indexed Jobs only")
        metadata.setdefault("name", metadata.get("generateName", "") + _suffix())
        metadata.update(namespace=namespace, uid=_suffix(), creationTimestamp=_now())
        if (namespace, metadata["name"]) in self.server.jobs:
            return 409, _status(409, "AlreadyExists", f'jobs.batch "{metadata["name"]}" exists')
        if dry_run:
            return 201, body
        job = _Job(self.server, body)
        self.server.jobs[(namespace, job.name)] = job
        return 201, job.manifest

    def _secrets(self, method: str, match: re.Match, query: dict, body: Any) -> tuple[int, Any]:
        if method != "POST":
            return 405, _status(405, "MethodNotAllowed", method)
        data = dict(body.get("data") or {})
        data.update(
            {
                k: base64.b64encode(v.encode()).decode()
                for k, v in (body.pop("stringData", None) or {}).items()
            }
        )
        secret = {**body, "data": data}
        if query.get("dryRun") != "All":
            self.server.secrets[(match["ns"], body["metadata"]["name"])] = secret
        return 201, secret

    def _pods(self, method: str, match: re.Match, query: dict, body: Any) -> tuple[int, Any]:
        namespace, name = match["ns"], match["name"]
        if method != "GET":
            return 405, _status(405, "MethodNotAllowed", method)
        if name is not None:
            pod = self.server.pods.get((namespace, name))
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{name}" not found')
            return 200, pod.container.output()
        wanted = dict(
            term.split("=", 1) for term in query.get("labelSelector", "").split(",") if term
        )
        items = [
            pod.record
            for (pod_namespace, _), pod in self.server.pods.items()
            if pod_namespace == namespace
            and wanted.items() <= pod.record["metadata"]["labels"].items()
        ]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}


@contextmanager
def k8s_api() -> Iterator[K8sStandIn]:
    """A running stand-in with a kubeconfig (``.kubeconfig``) that points the client at it."""
    with tempfile.TemporaryDirectory(prefix="k8s-standin-") as folder:
        server = K8sStandIn(Path(folder))
        server.write_kubeconfig()
        try:
            with server:
                yield server
        finally:
            server.close()
