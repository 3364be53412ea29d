"""The images these tests start, built once per session (``make image-test``; docs/ci.md):
the project's, with every store's and the Hugging Face task's extras as its image workflow
builds it, and a rendered project's. Each build's seconds are printed at the end, with
whether the base had to be made first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from support import ROOT
from support import image_engine as engine
from support.template import render

PROJECT_IMAGE = "localhost/diloco-anywhere:image-test"
RENDERED_IMAGE = "localhost/diloco-rendered:image-test"
PROJECT_EXTRAS = "s3,gcs,azure,hf,hf-task"  # .github/workflows/image.yml's
TIMINGS = pytest.StashKey[dict[str, float]]()

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Engine:
    env: dict[str, str]  # CONTAINERS_CONF set: podman needs no flags
    work: Path


@pytest.fixture(scope="session")
def podman(request, tmp_path_factory) -> Engine:
    missing = engine.missing_tools()
    if missing:
        pytest.fail(
            f"the image check needs {', '.join(missing)}: `make image-test` installs them from "
            f"Debian's packages when run as root (apt-get install podman runc debootstrap)",
            pytrace=False,
        )
    work = tmp_path_factory.mktemp("engine")
    env = engine.engine_env(engine.containers_conf(work))
    seconds = engine.ensure_base(env, work)
    if seconds:
        request.config.stash.setdefault(TIMINGS, {})["debian base (debootstrap + import)"] = seconds
    return Engine(env, work)


def _build(request, podman: Engine, context: Path, tag: str, extras: str, name: str) -> str:
    built = engine.build(context, tag, extras=extras, env=podman.env, work=podman.work)
    request.config.stash.setdefault(TIMINGS, {})[name] = built.seconds
    return tag


@pytest.fixture(scope="session")
def image(request, podman) -> str:
    return _build(request, podman, ROOT, PROJECT_IMAGE, PROJECT_EXTRAS, "project image build")


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> Path:
    """A project as `copier copy` renders it for S3 and Kubernetes, the byte-level GPT."""
    return render(tmp_path_factory.mktemp("rendered"), storage="s3", backends=["k8s"])


@pytest.fixture(scope="session")
def rendered_image(request, podman, rendered) -> str:
    return _build(request, podman, rendered, RENDERED_IMAGE, "store,task", "rendered image build")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    timings = config.stash.get(TIMINGS, {})
    if timings:
        terminalreporter.section("image builds")
        for name, seconds in timings.items():
            terminalreporter.write_line(f"{name}: {seconds:.0f} s")
