"""The stand-ins' containers under an engine (``DILOCO_STANDIN_ENGINE``): the command each
platform's way, and no secret on a command line. Running them is ``make image-test``'s
(tests/image)."""

from __future__ import annotations

import json

import pytest

from diloco_anywhere.standins.containers import (
    ENV_STANDIN_ENGINE,
    ContainerProcess,
    engine_run,
    standin_engine,
)

COMMAND = ["python", "-m", "diloco_anywhere.replica"]
ENV = {"DILOCO_RUN": "t", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}


def test_kubernetes_command_replaces_the_entrypoint():
    argv, env = engine_run("podman", "img:1", "c1", COMMAND, ENV, replaces_entrypoint=True)
    assert argv[-1] == "img:1"
    assert json.loads(argv[argv.index("--entrypoint") + 1]) == COMMAND
    assert argv[argv.index("--network") : argv.index("--network") + 2] == ["--network", "host"]
    assert env["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"


def test_hf_jobs_command_is_given_to_the_entrypoint():
    argv, _ = engine_run("podman", "img:1", "c1", COMMAND, ENV, replaces_entrypoint=False)
    assert "--entrypoint" not in argv
    assert argv[-4:] == ["img:1", *COMMAND]


@pytest.mark.parametrize("replaces", [True, False])
def test_variables_reach_the_container_by_name_only(replaces):
    argv, env = engine_run("podman", "img:1", "c1", COMMAND, ENV, replaces_entrypoint=replaces)
    names = [argv[k + 1] for k, flag in enumerate(argv) if flag == "--env"]
    assert names == list(ENV)
    assert not any("s3cr3t" in word for word in argv)
    assert {name: env[name] for name in names} == ENV


def test_an_unknown_engine_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_STANDIN_ENGINE, "docker")
    refused = r"DILOCO_STANDIN_ENGINE='docker': allowed podman or unset"
    with pytest.raises(ValueError, match=refused):
        standin_engine()
    monkeypatch.setenv(ENV_STANDIN_ENGINE, "")
    assert standin_engine() is None


def test_a_job_without_an_image_is_refused_under_an_engine(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_STANDIN_ENGINE, "podman")
    with pytest.raises(ValueError, match="the job names no image"):
        ContainerProcess(COMMAND, ENV, tmp_path / "log", image=None, replaces_entrypoint=True)
