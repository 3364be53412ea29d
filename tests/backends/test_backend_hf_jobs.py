"""The HF Jobs launcher with the real huggingface_hub client, against a local Jobs API that
runs each job's command as a process (``diloco_anywhere.standins.hf_jobs``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub.errors import HfHubHTTPError

from diloco_anywhere.backends.base import BackendUnavailableError, ReplicaHandle
from diloco_anywhere.backends.hf_jobs import HfJobsBackend, hub_api
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError, load_config, parse_config
from diloco_anywhere.launching.start.launch import plan_launch, run_metrics, start
from diloco_anywhere.published_config import publish_config
from diloco_anywhere.standins import free_port
from diloco_anywhere.standins.hf_jobs import USER, hf_jobs_api
from support.proxy import Fault, FaultProxy
from support.runs import SECRETS, wait_for_starts, write_run


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the run folder (.diloco/<run>) goes here
    with hf_jobs_api() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        yield server


def wait_for(backend, handles, states, seconds=180.0):
    deadline = time.monotonic() + seconds
    while {backend.state(handle) for handle in handles} - set(states):
        assert time.monotonic() < deadline, [backend.state(handle) for handle in handles]
        time.sleep(0.5)


def test_describe_gives_run_job_arguments_with_secret_values_masked(tmp_path, s3_run):
    plan = plan_launch(load_config(write_run(tmp_path, s3_run[0])), {"hf_jobs": 2})
    jobs = [item["run_job"] for item in plan.backends["hf_jobs"].describe(list(plan.specs))]
    assert [job["env"]["DILOCO_REPLICA_ID"] for job in jobs] == ["hf_jobs-0", "hf_jobs-1"]
    assert jobs[0]["image"] == "ghcr.io/acme/run:1"
    assert jobs[0]["command"] == ["python", "-m", "diloco_anywhere.replica"]
    assert jobs[0]["env"]["DILOCO_CONFIG_KEY"] == plan.config_key
    assert (jobs[0]["flavor"], jobs[0]["timeout"], jobs[0]["attempts"]) == ("a100-large", "2d", 2)
    assert jobs[0]["secrets"] == dict.fromkeys(SECRETS, "***")
    assert "testing" not in json.dumps(jobs)  # the credentials' values


def test_replicas_run_as_jobs_and_the_hub_gets_what_describe_said(tmp_path, s3_run, hub):
    store, credentials = s3_run
    config = load_config(write_run(tmp_path, store))
    plan = plan_launch(config, {"hf_jobs": 2})
    backend = plan.backends["hf_jobs"]
    handles = start(plan)["hf_jobs"][1]
    assert [handle.job["namespace"] for handle in handles] == [USER, USER]  # from whoami

    bodies = hub.created()
    described = [item["run_job"] for item in backend.describe(list(plan.specs))]
    for body, job in zip(bodies, described, strict=True):
        assert body["dockerImage"] == job["image"]
        assert body["command"] == job["command"]
        assert body["environment"] == job["env"]
        assert body["flavor"] == "a100-large"
        assert body["timeoutSeconds"] == 2 * 86400  # not the hub's 30-minute default
        assert body["attempts"] == 2
        assert body["secrets"] == credentials  # values only in the request to the hub
        assert body["labels"]["diloco-replica"] == job["env"]["DILOCO_REPLICA_ID"]

    wait_for(backend, handles, {"exited"})
    metrics = run_metrics(config).read()
    assert {replica: m.state() for replica, m in metrics.items()} == {
        "hf_jobs-0": "done", "hf_jobs-1": "done",
    }  # fmt: skip
    assert {m.platform for m in metrics.values()} == {"hf_jobs"}
    assert "done:" in backend.logs(handles[0])
    assert "testing" not in backend.logs(handles[0])
    backend.stop(handles[0])  # an ended job: nothing to cancel
    assert not [path for method, path, _ in hub.requests if path.endswith("/cancel")]


def launch_one_of_two(config, tmp_path) -> tuple[HfJobsBackend, ReplicaHandle]:
    """Replica hf_jobs-0 of a 2-replica run alone, run.toml published: it trains, then waits
    at its first sync for a quorum that never comes."""
    plan = plan_launch(config, {"hf_jobs": 2})
    with Store(config.store_url()) as bucket:
        publish_config(bucket, config)
    backend = plan.backends["hf_jobs"]
    return backend, backend.launch([plan.specs[0]], tmp_path)[0]


def test_stop_cancels_a_running_job(tmp_path, s3_run, hub):
    config = load_config(write_run(tmp_path, s3_run[0], replicas=2, outer_steps=500))
    backend, handle = launch_one_of_two(config, tmp_path)
    assert backend.state(handle) == "running"
    backend.stop(handle)
    wait_for(backend, [handle], {"stopped"}, seconds=30)


def handle_of(job_id: str, **more: float) -> ReplicaHandle:
    job = {"id": job_id, "namespace": USER, "url": "", **more}
    return ReplicaHandle("hf_jobs-0", "hf_jobs", job)


def cancels(hub, job_id: str) -> int:
    return sum(path.endswith(f"/{job_id}/cancel") for _, path, _ in hub.requests)


@pytest.fixture
def flaky_hub(hub, monkeypatch):
    """The stand-in behind a proxy that can refuse requests, as the client's endpoint."""
    with FaultProxy(hub.url) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.url)
        yield hub, proxy


