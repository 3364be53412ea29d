"""A run left alone: launched with ``--detach`` on local + HF Jobs + Kubernetes stand-ins,
replicas SIGKILLed or frozen (a zombie once it wakes) as the run reaches given rounds, and
nothing but ``diloco keep`` run on a schedule as cron would (a fresh process each time). The
test never starts or restarts a replica itself."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.bench.disruptions import Disrupter, Disruption, Platforms
from diloco_anywhere.bench.unattended import (
    PLATFORMS,
    keep_pass,
    leave_alone,
    machine_limits,
    passes_left_ended,
    passes_to_return,
    restarts,
    sent_alerts,
    startup_seconds,
    unattended_figures,
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
    """k8s-0 freezes after round 2 (then wakes a zombie), local-0 is SIGKILLed after round 6
    and hf_jobs-0 frozen after round 10, of 30 (the benchmark's run is 55 rounds, disrupted
    after rounds 5, 15 and 25: here every disruption comes as early as it can, each after the
    run has moved on from the one before, which every round needing all three replicas makes
    sure of). The rounds after the last are the disrupter's slack: it sees the run's progress
    in its metrics, rounds behind on a loaded machine (where the run went on at a round in 0.7
    s, the disrupter saw round 12 when it was at 15 and froze hf_jobs-0 after its last
    contribution, of 16 rounds: nothing for the keeper to do). Every disruption is made on the
    run's progress, none on the clock: the platforms' own time limits (HF Jobs' timeout, the
    Kubernetes deadline) are the run's deadline here, never reached. Made on the clock they
    raced the run: HF attempts that ended every 39 s on a loaded CI machine took most of each
    attempt to start and heal, and a 24-round run was not done after 1,293 s; an attempt's
    timeout as a restart reason is proven by the keeper's own tests and the HF Jobs backend's.
    The keeper's limits are seconds too: where this machine starts a replica slower than in 3
    s, hung_after, the round's timeout and the deadline grow with it (``machine_limits``), or
    hung replicas would be restarted, and rounds end, before a replacement could ever sync. The
    test's limit is past that deadline, not pytest's 300 s (``leave_alone`` then says what the
    keeper passes saw)."""
    monkeypatch.chdir(tmp_path)
    limits = machine_limits(startup_seconds())
    path = tmp_path / "run.toml"
    path.write_text(unattended_toml(
        s3_run[0], outer_steps=30, hf_jobs_timeout=f"{limits.deadline:.0f}s",
        k8s_deadline_s=int(limits.deadline), hung_after=limits.hung_after,
        sync_timeout=limits.sync_timeout,
    ))  # fmt: skip
    result = diloco("launch", "--config", str(path), *PLATFORMS, "--detach")
    assert result.exit_code == 0, result.output

    plan = (Disruption("k8s-0", 2, "freeze"), Disruption("local-0", 6, "kill"),
            Disruption("hf_jobs-0", 10, "freeze"))  # fmt: skip
    run = leave_alone(
        str(path), Platforms(hub, cluster), print, plan,
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
    assert reasons <= {"failed", "exited", "stopped", "hung"}, seen
    assert {("k8s-0", "hung"), ("hf_jobs-0", "hung")} <= set(made), seen  # the two frozen
    assert {reason for replica, reason in made if replica == "local-0"} & {"failed", "exited"}
    # each replica's newest incarnation trained to the end (done), or it was stopped (by its
    # platform's time limit, or by the keeper once the run ended) and no keeper pass left it so:
    # the end came before a pass could restart it (at any time of the run, the last round too)
    states = {r: m.state() for r, m in run.metrics.items()}
    endings = {r: m.ending() for r, m in run.metrics.items()}
    assert "done" in states.values(), endings
    assert set(states.values()) <= {"done", "stopped"}, (endings, seen)
    assert not [d for p in run.passes for d in p["decisions"].values()
                if d["action"] == "give_up"], run.passes  # fmt: skip
    for replica, state in states.items():
        assert state == "done" or passes_left_ended(run, replica) <= 1, (replica, run.passes)
    assert run.metrics["k8s-0"].count("superseded") >= 1  # the zombie ended itself when it woke
    for replica in ("local-0", "hf_jobs-0", "k8s-0"):
        assert all(n <= 1 for n in passes_to_return(run, replica)), replica  # back in 2

    figures = unattended_figures(run, config)  # what `diloco bench unattended` reports
    assert figures["rounds"] == figures["outer_steps"] == 30, figures
    assert figures["restarts"] == len(made), figures
    assert figures["rounds_with_disagreeing_fingerprints"] == 0
    assert 0 < figures["goodput"] < 1  # each restart is charged a round it lost
    assert figures["return_seconds_max"] >= figures["return_seconds_median"] > 0, figures
    assert figures["keeper_passes"] == len(run.passes)

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
    assert not Disrupter._signal(ended.pid, signal.SIGKILL)
    assert Disrupter._signal(os.getpgrp(), 0)  # signal 0: only whether the group lives
