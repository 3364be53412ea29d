"""The Modal launcher with the real modal SDK, offline: the App it defines, its settings, and
the function body every replica's call runs. Deploying, spawning, polling and cancelling talk
to Modal's servers and are not run here (polling and cancelling are checked on a stand-in for
``FunctionCall``); the client is pointed at a closed local port so that anything that tried
would fail instead of reaching Modal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpclib import GRPCError, Status
from grpclib.exceptions import StreamTerminatedError

from diloco_anywhere.backends.base import BackendUnavailableError, ReplicaHandle
from diloco_anywhere.backends.modal import ModalBackend, ReplicaExitError
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, load_config, parse_config
from diloco_anywhere.launching.start.launch import plan_launch, run_metrics
from diloco_anywhere.published_config import publish_config
from diloco_anywhere.standins import free_port
from support.runs import RUN_TOML

modal = pytest.importorskip("modal", reason="the modal SDK: pip install 'diloco-anywhere[modal]'")

# A client that tried to reach Modal would retry the closed port for about a minute, then fail.
pytestmark = pytest.mark.timeout(90)
IMAGE = """
[image]
ref = "ghcr.io/acme/run:1"
"""
MODAL = f"""{IMAGE}
[backends.modal]
gpu = "a100-80gb:2"
processes_per_replica = 2
secrets = ["diloco-store", "wandb"]
timeout_hours = 6
retries = 3
memory = 32768
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No Modal server and no token: nothing here may need them."""
    monkeypatch.setenv("MODAL_SERVER_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)


def write_run(tmp_path, store: str, replicas: int = 2, modal_settings: str = MODAL) -> str:
    text = RUN_TOML.format(replicas=replicas, outer_steps=2)
    text = text.replace('store = "store"', f'store = "{store}"')
    text = text.replace("min_replicas = 2", f"min_replicas = {min(replicas, 2)}")
    (tmp_path / "run.toml").write_text(text + modal_settings)
    return str(tmp_path / "run.toml")


def dockerfile(image) -> list[str]:
    """The Dockerfile Modal would build ``image`` from. The SDK exposes none before the image
    is built on Modal's servers, so this calls the ``build_dockerfile`` its loader holds."""
    from modal._image import LATEST_IMAGE_BUILDER_VERSION
    from modal._utils.async_utils import synchronizer

    loader = synchronizer._translate_in(image)._load
    (build,) = [
        cell.cell_contents
        for cell in loader.__closure__
        if getattr(cell.cell_contents, "__name__", "") == "build_dockerfile"
    ]
    return build(LATEST_IMAGE_BUILDER_VERSION).commands