@pytest.mark.integration
def test_stop_cancels_a_job_whose_state_the_hub_could_not_give(flaky_hub):
    hub, proxy = flaky_hub
    job = hub.create(USER, {"command": ["python", "-c", "import time; time.sleep(60)"],
                            "flavor": "cpu-basic"})  # fmt: skip
    backend, handle = HfJobsBackend(parse_config("", "run.toml")), handle_of(job.id)
    inspect = Fault("GET", status=503, path_contains=f"/api/jobs/{USER}/{job.id}", times=2)
    proxy.inject(inspect)
    assert backend.state(handle) == "unknown"  # a 503: the job may well be running

    backend.stop(handle)

    assert cancels(hub, job.id) == 1
    assert job.container.cancelled
    assert backend.state(handle) == "stopped"


def test_stop_takes_a_job_gone_meanwhile_as_stopped(flaky_hub):
    """The hub could not say (503), so stop cancels; the job is gone by then (404)."""
    hub, proxy = flaky_hub
    backend, handle = HfJobsBackend(parse_config("", "run.toml")), handle_of("f" * 24)
    proxy.inject(Fault("GET", status=503, path_contains=f"/api/jobs/{USER}/{'f' * 24}"))
    backend.stop(handle)
    assert cancels(hub, "f" * 24) == 1
    assert backend.state(handle) == "stopped"  # 404: the hub does not know it


