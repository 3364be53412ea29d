"""Local stand-ins for cloud object stores: real servers started as subprocesses on loopback.

- S3: moto's server (``python -m moto.server``), which honours ``If-None-Match: *``.
- Azure Blob: Azurite (npm ``azurite``), which honours ``If-None-Match: *``.
- GCS: gcp-storage-emulator. It ignores ``ifGenerationMatch``, so a second create-only write
  silently overwrites: I/O can be tested there, exclusive create cannot.
- Hugging Face Storage Buckets: moto behind a front that behaves as the Hub's S3 gateway
  documents (``hf_gateway.py``).

Each yields a ``StandIn``: the store URL of a fresh bucket and the ``storage_options`` (endpoint,
well-known dummy credentials) that reach it. Tests and ``diloco bench store --standin`` use them.

Platforms have stand-ins here too, servers for their real clients whose jobs run as local
processes (``containers.py``): Hugging Face Jobs (``hf_jobs.py``) and Kubernetes
(``kubernetes.py``); and a chat webhook (``webhook.py``). Tests and ``diloco bench unattended``
use them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from diloco_anywhere.standins.hf_gateway import gateway_front

# Azurite's documented development account (public, not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
# gcsfs's experimental zonal/HNS layer probes endpoints an emulator does not serve.
GCS_EMULATOR_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class StandInUnavailableError(RuntimeError):
    """The stand-in's server program is not installed here; the message says how to get it."""


@dataclass
class StandIn:
    name: str
    url: str
    storage_options: dict[str, Any]
    exclusive_create: bool = True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode} while starting")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:g}s")


@contextmanager
def _server(name: str, command: list[str], port: int, env: dict[str, str]) -> Iterator[None]:
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | env,
        start_new_session=True,
    )
    try:
        _wait_for_port(port, process, name)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's server (every AWS service it models) on a free port; its endpoint URL. ``env``
    configures it, e.g. ``INITIAL_NO_AUTH_ACTION_COUNT`` to enforce IAM after that many
    requests."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _server("moto server", command, port, env or {}):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def moto_s3(bucket: str = "diloco") -> Iterator[StandIn]:
    with moto_server() as endpoint:
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(bucket)
        yield StandIn("s3", f"s3://{bucket}", options)


def azurite_command() -> str:
    """The azurite-blob program: on PATH, or installed by ``make test`` under ``.tools``."""
    candidates = [
        shutil.which("azurite-blob"),
        Path.cwd() / ".tools/node_modules/.bin/azurite-blob",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise StandInUnavailableError(
        "azurite-blob not found: install it with `npm install --prefix .tools azurite` "
        "(make test does this where npm exists)"
    )


@contextmanager
def azurite(container: str = "diloco") -> Iterator[StandIn]:
    program, port = azurite_command(), free_port()
    command = [
        program,
        "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
        "--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry",
    ]  # fmt: skip
    with _server("Azurite", command, port, {}):
        options = {
            "connection_string": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
            )
        }
        fsspec.filesystem("az", skip_instance_cache=True, **options).mkdir(container)
        yield StandIn("azure", f"az://{container}", options)


@contextmanager
def gcs_emulator(bucket: str = "diloco") -> Iterator[StandIn]:
    os.environ.update(GCS_EMULATOR_ENV)  # read when gcsfs is first imported
    if fsspec.get_filesystem_class("gs").__name__ != "GCSFileSystem":
        raise StandInUnavailableError(
            "gcsfs was imported with its experimental zonal/HNS layer, which cannot talk to the "
            "GCS emulator: set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before importing gcsfs"
        )
    port = free_port()
    command = [
        sys.executable, "-m", "gcp_storage_emulator", "start",
        "--host", "127.0.0.1", "--port", str(port), "--in-memory",
        "--default-bucket", bucket, "-q",
    ]  # fmt: skip
    with _server("GCS emulator", command, port, GCS_EMULATOR_ENV):
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "test"}
        yield StandIn("gcs", f"gs://{bucket}", options, exclusive_create=False)


@contextmanager
def hf_gateway(namespace: str = "diloco-ns", bucket: str = "diloco") -> Iterator[StandIn]:
    """The Hugging Face Storage Buckets S3 gateway: moto behind a front that behaves as the
    gateway documents (``hf_gateway.py``)."""
    with moto_s3(bucket) as s3, gateway_front(namespace, s3.storage_options["endpoint_url"]) as url:
        options = {"endpoint_url": url, "key": "HFAKstandin", "secret": "standin"}
        yield StandIn("hf", f"hf://buckets/{namespace}/{bucket}", options)


STANDINS = {"s3": moto_s3, "gcs": gcs_emulator, "azure": azurite, "hf": hf_gateway}


@contextmanager
def standin(name: str) -> Iterator[StandIn]:
    """Start the named stand-in (``s3``, ``gcs``, ``azure``) for the duration of the block."""
    if name not in STANDINS:
        raise ValueError(f"unknown stand-in {name!r}; choose one of {', '.join(STANDINS)}")
    with STANDINS[name]() as server:
        yield server
