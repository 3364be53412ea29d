"""A run left alone: launched with ``--detach`` on local + HF Jobs + Kubernetes stand-ins whose
time limits end attempts within a minute, replicas SIGKILLed, one frozen (a zombie once it
wakes), and nothing but ``diloco keep`` run on a schedule as cron would (a fresh process each
time). The test never starts or restarts a replica itself."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.bench.unattended import (
    PLATFORMS,
    Disruption,
    Platforms,
    _Disrupter,
    keep_pass,
    leave_alone,
    machine_limits,
    passes_left_ended,
    passes_to_return,
    restarts,
    sent_alerts,
    startup_seconds,
    unattended_toml,
)
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_launches
from support.runs import K8S, diloco, statuses, write_run

PYTEST_LIMIT_S = 2400  # past the run's own deadline (``machine_limits``) on any machine


@pytest.mark.timeout(PYTEST_LIMIT_S)
def test_a_detached_run_left_to_the_keeper_completes(
    tmp_path, monkeypatch, s3_run, hub, cluster, webhook
):
    """HF Jobs attempts end after 20 s; k8s-0 freezes after round 2 (then wakes a zombie),
    local-0 is SIGKILLed after round 8 and hf_jobs-0 frozen after round 14, of 24 (the
    benchmark's run is 55 rounds, disrupted after rounds 5, 15 and 25: here every disruption
    comes as early as it can, each after the run has moved on from the one before). A frozen
    HF Jobs attempt is ended by its timeout before the keeper would call it hung (here the
    keeper waits two start-ups longer than an attempt's timeout), so the run restarts one
    attempt as timed out whatever its pace: with its HF attempts left alone, a 24-round run
    that went fast ended before any reached its timeout, and the test failed. The benchmark
    gives Kubernetes Jobs a 90 s deadline; here none ends within the run's own deadline (600
    s): the zombie must wake (hung, keeper passes, a new pod claiming its id) and sync before
    anything else ends it, and on a loaded machine the 90 s deadline came first (its first
    round took 47 s), leaving nothing to supersede. The test's limit is that deadline too, not
    pytest's 300 s (``leave_alone`` then says what the keeper passes saw). The platforms'
    limits are seconds: where this machine starts a replica slower than in 3 s, they and the
    deadline grow with it (``machine_limits``), or attempts would end, and hung replicas be
    restarted, before they could ever sync."""
    monkeypatch.chdir(tmp_path)
    startup = startup_seconds()
    limits = machine_limits(startup)
    hung_after = max(limits.hung_after, limits.hf_jobs_timeout + 2 * startup)
    path = tmp_path / "run.toml"
    path.write_text(unattended_toml(
        s3_run[0], outer_steps=24, hf_jobs_timeout=f"{limits.hf_jobs_timeout:.0f}s",
        k8s_deadline_s=int(limits.deadline), hung_after=hung_after,
    ))  # fmt: skip
    result = diloco("launch", "--config", str(path), *PLATFORMS, "--detach")
    assert result.exit_code == 0, result.output

    plan = (Disruption("k8s-0", 2, "freeze"), Disruption("local-0", 8, "kill"),
            Disruption("hf_jobs-0", 14, "freeze"))  # fmt: skip
    run = leave_alone(
        str(path), Platforms(hub, cluster), lambda _: None, plan,
        deadline_seconds=limits.deadline,
    )  # fmt: skip

    config = load_config(path)
    launch = run_launches(config).latest()
    assert launch.end is not None
    assert launch.end.reason == "done", launch.end
    assert [(d.replica, d.how) for d in run.disrupted] == [
        ("k8s-0", "freeze"), ("local-0", "kill"), ("hf_jobs-0", "freeze")
    ]  # fmt: skip
    assert fingerprint_disagreements(run.metrics) == {}
    made = restarts(run)
    reasons = {reason for _, reason in made}
    seen = (made, run.disrupted, f"{run.seconds:.0f} s, {len(run.passes)} passes")
    assert {"hung", "timed_out"} <= reasons <= {"failed", "exited", "stopped", "timed_out",
                                                "hung"}, seen  # fmt: skip
    assert {replica for replica, _ in made} >= {"local-0", "hf_jobs-0", "k8s-0"}, made
    assert ("hf_jobs-0", "timed_out") in made, made  # its frozen attempt: timed out, not hung
    # each replica's newest incarnation trained to the end (done), or it was stopped (by its
    # platform's time limit, or by the keeper once the run ended) and no keeper pass left it so:
    # the end came before a pass could restart it (at any time of the run, the last round too)
    states = {r: m.state() for r, m in run.metrics.items()}
    assert "done" in states.values(), states
    assert set(states.values()) <= {"done", "stopped"}, states
    assert not [d for p in run.passes for d in p["decisions"].values()
                if d["action"] == "give_up"], run.passes  # fmt: skip
    for replica, state in states.items():
        assert state == "done" or passes_left_ended(run, replica) <= 1, (replica, run.passes)
    assert run.metrics["k8s-0"].count("superseded") >= 1  # the zombie ended itself when it woke
    for replica in ("local-0", "hf_jobs-0", "k8s-0"):
        assert all(n <= 1 for n in passes_to_return(run, replica)), replica  # back in 2

    texts = webhook.texts()
    assert sorted(texts) == sorted(sent_alerts(config, launch.number))  # once each
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
    report = keep_pass(path)
    assert report["ended"].startswith("budget: the run's spend at list prices, $"), report
    assert "reached [budget] max_usd = $0.01" in report["ended"]
    rows = statuses(path)
    assert {row["state"] for row in rows.values()} == {"stopped"}, rows
    assert "launch ended (budget)" in diloco("status", "--config", path).output


@pytest.mark.integration  # starts a process that ends
def test_a_disruption_counts_only_where_its_signal_reached_a_live_process():
    """A replica whose process had already ended (the run moved on, or its attempt ended) was
    not disrupted: the disrupter tries again at its next look instead of counting it done,
    which had let a run that outran it end with nothing for the keeper to restart."""
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    assert not _Disrupter._signal(ended.pid, signal.SIGKILL)
    assert _Disrupter._signal(os.getpgrp(), 0)  # signal 0: only whether the group lives
