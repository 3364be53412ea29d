"""A run left alone: launched with ``--detach`` on local + HF Jobs + Kubernetes stand-ins whose
time limits end attempts within a minute, replicas SIGKILLed, one frozen (a zombie once it
wakes), and nothing but ``diloco keep`` run on a schedule as cron would (a fresh process each
time). The test never starts or restarts a replica itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.alerts import Alerts
from diloco_anywhere.launching.launch import run_launches, run_metrics
from test_backend_hf_jobs import write_run
from test_launch import diloco, statuses
from test_mixed_launch import K8S

KEEP_EVERY = 3.0  # seconds between passes: cron's 10 minutes, compressed
UNATTENDED = """
[keep]
backoff = 1.0
max_backoff = 4.0
hung_after = 12.0
max_restarts = 20
[alerts]
stalled_after = 30.0
"""
DILOCO = str(Path(sys.executable).parent / "diloco")


def keep(config: str) -> dict:
    """One pass, as a scheduler runs it: a new process."""
    done = subprocess.run([DILOCO, "keep", "--config", config, "--json"], capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _newest_committed(config) -> int:
    metrics = run_metrics(config).read()
    return max((s.round for m in metrics.values() for s in m.syncs if s.committed), default=-1)


def _current_pid(config, replica: str, hub_api, cluster_api) -> int | None:
    """The process of ``replica``'s current job, found where its platform runs it."""
    launch = run_launches(config).latest()
    job = launch.jobs[replica].job
    if replica.startswith("local"):
        return job["pid"]
    if replica.startswith("hf_jobs"):
        return hub_api.jobs[job["id"]].container.process.pid
    jobs = cluster_api.jobs[(job["namespace"], job["name"])]
    pods = [pod for pod in cluster_api.pods_of(jobs)
            if pod.container is not None]  # fmt: skip
    return pods[-1].container.process.pid if pods else None


def _passes_to_return(passes: list[dict], replica: str) -> list[int]:
    """For each restart of ``replica``: how many passes saw it ended before one restarted it
    (0: the first pass that saw it ended restarted it)."""
    waited, counts = 0, []
    for report in passes:
        action = report["decisions"].get(replica, {}).get("action", "leave")
        if action == "restart":
            counts.append(waited)
            waited = 0
        elif action == "wait":
            waited += 1
    return counts


def test_a_detached_run_left_to_the_keeper_completes(
    tmp_path, monkeypatch, s3_run, hub, cluster, webhook
):
    monkeypatch.chdir(tmp_path)
    path = write_run(tmp_path, s3_run[0], replicas=3, outer_steps=55, timeout="20s")
    text = (tmp_path / "run.toml").read_text().replace("[keep]\nbackoff = 0.5\n", "")
    # every round needs all three: the run cannot end before the keeper replaces each ended or
    # frozen replica, however fast or slow this machine is
    text = text.replace("min_replicas = 2", "min_replicas = 3")
    text += K8S + "deadline_hours = 0.025\n" + UNATTENDED  # HF Jobs: 20 s, k8s: 90 s
    (tmp_path / "run.toml").write_text(text)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=1", "--backend", "k8s=1")
    result = diloco("launch", "--config", path, *mix, "--detach")
    assert result.exit_code == 0, result.output
    config = load_config(path)

    passes, killed, frozen = [], [], None  # frozen: (pid, attempt)
    deadline = time.monotonic() + 600
    try:
        while not (passes and passes[-1]["ended"]):
            assert time.monotonic() < deadline, passes[-3:]
            passes.append(keep(path))
            newest, launch = _newest_committed(config), run_launches(config).latest()
            if newest >= 5 and frozen is None:  # k8s-0 freezes early in its Job's 90 s
                frozen = (_current_pid(config, "k8s-0", hub, cluster), launch.attempt("k8s-0"))
                os.killpg(frozen[0], signal.SIGSTOP)
            if frozen and launch.attempt("k8s-0") > frozen[1]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(frozen[0], signal.SIGCONT)  # a zombie: its replica runs anew
            for at_round, replica in ((15, "local-0"), (25, "hf_jobs-0")):  # preempted
                if newest >= at_round and replica not in killed:
                    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                        os.killpg(_current_pid(config, replica, hub, cluster), signal.SIGKILL)
                    killed.append(replica)
            time.sleep(KEEP_EVERY)
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(frozen[0], signal.SIGCONT)

    launch = run_launches(config).latest()
    assert launch.end is not None
    assert launch.end.reason == "done", launch.end
    # a replica restarted just before the last commit heals to it, and ends by itself
    while {row["state"] for row in statuses(path).values()} & {"running", "starting"}:
        assert time.monotonic() < deadline, statuses(path)
        passes.append(keep(path))
        time.sleep(KEEP_EVERY)
    metrics = run_metrics(config).read()
    assert fingerprint_disagreements(metrics) == {}
    restarts = [(r, d["reason"]) for p in passes for r, d in p["decisions"].items()
                if d["action"] == "restart"]  # fmt: skip
    reasons = {reason for _, reason in restarts}
    assert {"hung", "timed_out"} <= reasons <= {"failed", "exited", "stopped", "timed_out",
                                                "hung"}, restarts  # fmt: skip
    assert {replica for replica, _ in restarts} >= {"local-0", "hf_jobs-0", "k8s-0"}, restarts
    assert {r: m.state() for r, m in metrics.items()} == dict.fromkeys(metrics, "done")
    assert metrics["k8s-0"].count("superseded") >= 1  # the zombie ended itself when it woke
    for replica in ("local-0", "hf_jobs-0", "k8s-0"):
        assert all(n <= 1 for n in _passes_to_return(passes, replica)), replica  # back in 2

    alerts = Alerts(Store(config.store_url()), RunLayout(config.run.name), launch.number,
                    config.alerts).recorded()  # fmt: skip
    texts = webhook.texts()
    assert sorted(texts) == sorted(f"[{config.run.name}] {a.text}" for a in alerts)  # once each
    assert any("restarted" in text for text in texts)
    assert f"[{config.run.name}] run {config.run.name} ended: the last outer step is committed" in (
        texts
    )


def test_a_budget_below_the_runs_cost_stops_every_platform_with_the_reason(
    tmp_path,
    monkeypatch,
    s3_run,
    hub,
    cluster,
):
    monkeypatch.chdir(tmp_path)
    path = write_run(tmp_path, s3_run[0], replicas=3, outer_steps=500)
    budget = "[budget]\nmax_usd = 0.01\nhourly_usd = { hf_jobs = 36000.0 }\n"  # $10 a second
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text() + K8S + budget)
    mix = ("--backend", "local=1", "--backend", "hf_jobs=1", "--backend", "k8s=1")
    assert diloco("launch", "--config", path, *mix, "--detach").exit_code == 0
    report = keep(path)
    assert report["ended"].startswith("budget: the run's spend at list prices, $"), report
    assert "reached [budget] max_usd = $0.01" in report["ended"]
    rows = statuses(path)
    assert {row["state"] for row in rows.values()} == {"stopped"}, rows
    assert "launch ended (budget)" in diloco("status", "--config", path).output
