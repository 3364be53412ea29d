"""Shared fixtures: stand-in servers (started once per session) and a fresh store per test; and
the ``integration`` marker, on every test that starts a server or a process.

A test using a stand-in server is marked here; a test that starts processes carries the mark
itself (its module's ``pytestmark``, or its own), and one that does not yet starts a process
fails saying so: ``pytest -m "not integration"`` stays a fast loop of in-process tests."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import random
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from diloco_anywhere.bench.unattended import store_secret
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.standins import GCS_EMULATOR_ENV, StandIn, StandInUnavailableError, standin
from diloco_anywhere.standins.hf_jobs import hf_jobs_api
from diloco_anywhere.standins.kubernetes import k8s_api
from diloco_anywhere.standins.webhook import WebhookServer

# gcsfs reads this once, at its first import, which a test module may do at collection time.
os.environ.update(GCS_EMULATOR_ENV)

# Hypothesis fails an example that takes longer than 200 ms, a limit in wall-clock time: on a
# loaded machine (make test's workers, CI) an example of part_ranges once took 251 ms and the
# test failed. Examples are judged by what they assert, never by how fast the machine was.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

LOCAL_BACKENDS = ("path", "file", "memory")
SERVER_BACKENDS = ("s3", "gcs", "azure", "hf")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--image",
        action="store_true",
        help="collect tests/image: build the project image with podman and run replicas in it "
        "(make image-test); without it those tests are not collected, so make test needs no "
        "container engine",
    )


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    if collection_path.name == "image" and collection_path.parent == Path(__file__).parent:
        return not config.getoption("--image")
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _uses_servers(item):
            item.add_marker(pytest.mark.integration)
    items.sort(key=_start_order)


# The longest tests (docs/testing.md, "Where the time goes"), started first, in this order:
# begun last, one would keep its worker busy while the others have nothing left to run. Then
# every other test that starts processes or servers, then the in-process ones: quick, they
# fill the end. `make test` hands tests out a couple at a time (--dist load), so this order
# is the order in which workers take them up.
LONGEST = (
    "tests/bench/test_gpu_check.py::test_every_gpu_check_passes",
    "tests/launching/keep/test_unattended.py::test_a_detached_run",
    "tests/project/test_terraform_apply.py",
    "tests/project/test_template.py::test_the_rendered_projects_own_tests_pass",
    "tests/cli/test_cli.py::test_bench_overlap_and_throughput",
    "tests/cli/test_cli.py::test_bench_convergence_sweeps",
    "tests/bench/test_checkpoint_bench.py",
    "tests/bench/test_hetero_bench.py",
    "tests/project/test_workflows.py::test_the_build_context_is_enough",
    "tests/training/test_torchtitan.py::test_a_torchtitan_run",
)


def _start_order(item: pytest.Item) -> tuple[int, bool]:
    """Sorts the longest first, then tests that start processes, then the rest (stable)."""
    longest = next((rank for rank, prefix in enumerate(LONGEST)
                    if item.nodeid.startswith(prefix)), len(LONGEST))  # fmt: skip
    return longest, item.get_closest_marker("integration") is None


def _uses_servers(item: pytest.Item) -> bool:
    """A store of the ``backend`` fixture on a server, or any other use of the stand-ins."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "backend" in params:
        return params["backend"] in SERVER_BACKENDS
    return "standins" in getattr(item, "fixturenames", ())


# Fixtures shared by several tests (module or session scope) that started a process while being
# set up, on this worker: a test that uses one starts processes too, if only when it happens to
# be the first to use it, so it must be marked ``integration`` like the tests that start their
# own (a function-scoped fixture's process is refused below, as the test's own would be).
# Spawns are counted on the main thread only, where fixtures are set up.
_spawns = {"count": 0}
_spawning_fixtures: set[str] = set()


