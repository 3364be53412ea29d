"""The project image built and run with podman on a machine that reaches no registry
(``make image-test``, docs/ci.md).

Three things stand in for what a registry and a CI runner's Docker would give:
- the base image: Debian bookworm made here with ``debootstrap`` and imported (bookworm's
  Python 3.11 matches the CPU wheel of torch this machine's pip finds); made once, then kept in
  podman's storage;
- the engine's settings, in a containers.conf given through ``CONTAINERS_CONF`` so no command
  needs extra flags: the ``runc`` runtime (``crun`` refuses this machine's mix of cgroup
  versions) and default limits no higher than podman's own (it refuses to raise a limit);
- pip inside the build configured as pip is here: the same settings (``pip config list``,
  environment included), the files they name mounted read-only, so HTTPS goes through this
  machine's CA bundle and ``torch==2.13.0`` is the CPU wheel on this disk, never a CUDA
  download.
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE = "podman"
BASE_IMAGE = "localhost/diloco-base:bookworm"
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
HOST_FILES = "/run/host-pip"  # where the build sees the files this machine's pip names
TORCH_SPEC = "torch==2.13.0"  # the Makefile's: the version the tests run
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")
CLOSED_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, every request fails


class ImageCheckError(AssertionError):
    """A step of the image check failed: what failed, its output, and what to look at."""


@dataclass(frozen=True)
class Ran:
    code: int
    output: str
    seconds: float


def run(command: list[str], *, env: dict[str, str] | None = None, timeout: float = 1800) -> Ran:
    """``command`` to its end, stdout and stderr together."""
    started = time.monotonic()
    done = subprocess.run(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Ran(done.returncode, done.stdout, time.monotonic() - started)


def require(ran: Ran, what: str, hint: str = "") -> Ran:
    if ran.code != 0:
        tail = "\n".join(ran.output.splitlines()[-40:])
        advice = f": {hint}" if hint else ""
        raise ImageCheckError(f"{what} failed (exit {ran.code}){advice}\n{tail}")
    return ran


def missing_tools() -> list[str]:
    return [tool for tool in (ENGINE, "runc", "debootstrap") if shutil.which(tool) is None]


def containers_conf(folder: Path) -> Path:
    """The engine's settings for this machine. Limits: podman lowers its own process limit to
    the kernel's ``pid_max`` and cannot give a container more than it has, so the defaults are
    this process's hard limits, capped there."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], pid_max)
    conf = folder / "containers.conf"
    conf.write_text(
        "# written by tests/support/image_engine.py for this machine (docs/ci.md)\n"
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
    )
    return conf


def engine_env(conf: Path) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def has_image(image: str, env: dict[str, str]) -> bool:
    return run([ENGINE, "image", "exists", image], env=env).code == 0


def ensure_base(env: dict[str, str], work: Path) -> float:
    """The Debian base in podman's storage, made with debootstrap if missing; seconds taken
    (0 when it was there)."""
    if has_image(BASE_IMAGE, env):
        return 0.0
    started = time.monotonic()
    rootfs = work / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    command = ["debootstrap", "--variant=minbase", SUITE, str(rootfs), MIRROR]
    require(run(command, env=env), "debootstrap of the Debian base", f"mirror {MIRROR}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        [ENGINE, "import", "-", BASE_IMAGE], stdin=tar.stdout, env=env, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    require(Ran(imported.returncode, imported.stdout + imported.stderr, 0), "podman import")
    return time.monotonic() - started


def host_pip_settings() -> dict[str, str]:
    """``pip config list`` as key -> value, the environment's ``PIP_*`` winning as in pip."""
    listed = require(run([sys.executable, "-m", "pip", "config", "list"]), "pip config list").output
    settings: dict[str, str] = {}
    for line in sorted(listed.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        settings[key.rsplit(".", 1)[-1]] = shlex.split(value)[0] if value else ""
    return settings


def _host_path(word: str) -> str | None:
    path = word.removeprefix("file://")
    return path if path.startswith("/") and Path(path).exists() else None


def _mounted(word: str, path: str) -> str:
    """What to mount for ``path``: a local index (``file://.../simple``) with its parent, where
    its pages' relative links lead (``../../files/...`` in a dir2pi-style mirror)."""
    return str(Path(path).parent) if word.startswith("file://") else path


def build_pip_conf(settings: dict[str, str], folder: Path) -> tuple[Path, list[str]]:
    """A pip.conf for inside the build with every local path of ``settings`` moved under
    ``HOST_FILES``, and the read-only mounts that put those paths there."""
    lines, mounts = ["[global]"], set()
    for key, value in settings.items():
        words = []
        for word in value.split():
            path = _host_path(word)
            if path is not None:
                mounts.add(_mounted(word, path))
                word = word.replace(path, HOST_FILES + path, 1)
            words.append(word)
        lines.append(f"{key} = {' '.join(words)}")
    conf = folder / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    volumes = [f"{conf}:/etc/pip.conf:ro"]
    volumes += [f"{path}:{HOST_FILES}{path}:ro" for path in sorted(mounts)]
    return conf, volumes


def index_url(settings: dict[str, str]) -> str:
    return settings.get("index-url", "https://pypi.org/simple")


def build(context: Path, tag: str, *, extras: str, env: dict[str, str], work: Path) -> Ran:
    """``images/Dockerfile`` of ``context`` built as ``tag`` on the local base, torch from where
    this machine's pip finds it. Three passes, because podman mounts a build's volumes into
    every RUN and leaves their mount points in the layers: the builder stage with pip's files
    mounted; the builder again with no volumes and every download sent to a closed proxy (podman
    passes the proxy variables into RUN steps), which passes only if every layer came from the
    cache, so the last pass cannot download a CUDA torch; then the whole image with no volumes,
    its final stage clean."""
    settings = host_pip_settings()
    _, volumes = build_pip_conf(settings, work)
    args = {
        "BASE_IMAGE": BASE_IMAGE,
        "TORCH_INDEX_URL": index_url(settings),
        "TORCH_SPEC": TORCH_SPEC,
        "EXTRAS": extras,
    }
    common = [
        ENGINE, "build", "--isolation", "chroot", "--layers",
        "-f", str(context / "images/Dockerfile"),
        "--ignorefile", str(context / "images/Dockerfile.dockerignore"),
        *(flag for name, value in args.items() for flag in ("--build-arg", f"{name}={value}")),
    ]  # fmt: skip
    mounted = [flag for volume in volumes for flag in ("--volume", volume)]
    what = f"podman build of {context}/images/Dockerfile"
    started = time.monotonic()
    require(run([*common, *mounted, "--target", "builder", str(context)], env=env), what)
    offline = {**env, **dict.fromkeys(PROXY_VARIABLES, CLOSED_PROXY)}
    cached = run([*common, "--target", "builder", str(context)], env=offline)
    hint = (
        "a layer was not in the cache, so it would have been built without this machine's pip "
        "settings (a CUDA torch); was a file of the build context changed during the build?"
    )
    require(cached, f"{what} (the builder stage again, from the cache)", hint)
    final = require(run([*common, "-t", tag, str(context)], env=env), what)
    return Ran(final.code, final.output, time.monotonic() - started)