def test_the_app_modal_would_deploy_is_what_describe_says(tmp_path):
    plan = plan_launch(load_config(write_run(tmp_path, "s3://diloco")), {"modal": 2})
    backend = plan.backends["modal"]
    app, function = backend.build_app()

    assert app.name == "diloco-t"  # diloco-{run.name}
    assert function.app is app
    info = function.info()  # Modal's own record of the definition, read without a server
    assert info.gpus == [("A100-80GB", 2)]
    assert info.timeout == 6 * 3600
    assert info.max_retries == 3
    assert info.memory_mib == 32768
    assert info.secrets == [
        "modal.Secret.from_name('diloco-store')", "modal.Secret.from_name('wandb')",
    ]  # fmt: skip
    assert function._spec_.gpus == "A100-80GB:2"
    assert dockerfile(function._spec_.image) == ["FROM ghcr.io/acme/run:1"]  # no Python added
    # Modal ships the function pickled, and the pickle is a reference to this module's
    # run_replica: the container runs it from the package installed in the image.
    source = function._get_source_info()
    assert source.is_serialized()
    assert b"diloco_anywhere.backends.modal" in source.serialized_function()
    assert source.function_name == "run_replica"

    deploy, *spawns = backend.describe(list(plan.specs))
    assert deploy["deploy"] == {
        "app": "diloco-t",
        "function": "run_replica",
        "image": "ghcr.io/acme/run:1",
        "registry_secret": None,
        "gpu": "A100-80GB:2",
        "secrets": ["diloco-store", "wandb"],
        "timeout": 6 * 3600,
        "retries": {"max_retries": 3, "initial_delay": 10.0, "backoff_coefficient": 2.0},
        "cpu": None,
        "memory": 32768,
    }
    assert [spawn["spawn"]["replica"] for spawn in spawns] == ["modal-0", "modal-1"]
    for spawn, spec in zip(spawns, plan.specs, strict=True):
        assert spawn["spawn"]["env"] == spec.env
        assert spawn["spawn"]["env"]["DILOCO_CONFIG_KEY"] == plan.config_key
        assert spawn["spawn"]["command"] == [
            "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "diloco_anywhere.replica",
        ]  # fmt: skip
    json.dumps(deploy | {"spawns": spawns})  # JSON-able as it is


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('gpu = "H100:9"', "backends.modal.gpu = 'H100:9': the count after H100: must be a "
         "whole number from 1 to 8"),
        ('gpu = "TPU"', "backends.modal.gpu = 'TPU': Modal has no GPU 'TPU'; choose from T4, "
         "L4, A10, A10G, L40S, A100, A100-40GB, A100-80GB, RTX-PRO-6000, H100, H100!, H200"),
        ("timeout_hours = 25", "backends.modal.timeout_hours = 25: Input should be less than "
         "or equal to 24"),
        ('gpu = "H100:2"', "backends.modal: gpu = 'H100:2' gives each replica 2 GPUs but "
         "processes_per_replica is 1"),
        ('secrets = ["store keys"]', "backends.modal.secrets = ['store keys']: 'store keys' is "
         "not a Modal Secret name"),
        ("gpus = 8", "backends.modal.gpus = 8: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_field(setting, message):
    config = parse_config(f"[backends.modal]\n{setting}\n", "run.toml")
    with pytest.raises(ConfigError) as error:
        ModalBackend(config)
    assert message in str(error.value)


def test_a_run_name_modal_cannot_take_needs_an_app_name():
    config = parse_config('[run]\nname = "lr=3e-4"\n', "run.toml")
    with pytest.raises(ConfigError, match=r"backends\.modal\.app_name: 'diloco-lr=3e-4' is not"):
        ModalBackend(config)
    named = parse_config('[run]\nname = "lr=3e-4"\n[backends.modal]\napp_name = "lr"\n', "x")
    assert ModalBackend(named).app_name == "lr"


def test_a_replica_call_trains_its_outer_steps(tmp_path, s3_run, monkeypatch):
    """The function body as a container would run it: the spec's environment and command,
    the store credentials in the container's environment (where the Modal Secret puts them:
    s3_run sets them here), and ``python`` on PATH being the project's."""
    store, _ = s3_run
    config = load_config(write_run(tmp_path, store, replicas=1, modal_settings=IMAGE))
    plan = plan_launch(config, {"modal": 1})
    with Store(config.store_url()) as bucket:
        assert publish_config(bucket, config) == plan.config_key
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    (spec,) = plan.specs
    _, function = plan.backends["modal"].build_app()

    assert function.local(spec.env, spec.command("python")) == 0

    (metrics,) = run_metrics(config).read().values()
    assert (metrics.replica, metrics.platform, metrics.state()) == ("modal-0", "modal", "done")
    assert [sync.round for sync in metrics.syncs] == [0, 1]


@pytest.mark.integration
def test_a_failing_replica_raises_without_its_environment_in_the_message():
    _, function = ModalBackend(parse_config(IMAGE, "run.toml")).build_app()
    env = {"DILOCO_STORE": "s3://bucket-name-here", "SOME_TOKEN": "hunter2"}
    exit_with_length = "import os, sys; sys.exit(len(os.environ['SOME_TOKEN']))"
    with pytest.raises(ReplicaExitError, match="exited with code 7") as error:
        function.local(env, [sys.executable, "-c", exit_with_length])
    assert "hunter2" not in str(error.value)
    assert "bucket-name-here" not in str(error.value)


@pytest.mark.integration
@pytest.mark.parametrize("code", [2, 3])
def test_a_replica_a_retry_cannot_help_returns_its_code_so_modal_does_not_retry(code):
    """Exit 2: the replica refused its run.toml, which a retry would refuse again; exit 3: a
    newer incarnation runs, which a retry would supersede. Returned, not raised, so Modal
    counts the call as done; ``state`` reads the code as failed."""
    _, function = ModalBackend(parse_config(IMAGE, "run.toml")).build_app()
    exit_with = f"import sys; sys.exit({code})"
    assert function.local({}, [sys.executable, "-c", exit_with]) == code


class Call:
    """A stand-in for ``modal.FunctionCall``: ``get`` returns ``result`` or raises it."""

    def __init__(self, result: object) -> None:
        self.result, self.cancelled = result, False

    def get(self, timeout: float | None = None) -> object:
        assert timeout == 0  # polled, never waited on
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def cancel(self, terminate_containers: bool = False) -> None:
        self.cancelled = terminate_containers


def polled(monkeypatch, result: object) -> Call:
    call = Call(result)
    monkeypatch.setattr(modal.FunctionCall, "from_id", lambda call_id: call)
    return call


HANDLE = ReplicaHandle("modal-0", "modal", {"app": "diloco-t", "call_id": "fc-1"})


@pytest.mark.parametrize(
    ("result", "state"),
    [
        (TimeoutError(), "running"),  # no result yet
        (0, "exited"),
        (2, "failed"),  # run_replica returned a refused run.toml's code
        (ReplicaExitError("`python -m diloco_anywhere.replica` exited with code 1"), "failed"),
        (FileNotFoundError("python"), "failed"),  # raised by the call, in the container
        (modal.exception.FunctionTimeoutError("timed out after 6h"), "timed_out"),
        (modal.exception.InternalFailure("the input failed"), "failed"),
        (modal.exception.RemoteError("container crashed"), "failed"),
        (modal.exception.RemoteError(""), "stopped"),  # a cancelled call
        (modal.exception.AuthError("token rejected"), "unknown"),
        (modal.exception.NotFoundError("no such call"), "unknown"),
        (modal.exception.ServiceError("unavailable"), "unknown"),
        (modal.exception.InternalError("oops"), "unknown"),
        (modal.exception.ConnectionError("Could not connect"), "unknown"),
        (modal.exception.OutputExpiredError(), "unknown"),  # the result is no longer kept
        (GRPCError(Status.UNAVAILABLE, "down"), "unknown"),
        (StreamTerminatedError("reset"), "unknown"),
    ],
)
def test_state_is_failed_only_when_the_call_itself_failed_or_timed_out(monkeypatch, result, state):
    polled(monkeypatch, result)
    assert ModalBackend(parse_config(IMAGE, "run.toml")).state(HANDLE) == state


@pytest.mark.parametrize(
    ("result", "cancelled"),
    [
        (TimeoutError(), True),
        (modal.exception.ServiceError("unavailable"), True),  # unknown: it may be running
        (0, False),
        (ReplicaExitError("exited with code 1"), False),
        (modal.exception.RemoteError(""), False),
    ],
)
def test_stop_cancels_a_call_unless_it_has_ended(monkeypatch, result, cancelled):
    call = polled(monkeypatch, result)
    ModalBackend(parse_config(IMAGE, "run.toml")).stop(HANDLE)
    assert call.cancelled is cancelled


@pytest.mark.integration
def test_a_cancelled_call_gives_the_replica_sigterm(tmp_path):
    """Modal cancels a running call by raising InputCancellation from a SIGUSR1 handler in the
    function's thread; the replica must then get SIGTERM, so that it records its stop."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    replica = (
        "import pathlib, signal, sys, time\n"
        "def stop(*_):\n"
        f"    pathlib.Path({str(stopped)!r}).touch()\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )

    def cancel(*_):
        raise modal.exception.InputCancellation("Input was cancelled by user")

    def cancel_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    _, function = ModalBackend(parse_config(IMAGE, "run.toml")).build_app()
    previous = signal.signal(signal.SIGUSR1, cancel)
    try:
        threading.Thread(target=cancel_when_ready, daemon=True).start()
        with pytest.raises(modal.exception.InputCancellation):
            function.local({}, [sys.executable, "-c", replica])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stopped.exists()


def test_the_attempt_limit_is_the_function_timeout_and_the_hardware_its_gpus(tmp_path):
    backend = ModalBackend(load_config(write_run(tmp_path, "s3://diloco")))
    assert (backend.attempt_limit(), backend.hardware()) == (6 * 3600, "A100-80GB:2")
    cpu = ModalBackend(parse_config("[backends.modal]\ntimeout_hours = 0.5\n", "run.toml"))
    assert (cpu.attempt_limit(), cpu.hardware()) == (1800, "cpu")


def test_a_replica_started_again_is_one_new_call_with_its_spec(tmp_path, monkeypatch):
    """What `diloco keep` does: launching the one spec of replica modal-1 again spawns one
    call of that replica, with its id and shard. Modal's servers are not here: deploy and
    spawn are recorded where the App and its Function would send them."""
    plan = plan_launch(load_config(write_run(tmp_path, "s3://diloco", replicas=3)), {"modal": 3})
    backend, spec = plan.backends["modal"], plan.specs[1]
    deployed, spawned = [], []
    monkeypatch.setattr(modal.App, "deploy", lambda app, **_: deployed.append(app.name))

    def spawn(function, env, command):
        spawned.append((env, command))
        return SimpleNamespace(object_id=f"fc-{len(spawned)}")  # a FunctionCall's id

    monkeypatch.setattr(modal.Function, "spawn", spawn)

    handles = [backend.launch([spec], tmp_path)[0] for _ in range(2)]

    assert deployed == ["diloco-t", "diloco-t"]  # the App again: a relaunch updates it
    assert spawned == [(spec.env, spec.command("python"))] * 2
    assert (spec.env["DILOCO_REPLICA_ID"], spec.env["DILOCO_REPLICA_INDEX"]) == ("modal-1", "1")
    assert [(h.replica_id, h.job["call_id"]) for h in handles] == [
        ("modal-1", "fc-1"), ("modal-1", "fc-2"),
    ]  # fmt: skip


CHECK = """
from diloco_anywhere.backends.base import BackendUnavailableError
from diloco_anywhere.backends.modal import ModalBackend
from diloco_anywhere.config import RunConfig
try:
    ModalBackend(RunConfig()).check()
except BackendUnavailableError as error:
    print(error)
"""


def check_in_a_new_process(tmp_path, **env: str) -> str:
    """``check()`` as a fresh CLI sees it: modal reads its config file when first imported."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_TOKEN_")}
    base |= {"HOME": str(tmp_path), "MODAL_CONFIG_PATH": str(tmp_path / "absent.toml")}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=base | env, capture_output=True, text=True, check=True
    )
    return result.stdout


@pytest.mark.integration
def test_check_without_a_token_says_how_to_get_one_in_one_line(tmp_path):
    said = check_in_a_new_process(tmp_path)
    assert said.count("\n") == 1
    assert said.startswith("backend modal: no Modal token; run `modal token new`")
    assert "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET" in said


@pytest.mark.integration
def test_check_takes_the_token_from_the_environment_or_modals_config_file(tmp_path):
    assert check_in_a_new_process(tmp_path, MODAL_TOKEN_ID="ak-1", MODAL_TOKEN_SECRET="as-2") == ""
    profile = tmp_path / "modal.toml"
    profile.write_text('[ci]\ntoken_id = "ak-1"\ntoken_secret = "as-2"\nactive = true\n')
    assert check_in_a_new_process(tmp_path, MODAL_CONFIG_PATH=str(profile)) == ""


def test_check_without_the_sdk_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal.config", None)  # as if modal were not installed
    with pytest.raises(BackendUnavailableError) as error:
        ModalBackend(parse_config("", "run.toml")).check()
    assert str(error.value) == (
        "backend modal needs the modal package: pip install 'diloco-anywhere[modal]'"
    )
