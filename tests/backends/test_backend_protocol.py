"""What every launch relies on whatever the platform: every platform is one subclass of the
``Backend`` ABC declaring what it can do, with its tests and its docs section; a platform
failing part-way stops what it had started, stops carry on past failures, a platform that
cannot be asked reads ``unknown``, run.toml's platform sections are checked, and remote
replicas get a store they can reach."""

from __future__ import annotations

import inspect
import pkgutil
import re

import pytest

from diloco_anywhere import backends
from diloco_anywhere.backends import BACKENDS, backend_class, get_backend
from diloco_anywhere.backends.base import (
    Backend,
    Capabilities,
    PartialLaunchError,
    ReplicaHandle,
    ReplicaSpec,
    SecretHints,
    launch_each,
    one_line,
    stop_all,
)
from diloco_anywhere.cli.launch import parse_backends
from diloco_anywhere.config import ConfigError, RunConfig, parse_config
from diloco_anywhere.launching.start.launch import check_remote_store, job_state
from support import ROOT
from support.imports import loaded_modules

SPECS = [ReplicaSpec(f"x-{k}", k, "x", {}, ()) for k in range(3)]
# What a capability promises, the method it promises (defined by the class, not the base's)
PROMISED = {"server_dry_run": "server_dry_run", "exit_codes": "exit_code",
            "spot_wait": "spot_wait_limit"}  # fmt: skip


def test_every_module_of_the_package_is_a_platform():
    modules = {module.name for module in pkgutil.iter_modules(backends.__path__)}
    assert modules - {"base"} == set(BACKENDS)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_platform_is_a_backend_declaring_what_it_can_do(name):
    cls = backend_class(name)
    assert issubclass(cls, Backend)
    assert inspect.isabstract(Backend)
    assert not inspect.isabstract(cls)
    assert (cls.name, cls.__module__) == (name, f"diloco_anywhere.backends.{name}")
    assert Backend.registry[name] is cls
    assert isinstance(cls.__dict__["capabilities"], Capabilities)
    assert isinstance(cls.__dict__["secret_hints"], SecretHints)
    for capability, method in PROMISED.items():
        defined = getattr(cls, method) is not getattr(Backend, method)
        assert defined == getattr(cls.capabilities, capability), (capability, method)
    assert cls.launch is not Backend.launch or cls.starter is not Backend.starter
    for cloud in ("aws", "gcp", "hf"):
        hint = cls.secret_hints.for_cloud(cloud, "demo")
        assert hint is None or "{" not in hint  # {run} filled in, no other placeholder


@pytest.mark.parametrize("name", BACKENDS)
def test_a_platforms_time_limit_is_as_declared(name):
    """``always``: its default settings end an attempt; ``none`` and ``optional``: not."""
    backend = get_backend(name, parse_config("", "run.toml"))
    limit = backend.attempt_limit()
    assert (limit is not None) == (backend.capabilities.time_limit == "always")
    if backend.capabilities.time_limit == "always":
        assert limit > 0


@pytest.mark.parametrize("name", BACKENDS)
def test_every_platform_has_its_test_file_and_its_docs_section(name):
    assert (ROOT / "tests" / "backends" / f"test_backend_{name}.py").is_file()
    docs = (ROOT / "docs" / "backends.md").read_text()
    per_platform = docs.split("\n## Per platform\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^### .+ \(`backends/(\w+)\.py`\)$", per_platform, re.MULTILINE)
    assert name in headings


@pytest.mark.integration
def test_the_platform_names_load_no_platform_module():
    """``--backend`` help and ``diloco infra`` need the names only: a platform's module is
    imported when its class is asked for."""
    loaded = loaded_modules("import diloco_anywhere.cli")
    assert {f"diloco_anywhere.backends.{name}" for name in BACKENDS}.isdisjoint(loaded)


def test_a_platform_must_declare_its_capabilities_and_secret_hints():
    with pytest.raises(TypeError, match="must declare capabilities and secret_hints"):

        class Nowhere(Backend):
            name = "nowhere"

    assert "nowhere" not in Backend.registry


def test_a_platform_name_is_taken_once():
    with pytest.raises(TypeError, match="'local' is LocalBackend already"):

        class Elsewhere(Backend):
            name = "local"
            capabilities = backend_class("local").capabilities
            secret_hints = SecretHints()

    assert Backend.registry["local"] is backend_class("local")


def test_an_unknown_platform_is_refused_naming_the_others():
    with pytest.raises(ValueError, match="choose from local, modal, hf_jobs, sagemaker, k8s"):
        backend_class("mainframe")


