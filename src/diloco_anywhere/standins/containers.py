"""What the platform stand-ins share: a job's container, played by a local process.

A stand-in server (HF Jobs, Kubernetes) accepts a job as its platform would and runs the job's
command here, with only the environment the platform would give the container: the job's own
variables and secrets, plus what the project image provides (this Python, its PATH, the
project's sources on PYTHONPATH). This machine's Python stands in for the image, so a leading
``python`` becomes ``sys.executable``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

IMAGE_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR")


class ContainerProcess:
    """One container of a job: its process, its output, and how it ended."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        if command and command[0] == "python":
            command = [sys.executable, *command[1:]]
        image = {name: os.environ[name] for name in IMAGE_ENV if name in os.environ}
        self.log = log
        self.cancelled = False
        with log.open("ab") as output:
            self.process = subprocess.Popen(
                command,
                env={**image, "OMP_NUM_THREADS": "1", **env},
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
