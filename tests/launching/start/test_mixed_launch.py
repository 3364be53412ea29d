"""One run across platforms: ``diloco launch --backend local=1 --backend hf_jobs=1 --backend
k8s=1`` starts one run (one run id, one store), ``status`` lists every replica with its
platform, and ``stop`` reaches them all. Remote platforms are their local stand-ins (the HF
Jobs and Kubernetes APIs), whose jobs run here as processes against moto's S3."""

from __future__ import annotations

import json

from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import load_handles, run_metrics
from diloco_anywhere.standins.hf_jobs import hf_jobs_api
from support.runs import K8S, diloco, statuses, write_run


def test_one_run_spans_platforms_and_reports_in_one_table(
    tmp_path, monkeypatch, s3_run, hub, cluster
):
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, s3_run[0], replicas=4, outer_steps=2)
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text() + K8S)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=2", "--backend", "k8s=1")
    result = diloco("launch", "--config", config, *mix)
    assert result.exit_code == 0, result.output
    assert "Run summary" in result.stdout

    rows = statuses(config)
    assert {(r, row["platform"], row["state"], row["outer_step"]) for r, row in rows.items()} == {
        ("local-0", "local", "done", 2),
        ("hf_jobs-0", "hf_jobs", "done", 2),
        ("hf_jobs-1", "hf_jobs", "done", 2),
        ("k8s-0", "k8s", "done", 2),
    }
    metrics = run_metrics(load_config(config)).read()
    # one run: every replica committed the same rounds with the same global state
    fingerprints = {tuple(s.fingerprint for s in m.syncs if s.committed) for m in metrics.values()}
    assert len(fingerprints) == 1
    assert [b["environment"]["DILOCO_REPLICA_INDEX"] for b in hub.created()] == ["1", "2"]
    table = diloco("status", "--config", config)
    assert all(name in table.stdout for name in ("local-0", "hf_jobs-0", "hf_jobs-1", "k8s-0"))


def test_stop_reaches_every_platform(tmp_path, monkeypatch, s3_run, hub):
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, s3_run[0], replicas=3, outer_steps=500)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=2")
    assert diloco("launch", "--config", config, *mix, "--detach").exit_code == 0
    result = diloco("stop", "--config", config)
    assert result.exit_code == 0, result.output
    assert "stopped 3 replicas (local-0, hf_jobs-0, hf_jobs-1) on hf_jobs, local" in result.stdout
    assert len([p for m, p, _ in hub.requests if m == "POST" and p.endswith("/cancel")]) == 2
    handles = load_handles(load_config(config))
    assert [h.platform for h in handles] == ["local", "hf_jobs", "hf_jobs"]


def test_a_relaunch_is_refused_while_the_last_launch_runs(tmp_path, monkeypatch, s3_run, hub):
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, s3_run[0], replicas=2, outer_steps=500)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=1")
    assert diloco("launch", "--config", config, *mix, "--detach").exit_code == 0
    again = diloco("launch", "--config", config, *mix, "--detach")
    assert again.exit_code == 1
    assert "run t is still going: hf_jobs-0 (hf_jobs job running), local-0 (local job " in (
        again.output
    )
    assert len(hub.created()) == 1  # nothing more was started
    assert diloco("stop", "--config", config).exit_code == 0


def test_stop_goes_on_past_a_platform_it_cannot_reach(tmp_path, monkeypatch, s3_run):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
    config = write_run(tmp_path, s3_run[0], replicas=2, outer_steps=500)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=1")
    with hf_jobs_api() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert diloco("launch", "--config", config, *mix, "--detach").exit_code == 0
    # the Jobs API is gone (its jobs with it): the local replica must still be stopped.
    # (Elsewhere: huggingface_hub keeps connections to the stand-in alive past its close.)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    result = diloco("stop", "--config", config)
    assert result.exit_code == 1, result.output
    assert "stopped 1 replicas (local-0)" in result.output
    assert "STILL RUNNING, stop by hand: hf_jobs-0 (hf_jobs job {'id': " in result.output
    assert statuses(config)["hf_jobs-0"]["state"] == "unknown"
    logs = diloco("logs", "--config", config)
    assert logs.exit_code == 1  # one platform's logs unreadable, the other's shown
    assert "local-0 (local)" in logs.output


def test_a_platform_failing_mid_launch_stops_what_had_started(tmp_path, monkeypatch, s3_run):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: run_job fails
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    config = write_run(tmp_path, s3_run[0], replicas=2, outer_steps=500)
    result = diloco("launch", "--config", config, "--backend", "local=1", "--backend", "hf_jobs=1")
    assert result.exit_code == 1
    assert "hf_jobs failed to start its replicas" in result.output
    assert "other platforms: stopped 1 replicas (local-0)" in result.output
    assert "Traceback" not in result.output
    (local,) = load_handles(load_config(config))
    rows = statuses(config)
    assert rows[local.replica_id]["state"] == "stopped"


def test_dry_run_shows_each_platform_request_and_contacts_nothing(tmp_path, monkeypatch, s3_run):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    config = write_run(tmp_path, s3_run[0], replicas=3)
    result = diloco("launch", "--config", config, "--backend", "local=1", "--backend", "hf_jobs=2",
                    "--dry-run")  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert [r["replica_id"] for r in shown["replicas"]] == ["local-0", "hf_jobs-0", "hf_jobs-1"]
    assert set(shown["submit"]) == {"local", "hf_jobs"}
    assert shown["submit"]["hf_jobs"][1]["run_job"]["secrets"]["AWS_SECRET_ACCESS_KEY"] == "***"
    assert "testing" not in result.stdout
    assert not (tmp_path / ".diloco").exists()


def test_the_cluster_admits_the_job_in_a_server_side_dry_run(
    tmp_path, monkeypatch, s3_run, cluster
):
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, s3_run[0], replicas=3)
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text() + K8S)
    mix = ("--backend", "local=1", "--backend", "k8s=2")
    result = diloco("launch", "--config", config, *mix, "--server-dry-run")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    (job,) = shown["k8s"]
    assert job["metadata"]["name"].startswith("diloco-t-")  # named by the API server
    assert job["spec"]["completions"] == 2
    assert shown["local"] == "local has no server-side dry run; --dry-run shows its requests"
    assert not cluster.jobs  # admitted, not created
    assert not (tmp_path / ".diloco").exists()
