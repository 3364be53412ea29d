"""What the platform stand-ins share: a job's container, played by a local process or, with
``DILOCO_STANDIN_ENGINE=podman``, by the job's own image under podman.

A stand-in server (HF Jobs, Kubernetes) accepts a job as its platform would and runs the job's
command with only the environment the platform would give the container: the job's own
variables and secrets. By default this machine's Python stands in for the image (a leading
``python`` becomes ``sys.executable``, and the image's PATH, PYTHONPATH and HOME are this
machine's). With ``DILOCO_STANDIN_ENGINE=podman``, the command runs in the image the job names
(a local one), as its platform starts it (``make image-test``, docs/ci.md): host networking,
so the job reaches the stand-in store on loopback as a cloud job reaches its bucket; a
Kubernetes ``command`` replaces the image's ENTRYPOINT, an HF Jobs command is given to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

IMAGE_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR")
ENV_STANDIN_ENGINE = "DILOCO_STANDIN_ENGINE"  # "podman": jobs run in their images
ENGINES = ("podman",)


def local_process(command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The job's command here, this Python and its paths standing in for the image's."""
    if command and command[0] == "python":
        command = [sys.executable, *command[1:]]
    image = {name: os.environ[name] for name in IMAGE_ENV if name in os.environ}
    return command, {**image, **env}


def engine_run(
    engine: str,
    image: str,
    name: str,
    command: list[str],
    env: dict[str, str],
    replaces_entrypoint: bool,
) -> tuple[list[str], dict[str, str]]:
    """``podman run`` of the job's command in ``image``, as its platform starts it. The job's
    variables reach the container by name only (``--env NAME`` takes the value from podman's
    own environment), so no secret is on a command line."""
    names = [flag for variable in env for flag in ("--env", variable)]
    start = [engine, "run", "--rm", "--name", name, "--network", "host", *names]
    if replaces_entrypoint:  # Kubernetes ``command``, SageMaker ``ContainerEntrypoint``
        argv = [*start, "--entrypoint", json.dumps(command), image]
    else:  # HF Jobs, Modal: the command is given to the image's ENTRYPOINT
        argv = [*start, image, *command]
    return argv, {**os.environ, **env}


def standin_engine() -> str | None:
    """The engine that runs jobs in their images, or None: this Python runs them."""
    engine = os.environ.get(ENV_STANDIN_ENGINE) or None
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"{ENV_STANDIN_ENGINE}={engine!r}: allowed {', '.join(ENGINES)} or unset")
    return engine


class ContainerProcess:
    """One container of a job: its process, its output, and how it ended. ``image`` is the
    image the job names and ``replaces_entrypoint`` whether the platform's command replaces its
    ENTRYPOINT (Kubernetes) or is given to it (HF Jobs); both matter only under an engine."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        log: Path,
        *,
        image: str | None,
        replaces_entrypoint: bool,
    ) -> None:
        env = {"OMP_NUM_THREADS": "1", **env}
        self.engine = standin_engine()
        self.container_name = f"diloco-standin-{uuid.uuid4().hex[:12]}"
        if self.engine is not None:
            if not image:
                raise ValueError(f"{ENV_STANDIN_ENGINE}={self.engine}: the job names no image")
            argv, process_env = engine_run(
                self.engine, image, self.container_name, command, env, replaces_entrypoint
            )
        else:
            argv, process_env = local_process(command, env)
        self.log = log
        self.cancelled = False
        with log.open("ab") as output:
            self.process = subprocess.Popen(
                argv,
                env=process_env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exit_code(self) -> int | None:
        return self.process.poll()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def cancel(self) -> None:
        self.cancelled = True
        self.terminate()

    def terminate(self) -> None:
        """SIGTERM, as a platform ends a container: its replica records that it stopped. The
        process may end (and be reaped by the thread waiting on it) meanwhile."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self.engine is not None:  # the engine's client is gone; its container may not be
            subprocess.run(
                [self.engine, "rm", "--force", "--time", "0", self.container_name],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )


class RecordingServer(ThreadingHTTPServer):
    """A loopback HTTP server that keeps every request (method, path, JSON body) it served."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.requests: list[tuple[str, str, object]] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> RecordingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
        self.server_close()
