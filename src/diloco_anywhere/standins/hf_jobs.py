"""A stand-in for the Hugging Face Jobs API, for the real ``huggingface_hub`` client.

It serves the routes ``HfApi.run_job``, ``inspect_job``, ``fetch_job_logs`` and ``cancel_job``
use (``/api/jobs/{namespace}[/{id}[/cancel|/logs]]``, and ``/api/whoami-v2`` for the default
namespace), and those of ``create_bucket``, ``bucket_info`` and ``delete_bucket``
(``/api/buckets/{namespace}/{name}``; a bucket's files are not modelled), with the request and
response shapes of huggingface_hub 2.x, and runs each job's command as a local process
(``containers.ContainerProcess``) with the job's environment and secrets. A job still
running ``timeoutSeconds`` after it started is ended (SIGTERM, then SIGKILL after
``TIMEOUT_GRACE``) and, once its process has gone, reported in stage ERROR with a message
saying it timed out (``TIMED_OUT``: huggingface_hub's JobStage has no stage of its own for
it, and the hub documents no wording), with its running time in ``durations``. Not modelled:
images (this Python runs every job, or with ``DILOCO_STANDIN_ENGINE`` the job's image:
``containers``), flavors and their hardware, attempts (a failed job is not
restarted), scheduling delay, authentication beyond requiring a bearer token.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from diloco_anywhere.standins.containers import ContainerProcess, RecordingServer

USER = "alice"
TIMED_OUT = "Job timed out after {seconds}s"  # the status message of a job its timeout ended
TIMEOUT_GRACE = 10.0  # seconds between SIGTERM and SIGKILL when a job's timeout ends it


def _timestamp() -> str:
    """UTC, as the hub writes it (huggingface_hub parses exactly this shape)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Job:
    def __init__(self, job_id: str, namespace: str, spec: dict[str, Any], folder: Path) -> None:
        self.id, self.namespace, self.spec = job_id, namespace, spec
        self.created = _timestamp()
        self.started, self.ended = time.monotonic(), None
        self.timed_out = False
        env = {**spec.get("environment", {}), **spec.get("secrets", {})}
        log, image = folder / f"{job_id}.log", spec.get("dockerImage")
        self.container = ContainerProcess(
            spec["command"], env, log, image=image, replaces_entrypoint=False
        )
        timeout = spec.get("timeoutSeconds")
        threading.Thread(target=self._watch, args=(timeout,), daemon=True).start()

    def _watch(self, timeout: float | None) -> None:
        """Wait for the job's process; end it at its timeout, as the hub does."""
        process = self.container.process
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = not self.container.cancelled
            self.container.terminate()
            try:
                process.wait(timeout=TIMEOUT_GRACE)
            except subprocess.TimeoutExpired:
                self.container.kill()
        self.ended = time.monotonic()

    def stage(self) -> str:
        if self.container.cancelled:
            return "CANCELED"
        if self.ended is None:  # also while a process its timeout ended is still going
            return "RUNNING"
        return "COMPLETED" if self.container.exit_code() == 0 and not self.timed_out else "ERROR"

    def message(self) -> str | None:
        if self.timed_out and self.stage() == "ERROR":
            return TIMED_OUT.format(seconds=self.spec["timeoutSeconds"])
        return None

    def durations(self) -> dict[str, int]:
        running = round((self.ended or time.monotonic()) - self.started)
        return {"schedulingSecs": 0, "runningSecs": running, "totalSecs": running}

    def info(self) -> dict[str, Any]:
        """JobInfo as the hub returns it: secrets by name only."""
        return {
            "id": self.id,
            "createdAt": self.created,
            "dockerImage": self.spec.get("dockerImage"),
            "command": self.spec["command"],
            "arguments": self.spec.get("arguments", []),
            "environment": self.spec.get("environment", {}),
            "secrets": sorted(self.spec.get("secrets", {})),
            "flavor": self.spec["flavor"],
            "labels": self.spec.get("labels"),
            "owner": {"id": "0", "name": self.namespace, "type": "user"},
            "status": {"stage": self.stage(), "message": self.message()},
            "durations": self.durations(),
        }


class _Handler(BaseHTTPRequestHandler):
    server: HfJobsStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _reply(self, status: int, body: object, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _route(self, method: str) -> None:
        body = self._body() if method == "POST" else None
        self.server.requests.append((method, self.path, body))
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            return self._reply(401, {"error": "no token"})
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts == ["api", "whoami-v2"]:
            return self._reply(200, {"name": USER, "type": "user"})
        if parts[:2] == ["api", "buckets"] and len(parts) == 4:
            return self._bucket(method, "/".join(parts[2:]), body)
        if parts[:2] != ["api", "jobs"] or len(parts) < 3:
            return self._reply(404, {"error": f"no route {self.path}"})
        if len(parts) == 3 and method == "POST":
            return self._reply(200, self.server.create(parts[2], body).info())
        job = self.server.jobs.get(parts[3]) if len(parts) > 3 else None
        if job is None or job.namespace != parts[2]:
            return self._reply(404, {"error": "Job not found"})
        if len(parts) == 4 and method == "GET":
            return self._reply(200, job.info())
        if parts[4:] == ["cancel"] and method == "POST":
            job.container.cancel()
            return self._reply(200, {})
        if parts[4:] == ["logs"] and method == "GET":
            return self._reply(200, _events(job.container.output()), "text/event-stream")
        return self._reply(404, {"error": f"no route {self.path}"})

    def _bucket(self, method: str, bucket_id: str, body: Any) -> None:
        buckets = self.server.buckets
        if method == "POST":
            if bucket_id in buckets:
                return self._reply(409, {"error": "You already created this bucket"})
            private = body.get("visibility") == "private"
            buckets[bucket_id] = {"id": bucket_id, "private": private, "createdAt": _timestamp(),
                                  "size": 0, "totalFiles": 0}  # fmt: skip
            return self._reply(200, {"url": f"https://huggingface.co/buckets/{bucket_id}"})
        if bucket_id not in buckets:
            return self._reply(404, {"error": "Bucket not found"})
        if method == "DELETE":
            del buckets[bucket_id]
            return self._reply(200, {})
        return self._reply(200, buckets[bucket_id])

    def do_GET(self) -> None:
        self._route("GET")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_POST(self) -> None:
        self._route("POST")


def _events(output: str) -> bytes:
    """Log lines as the hub streams them: server-sent events with a timestamp each."""
    now = _timestamp()
    lines = ["===== Job started =====", *output.splitlines()]
    return "".join(
        f"data: {json.dumps({'timestamp': now, 'data': line})}\n\n" for line in lines
    ).encode()


class HfJobsStandIn(RecordingServer):
    def __init__(self, folder: Path) -> None:
        super().__init__(_Handler)
        self.folder = folder
        self.jobs: dict[str, _Job] = {}
        self.buckets: dict[str, dict[str, Any]] = {}

    def create(self, namespace: str, spec: dict[str, Any]) -> _Job:
        job = _Job(f"{len(self.jobs) + 1:024x}", namespace, spec, self.folder)
        self.jobs[job.id] = job
        return job

    def created(self) -> list[dict[str, Any]]:
        """The bodies of every job creation request, in order."""
        return [body for method, path, body in self.requests
                if method == "POST" and path.count("/") == 3]  # fmt: skip


@contextmanager
def hf_jobs_api() -> Iterator[HfJobsStandIn]:
    with tempfile.TemporaryDirectory() as folder, HfJobsStandIn(Path(folder)) as server:
        try:
            yield server
        finally:
            for job in server.jobs.values():
                job.container.kill()