def starter(fail_at: int, error: BaseException):
    def start_one(spec: ReplicaSpec) -> ReplicaHandle:
        if spec.index == fail_at:
            raise error
        return ReplicaHandle(spec.replica_id, "x", {"job": spec.index})

    return start_one


def test_a_platform_failing_part_way_stops_what_it_started():
    stopped = []
    with pytest.raises(PartialLaunchError) as error:
        launch_each(SPECS, starter(2, RuntimeError("quota\nexceeded")), stopped.append)
    assert [handle.replica_id for handle in stopped] == ["x-0", "x-1"]
    assert [handle.replica_id for handle in error.value.started] == ["x-0", "x-1"]
    assert str(error.value) == "quota exceeded; stopped 2 replicas (x-0, x-1)"


def test_ctrl_c_during_a_launch_stops_what_had_started_and_goes_on():
    stopped = []
    with pytest.raises(KeyboardInterrupt):
        launch_each(SPECS, starter(1, KeyboardInterrupt()), stopped.append)
    assert [handle.replica_id for handle in stopped] == ["x-0"]


def test_stops_carry_on_past_a_failing_one_and_name_it():
    def stop(handle: ReplicaHandle) -> None:
        if handle.replica_id == "x-1":
            raise ConnectionError("platform\n  unreachable")

    handles = [ReplicaHandle(s.replica_id, "x", {"job": s.index}) for s in SPECS]
    report = stop_all(handles, stop)
    assert (report.stopped, len(report.left)) == (["x-0", "x-2"], 1)
    assert str(report) == (
        "stopped 2 replicas (x-0, x-2); STILL RUNNING, stop by hand: "
        "x-1 (x job {'job': 1}: platform unreachable)"
    )


def test_a_platform_that_cannot_be_asked_reads_unknown():
    class Unreachable:
        def state(self, handle: ReplicaHandle) -> str:
            raise TimeoutError("no answer")

    assert job_state(Unreachable(), ReplicaHandle("x-0", "x")) == "unknown"


def test_one_line_keeps_sdk_errors_short():
    text = one_line(RuntimeError("(403)\nReason: Forbidden\nHTTP response body: " + "x" * 999))
    assert "\n" not in text
    assert len(text) == 400
    assert text.startswith("(403) Reason: Forbidden")


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        ({"hfjobs": {"replicas": 2}}, r"\[backends.hfjobs\] in run.toml: no such platform"),
        ({"modal": {"replicas": "2"}}, r"backends.modal.replicas = '2': give a whole number"),
        ({"modal": {"replicas": True}}, r"backends.modal.replicas = True"),
    ],
)
def test_platform_sections_are_checked_before_counting(backends, message):
    config = RunConfig.model_validate({"backends": backends})
    with pytest.raises(ValueError, match=message):
        parse_backends([], config, None)


@pytest.mark.parametrize(
    ("store", "allowed"),
    [
        ("s3://bucket/runs", True),
        ("abfs://container@account.dfs.core.windows.net/runs", True),  # not a credential
        ("s3://AKIA:secret@bucket/runs", False),
        ("az://container/runs?sig=abc", False),
        ("/data/store", False),
        ("file:///data/store", False),
    ],
)
@pytest.mark.parametrize("field", ["run.store", "checkpoint.mirrors.1"])
def test_remote_replicas_need_buckets_without_credentials_in_their_urls(store, allowed, field):
    """The store and every checkpoint mirror: each is written by the replicas."""
    if field == "run.store":
        text = f'[run]\nstore = "{store}"\n'
    else:
        text = f'[run]\nstore = "s3://b/r"\n[checkpoint]\nmirrors = ["gs://m/r", "{store}"]\n'
    config = parse_config(text, "run.toml")
    if allowed:
        check_remote_store(config, ["modal"])
    else:
        with pytest.raises(ConfigError, match=re.escape(field)) as error:
            check_remote_store(config, ["modal"])
        assert "secret" not in str(error.value)
        assert "sig=abc" not in str(error.value)


def test_a_replica_runs_under_torchrun_with_several_processes_or_when_asked():
    entrypoint = ["-m", "diloco_anywhere.replica", "--config", "run.toml"]
    one = ReplicaSpec("local-0", 0, "local", {}, ("--config", "run.toml"))
    torchrun = ["python", "-m", "torch.distributed.run", "--standalone"]
    assert one.command() == ["python", *entrypoint]
    assert one.command(torchrun=True) == [*torchrun, "--nproc-per-node=1", *entrypoint]
    two = ReplicaSpec("local-0", 0, "local", {}, ("--config", "run.toml"), processes=2)
    assert two.command() == [*torchrun, "--nproc-per-node=2", *entrypoint]