def _counted(start: Callable) -> Callable:
    def counting(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            _spawns["count"] += 1
        return start(*args, **kwargs)

    return counting


subprocess.Popen.__init__ = _counted(subprocess.Popen.__init__)
multiprocessing.process.BaseProcess.start = _counted(multiprocessing.process.BaseProcess.start)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    before = _spawns["count"]
    try:
        return (yield)
    finally:
        if _spawns["count"] > before and fixturedef.scope != "function":
            _spawning_fixtures.add(fixturedef.argname)


@pytest.fixture(autouse=True)
def _in_process_unless_integration(request: pytest.FixtureRequest, monkeypatch) -> None:
    """A test not marked ``integration`` starts no process, nor uses a fixture that did."""
    if request.node.get_closest_marker("integration"):
        return
    spawning = sorted(_spawning_fixtures.intersection(request.fixturenames))
    assert not spawning, (
        f"{request.node.nodeid} uses {', '.join(spawning)}, which started processes: "
        "mark it @pytest.mark.integration"
    )

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@dataclass
class Backend:
    """Where a test's store lives: URL, options, and whether create-only is enforced."""

    name: str
    url: str
    storage_options: dict[str, Any]
    exclusive_create: bool = True

    def store(self, **kwargs: Any) -> Store:
        return Store(self.url, storage_options=self.storage_options, **kwargs)


@pytest.fixture(scope="session")
def standins() -> Iterator[Callable[[str], StandIn]]:
    """Each stand-in server, started lazily; a str value is the reason it is unavailable."""
    started: dict[str, StandIn | str] = {}
    contexts = []

    def get(name: str) -> StandIn:
        if name not in started:
            context = standin(name)
            try:
                started[name] = context.__enter__()
                contexts.append(context)
            except StandInUnavailableError as exc:
                started[name] = str(exc)
        value = started[name]
        if isinstance(value, str):
            pytest.skip(value)
        return value

    yield get
    for context in reversed(contexts):
        context.__exit__(None, None, None)


def _backend(name: str, standins, tmp_path) -> Backend:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if name == "path":
        return Backend(name, str(tmp_path / "store"), {})
    if name == "file":
        return Backend(name, f"file://{tmp_path}/store", {})
    if name == "memory":
        return Backend(name, f"memory://{prefix}", {})
    server = standins(name)
    return Backend(
        name,
        f"{server.url}/{prefix}",
        server.storage_options,
        exclusive_create=server.exclusive_create,
    )


@pytest.fixture
def make_backend(standins, tmp_path) -> Callable[[str], Backend]:
    """A fresh, empty store on the named backend (a stand-in server is started if needed)."""
    return lambda name: _backend(name, standins, tmp_path)


@pytest.fixture(params=LOCAL_BACKENDS + SERVER_BACKENDS)
def backend(request, make_backend) -> Backend:
    return make_backend(request.param)


@pytest.fixture
def s3_run(standins, monkeypatch) -> tuple[str, dict[str, str]]:
    """A fresh prefix on the moto S3 server, for runs whose replicas are remote: its URL, and
    the credentials a replica needs (set in this process too, so the test reads the bucket)."""
    server = standins("s3")
    credentials = {
        "AWS_ACCESS_KEY_ID": server.storage_options["key"],
        "AWS_SECRET_ACCESS_KEY": server.storage_options["secret"],
        "AWS_ENDPOINT_URL": server.storage_options["endpoint_url"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    return f"{server.url}/r-{uuid.uuid4().hex[:12]}", credentials


# -- the Hugging Face task's offline parts --------------------------------------------------

WORDS = "the a cat dog sat ran on under mat log and then quickly slowly big small red"


@pytest.fixture(scope="session")
def hf_corpus(tmp_path_factory):
    """(tokenizer folder, data.jsonl): 240 documents written here and a BPE tokenizer (120
    tokens, ``</s>`` its end of sequence) trained on them with ``tokenizers``: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    documents = [" ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(20, 60))) + "."
                 for _ in range(240)]  # fmt: skip
    with (folder / "data.jsonl").open("w") as file:
        for document in documents:
            file.write(json.dumps({"text": document}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(documents, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>"
    )
    wrapped.save_pretrained(folder / "tokenizer")
    return folder / "tokenizer", folder / "data.jsonl"


@pytest.fixture
def run_toml(tmp_path, monkeypatch):
    """A small run of local replicas (test_launch.RUN_TOML) in an empty folder, which is also
    the current directory: ``run_toml(replicas, outer_steps)`` writes it, returns its path."""
    from support.runs import RUN_TOML

    monkeypatch.chdir(tmp_path)

    def write(replicas: int = 2, outer_steps: int = 2) -> str:
        (tmp_path / "run.toml").write_text(
            RUN_TOML.format(replicas=replicas, outer_steps=outer_steps)
        )
        return str(tmp_path / "run.toml")

    return write


# -- platform and chat stand-ins shared by the launch, keeper and unattended tests ----------


@pytest.fixture
def hub(monkeypatch):
    with hf_jobs_api() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        yield server


@pytest.fixture
def cluster(monkeypatch, s3_run):
    """The Kubernetes stand-in as the current cluster, the bucket's credentials in a Secret."""
    with k8s_api() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        store_secret("store", s3_run[1])
        yield api


@pytest.fixture
def webhook(monkeypatch):
    server = WebhookServer()
    monkeypatch.setenv("DILOCO_ALERT_WEBHOOK", server.url)
    yield server
    server.shutdown()