def test_state_raises_when_the_hub_cannot_be_reached(hub, monkeypatch):
    """Not a job state: the caller (status, supervisor) decides what an outage means."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Exception) as error:  # noqa: PT011 (the HTTP library's own error)
        HfJobsBackend(parse_config("", "run.toml")).state(handle_of("1" * 24))
    assert not isinstance(error.value, HfHubHTTPError)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('flavor = "h100"', "backends.hf_jobs.flavor = 'h100': HF Jobs has no "
         "flavor 'h100'; choose from cpu-basic"),
        ('timeout = "forever"', "backends.hf_jobs.timeout = 'forever': give seconds"),
        ("attempts = 0", "backends.hf_jobs.attempts = 0: Input should be greater than or equal"),
        ('secrets = ["AWS KEY"]', "['AWS KEY']: give NAME or NAME=SOURCE"),
        ('secrets = ["A=B=C"]', "['A=B=C']: give NAME or NAME=SOURCE"),
        ("gpus = 8", "backends.hf_jobs.gpus = 8: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_field(setting, message):
    config = parse_config(f"[backends.hf_jobs]\n{setting}\n", "run.toml")
    with pytest.raises(ConfigError) as error:
        HfJobsBackend(config)
    assert message in str(error.value)


def test_check_says_what_is_missing_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no saved login either
    config = parse_config('[backends.hf_jobs]\nsecrets = ["NOT_SET_HERE"]\n', "run.toml")
    with pytest.raises(BackendUnavailableError, match="no Hugging Face token") as error:
        HfJobsBackend(config).check()
    assert "\n" not in str(error.value)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    with pytest.raises(BackendUnavailableError, match="reads NOT_SET_HERE, not set here"):
        HfJobsBackend(config).check()


def test_check_without_the_sdk_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(BackendUnavailableError) as error:
        HfJobsBackend(parse_config("", "run.toml")).check()
    assert str(error.value) == (
        "backend hf_jobs needs the huggingface_hub package: pip install 'diloco-anywhere[hf-jobs]'"
    )


def test_a_secret_can_be_read_from_another_variable(tmp_path, s3_run, hub, monkeypatch):
    """A launcher whose own AWS_* are an OIDC session (GitHub Actions) passes the replicas'
    long-lived key under other names: ``NAME=SOURCE``."""
    monkeypatch.setenv("STORE_KEY_ID", "AKIA-REPLICA")
    path = write_run(tmp_path, s3_run[0], replicas=2, outer_steps=500)
    text = Path(path).read_text().replace(json.dumps(SECRETS), '["AWS_ACCESS_KEY_ID=STORE_KEY_ID"]')
    Path(path).write_text(text)
    plan = plan_launch(load_config(path), {"hf_jobs": 1})
    backend = plan.backends["hf_jobs"]
    (described,) = backend.describe(list(plan.specs))
    assert described["run_job"]["secrets"] == {"AWS_ACCESS_KEY_ID": "***"}
    (handle,) = start(plan)["hf_jobs"][1]
    assert hub.created()[0]["secrets"] == {"AWS_ACCESS_KEY_ID": "AKIA-REPLICA"}
    backend.stop(handle)


@pytest.mark.parametrize(
    ("timeout", "seconds"), [("2d", 172800), ("1.5h", 5400), ("30m", 1800), ("90s", 90), ("75", 75)]
)
def test_the_attempt_limit_is_the_timeout_the_hub_is_sent(tmp_path, timeout, seconds):
    config = load_config(write_run(tmp_path, "s3://diloco", timeout=timeout))
    backend = HfJobsBackend(config)
    assert (backend.attempt_limit(), backend.hardware()) == (seconds, "a100-large")


def test_a_job_its_timeout_ended_reads_timed_out(tmp_path, s3_run, hub):
    """The hub ends the job at its timeout (the stand-in as the hub: SIGTERM, then stage
    ERROR with a message saying so); an ended job is not cancelled."""
    config = load_config(write_run(tmp_path, s3_run[0], outer_steps=500, timeout="4s"))
    backend, handle = launch_one_of_two(config, tmp_path)
    assert (hub.created()[0]["timeoutSeconds"], handle.job["timeout_s"]) == (4, 4)

    wait_for(backend, [handle], {"timed_out"}, seconds=60)

    job = hub_api().inspect_job(job_id=handle.job["id"], namespace=USER)
    assert (job.status.stage, job.status.message) == ("ERROR", "Job timed out after 4s")
    assert "error:" not in backend.logs(handle)  # it ran until the hub ended it
    backend.stop(handle)
    assert cancels(hub, handle.job["id"]) == 0


@pytest.mark.integration
def test_a_timeout_is_read_from_the_message_or_from_the_time_the_job_ran(hub):
    """The hub documents no wording for a timeout: a message that says so is enough, and so is
    a job that ended unfinished after running its whole timeout (kept in the handle)."""
    backend = HfJobsBackend(parse_config("", "run.toml"))

    def job(code: str, **spec: int) -> str:
        command = ["python", "-c", f"import sys, time; {code}"]
        return hub.create(USER, {"command": command, "flavor": "cpu-basic", **spec}).id

    said = handle_of(job("time.sleep(60)", timeoutSeconds=1))  # an older handle: no timeout_s
    ran_out = handle_of(job("time.sleep(2); sys.exit(1)"), timeout_s=1)
    crashed = handle_of(job("sys.exit(1)"), timeout_s=60)
    done = handle_of(job("time.sleep(2)"), timeout_s=1)
    handles = [said, ran_out, crashed, done]
    wait_for(backend, handles, {"timed_out", "failed", "exited"}, seconds=60)
    assert [backend.state(handle) for handle in handles] == [
        "timed_out", "timed_out", "failed", "exited",
    ]  # fmt: skip


def test_a_replica_started_again_is_a_new_job_with_its_id_and_shard(tmp_path, s3_run, hub):
    """What `diloco keep` does: the one spec of replica hf_jobs-1, launched again after its
    job ended, is a new job that trains as hf_jobs-1 on shard 1 (a new incarnation of it)."""
    path = write_run(tmp_path, s3_run[0], outer_steps=500)
    # hf_jobs-0 never starts: hf_jobs-1 trains alone (min_replicas = 1), not waiting for it
    Path(path).write_text(Path(path).read_text().replace("min_replicas = 2", "min_replicas = 1"))
    config = load_config(path)
    plan = plan_launch(config, {"hf_jobs": 2})
    with Store(config.store_url()) as bucket:
        publish_config(bucket, config)
    backend, spec = plan.backends["hf_jobs"], plan.specs[1]
    handles = []
    for incarnation in (1, 2):
        (handle,) = backend.launch([spec], tmp_path)
        handles.append(handle)
        starts = wait_for_starts(config, "hf_jobs-1", incarnation)
        assert starts[-1].startswith("shard 1 of 2, ")
        backend.stop(handle)
        wait_for(backend, [handle], {"stopped"}, seconds=30)

    assert [handle.replica_id for handle in handles] == ["hf_jobs-1", "hf_jobs-1"]
    assert handles[0].job["id"] != handles[1].job["id"]
    first, again = hub.created()
    assert first == again  # the same job, started anew
    assert first["environment"]["DILOCO_REPLICA_ID"] == "hf_jobs-1"
    assert first["environment"]["DILOCO_REPLICA_INDEX"] == "1"
    assert first["labels"]["diloco-replica"] == "hf_jobs-1"
